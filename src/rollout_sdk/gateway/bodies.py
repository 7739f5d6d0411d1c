"""Request bodies before they become Python objects: what a body may cost is decided from its bytes.

A JSON body decoded whole costs more than its bytes: a 15 MiB text is 15 MiB of ``str`` next to the
15 MiB read buffer (2x), and 15 MiB of ``{},{},...`` is ~360 MB of dicts (24x).  So a large body is
looked at twice before it is decoded, each look cheap and without copies of its text:

::

    read buffer (1x) ──▶ shape: JSON values outside strings counted (bytes.count between the strings
                         one regex finds; nothing copied) ──▶ 400 too_many_items when their objects
                         would outweigh the body (naming the field that holds most of it)
                     ──▶ skeleton: msgspec.json.decode(raw, type=<API skeleton>); every counted text is a
                         msgspec.Raw (a view into the buffer), its characters bounded below from its
                         bytes ──▶ 400 context_length_exceeded when no prompt could hold them
                     ──▶ its tokens bounded below from how often its best lowercase letters or digits
                         occur (:class:`CharCaps`: the most copies of one a token holds) ──▶ the same 400
                     ──▶ still long: its first characters decoded for the service's prefix probe
                     ──▶ the whole body decoded (only now), then checked field by field (typed)

The text bound is the service's (:meth:`~.service.TurnService.prompt_limits`): at most ``chars``
characters of system, user and tool text (the texts every template renders verbatim, as
``service._kept_texts`` counts them) and of assistant text what no template drops
(:func:`min_kept_chars`), and ``tokens`` prompt ids.  The bound is loose on purpose (the
context less one token, whatever ``max_tokens`` asks): the exact refusal stays where it was; this one
only has to come before the work.  A body whose skeleton does not decode (a field of the wrong type) is
left to the full checks, which name the field.
"""

from __future__ import annotations

import re
import string
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from .errors import GatewayError, bad_request

__all__ = ["Api", "CharCaps", "PromptLimits", "check_body"]

Api = Literal["chat", "completions", "responses", "messages", "other"]

#: bodies smaller than this are not weighed (their objects cost at most ~7 MB)
SHAPE_CHECK_BYTES = 256 * 1024
#: decoded objects may cost up to the body's own size, or this much for small bodies
SHAPE_FLOOR_BYTES = 16 * 1024 * 1024
#: what one JSON value outside a string costs as a Python object, at most (measured with tracemalloc on
#: msgspec's decode, CPython 3.11: ``{}`` 64 B + its slot, ``[]`` 56 B, a member's key and slot ~100 B, an
#: element's slot and a fresh int/float ~40 B, a short string ~56 B; tests/test_gateway_bodies.py checks
#: that these bound what the decode takes)
_COST_DICT = 80
_COST_LIST = 64
_COST_MEMBER = 112
_COST_ITEM = 40
_COST_STRING = 64
#: a JSON string (``"..."`` with its escapes), as one regex match (the unrolled form: no backtracking)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_CONTINUATION = bytes(range(0x80, 0xC0))
_PIECE = 256 * 1024
_SAMPLE = 64 * 1024
#: bytes that begin a character no ``str.strip`` removes: printable ASCII but the space, UTF-8 lead bytes
#: of the blocks without whitespace (U+00C0-U+0FFF, U+4000-U+10FFFF)
_SURE = bytes(range(0x21, 0x7F)) + bytes(range(0xC3, 0xE1)) + bytes(range(0xE4, 0xF5))
#: the characters :class:`CharCaps` counts, and every other byte
_COUNTED = (string.ascii_lowercase + string.digits).encode()
_NOT_COUNTED = bytes(b for b in range(256) if b not in _COUNTED + b"\n")
_NULL = msgspec.Raw(b"null")


@dataclass(frozen=True)
class PromptLimits:
    """The most a prompt of this gateway can hold: ``tokens`` ids, ``chars`` characters of counted text
    (None: no character bound is known); a text longer than ``probe_chars`` characters is first
    tokenized only that far (:class:`Probe`)."""

    tokens: int
    chars: int | None
    probe_chars: int | None = None
    #: the most copies of each counted character one token of the vocabulary holds (None: unknown)
    char_caps: CharCaps | None = None
    #: the chat template renders an assistant message's content beside its tool calls (so it counts)
    call_content: bool = False
    #: the chat template renders an assistant's text before ``</think>`` (so all of it counts)
    reasoning: bool = False


@dataclass(frozen=True)
class Probe:
    """The first characters of a body's counted texts, decoded (only they): for the service's prefix
    probe (``TurnService.probe``), which refuses them when they alone are more tokens than fit."""

    param: str
    texts: list[str]


