"""How users and agent frameworks write the calculator tool: the phrasings the tool model is trained on
and the ones held back to test it.

The model must call the tool whatever its definition says, as long as it is a function named
``calculator`` with one string parameter ``expression``: frameworks generate these definitions from a
signature and a docstring (the OpenAI Agents SDK's ``function_tool``: strict, titles,
``additionalProperties``; LangChain's ``@tool``: no parameter description; hand-written ones: any
wording, with or without ``required``), and agents add their own system prompt.

* :func:`training_tools` draws a random definition: descriptions are random words (mostly words the
  model has no embedding of: every word outside the task's vocabulary shares one row, so what it learns
  is to read *past* a description of any length, not a list of sentences), keys in any order, optional
  ``required``, ``additionalProperties``, titles, a stray key, a system prompt, a second tool.
* :data:`HELD_BACK` are definitions written as users and frameworks write them, never trained on; the
  tests and ``bench/tool_model_check.py`` call the model through the gateway with them.

Definitions are in the chat API's normalised form (``{"type": "function", "function": {name,
description, parameters}}``), which is what the gateway renders for chat completions, Responses and
Messages alike (:func:`rollout_sdk.gateway.tools.template_tools`).
"""

from __future__ import annotations

import random
from typing import Any

__all__ = ["HELD_BACK", "HeldBackTool", "training_tools"]

#: words descriptions and system prompts are drawn from (a few are task words, most are not)
_WORD_TEXT = (
    "evaluate compute calculate an a the arithmetic math mathematical expression expressions of two integers "
    "numbers number operator operators and or with for to returns return result results value simple basic "
    "tool use this when you need exact answer answers question questions user string input e.g. like such as "
    "product sum difference multiply multiplication add subtract plus minus times digits precise python "
    "syntax valid evaluates formula formulas literal only must should be is are it that which handles support "
    "supports run runs safe safely any given helper function call calls do not guess always your assistant "
    "helpful agent concise careful You are helpful assistant Use Evaluate Compute Calculate Returns Math A The"
)
_WORDS = tuple(_WORD_TEXT.split())
_PUNCT = ("", "", "", ".", ".", ",", ":", "!", ";")
_QUOTES = ("", "", "", '"', "'", "`")
_OPS = ("*", "+", "-", "/")


def _example(rng: random.Random) -> str:
    """An example expression as descriptions write one ("e.g. 12 * 34", "'2+2'", "`(3 + 4) * 5`"): its
    numbers are random, so the model learns to copy the operands from the question, never from a
    description (with a few fixed examples, a held-back "e.g. 12 * 34" pulled the copy off on some CPUs)."""

    def number() -> str:
        return str(rng.randint(0, 10 ** rng.randint(1, 3) - 1))

    sep = rng.choice((" ", " ", ""))
    text = sep.join((number(), rng.choice(_OPS), number()))
    if rng.random() < 0.15:
        text = f"({text}){sep}{rng.choice(_OPS)}{sep}{number()}"
    quote = rng.choice(_QUOTES)
    text = quote + text + quote
    return rng.choice(("", "", "e.g. ", "like ", "such as ", "for example ")) + text


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(lo, hi))]
    if rng.random() < 0.4:
        words.insert(rng.randint(0, len(words)), _example(rng))
    if rng.random() < 0.5 and words:
        words[0] = words[0][:1].upper() + words[0][1:]
    text = " ".join(words) + rng.choice(_PUNCT)
    if rng.random() < 0.1:
        text += "\n" + _sentence(rng, 1, 8)
    return text


def _ordered(rng: random.Random, d: dict[str, Any]) -> dict[str, Any]:
    keys = list(d)
    rng.shuffle(keys)
    return {k: d[k] for k in keys}


def _name(rng: random.Random) -> str:
    return "_".join(rng.choice(_WORDS).lower().strip(".") for _ in range(rng.randint(1, 3)))


def _other_tool(rng: random.Random) -> dict[str, Any]:
    """A second tool the model must not call for arithmetic (an agent usually has several)."""
    props = {
        _name(rng): _ordered(rng, {"type": rng.choice(("string", "number", "integer", "boolean"))})
        for _ in range(rng.randint(1, 3))
    }
    params: dict[str, Any] = {"type": "object", "properties": props}
    if rng.random() < 0.6:
        params["required"] = list(props)
    fn: dict[str, Any] = {"name": _name(rng)}
    if rng.random() < 0.8:
        fn["description"] = _sentence(rng, 2, 14)
    fn["parameters"] = _ordered(rng, params)
    return {"type": "function", "function": fn}


