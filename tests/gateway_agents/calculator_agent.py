"""A calculator agent as a newcomer writes it against the gateway: the ``openai`` client (chat completions,
Responses) or the ``anthropic`` client (Messages), the user's own calculator definition, one tool call, the
tool's result sent back, the model's answer.

It imports nothing from rollout-sdk: it is what a user's code looks like.  ``solve_*`` return an
:class:`Outcome` instead of raising, so a caller can count how many questions the model gets right.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from dataclasses import dataclass
from typing import Any

import anthropic
import openai

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expression: str) -> int:
    """The user's calculator: + - * over integers (no eval)."""

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return int(_OPS[type(node.op)](ev(node.left), ev(node.right)))
        raise ValueError(f"unsupported expression {expression!r}")

    return ev(ast.parse(expression, mode="eval").body)


@dataclass
class Outcome:
    """What happened to one question: the parsed call's arguments (None: no parsed call) and the answer."""

    question: str
    answer: int
    arguments: dict[str, Any] | None = None
    final: str = ""
    error: str = ""

    @property
    def called(self) -> bool:
        """A parsed ``calculator`` call whose expression evaluates to the right number."""
        try:
            return self.arguments is not None and evaluate(self.arguments["expression"]) == self.answer
        except (KeyError, TypeError, ValueError, SyntaxError):
            return False

    @property
    def solved(self) -> bool:
        """The call, then a final answer whose last number is the right one."""
        numbers = re.findall(r"-?\d+", self.final)
        return self.called and bool(numbers) and int(numbers[-1]) == self.answer


def _result(arguments: str) -> tuple[dict[str, Any] | None, str]:
    try:
        args = json.loads(arguments)
        return args, str(evaluate(args["expression"]))
    except (ValueError, KeyError, TypeError, SyntaxError) as exc:
        return None, f"error: {exc}"


async def solve_chat(
    client: openai.AsyncOpenAI, model: str, tool: dict[str, Any], question: str, answer: int, **kw: Any
) -> Outcome:
    """Chat completions: ``tool`` is a chat tool (``{"type": "function", "function": {...}}``)."""
    out = Outcome(question, answer)
    messages: list[Any] = [{"role": "user", "content": question}]
    if kw.get("system"):
        messages.insert(0, {"role": "system", "content": kw.pop("system")})
    kw.pop("system", None)
    first = await client.chat.completions.create(model=model, messages=messages, tools=[tool], **kw)
    msg = first.choices[0].message
    if not msg.tool_calls:
        out.error = f"no tool call; content {msg.content!r}"
        return out
    call = msg.tool_calls[0]
    out.arguments, result = _result(call.function.arguments)
    messages += [msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": result}]
    second = await client.chat.completions.create(model=model, messages=messages, tools=[tool], **kw)
    out.final = second.choices[0].message.content or ""
    return out


async def solve_responses(
    client: openai.AsyncOpenAI, model: str, tool: dict[str, Any], question: str, answer: int, **kw: Any
) -> Outcome:
    """The Responses API: ``tool`` is a Responses function tool (``{"type": "function", "name", ...}``)."""
    out = Outcome(question, answer)
    system = kw.pop("system", None)
    if system:
        kw["instructions"] = system
    items: list[Any] = [{"role": "user", "content": question}]
    first = await client.responses.create(model=model, input=items, tools=[tool], **kw)
    calls = [o for o in first.output if o.type == "function_call"]
    if not calls:
        out.error = f"no function_call; output {first.output_text!r}"
        return out
    out.arguments, result = _result(calls[0].arguments)
    items += [o.model_dump(exclude_none=True) for o in first.output]
    items.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": result})
    second = await client.responses.create(model=model, input=items, tools=[tool], **kw)
    out.final = second.output_text
    return out


async def solve_messages(
    client: anthropic.AsyncAnthropic, model: str, tool: dict[str, Any], question: str, answer: int, **kw: Any
) -> Outcome:
    """The Messages API (``anthropic`` client): ``tool`` is ``{"name", "description", "input_schema"}``."""
    out = Outcome(question, answer)
    if not kw.get("system"):
        kw.pop("system", None)
    if "temperature" in kw:  # recent ``anthropic`` clients take no ``temperature`` argument; the API does
        kw["extra_body"] = {**kw.get("extra_body", {}), "temperature": kw.pop("temperature")}
    messages: list[Any] = [{"role": "user", "content": question}]
    first = await client.messages.create(model=model, max_tokens=64, messages=messages, tools=[tool], **kw)
    uses = [b for b in first.content if b.type == "tool_use"]
    if not uses:
        out.error = f"no tool_use; content {[b.model_dump() for b in first.content]!r}"
        return out
    out.arguments, result = _result(json.dumps(uses[0].input))
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": result}]},
    ]
    second = await client.messages.create(model=model, max_tokens=64, messages=messages, tools=[tool], **kw)
    out.final = "".join(b.text for b in second.content if b.type == "text")
    return out
