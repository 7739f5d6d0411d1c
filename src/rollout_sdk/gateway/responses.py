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
from .requests import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    Refusal,
    ResponsesRequest,
    TextPart,
    convert,
)
from .service import Choice, Outcome
from .sessions import Session

__all__ = ["CHAT_NAMES", "Echo", "response_body", "response_events", "to_chat"]

#: chat fields an error may name -> the Responses field they came from
CHAT_NAMES = {"max_tokens": "max_output_tokens"}


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
    """The chat body a Responses call means, and what its answer echoes.  400s name the Responses field
    (types: :class:`~.requests.ResponsesRequest`; the sampling fields are checked as the chat call's)."""
    req = convert(body, ResponsesRequest)
    if req.background:
        raise unsupported("background", "background responses are not supported")
    fmt = req.text.get("format") if isinstance(req.text, dict) else None
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise unsupported("text.format", "only the text format {'type': 'text'} is supported")
    echo = Echo(
        instructions=req.instructions,
        tools=list(req.tools or []),
        tool_choice=req.tool_choice or "auto",
        previous_response_id=req.previous_response_id,
        metadata=dict(req.metadata or {}),
        max_output_tokens=req.max_output_tokens,
        logprobs="message.output_text.logprobs" in (req.include or []),
    )
    messages: list[dict[str, Any]] = []
    prev = req.previous_response_id
    if prev is not None:
        try:
            messages = [dict(m) for m in session.response_node(prev).messages]
        except GatewayError:
            raise bad_request(
                "previous_response_id",
                f"no response {prev!r} in this session (responses chain within one session)",
                "previous_response_not_found",
            ) from None
    if req.instructions is not None:
        system = {"role": "system", "content": req.instructions}
        if messages and messages[0].get("role") == "system":
            messages[0] = system
        else:
            messages.insert(0, system)
    messages.extend(input_messages(req.input))
    chat: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.tools:
        chat["tools"] = [_chat_tool(t) for t in req.tools]
    if req.max_output_tokens is not None:
        chat["max_tokens"] = req.max_output_tokens
    # checked by the chat path with the same names (parallel_tool_calls=false, top_logprobs > 0 ... are 400s)
    for key in _PASSED_ON:
        if (value := getattr(req, key)) is not None:
            chat[key] = value
    if echo.logprobs:
        chat["logprobs"] = True
    return chat, echo


#: fields the chat call takes as they are
_PASSED_ON = (
    "tool_choice",
    "temperature",
    "top_p",
    "stream",
    "seed",
    "stop",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "min_tokens",
    "parallel_tool_calls",
    "service_tier",
    "top_logprobs",
)


def _chat_tool(tool: Any) -> Any:
    """A Responses function tool as a chat tool (``strict`` dropped); anything else is left for the chat
    path to refuse by name."""
    if isinstance(tool, dict) and tool.get("type") == "function" and "function" not in tool:
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        return {"type": "function", "function": fn}
    return tool


def _text(content: str | list[TextPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(p.refusal if isinstance(p, Refusal) else p.text for p in content)


def input_messages(items: str | list[Any] | None) -> list[dict[str, Any]]:
    """Responses ``input`` as chat messages (a function call joins the assistant message it follows)."""
    if items is None:
        raise bad_request("input", "input is required", "missing_required_parameter")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    # an item with a role and no type is a message (the typed union needs its tag)
    tagged = [
        {**item, "type": "message"} if isinstance(item, dict) and not item.get("type") and "role" in item else item
        for item in items
    ]
    out: list[dict[str, Any]] = []
    joinable = False  # the last message is an assistant message that later function calls belong to
    for item in convert(tagged, list[InputItem], where="input"):
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": _text(item.content)})
            joinable = item.role == "assistant"
        elif isinstance(item, FunctionCallItem):
            fn = {"name": item.name, "arguments": item.arguments}
            if not joinable:
                out.append({"role": "assistant", "content": ""})
                joinable = True
            out[-1].setdefault("tool_calls", []).append({"id": item.call_id, "type": "function", "function": fn})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
            joinable = False
        # reasoning: already in the recorded tokens of the turn that produced it
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
