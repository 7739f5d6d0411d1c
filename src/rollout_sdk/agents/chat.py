"""Chat templates for token-in/token-out multi-turn rollouts.

The model's own output tokens are never decoded and re-encoded: they go into the trajectory as the engine
returned them.  Only what *we* add between model turns (the end of the assistant turn, tool results, the
next generation prompt) is rendered with the tokenizer's chat template and tokenized — the "glue".

The glue of one turn is computed as a difference of two renderings of the conversation::

    before = render(history)                                  # ends with the assistant turn just generated
    after  = render(history + tool results, generation prompt)
    glue   = (end of the assistant turn the model did not generate) + after[len(before):]

which is exact when the template is *append-only* at that boundary (``after`` starts with ``before``).
Qwen2.5's template is append-only at assistant-turn boundaries but not per message (consecutive tool
results share one ``<|im_start|>user`` block), so the tool results of one turn are always rendered together
with the generation prompt.  A template that rewrites earlier turns (e.g. one that drops past reasoning)
is not append-only: ``strategy="auto"`` then renders the new messages after a neutral context (one user
message, nothing to rewrite) and marks the trajectory, ``strategy="strict"`` raises.  Either way
:meth:`ChatTemplate.check_drift` re-renders the whole conversation and reports where it departs from the
tokens the model actually saw.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, RolloutError

__all__ = ["ChatTemplate", "DriftReport", "TemplateError", "message_images"]

Message = dict[str, Any]
_MARK = "\u2063rollout-sdk-content\u2063"


class TemplateError(RolloutError):
    """The chat template cannot extend the conversation as required (e.g. it is not append-only)."""


@dataclass(frozen=True)
class DriftReport:
    """How the accumulated token ids compare with a fresh rendering of the whole conversation."""

    ok: bool
    accumulated: int
    rendered: int
    first_mismatch: int | None
    accumulated_context: str = ""
    rendered_context: str = ""
    template_rewrites: bool = False
    #: where the first difference is: "prompt", "model" (re-tokenizing the model's text gives other
    #: tokens: expected with real models, and why ids are never re-encoded) or "added" (a token the loop
    #: added differs from the template's rendering: a template that rewrites turns, or a bug)
    region: str = ""

    def __str__(self) -> str:
        if self.ok:
            return f"no drift ({self.accumulated} tokens)"
        return (
            f"token drift in {self.region or 'the'} tokens at position {self.first_mismatch} of "
            f"{self.accumulated}: accumulated {self.accumulated_context!r} vs re-rendered {self.rendered_context!r}"
        )


class ChatTemplate:
    """A tokenizer's chat template, as the agent loop needs it."""

    def __init__(
        self, tokenizer: Any, *, tools: Sequence[dict[str, Any]] | None = None, strategy: str = "auto"
    ) -> None:
        if strategy not in ("auto", "strict"):
            raise ConfigError("strategy", strategy, "must be 'auto' or 'strict'")
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("tokenizer", type(tokenizer).__name__, "has no chat template")
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.strategy = strategy
        #: the template writes tool-call arguments as they are (DeepSeek's: ``'...' + arguments + '...'``):
        #: they are then given as JSON text, else as objects (see :meth:`render`)
        self.arguments_as_text = self._writes_arguments_as_text()
        self.assistant_suffix = self._assistant_suffix()

    # -- rendering ---------------------------------------------------------------------------------

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> str:
        """The template's text for ``messages``.  OpenAI-style string ``tool_calls[].function.arguments``
        are parsed into objects first (as vLLM and SGLang do), so they render exactly like dict
        arguments instead of being double-encoded; the caller's messages are not modified.  A template
        that writes arguments as they are (:attr:`arguments_as_text`: DeepSeek V3 / V3.1 / R1 concatenate
        them into the text) gets them as JSON text instead: an object there would raise, or show Python's
        ``{'k': 'v'}``."""
        fixed = _with_text_arguments(messages) if self.arguments_as_text else _with_object_arguments(messages)
        return self._apply(fixed, add_generation_prompt)

    def _apply(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        return str(text)

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return list(ids)

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The first prompt: the messages and the generation prompt."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def _writes_arguments_as_text(self) -> bool:
        """Whether the template writes a call's arguments as they are.  Probed once: an assistant turn with
        a call whose arguments are an object either fails to render (string concatenation) or shows
        Python's repr of the object; then arguments go to this template as JSON text.  Any template error
        in the probe (one that refuses tool calls altogether) leaves the default, objects."""
        call = {"id": "abcdefghi", "type": "function", "function": {"name": "f", "arguments": {"k": "v"}}}
        probe: list[Message] = [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
        ]
        try:
            return "{'k': 'v'}" in self._apply(probe, False)
        except Exception:  # the probe's boundary: any template's own error means "not with objects"
            pass
        try:
            self._apply(_with_text_arguments(probe), False)
        except Exception:  # refuses tool calls in both forms: keep the default
            return False
        return True

    def _assistant_suffix(self) -> str:
        """What the template writes after an assistant message's content (``<|im_end|>\\n`` for Qwen)."""
        msgs = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]
        text = self.render(msgs, add_generation_prompt=False)
        idx = text.rfind(_MARK)
        if idx < 0:
            raise TemplateError("the chat template drops assistant content; cannot find the end of a turn")
        return text[idx + len(_MARK) :]

    # -- glue --------------------------------------------------------------------------------------

    def decode_reply(self, output_ids: Sequence[int]) -> tuple[str, str]:
        """A model turn's text as generated (special tokens kept: :meth:`glue_ids` continues after it) and
        its content, the same text without the end-of-turn marker (:meth:`strip_turn_end`)."""
        text = self.tokenizer.decode(list(output_ids), skip_special_tokens=False)
        return text, self.strip_turn_end(text)

    def strip_turn_end(self, model_text: str) -> str:
        """The model's text without the end-of-turn marker it generated (e.g. a trailing ``<|im_end|>``)."""
        suffix = self.assistant_suffix
        for k in range(len(suffix), 0, -1):
            if suffix[:k].strip() and model_text.endswith(suffix[:k]):
                return model_text[:-k]
        return model_text

    def turn_end(self, model_text: str) -> str:
        """The part of the assistant suffix the model did not generate itself.

        A model that stopped on ``<|im_end|>`` leaves ``"\\n"``; one cut off mid-turn leaves the whole
        suffix.
        """
        suffix = self.assistant_suffix
        for k in range(len(suffix), 0, -1):
            if model_text.endswith(suffix[:k]):
                return suffix[k:]
        return suffix

    def glue(self, history: Sequence[Message], new: Sequence[Message], model_text: str) -> tuple[str, bool]:
        """Text to append after the model's last output so that the context continues with ``new``
        messages and a generation prompt.  Returns ``(text, template_rewrites)``."""
        before = self.render(history, add_generation_prompt=False)
        after = self.render([*history, *new], add_generation_prompt=True)
        if after.startswith(before):
            return self.turn_end(model_text) + after[len(before) :], False
        if self.strategy == "strict":
            raise TemplateError(
                "the chat template is not append-only here: rendering the tool results changes earlier text"
                f" (first difference at character {_first_diff(before, after)})"
            )
        # The template rewrites earlier turns.  Render the new messages after a neutral context (one user
        # message, no assistant turn to rewrite) and take what they add.
        base = [{"role": "user", "content": _MARK}]
        local_before = self.render(base, add_generation_prompt=False)
        local_after = self.render([*base, *new], add_generation_prompt=True)
        if not local_after.startswith(local_before):
            raise TemplateError("the chat template is not append-only even locally; cannot extend the turn")
        return self.turn_end(model_text) + local_after[len(local_before) :], True

    def glue_ids(self, history: Sequence[Message], new: Sequence[Message], model_text: str) -> tuple[list[int], bool]:
        text, rewrites = self.glue(history, new, model_text)
        return self.encode(text), rewrites

    # -- drift -------------------------------------------------------------------------------------

    def check_drift(
        self,
        messages: Sequence[Message],
        ids: Sequence[int],
        *,
        template_rewrites: bool = False,
        loss_mask: Sequence[int] | None = None,
        prompt_len: int = 0,
    ) -> DriftReport:
        """Re-render the whole conversation and compare it with ``ids``, the tokens the model saw.

        ``ids`` ends either with the model's final turn (the re-rendering then ends with the template's
        end of that turn, so only the first ``len(ids)`` rendered tokens must match) or, when the loop
        stopped right after adding tool results (max_turns, stale, budget), with that glue and the
        generation prompt: then the conversation is re-rendered with the generation prompt too.
        """
        ends_on_glue = bool(messages) and messages[-1].get("role") != "assistant"
        rendered = self.encode(self.render(messages, add_generation_prompt=ends_on_glue))
        n = min(len(ids), len(rendered))
        first = next((i for i in range(n) if ids[i] != rendered[i]), None)
        if first is None and len(rendered) < len(ids):
            first = n
        if first is None:
            return DriftReport(True, len(ids), len(rendered), None, template_rewrites=template_rewrites)
        lo = max(0, first - 8)
        dec = self.tokenizer.decode
        region = ""
        if loss_mask is not None:
            if first < prompt_len:
                region = "prompt"
            elif first - prompt_len < len(loss_mask):
                region = "model" if loss_mask[first - prompt_len] else "added"
        return DriftReport(
            False,
            len(ids),
            len(rendered),
            first,
            accumulated_context=dec(list(ids[lo : first + 8])),
            rendered_context=dec(list(rendered[lo : first + 8])),
            template_rewrites=template_rewrites,
            region=region,
        )