def check_body(raw: bytes | bytearray, api: Api, limits: PromptLimits | None) -> Probe | None:
    """400 when ``raw`` (a whole request body, not yet decoded) would cost more than it may: its objects
    more than its bytes (``too_many_items``), or a text no prompt can hold (``context_length_exceeded``,
    ``limits`` given).  Reads ``raw`` without copying its text; a body it cannot read is left alone.
    Returns the prefix to probe when the counted texts are longer than ``limits.probe_chars``."""
    if len(raw) >= SHAPE_CHECK_BYTES:
        _check_shape(raw)
    if limits is not None and api != "other" and len(raw) >= SHAPE_CHECK_BYTES:
        return _check_text(raw, api, limits)
    return None


# -- shape -------------------------------------------------------------------------------------------


def object_cost(raw: bytes | bytearray, limit: int | None = None) -> int:
    """An upper bound of the bytes the Python objects of ``raw``'s values cost beyond their text (a
    string's characters are counted by the body's own size).  First from counts over the whole body
    (C speed; characters inside strings counted too, so it only over-estimates); when that is over
    ``limit`` (or no limit is given), again counting only between strings (found by one regex; nothing
    is copied), stopping as soon as ``limit`` is exceeded (the value returned is then only known to be
    above it)."""
    cost = _cost(raw, 0, len(raw), raw.count(b'"') // 2)
    if limit is not None and cost <= limit:
        return cost
    cost = pos = 0
    for m in _STRING.finditer(raw):
        cost += _cost(raw, pos, m.start(), 1)
        pos = m.end()
        if limit is not None and cost > limit:
            return cost
    return cost + _cost(raw, pos, len(raw), 0)


def _cost(raw: bytes | bytearray, start: int, end: int, strings: int) -> int:
    """What the values between ``start`` and ``end`` (no string among them) and ``strings`` strings cost."""
    dicts, lists = raw.count(b"{", start, end), raw.count(b"[", start, end)
    members, items = raw.count(b":", start, end), raw.count(b",", start, end) + dicts + lists
    return (
        _COST_DICT * dicts + _COST_LIST * lists + _COST_MEMBER * members + _COST_ITEM * items + _COST_STRING * strings
    )


class _Fields(msgspec.Struct):
    """The fields of any route that can hold many values (lists, objects), as spans of the body."""

    messages: msgspec.Raw = _NULL
    input: msgspec.Raw = _NULL
    prompt: msgspec.Raw = _NULL
    system: msgspec.Raw = _NULL
    tools: msgspec.Raw = _NULL
    stop: msgspec.Raw = _NULL
    stop_token_ids: msgspec.Raw = _NULL
    logit_bias: msgspec.Raw = _NULL
    metadata: msgspec.Raw = _NULL
    include: msgspec.Raw = _NULL
    turn_rewards: msgspec.Raw = _NULL
    ids: msgspec.Raw = _NULL
    sampling: msgspec.Raw = _NULL


def _check_shape(raw: bytes | bytearray) -> None:
    allowed = max(len(raw), SHAPE_FLOOR_BYTES)
    cost = object_cost(raw, allowed)
    if cost > allowed:
        raise bad_request(
            _largest_field(raw),
            f"the body's {len(raw)} bytes hold too many JSON values (objects, arrays, numbers, strings): "
            f"decoded they would take more than {allowed >> 20} MiB beyond their text; send fewer, larger values",
            "too_many_items",
        )


def _largest_field(raw: bytes | bytearray) -> str | None:
    """The field that holds most of the body (at least half of it), if one does."""
    fields = _decode(raw, _Fields)
    if fields is None:
        return None
    size, name = max((len(getattr(fields, f)), f) for f in _Fields.__struct_fields__)
    return name if 2 * size >= len(raw) else None


# -- text ----------------------------------------------------------------------------------------------


class _Part(msgspec.Struct):
    """A content part or block: its text (OpenAI parts, Anthropic text blocks) or its content
    (Anthropic tool_result blocks); everything else is skipped unread."""

    type: msgspec.Raw = _NULL
    text: msgspec.Raw = _NULL
    content: msgspec.Raw = _NULL


class _Message(msgspec.Struct):
    role: msgspec.Raw = _NULL
    type: msgspec.Raw = _NULL
    content: msgspec.Raw = _NULL
    output: msgspec.Raw = _NULL
    tool_calls: msgspec.Raw = _NULL


class _Body(msgspec.Struct):
    messages: msgspec.Raw = _NULL
    prompt: msgspec.Raw = _NULL
    input: msgspec.Raw = _NULL
    instructions: msgspec.Raw = _NULL
    system: msgspec.Raw = _NULL


def _decode(raw: msgspec.Raw | bytes | bytearray, kind: Any) -> Any:
    try:
        return msgspec.json.decode(raw, type=kind)
    except (msgspec.DecodeError, RecursionError):
        return None


def _first(raw: msgspec.Raw) -> bytes:
    with memoryview(raw) as view:
        return view[:1].tobytes()


def _small(raw: msgspec.Raw) -> Any:
    """A short value (a role, a type) decoded; None for a long one (never a role)."""
    return _decode(raw, Any) if len(raw) <= 64 else None


def _items(raw: msgspec.Raw, kind: type) -> Iterator[Any]:
    """The elements of a JSON array as ``kind`` skeletons, one by one (an element of another shape is
    skipped); nothing for anything but an array.  The array was counted by the shape check already, so
    its skeletons cost at most about what its own objects would."""
    if _first(raw) != b"[":
        return
    for item in _decode(raw, list[msgspec.Raw]) or []:
        if _first(item) == b"{":
            sk = _decode(item, kind)
            if sk is not None:
                yield sk


def _texts(raw: msgspec.Raw) -> Iterator[msgspec.Raw]:
    """The text of a content value: a string, or the texts (and nested tool-result contents) of its parts."""
    head = _first(raw)
    if head == b'"':
        yield raw
    elif head == b"[":
        for part in _items(raw, _Part):
            if _first(part.text) == b'"':
                yield part.text
            elif _small(part.type) == "tool_result":
                yield from _texts(part.content)


def _counted(body: _Body, api: Api) -> Iterator[msgspec.Raw]:
    """The texts of a request that its prompt holds verbatim (system, user, tool; never the assistant's,
    which a template may drop in part)."""
    if api == "completions":  # a string, or one string in a list
        prompt = body.prompt
        if _first(prompt) == b"[":
            one = _decode(prompt, tuple[msgspec.Raw])
            prompt = one[0] if one is not None else _NULL
        if _first(prompt) == b'"':
            yield prompt
        return
    if api == "messages":
        yield from _texts(body.system)
    if api == "responses":
        yield from _texts(body.instructions)
        if _first(body.input) == b'"':
            yield body.input
    for m in _items(body.input if api == "responses" else body.messages, _Message):
        if _small(m.role) == "assistant":
            continue
        yield from _texts(m.content)
        if api == "responses" and _small(m.type) == "function_call_output":
            yield from _texts(m.output)


def _assistant(body: _Body, api: Api, *, calls: bool) -> Iterator[list[msgspec.Raw]]:
    """The texts of each assistant message whose content the template renders (in part: see
    :func:`min_kept_chars`).  One with tool calls only when ``calls`` (the template was seen to render
    such content, :attr:`PromptLimits.call_content`; Llama 3.1's does not): in Responses, a message that
    function calls after it join; in Messages, one with a ``tool_use`` block."""
    if api == "completions":
        return
    items = list(_items(body.input if api == "responses" else body.messages, _Message))
    for k, m in enumerate(items):
        if _small(m.role) != "assistant":
            continue
        if api == "responses" and _small(m.type) not in (None, "message"):
            continue
        if not calls and _has_calls(api, m, items[k + 1 :]):
            continue
        yield list(_texts(m.content))


def _has_calls(api: Api, m: _Message, after: list[_Message]) -> bool:
    if api == "chat":
        return len(m.tool_calls) > 64 or bool(_decode(m.tool_calls, Any))
    if api == "responses":
        return _joined(after)
    if _first(m.content) == b"[":
        return any(_small(b.type) == "tool_use" for b in _items(m.content, _Part))
    return False


def _joined(after: list[_Message]) -> bool:
    """Whether a function call joins the Responses assistant message before ``after`` (one comes before
    the next message or call output; reasoning items between change nothing)."""
    for item in after:
        kind = _small(item.type)
        if kind == "function_call":
            return True
        if kind in ("message", "function_call_output") or (kind is None and item.role != _NULL):
            return False
    return False


def min_kept_chars(texts: list[msgspec.Raw]) -> int:
    """A lower bound of the characters any template keeps of an assistant message whose content is the
    JSON strings ``texts`` joined: templates drop reasoning (what comes before the last ``</think>``,
    or another tag holding ``think``) and strip whitespace, so only what follows the last ``think`` is
    counted (:func:`_kept_spans`), and of it only code points that cannot be whitespace (printable ASCII
    but the space, and UTF-8 lead bytes of blocks without any: not C2, E1-E3), less 6 per backslash (an
    escape may be one blank character), 2 quotes per text and 8 per text for a tag cut between two."""
    return max(sum(_sure_chars(text, start) - 10 for text, start in _kept_spans(texts)), 0)


def _kept_spans(texts: list[msgspec.Raw], *, whole: bool = False) -> list[tuple[msgspec.Raw, int]]:
    """``texts`` from the byte after their last ``think`` on (all of them when none holds one, or
    ``whole``: the template keeps reasoning)."""
    if not whole:
        for k in range(len(texts) - 1, -1, -1):
            pos = _rfind(texts[k], b"think")
            if pos >= 0:
                return [(texts[k], pos + 5), *((t, 0) for t in texts[k + 1 :])]
    return [(t, 0) for t in texts]


def _rfind(text: msgspec.Raw, needle: bytes) -> int:
    """The last position of ``needle`` in ``text``, searched 256 KiB at a time from the end (-1: none)."""
    with memoryview(text) as view:
        end = len(view)
        while end > 0:
            begin = max(end - _PIECE, 0)
            pos = view[begin : min(end + len(needle) - 1, len(view))].tobytes().rfind(needle)
            if pos >= 0:
                return begin + pos
            end = begin
    return -1


def _sure_chars(text: msgspec.Raw, start: int) -> int:
    sure = slashes = 0
    with memoryview(text) as view:
        for pos in range(start, len(view), _PIECE):
            piece = view[pos : pos + _PIECE].tobytes()
            sure += len(piece) - len(piece.translate(None, _SURE))
            slashes += piece.count(b"\\")
    return sure - 6 * slashes


class CharCaps:
    """For each ASCII lowercase letter and digit ``c``: the most copies of ``c`` one token of a vocabulary
    holds (``cap(c)``; 0: in no token).  ``n`` copies of ``c`` in a text are then at least ``n / cap(c)``
    tokens, whatever the rest of the text: every common normaliser (NFC, NFKC, lowercasing, accents,
    SentencePiece's spaces) keeps these characters, and byte-level and SentencePiece vocabularies write
    them as themselves.  Built from the vocabulary's strings once (their counted characters only, a
    line a token: ~1 MB for 150k tokens); each character's cap is found on first use (a few searches of
    those lines, milliseconds), so a gateway pays only for the characters large bodies are made of."""

    def __init__(self, vocab: Iterable[str]) -> None:
        tokens = list(vocab)
        text = "\n".join(tokens)
        if text.count("\n") != len(tokens) - 1:  # a token holds a newline: drop it (it is not counted)
            text = "\n".join(t.replace("\n", "") for t in tokens)
        self._lines = text.encode("utf-8", "surrogatepass").translate(None, _NOT_COUNTED)
        self._caps: dict[str, int] = {}
        self._lock = threading.Lock()

    def cap(self, c: str) -> int:
        with self._lock:
            cap = self._caps.get(c)
            if cap is None:
                only = self._lines.translate(None, _COUNTED.replace(c.encode(), b""))
                run = c.encode()
                cap = 0
                while run * (cap + 1) in only:
                    cap += 1
                self._caps[c] = cap
            return cap


def min_tokens(spans: list[tuple[msgspec.Raw, int]], caps: CharCaps, need: int) -> tuple[int, str]:
    """A lower bound of the tokens of the JSON strings ``spans`` (each from its byte offset), from how
    often the best counted characters occur (:class:`CharCaps`): at least ``ceil(n / cap(c))`` for ``n``
    copies of ``c``, less 4 per backslash (an escape's bytes hold at most 4 of one character).  The
    characters are chosen from the first 64 KiB (the 3 of the 6 most frequent there with the fewest
    copies a token); counting stops once the bound exceeds ``need``.  Returns the bound and its character."""
    sample = b""
    for raw, start in spans:
        with memoryview(raw) as view:
            sample += view[start : start + _SAMPLE - len(sample)].tobytes()
        if len(sample) >= _SAMPLE:
            break
    frequent = sorted(((sample.count(c), chr(c)) for c in _COUNTED), reverse=True)[:6]
    ranked = sorted(((n / caps.cap(c), c) for n, c in frequent if n and caps.cap(c)), reverse=True)
    chosen = {c: caps.cap(c) for _, c in ranked[:3]}
    if not chosen:
        return 0, ""
    counts = dict.fromkeys(chosen, 0)
    slashes = 0
    best, best_c = 0, ""
    for raw, start in spans:
        with memoryview(raw) as view:
            for pos in range(start, len(view), _PIECE):
                piece = view[pos : pos + _PIECE].tobytes()
                slashes += piece.count(b"\\")
                for c in chosen:
                    counts[c] += piece.count(c.encode())
                best, best_c = max((-(-max(n - 4 * slashes, 0) // chosen[c]), c) for c, n in counts.items())
                if best > need:
                    return best, best_c
    return best, best_c


def min_chars(text: msgspec.Raw) -> int:
    """A lower bound of the characters the JSON string ``text`` (quotes included) decodes to, from its
    bytes, 256 KiB at a time: its UTF-8 code points, less 5.5 per backslash (an escape is at most 6 code
    points a character, a surrogate pair 12 for one)."""
    points = slashes = 0
    with memoryview(text) as view:
        for pos in range(0, len(view), _PIECE):
            piece = view[pos : pos + _PIECE].tobytes()
            points += len(piece) - _continuations(piece)
            slashes += piece.count(b"\\")
    return max(points - 2 - (11 * slashes + 1) // 2, 0)


def _continuations(piece: bytes) -> int:
    return len(piece) - len(piece.translate(None, _CONTINUATION))


def _token_ids(raw: msgspec.Raw) -> int:
    """How many values a flat JSON array of numbers holds (0 for anything else): its commas plus one."""
    with memoryview(raw) as view:
        if view[:1].tobytes() != b"[":
            return 0
        count = 0
        for pos in range(0, len(view), _PIECE):
            piece = view[pos : pos + _PIECE].tobytes()
            if b'"' in piece or b"{" in piece or b"[" in piece[1 if pos == 0 else 0 :]:
                return 0
            count += piece.count(b",")
    return count + 1


def _check_text(raw: bytes | bytearray, api: Api, limits: PromptLimits) -> Probe | None:
    body = _decode(raw, _Body)
    if body is None:
        return None
    param = {"completions": "prompt", "responses": "input"}.get(api, "messages")
    if api == "completions":
        ids = _token_ids(body.prompt)
        if ids > limits.tokens:
            raise _too_long(param, f"the prompt has {ids} tokens", limits)
    counted = list(_counted(body, api))
    kept = [_kept_spans(texts, whole=limits.reasoning) for texts in _assistant(body, api, calls=limits.call_content)]
    size = sum(len(t) for t in counted)
    if limits.chars is not None:
        chars = 0
        for text in counted:
            chars += min_chars(text)
            if chars > limits.chars:
                raise _too_long(param, f"the text holds more than {limits.chars} characters", limits)
        for spans in kept:
            chars += max(sum(_sure_chars(text, start) - 10 for text, start in spans), 0)
            if chars > limits.chars:
                raise _too_long(param, f"the text holds more than {limits.chars} characters", limits)
    spans = [(t, 0) for t in counted] + [span for message in kept for span in message]
    if limits.char_caps is not None and sum(len(t) - start for t, start in spans) > limits.tokens:
        caps = limits.char_caps
        n, c = min_tokens(spans, caps, limits.tokens)
        if n > limits.tokens:
            what = f"the text holds at least {n} tokens (one token holds at most {caps.cap(c)} {c!r}, the text more)"
            raise _too_long(param, what, limits)
    if limits.probe_chars is None or limits.chars is None or size <= limits.probe_chars:
        return None
    texts, left = [], limits.probe_chars
    for text in counted:
        head = _head(text, 2 * left)
        if head is None:
            return None  # not cut cleanly: left to the full path
        texts.append(head)
        left -= len(head)
        if left <= 0:
            break
    return Probe(param, texts)


def _head(text: msgspec.Raw, size: int) -> str | None:
    """The JSON string ``text`` decoded from its first ``size`` bytes only, cut before an escape and at a
    UTF-8 boundary (None: that cut does not decode, e.g. inside a surrogate pair)."""
    with memoryview(text) as view:
        if len(view) - 2 <= size:
            return _decode(text, str)  # type: ignore[no-any-return]
        end = size + 1
        window = view[end - 12 : end].tobytes()
        slash = window.rfind(b"\\")
        if slash >= 0:
            end -= len(window) - slash
            while view[end - 1 : end].tobytes() == b"\\":
                end -= 1
        while 0x80 <= view[end] < 0xC0:
            end -= 1
        piece = b'"' + view[1:end].tobytes() + b'"'
    return _decode(piece, str)  # type: ignore[no-any-return]


def _too_long(param: str, what: str, limits: PromptLimits) -> GatewayError:
    return bad_request(param, f"this model's context is {limits.tokens + 1} tokens; {what}", "context_length_exceeded")
