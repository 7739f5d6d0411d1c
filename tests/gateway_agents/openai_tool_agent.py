"""A multi-turn tool-using agent written against the ``openai`` package only.

It imports nothing from rollout-sdk (a test checks): it is what a user's black-box agent looks like.  It
keeps the conversation itself and re-sends all of it on every call, as agents do.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from openai import AsyncOpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "mul",
            "description": "Multiply two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]

FUNCTIONS: dict[str, Callable[..., Any]] = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b}


async def _call(client: AsyncOpenAI, stream: bool, **kw: Any) -> tuple[dict[str, Any], str, Any]:
    """One model call; returns (assistant message as a dict, finish_reason, logprobs content or None)."""
    if not stream:
        r = await client.chat.completions.create(**kw)
        choice = r.choices[0]
        lps = choice.logprobs.content if choice.logprobs is not None else None
        return choice.message.model_dump(exclude_none=True), str(choice.finish_reason), lps
    content, calls, finish, lps = "", {}, "", []
    async for chunk in await client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            if ch.delta.content:
                content += ch.delta.content
            for tc in ch.delta.tool_calls or []:
                slot = calls.setdefault(
                    tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                )
                slot["id"] = tc.id or slot["id"]
                if tc.function is not None:
                    slot["function"]["name"] += tc.function.name or ""
                    slot["function"]["arguments"] += tc.function.arguments or ""
            if ch.logprobs is not None and ch.logprobs.content:
                lps.extend(ch.logprobs.content)
            if ch.finish_reason:
                finish = ch.finish_reason
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg, finish, lps or None


async def run_agent(
    base_url: str,
    api_key: str,
    model: str,
    task: str,
    *,
    follow_ups: list[str] | None = None,
    max_turns: int = 6,
    max_tokens: int | None = None,
    seed: int | None = None,
    stream: bool = False,
    logprobs: bool = True,
) -> dict[str, Any]:
    """Run until the model answers without a tool call and no follow-up question is left."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a calculator. Use the tools."},
        {"role": "user", "content": task},
    ]
    pending = list(follow_ups or [])
    replies = []
    try:
        for turn in range(max_turns):
            kw: dict[str, Any] = {"model": model, "messages": messages, "tools": TOOLS, "logprobs": logprobs}
            if max_tokens is not None:
                kw["max_tokens"] = max_tokens
            if seed is not None:
                kw["seed"] = seed + turn
            msg, finish, lps = await _call(client, stream, **kw)
            replies.append({"message": msg, "finish_reason": finish, "logprobs": lps})
            messages.append(msg)
            if msg.get("tool_calls"):
                for call in msg["tool_calls"]:
                    fn = call["function"]
                    try:
                        out = FUNCTIONS[fn["name"]](**json.loads(fn["arguments"]))
                    except Exception as exc:  # the agent reports bad calls back, as agents do
                        out = f"error: {exc}"
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": str(out)})
            elif pending:
                messages.append({"role": "user", "content": pending.pop(0)})
            else:
                break
    finally:
        await client.close()
    return {"messages": messages, "replies": replies}
