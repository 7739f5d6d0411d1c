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
from .service import Outcome

__all__ = ["CHAT_NAMES", "message_body", "message_events", "to_chat"]

#: chat fields an error may name -> the Messages field they came from
CHAT_NAMES = {"stop": "stop_sequences"}

_FIELDS = {
    "model",
    "messages",
    "system",
    "max_tokens",
    "tools",
    "tool_choice",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "stream",
    # accepted, change nothing the model sees
    "metadata",
    "thinking",
    "service_tier",
    "cache_control",
    "output_config",
    "container",
    "diagnostics",
    "inference_geo",
    "speed",
    "user_profile_id",
    "workspace_id",
}


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body a Messages call means.  400s name the Messages field."""
    for key in body:
        if key not in _FIELDS:
            raise unsupported(key, f"unsupported field {key!r}: this gateway does not implement it")
    config = body.get("output_config")
    if config is not None and (not isinstance(config, dict) or config.get("format") is not None):
        raise unsupported("output_config.format", "output formats (JSON schemas) cannot be enforced on the model")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _blocks_text(system, "system")})
    raw = body.get("messages")
    if raw is None:
        raise bad_request("messages", "messages is required", "missing_required_parameter")
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages", "messages must be a non-empty list", "invalid_type")
    for i, m in enumerate(raw):
        messages.extend(_message(m, f"messages[{i}]"))
    if body.get("max_tokens") is None:  # required by Anthropic's API, answered as Anthropic does
        raise bad_request("max_tokens", "max_tokens: Field required", "missing_required_parameter")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "none"):
            raise unsupported("tool_choice", f"tool_choice {choice!r}: only 'auto' and 'none' can be honoured")
        if choice.get("disable_parallel_tool_use"):
            raise unsupported("tool_choice.disable_parallel_tool_use", "cannot be enforced on the model")
        chat["tool_choice"] = kind
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    for key in ("max_tokens", "temperature", "top_p", "top_k", "stream"):
        if body.get(key) is not None:
            chat[key] = body[key]
    return chat


def _blocks_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(where, "content must be a string or a list of blocks", "invalid_type")
    texts = []
    for k, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        if kind != "text" or not isinstance(block.get("text"), str):
            raise unsupported(f"{where}[{k}]", f"block of type {kind!r}: only text blocks are supported here")
        texts.append(block["text"])
    return "".join(texts)


def _message(m: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(m, dict):
        raise bad_request(where, "each message must be an object", "invalid_type")
    role = m.get("role")
    if role not in ("user", "assistant"):
        raise bad_request(f"{where}.role", f"role {role!r} is not one of user, assistant")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content", "content must be a string or a list of blocks", "invalid_type")
    if role == "assistant":
        parts: list[str] = []
        calls: list[dict[str, Any]] = []
        for k, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                parts.append(_blocks_text([block], f"{where}.content"))
            elif kind == "tool_use":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise bad_request(f"{where}.content[{k}]", "a tool_use block needs a string id and name")
                fn = {"name": block["name"], "arguments": block.get("input") or {}}
                calls.append({"id": block["id"], "type": "function", "function": fn})
            elif kind in ("thinking", "redacted_thinking"):
                continue
            else:
                raise unsupported(f"{where}.content[{k}]", f"block of type {kind!r} is not supported")
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(parts)}
        if calls:
            msg["tool_calls"] = calls
        return [msg]
    out: list[dict[str, Any]] = []
    for k, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text = _blocks_text([block], f"{where}.content")
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += text
            else:
                out.append({"role": "user", "content": text})
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad_request(f"{where}.content[{k}].tool_use_id", "a tool_result block needs a tool_use_id")
            result = block.get("content")
            text = "" if result is None else _blocks_text(result, f"{where}.content[{k}].content")
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        else:
            raise unsupported(f"{where}.content[{k}]", f"block of type {kind!r} is not supported")
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad_request("tools", "tools must be a list", "invalid_type")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") not in (None, "custom"):
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise unsupported(f"tools[{i}].type", f"tools of type {kind!r}: only custom (client) tools are supported")
        fn = {"name": t.get("name"), "description": t.get("description"), "parameters": t.get("input_schema")}
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out


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