def training_tools(rng: random.Random) -> tuple[list[dict[str, Any]], str | None]:
    """A random calculator definition (in a list with, sometimes, one or two other tools) and a system prompt (None:
    the template's default).  Draws from ``rng`` only."""
    prop: dict[str, Any] = {"type": "string"}
    if rng.random() < 0.6:
        prop["description"] = _sentence(rng, 1, 16)
    if rng.random() < 0.3:
        prop["title"] = rng.choice(("Expression", "expression", _sentence(rng, 1, 2)))
    params: dict[str, Any] = {"type": "object", "properties": {"expression": _ordered(rng, prop)}}
    if rng.random() < 0.7:
        params["required"] = ["expression"]
    if rng.random() < 0.5:
        params["additionalProperties"] = False
    if rng.random() < 0.25:
        params["title"] = rng.choice(("calculator_args", "CalculatorInput", "Input", _name(rng)))
    if rng.random() < 0.1:
        params[_name(rng)] = rng.choice((True, False, _sentence(rng, 1, 4), 0))
    fn: dict[str, Any] = {"name": "calculator"}
    r = rng.random()
    if r < 0.8:
        fn["description"] = _sentence(rng, 1, 30)
    elif r < 0.85:
        fn["description"] = ""
    fn["parameters"] = _ordered(rng, params)
    tools = [{"type": "function", "function": fn}]
    for _ in range(rng.choice((0, 0, 0, 0, 0, 1, 1, 2))):
        tools.insert(rng.randint(0, len(tools)), _other_tool(rng))
    system = _sentence(rng, 2, 24) if rng.random() < 0.35 else None
    return tools, system


class HeldBackTool:
    """A calculator definition as one user or framework writes it, never trained on; ``chat()``,
    ``responses()`` and ``messages()`` are its spelling in each API's ``tools``."""

    def __init__(
        self,
        label: str,
        *,
        description: str | None,
        parameters: dict[str, Any],
        strict: bool | None = None,
        system: str | None = None,
    ) -> None:
        self.label = label
        self.description = description
        self.parameters = parameters
        self.strict = strict
        #: the system prompt the framework sends with it (None: none)
        self.system = system

    def chat(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": "calculator"}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        if self.strict is not None:
            fn["strict"] = self.strict
        return {"type": "function", "function": fn}

    def responses(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "function", "name": "calculator"}
        if self.description is not None:
            out["description"] = self.description
        out["parameters"] = self.parameters
        if self.strict is not None:
            out["strict"] = self.strict
        return out

    def messages(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": "calculator"}
        if self.description is not None:
            out["description"] = self.description
        out["input_schema"] = self.parameters
        return out

    def __repr__(self) -> str:
        return f"HeldBackTool({self.label!r})"


_EXPRESSION = {"type": "string"}
#: never trained on: what users and frameworks write (the first is the docs' snippet)
HELD_BACK: tuple[HeldBackTool, ...] = (
    HeldBackTool(
        "hand-written (docs)",
        description="Evaluate an arithmetic expression and return the result.",
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12 * 34"}},
            "required": ["expression"],
        },
    ),
    HeldBackTool(
        "hand-written, strict",
        description="Use this tool to do math. Always call it instead of computing in your head.",
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "A math expression like '2 + 2'."}},
            "required": ["expression"],
            "additionalProperties": False,
        },
        strict=True,
    ),
    HeldBackTool(
        "OpenAI Agents SDK function_tool",
        description="Evaluate a multiplication such as 6 * 7 and return the product.",
        parameters={
            "properties": {"expression": {"title": "Expression", "type": "string"}},
            "required": ["expression"],
            "title": "calculator_args",
            "type": "object",
            "additionalProperties": False,
        },
        strict=True,
        system="You are a precise assistant. Use the calculator for every arithmetic question.",
    ),
    HeldBackTool(
        "LangChain @tool",
        description="Multiply or add two numbers given as a Python expression.",
        parameters={"properties": {"expression": {"type": "string"}}, "required": ["expression"], "type": "object"},
    ),
    HeldBackTool(
        "minimal",
        description=None,
        parameters={"type": "object", "properties": {"expression": _EXPRESSION}},
    ),
    HeldBackTool(
        "verbose, with a system prompt",
        description=(
            "Calculator. Takes a single arithmetic expression using +, -, * and parentheses over integers, "
            "evaluates it exactly and returns the numeric result as a string. Do not attempt mental math."
        ),
        parameters={
            "type": "object",
            "required": ["expression"],
            "properties": {
                "expression": {
                    "description": "The expression to evaluate, for example '128 * 256'.",
                    "type": "string",
                }
            },
        },
        system="You are a helpful assistant.",
    ),
)
