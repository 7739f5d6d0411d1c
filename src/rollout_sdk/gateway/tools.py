"""OpenAI messages and tools in, OpenAI ``tool_calls`` out: the mapping between the chat API and the template.

Requests are normalised into the messages a chat template renders (:func:`template_messages`):
``developer`` becomes ``system``, text content parts are joined (user and tool messages may hold OpenAI
``image_url`` parts with data URLs: the content is then a list of text and image parts), and tool-call
``arguments`` — JSON *strings* in OpenAI's format — are decoded into objects (a template given strings would encode them
twice).  The normalised form is also what the session matches re-sent history against
(:func:`canonical`), so a client that re-serialises arguments with other whitespace still matches.

The model's text is split by the project's tool-call parser (:func:`~rollout_sdk.agents.get_parser`).
Well-formed calls become OpenAI ``tool_calls`` (arguments re-encoded as JSON strings, ids unique within
the session); a malformed call is returned *as content* (its raw text, so the agent sees what the model
wrote) and its parse error is recorded on the turn for the trainer.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Sequence
from typing import Any

import msgspec

from ..agents import ParsedTurn
from ..protocol import MAX_IMAGE_BYTES
from .errors import bad_request, unsupported
from .requests import ChatMessage, ChatTools, ImageUrlPart, ToolCall, convert

__all__ = ["assistant_reply", "canonical", "parse_tool_choice", "template_messages", "template_tools"]


def template_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The request's ``tools``, checked (function tools only: :data:`~.requests.ChatTools`), as the
    template renders them."""
    if tools is None or tools == []:
        return None
    # only what a template renders, in one order: client-side fields ("strict") never reach the prompt
    return [
        {"type": "function", "function": {k: v for k, v in msgspec.structs.asdict(t.function).items() if v is not None}}
        for t in convert(tools, ChatTools, where="tools")
    ]


def parse_tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> bool:
    """Whether the model's tool calls are parsed: ``auto`` (default) yes, ``none`` no.  ``required`` and a
    named function would need constrained decoding: a 400."""
    if value is None or value == "auto":
        return tools is not None
    if value == "none":
        return False
    raise unsupported("tool_choice", f"tool_choice {value!r}: only 'auto' and 'none' can be honoured")


def _image(spec: Any, where: str) -> dict[str, Any]:
    """An OpenAI ``image_url`` part's ``image_url`` holding a data URL, as the template's ``{"type": "image",
    "image": bytes}``.  Nothing is fetched: any other URL is refused."""
    if not isinstance(spec, dict | str):
        raise bad_request(where, "an image_url part needs an 'image_url' with a data URL (data:image/png;base64,...)")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str):
        raise bad_request(f"{where}.image_url.url", "an image_url part needs a string 'url'")
    head, sep, data = url.partition(",")
    if not (url.startswith("data:image/") and sep and head.endswith(";base64")):
        raise bad_request(
            f"{where}.image_url.url",
            f"only data URLs (data:image/png;base64,...) are accepted; nothing is fetched: {url[:64]!r}",
        )
    if len(data) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise bad_request(f"{where}.image_url.url", f"the image is larger than {MAX_IMAGE_BYTES} bytes")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{where}.image_url.url", "the data URL is not valid base64") from None
    if not raw:
        raise bad_request(f"{where}.image_url.url", "the data URL holds no image")
    return {"type": "image", "image": raw}


def _content(content: str | list[Any] | None, where: str, *, images: bool) -> Any:
    """A message's content as the template renders it: a string, or (``images``: user and tool messages
    with ``image_url`` parts) a list of text and image parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if not images or not any(isinstance(p, ImageUrlPart) for p in content):
        for i, part in enumerate(content):
            if isinstance(part, ImageUrlPart):
                raise unsupported(f"{where}[{i}]", "content part of type 'image_url': only text is supported here")
        return "".join(p.text for p in content)
    return [
        _image(p.image_url, f"{where}[{i}]") if isinstance(p, ImageUrlPart) else {"type": "text", "text": p.text}
        for i, p in enumerate(content)
    ]


def _arguments(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            decoded = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as exc:
            raise bad_request(where, f"arguments must be a JSON object encoded as a string: {exc}") from None
        if isinstance(decoded, dict):
            return decoded
    raise bad_request(where, "arguments must be a JSON object (or a string holding one)", "invalid_type")


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    out = []
    for j, c in enumerate(convert(calls, list[ToolCall], where=where)):
        fn = {
            "name": c.function.name,
            "arguments": _arguments(c.function.arguments, f"{where}[{j}].function.arguments"),
        }
        call: dict[str, Any] = {"type": "function", "function": fn}
        if isinstance(c.id, str):
            call["id"] = c.id
        out.append(call)
    return out


def template_messages(messages: Any, *, max_messages: int) -> list[dict[str, Any]]:
    """Check the request's ``messages`` (:class:`~.requests.ChatMessage`) and normalise them into what
    the chat template renders."""
    if messages is None:
        raise bad_request("messages", "messages is required", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages", "messages must be a non-empty list", "invalid_type")
    if len(messages) > max_messages:
        raise bad_request("messages", f"at most {max_messages} messages per request on this gateway")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(convert(messages, list[ChatMessage], where="messages")):
        where = f"messages[{i}]"
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {
            "role": role,
            "content": _content(m.content, f"{where}.content", images=role in ("user", "tool")),
        }
        if role == "assistant" and m.tool_calls:
            msg["tool_calls"] = _tool_calls(m.tool_calls, f"{where}.tool_calls")
        if role == "tool":
            if isinstance(m.tool_call_id, str):
                msg["tool_call_id"] = m.tool_call_id
            if isinstance(m.name, str):
                msg["name"] = m.name
        out.append(msg)
    return out


def canonical(message: dict[str, Any]) -> str:
    """One normalised message as text: equal for equal renderings, whatever the client's JSON spelling."""
    return json.dumps(message, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=_digest)


def _digest(value: Any) -> str:
    """An image's bytes in a canonical message: their digest (equal images, equal keys)."""
    if isinstance(value, bytes):
        return "sha256:" + hashlib.sha256(value).hexdigest()
    raise TypeError(f"{type(value).__name__} in a message")


def assistant_reply(
    parsed: ParsedTurn | None, text: str, call_ids: Sequence[str]
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """The assistant message for the client, the same message for the template, and the parse errors.

    ``parsed`` is None when tool calls are not parsed (no tools, or ``tool_choice='none'``): the text is
    the content.  A malformed call's raw text is appended to the content so the agent sees it.
    """
    if parsed is None or not parsed.has_tool_activity:
        return {"role": "assistant", "content": text}, {"role": "assistant", "content": text}, []
    content = parsed.content
    if parsed.errors:
        raw = "\n".join(e.raw for e in parsed.errors if e.raw)
        content = f"{content}\n{raw}".strip() if content else raw
    calls: list[dict[str, Any]] = [
        {"id": cid, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c, cid in zip(parsed.calls, call_ids, strict=False)
    ]
    wire: dict[str, Any] = {"role": "assistant", "content": content or None}
    tmpl: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        wire["tool_calls"] = [
            {**c, "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
            for c in calls
        ]
        tmpl["tool_calls"] = calls
    return wire, tmpl, [f"{e.kind}: {e.message}" for e in parsed.errors]
