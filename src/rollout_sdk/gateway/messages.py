"""Anthropic's Messages API (``POST /v1/messages``) on top of the chat path: same turns, same tokens.

Like :mod:`.responses`, a Messages call is translated into the chat call it means, served by
:meth:`~.service.TurnService.chat` (same session tree, same recording) and written back in Anthropic's
shape.  The mapping::

    system (string or text blocks)       -> a system message first
    user    text blocks                  -> a user message
            tool_result blocks           -> one tool message each (their text content)
    assistant text blocks + tool_use     -> one assistant message with tool calls (input = arguments)
            thinking blocks              -> dropped (the model's reasoning is in the recorded tokens)
    tools: {"name", "description", "input_schema"} -> chat function tools
    tool_choice {"type": "auto" | "none"}; stop_sequences -> stop; max_tokens, temperature, top_p, top_k

    content: [thinking?] [text?] [tool_use ...]      stop_reason end_turn / tool_use / max_tokens / stop_sequence

Streaming sends the whole turn's events once generated, in the order the ``anthropic`` client's
accumulator expects: ``message_start``, per block ``content_block_start`` / ``content_block_delta`` /
``content_block_stop``, ``message_delta`` (stop reason, the cumulative usage: input and output tokens),
``message_stop``.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import bad_request, unsupported
from .requests import (
    AnthropicMessage,
    AnthropicTool,
    MessagesRequest,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    convert,
)
from .service import Outcome

__all__ = ["CHAT_NAMES", "message_body", "message_events", "to_chat"]

#: chat fields an error may name -> the Messages field they came from
CHAT_NAMES = {"stop": "stop_sequences"}


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body a Messages call means.  400s name the Messages field (types:
    :class:`~.requests.MessagesRequest`; the sampling fields are checked as the chat call's)."""
    req = convert(body, MessagesRequest)
    if req.output_config is not None and req.output_config.get("format") is not None:
        raise unsupported("output_config.format", "output formats (JSON schemas) cannot be enforced on the model")
    messages: list[dict[str, Any]] = []
    if req.system is not None:
        messages.append({"role": "system", "content": _text(req.system)})
    if req.messages is None:
        raise bad_request("messages", "messages is required", "missing_required_parameter")
    for i, m in enumerate(req.messages):
        messages.extend(_message(m, f"messages[{i}]"))
    if req.max_tokens is None:  # required by Anthropic's API, answered as Anthropic does
        raise bad_request("max_tokens", "max_tokens: Field required", "missing_required_parameter")
    chat: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.tools:
        chat["tools"] = [_tool(t) for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "none"):
            raise unsupported("tool_choice", f"tool_choice {choice!r}: only 'auto' and 'none' can be honoured")
        if choice.get("disable_parallel_tool_use"):
            raise unsupported("tool_choice.disable_parallel_tool_use", "cannot be enforced on the model")
        chat["tool_choice"] = kind
    if req.stop_sequences is not None:
        chat["stop"] = req.stop_sequences
    for key in ("max_tokens", "temperature", "top_p", "top_k", "stream"):
        if (value := getattr(req, key)) is not None:
            chat[key] = value
    return chat


def _text(content: str | list[TextBlock] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(b.text for b in content)


def _message(m: AnthropicMessage, where: str) -> list[dict[str, Any]]:
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    if m.role == "assistant":
        parts: list[str] = []
        calls: list[dict[str, Any]] = []
        for k, block in enumerate(m.content):
            if isinstance(block, TextBlock):
                parts.append(block.text)
            elif isinstance(block, ToolUseBlock):
                fn = {"name": block.name, "arguments": block.input or {}}
                calls.append({"id": block.id, "type": "function", "function": fn})
            elif isinstance(block, ToolResultBlock):
                raise unsupported(f"{where}.content[{k}]", "block of type 'tool_result' is not supported here")
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(parts)}
        if calls:
            msg["tool_calls"] = calls
        return [msg]
    out: list[dict[str, Any]] = []
    for k, block in enumerate(m.content):
        if isinstance(block, TextBlock):
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += block.text
            else:
                out.append({"role": "user", "content": block.text})
        elif isinstance(block, ToolResultBlock):
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _text(block.content)})
        else:
            kind = type(block).__struct_config__.tag
            raise unsupported(f"{where}.content[{k}]", f"block of type {kind!r} is not supported here")
    return out


def _tool(t: AnthropicTool) -> dict[str, Any]:
    fn = {"name": t.name, "description": t.description, "parameters": t.input_schema}
    return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


# -- the answer ----------------------------------------------------------------------------------


def _stop_reason(o: Outcome) -> tuple[str, str | None]:
    c = o.choices[0]
    if c.finish_reason == "tool_calls":
        return "tool_use", None
    if c.finish_reason == "length":
        return "max_tokens", None
    if c.matched_stop is not None:
        return "stop_sequence", c.matched_stop
    return "end_turn", None


def content_blocks(o: Outcome) -> list[dict[str, Any]]:
    c = o.choices[0]
    msg = c.message or {}
    calls = msg.get("tool_calls") or []
    blocks: list[dict[str, Any]] = []
    if c.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": c.reasoning, "signature": ""})
    content = msg.get("content") or ""
    if content or not calls:
        blocks.append({"type": "text", "text": content})
    for call in calls:
        fn = call["function"]
        blocks.append({"type": "tool_use", "id": call["id"], "name": fn["name"], "input": json.loads(fn["arguments"])})
    return blocks


def _usage(o: Outcome, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": o.prompt_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def message_body(o: Outcome) -> dict[str, Any]:
    reason, seq = _stop_reason(o)
    return {
        "id": o.id,
        "type": "message",
        "role": "assistant",
        "model": o.model,
        "content": content_blocks(o),
        "stop_reason": reason,
        "stop_sequence": seq,
        "usage": _usage(o, o.completion_tokens),
    }


def message_events(o: Outcome) -> list[tuple[str, dict[str, Any]]]:
    """The SSE events of one whole turn, as ``(event type, data)``."""
    start = {**message_body(o), "content": [], "stop_reason": None, "stop_sequence": None, "usage": _usage(o, 0)}
    events: list[dict[str, Any]] = [{"type": "message_start", "message": start}]
    for index, block in enumerate(content_blocks(o)):
        kind = block["type"]
        empty: dict[str, Any]
        delta: dict[str, Any]
        if kind == "text":
            empty, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        elif kind == "thinking":
            empty = {"type": "thinking", "thinking": "", "signature": ""}
            delta = {"type": "thinking_delta", "thinking": block["thinking"]}
        else:
            empty = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events.append({"type": "content_block_start", "index": index, "content_block": empty})
        events.append({"type": "content_block_delta", "index": index, "delta": delta})
        events.append({"type": "content_block_stop", "index": index})
    reason, seq = _stop_reason(o)
    events.append(
        {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": seq},
            "usage": _usage(o, o.completion_tokens),  # cumulative, as Anthropic's stream ends
        }
    )
    events.append({"type": "message_stop"})
    return [(e["type"], e) for e in events]