def _with_object_arguments(messages: Sequence[Message]) -> list[Message]:
    """``messages`` with every JSON-string ``function.arguments`` decoded (copies only what changes).

    A string that does not hold a JSON object is left as it is (the template shows what it was given).
    """
    out: list[Message] = []
    for m in messages:
        calls = m.get("tool_calls")
        if not calls or not any(isinstance(_function(c).get("arguments"), str) for c in calls):
            out.append(m)
            continue
        new_calls = []
        for c in calls:
            fn = _function(c)
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    decoded = json.loads(args)
                except ValueError:
                    decoded = None
                if isinstance(decoded, dict):
                    c = {**c, "function": {**fn, "arguments": decoded}}
            new_calls.append(c)
        out.append({**m, "tool_calls": new_calls})
    return out


def _with_text_arguments(messages: Sequence[Message]) -> list[Message]:
    """``messages`` with every object ``function.arguments`` as JSON text (copies only what changes);
    text arguments stay exactly as they are (what the model or the client wrote)."""
    out: list[Message] = []
    for m in messages:
        calls = m.get("tool_calls")
        if not calls or not any(isinstance(_function(c).get("arguments"), dict) for c in calls):
            out.append(m)
            continue
        new_calls = []
        for c in calls:
            fn = _function(c)
            if isinstance(fn.get("arguments"), dict):
                c = {**c, "function": {**fn, "arguments": json.dumps(fn["arguments"], ensure_ascii=False)}}
            new_calls.append(c)
        out.append({**m, "tool_calls": new_calls})
    return out


def _function(call: Any) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    return fn if isinstance(fn, dict) else {}


def _first_diff(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def message_images(messages: Sequence[Message]) -> list[bytes]:
    """The encoded images of ``messages``' ``{"type": "image", "image": <bytes>}`` content parts, in order:
    the images a vision-language request sends with the rendered prompt (one per image mark)."""
    out: list[bytes] = []
    for m in messages:
        parts = m.get("content")
        if isinstance(parts, list):
            out.extend(p["image"] for p in parts if isinstance(p, dict) and isinstance(p.get("image"), bytes))
    return out
