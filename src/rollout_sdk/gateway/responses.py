"""The OpenAI Responses API (``POST /v1/responses``) on top of the chat path: same turns, same tokens.

A Responses call is translated into the chat call it means (:func:`to_chat`), served by
:meth:`~.service.TurnService.chat` exactly like ``/v1/chat/completions`` (same session tree, same
recording), and the chat outcome is written back in the Responses shape (:func:`response_body`,
:func:`response_events`).  The mapping::

    instructions                       -> a system message first
    input: "text"                      -> one user message
    input items  message (user/system/developer/assistant, text parts) -> that message
                 function_call          -> a tool call of the assistant message before it (or a new one)
                 function_call_output   -> a tool message
                 reasoning              -> dropped (the model's reasoning is in the recorded tokens already)
    previous_response_id               -> the conversation after that response (this session's), then input
    tools: {"type": "function", "name", "description", "parameters", "strict"} -> chat function tools
    max_output_tokens -> max_tokens;   temperature, top_p, tool_choice ("auto"/"none"), stream as in chat

    output: [reasoning?] [message (output_text)?] [function_call ...]      status completed / incomplete

Streaming sends the whole turn's events once it is generated (the same whole-turn rule as chat), in the
order the ``openai`` client's stream accumulator and the Agents SDK expect: ``response.created``,
``response.in_progress``, per output item ``output_item.added`` / deltas / ``..done`` /
``output_item.done``, then ``response.completed`` (``response.incomplete`` when the token limit cut
the turn).  Nothing here awaits: it is pure translation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import GatewayError, bad_request, unsupported
from .service import Choice, Outcome
from .sessions import Session

__all__ = ["CHAT_NAMES", "Echo", "response_body", "response_events", "to_chat"]

#: chat fields an error may name -> the Responses field they came from
CHAT_NAMES = {"max_tokens": "max_output_tokens"}

#: fields mapped onto the chat call
_MAPPED = {
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "temperature",
    "top_p",
    "max_output_tokens",
    "stream",
    "previous_response_id",
    "include",
    "metadata",
    # SGLang / vLLM-style extensions, as in chat
    "seed",
    "stop",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "min_tokens",
}
#: fields that change nothing the model sees: accepted, echoed where the API echoes them
_IGNORED = {
    "store",
    "user",
    "parallel_tool_calls",
    "truncation",
    "text",
    "reasoning",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
    "safety_identifier",
    "service_tier",
    "stream_options",
    "top_logprobs",
    "background",
    "background_options",
    "context_management",
    # a limit on built-in (hosted) tool calls: this gateway has none, so it is always kept
    "max_tool_calls",
}
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


@dataclass(kw_only=True)
class Echo:
    """What a Responses body echoes back from its request."""

    instructions: str | None = None
    tools: list[Any] = field(default_factory=list)
    tool_choice: Any = "auto"
    previous_response_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    max_output_tokens: int | None = None
    logprobs: bool = False


def to_chat(body: dict[str, Any], session: Session) -> tuple[dict[str, Any], Echo]:
    """The chat body a Responses call means, and what its answer echoes.  400s name the Responses field."""
    for key in body:
        if key not in _MAPPED and key not in _IGNORED:
            raise unsupported(key, f"unsupported field {key!r}: this gateway does not implement it")
    _check_ignored(body)
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise bad_request("metadata", "metadata must be an object", "invalid_type")
    if body.get("tools") is not None and not isinstance(body["tools"], list):
        raise bad_request("tools", "tools must be a list", "invalid_type")
    echo = Echo(
        instructions=body.get("instructions"),
        tools=list(body.get("tools") or []),
        tool_choice=body.get("tool_choice") or "auto",
        previous_response_id=body.get("previous_response_id"),
        metadata=dict(body.get("metadata") or {}),
        max_output_tokens=body.get("max_output_tokens"),
    )
    include = body.get("include") or []
    if not isinstance(include, list):
        raise bad_request("include", "include must be a list", "invalid_type")
    echo.logprobs = "message.output_text.logprobs" in include
    messages: list[dict[str, Any]] = []
    prev = body.get("previous_response_id")
    if prev is not None:
        if not isinstance(prev, str):
            raise bad_request("previous_response_id", "previous_response_id must be a string", "invalid_type")
        try:
            messages = [dict(m) for m in session.response_node(prev).messages]
        except GatewayError:
            raise bad_request(
                "previous_response_id",
                f"no response {prev!r} in this session (responses chain within one session)",
                "previous_response_not_found",
            ) from None
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("instructions", "instructions must be a string", "invalid_type")
        system = {"role": "system", "content": instructions}
        if messages and messages[0].get("role") == "system":
            messages[0] = system
        else:
            messages.insert(0, system)
    messages.extend(input_messages(body.get("input")))
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    if body.get("tools"):
        chat["tools"] = chat_tools(body["tools"])
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = choice
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for key in ("temperature", "top_p", "stream", "seed", "stop", "top_k", "min_p", "repetition_penalty"):
        if body.get(key) is not None:
            chat[key] = body[key]
    # checked by the chat path with the same names (parallel_tool_calls=false, top_logprobs > 0 ... are 400s)
    for key in ("frequency_penalty", "presence_penalty", "min_tokens", "parallel_tool_calls", "service_tier"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("top_logprobs") is not None:
        chat["top_logprobs"] = body["top_logprobs"]
    if echo.logprobs:
        chat["logprobs"] = True
    return chat, echo


def _check_ignored(body: dict[str, Any]) -> None:
    if body.get("background"):
        raise unsupported("background", "background responses are not supported")
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise unsupported("text.format", "only the text format {'type': 'text'} is supported")


def chat_tools(tools: Any) -> Any:
    """Responses function tools as chat tools (``strict`` dropped); anything else is left for the chat
    path to refuse by name."""
    if not isinstance(tools, list):
        return tools
    out = []
    for t in tools:
        if isinstance(t, dict) and t.get("type") == "function" and "function" not in t:
            fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
            out.append({"type": "function", "function": fn})
        else:
            out.append(t)
    return out


def _parts_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(where, "content must be a string or a list of text parts", "invalid_type")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in _TEXT_PARTS:
            raise unsupported(f"{where}[{k}]", f"content part of type {kind!r}: only text is supported")
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise bad_request(f"{where}[{k}].text", "a text part needs a string 'text'")
        texts.append(text)
    return "".join(texts)


def input_messages(items: Any) -> list[dict[str, Any]]:
    """Responses ``input`` as chat messages (a function call joins the assistant message it follows)."""
    if items is None:
        raise bad_request("input", "input is required", "missing_required_parameter")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise bad_request("input", "input must be a string or a list of items", "invalid_type")
    out: list[dict[str, Any]] = []
    joinable = False  # the last message is an assistant message that later function calls belong to
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(where, "each input item must be an object", "invalid_type")
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role", f"role {role!r} is not one of user, system, developer, assistant")
            out.append({"role": role, "content": _parts_text(item.get("content"), f"{where}.content")})
            joinable = role == "assistant"
        elif kind == "function_call":
            name, call_id = item.get("name"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise bad_request(where, "a function_call item needs a string name and call_id")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": item.get("arguments")}}
            if not joinable:
                out.append({"role": "assistant", "content": ""})
                joinable = True
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise bad_request(f"{where}.call_id", "a function_call_output item needs a string call_id")
            out.append(
                {"role": "tool", "tool_call_id": call_id, "content": _parts_text(item.get("output"), f"{where}.output")}
            )
            joinable = False
        elif kind == "reasoning":
            continue  # already in the recorded tokens of the turn that produced it
        else:
            raise unsupported(f"{where}.type", f"input items of type {kind!r} are not supported")
    return out


# -- the answer ----------------------------------------------------------------------------------


def _logprobs(c: Choice, echo: Echo) -> list[dict[str, Any]]:
    if not echo.logprobs or c.logprobs is None:
        return []
    return [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []} for t, lp in c.logprobs]


def output_items(o: Outcome, echo: Echo) -> list[dict[str, Any]]:
    c = o.choices[0]
    key = o.id.removeprefix("resp_")
    items: list[dict[str, Any]] = []
    if c.reasoning is not None:
        items.append(
            {
                "type": "reasoning",
                "id": f"rs_{key}",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": c.reasoning}],
                "status": "completed",
            }
        )
    msg = c.message or {}
    calls = msg.get("tool_calls") or []
    content = msg.get("content") or ""
    if content or not calls:
        part = {"type": "output_text", "text": content, "annotations": [], "logprobs": _logprobs(c, echo)}
        items.append(
            {"type": "message", "id": f"msg_{key}", "status": "completed", "role": "assistant", "content": [part]}
        )
    items.extend(
        {
            "type": "function_call",
            "id": f"fc_{call['id']}",
            "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"],
            "status": "completed",
        }
        for call in calls
    )
    return items


def response_body(o: Outcome, echo: Echo, *, status: str | None = None) -> dict[str, Any]:
    c = o.choices[0]
    done = c.finish_reason != "length"
    sp = o.options.sampling
    return {
        "id": o.id,
        "object": "response",
        "created_at": o.created,
        "status": status or ("completed" if done else "incomplete"),
        "incomplete_details": None if done or status else {"reason": "max_output_tokens"},
        "error": None,
        "model": o.model,
        "output": output_items(o, echo) if status is None else [],
        "instructions": echo.instructions,
        "previous_response_id": echo.previous_response_id,
        "tools": echo.tools,
        "tool_choice": echo.tool_choice,
        "parallel_tool_calls": True,
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "max_output_tokens": echo.max_output_tokens,
        "metadata": echo.metadata,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "reasoning": {"effort": None, "summary": None},
        "store": True,
        "background": False,
        "service_tier": "default",
        "user": None,
        "usage": None
        if status
        else {
            "input_tokens": o.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": o.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": o.prompt_tokens + o.completion_tokens,
        },
    }


def response_events(o: Outcome, echo: Echo) -> list[tuple[str, dict[str, Any]]]:
    """The SSE events of one whole turn, ``(event type, data)`` with ``sequence_number`` in order."""
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": response_body(o, echo, status="in_progress")},
        {"type": "response.in_progress", "response": response_body(o, echo, status="in_progress")},
    ]
    for index, item in enumerate(output_items(o, echo)):
        base = {"output_index": index, "item_id": item["id"]}
        added = {"type": "response.output_item.added", "output_index": index}
        if item["type"] == "message":
            part = item["content"][0]
            events.append({**added, "item": {**item, "content": []}})
            events.append(
                {**base, "type": "response.content_part.added", "content_index": 0, "part": {**part, "text": ""}}
            )
            if part["text"]:
                events.append(
                    {
                        **base,
                        "type": "response.output_text.delta",
                        "content_index": 0,
                        "delta": part["text"],
                        "logprobs": part["logprobs"],
                    }
                )
            events.append(
                {
                    **base,
                    "type": "response.output_text.done",
                    "content_index": 0,
                    "text": part["text"],
                    "logprobs": part["logprobs"],
                }
            )
            events.append({**base, "type": "response.content_part.done", "content_index": 0, "part": part})
        elif item["type"] == "function_call":
            events.append({**added, "item": {**item, "arguments": ""}})
            events.append({**base, "type": "response.function_call_arguments.delta", "delta": item["arguments"]})
            events.append(
                {
                    **base,
                    "type": "response.function_call_arguments.done",
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
        else:  # reasoning
            text = item["content"][0]["text"]
            events.append({**added, "item": {**item, "content": []}})
            events.append({**base, "type": "response.reasoning_text.delta", "content_index": 0, "delta": text})
            events.append({**base, "type": "response.reasoning_text.done", "content_index": 0, "text": text})
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    final = response_body(o, echo)
    events.append({"type": f"response.{final['status']}", "response": final})
    return [(e["type"], {**e, "sequence_number": k}) for k, e in enumerate(events)]
