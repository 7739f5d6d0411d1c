"""OpenAI request fields onto :class:`~rollout_sdk.protocol.SamplingParams`, and nothing silently dropped.

Every top-level field of a request is in exactly one of three sets: fields mapped onto the engine's
sampling (``temperature``, ``top_p``, ``max_tokens`` / ``max_completion_tokens``, ``stop``, ``seed``,
``n``, ``logprobs``, the penalties, and the SGLang/vLLM extensions ``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``); fields that change nothing
the model sees (``user``, ``metadata``, ``store``, ``stream_options`` ...), accepted; and everything else,
answered with a 400 that names the field.  A value the gateway cannot honour (``top_logprobs > 0``,
``logit_bias``, a JSON response format) is a 400 too, never silence.

``stop`` strings: the engine protocol stops on token ids, so a stop string that is one token becomes a
stop token id, and every stop string is also matched in the decoded text after generation; the output is
cut at the token that completes it (that token kept, as OpenAI servers do, its text not returned).  The
tokens kept are a prefix of what the engine sampled, so their logprobs are exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from ..errors import InvalidRequestError
from ..protocol import SamplingParams
from .errors import bad_request, unsupported

__all__ = ["RequestOptions", "SessionSampling", "parse_options"]

#: OpenAI's range for ``temperature`` (the engines accept more; an agent sending 7 has a bug)
MAX_TEMPERATURE = 2.0

_SAMPLING_FLOATS = ("temperature", "top_p", "frequency_penalty", "presence_penalty", "min_p", "repetition_penalty")
_COMMON = {
    "model",
    "stream",
    "stream_options",
    "n",
    "temperature",
    "top_p",
    "max_tokens",
    "stop",
    "seed",
    "logprobs",
    "frequency_penalty",
    "presence_penalty",
    "user",
    "metadata",
    "store",
    "logit_bias",
    "service_tier",
    # SGLang / vLLM extensions
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
}
CHAT_FIELDS = _COMMON | {
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_completion_tokens",
    "top_logprobs",
    "response_format",
    "modalities",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
    "safety_identifier",
    # hints to OpenAI's own models: the chat template is rendered without them (docs/gateway.md)
    "reasoning_effort",
    "verbosity",
    "prediction",
}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}

MAX_STOP = 16
MAX_STOP_CHARS = 512


@dataclass(frozen=True, kw_only=True)
class RequestOptions:
    """What one request asks for, checked: sampling (``max_new_tokens`` still to be fitted), the rest."""

    sampling: SamplingParams
    #: the request's explicit token limit (None: the gateway's default, fitted to the context)
    max_tokens: int | None
    stop: tuple[str, ...]
    n: int
    logprobs: bool
    stream: bool
    include_usage: bool
    #: the session's limit on generated tokens (applied after fitting the default to the context)
    max_tokens_cap: int | None = None


def _number(body: dict[str, Any], name: str, kinds: tuple[type, ...]) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an integer" if kinds == (int,) else "a number"
        raise bad_request(name, f"{name} must be {kind}, got {value!r}", "invalid_type")
    return value


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(name, f"{name} must be a boolean, got {value!r}", "invalid_type")
    return value


def check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    for key in body:
        if key not in allowed:
            raise unsupported(key, f"unsupported field {key!r}: this gateway does not implement it")


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or len(items) > MAX_STOP:
        raise bad_request("stop", f"stop must be a string or a list of at most {MAX_STOP} strings", "invalid_type")
    for i, s in enumerate(items):
        if not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS:
            raise bad_request(f"stop[{i}]", f"each stop must be a non-empty string of <= {MAX_STOP_CHARS} characters")
    return tuple(items)


def parse_options(
    body: dict[str, Any], *, chat: bool, max_n: int, stop_token_ids: Callable[[Sequence[str]], list[int]]
) -> RequestOptions:
    """Check and map the sampling fields of ``body``.  ``stop_token_ids``: the ids of one-token stop strings."""
    check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    n = _number(body, "n", (int,))
    n = 1 if n is None else n
    if not 1 <= n <= max_n:
        raise bad_request("n", f"n must be in [1, {max_n}] on this gateway, got {n}", "n_out_of_range")
    if body.get("logit_bias"):
        raise unsupported("logit_bias", "logit_bias is not supported by the engine protocol")
    if body.get("service_tier") not in (None, "auto", "default"):
        raise unsupported("service_tier", f"service_tier {body['service_tier']!r} is not supported")
    logprobs = body.get("logprobs")
    if chat:
        logprobs = _flag(body, "logprobs")
        top = _number(body, "top_logprobs", (int,))
        if top:
            raise unsupported("top_logprobs", "top_logprobs > 0: the engines return the sampled token's logprob only")
        fmt = body.get("response_format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            raise unsupported("response_format", "only response_format {'type': 'text'} is supported")
        mods = body.get("modalities")
        if mods is not None and mods != ["text"]:
            raise unsupported("modalities", "only text output is supported")
        if body.get("parallel_tool_calls") is False:
            raise unsupported("parallel_tool_calls", "parallel_tool_calls=false cannot be enforced on the model")
    else:
        if logprobs is not None:
            logprobs = _number(body, "logprobs", (int,))
            if logprobs not in (0, 1):
                raise unsupported("logprobs", "logprobs must be 0 or 1: only the sampled token's logprob is returned")
        logprobs = bool(logprobs)
        if _flag(body, "echo"):
            raise unsupported("echo", "echo is not supported")
        if body.get("suffix") is not None:
            raise unsupported("suffix", "suffix (insertion) is not supported")
        if body.get("best_of") not in (None, 1):
            raise unsupported("best_of", "best_of is not supported; use n")
    max_tokens = _number(body, "max_completion_tokens", (int,)) if chat else None
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", (int,))
    field = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(field, f"{field} must be >= 1, got {max_tokens}")
    stream = _flag(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad_request("stream_options", "stream_options must be an object", "invalid_type")
    include_usage = bool(opts and opts.get("include_usage"))
    values: dict[str, Any] = {}
    for name in _SAMPLING_FLOATS:
        v = _number(body, name, (int, float))
        if v is not None:
            values[name] = float(v)
    _check_temperature(values.get("temperature"), "temperature")
    for name, key in (("top_k", "top_k"), ("min_tokens", "min_new_tokens"), ("seed", "seed")):
        v = _number(body, name, (int,))
        if v is not None:
            values[key] = v
    if body.get("ignore_eos") is not None:
        values["ignore_eos"] = _flag(body, "ignore_eos")
    extra_stop = body.get("stop_token_ids")
    if extra_stop is not None and (
        not isinstance(extra_stop, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in extra_stop)
    ):
        raise bad_request("stop_token_ids", "stop_token_ids must be a list of integers", "invalid_type")
    stop = _stop(body)
    values["stop_token_ids"] = sorted({*(extra_stop or []), *stop_token_ids(stop)})
    values["max_new_tokens"] = max(max_tokens or 1, values.get("min_new_tokens", 0), 1)
    try:
        sampling = SamplingParams(**values)
    except InvalidRequestError as exc:
        name = exc.field.removeprefix("sampling.")
        name = {"min_new_tokens": "min_tokens", "max_new_tokens": field}.get(name, name)
        raise bad_request(name, f"{name}={exc.value!r}: {exc.reason}") from None
    return RequestOptions(
        sampling=sampling,
        max_tokens=max_tokens,
        stop=stop,
        n=n,
        logprobs=bool(logprobs),
        stream=stream,
        include_usage=include_usage,
    )


def _check_temperature(value: float | None, name: str) -> None:
    if value is not None and not 0.0 <= value <= MAX_TEMPERATURE:
        raise bad_request(name, f"{name} must be in [0, {MAX_TEMPERATURE:g}] (as in OpenAI's API), got {value!r}")


_FIXED_FLOATS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")


@dataclass(frozen=True, kw_only=True)
class SessionSampling:
    """Sampling a trainer fixes for one session when it creates it (``POST /v1/sessions {"sampling": ...}``).

    Every field given here **overrides** the agent's value for that field on every call of the session
    (the agent's own temperature, seed ... are ignored for it: on-policy sampling is the trainer's
    decision, not the agent framework's).  ``max_tokens`` is a **limit**: a call asking for more is
    **clamped** to it (refusing would break agents that always send their own ``max_tokens``); a call
    asking for less keeps its own.  ``seed`` seeds the session: turn ``t``, choice ``k`` gets
    ``sample_seed(seed, member=k, turn=t)`` like every other API of the SDK.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    max_tokens: int | None = None

    @classmethod
    def from_json(cls, value: Any) -> SessionSampling | None:
        """Check a JSON object (400 naming ``sampling.<field>``); None stays None."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise bad_request("sampling", "sampling must be an object", "invalid_type")
        fields: dict[str, Any] = {}
        for key, v in value.items():
            where = f"sampling.{key}"
            if key in _FIXED_FLOATS:
                kinds: tuple[type, ...] = (int, float)
            elif key in ("top_k", "seed", "max_tokens"):
                kinds = (int,)
            else:
                raise unsupported(where, f"{key!r} cannot be fixed per session; fields: {sorted(_SESSION_FIELDS)}")
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, kinds):
                raise bad_request(where, f"{where} must be a number, got {v!r}", "invalid_type")
            fields[key] = v if kinds == (int,) else float(v)  # type: ignore[arg-type]
        out = cls(**fields)
        out.check()
        return out

    def check(self) -> None:
        _check_temperature(self.temperature, "sampling.temperature")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad_request("sampling.max_tokens", f"sampling.max_tokens must be >= 1, got {self.max_tokens}")
        try:
            self.fix(SamplingParams())
        except InvalidRequestError as exc:
            name = "sampling." + exc.field.removeprefix("sampling.")
            raise bad_request(name, f"{name}={exc.value!r}: {exc.reason}") from None

    def fix(self, sampling: SamplingParams) -> SamplingParams:
        """``sampling`` with this session's fixed fields put in (validated by SamplingParams)."""
        values = {f: getattr(self, f) for f in (*_FIXED_FLOATS, "top_k", "seed") if getattr(self, f) is not None}
        if not values:
            return sampling
        return SamplingParams(**{**msgspec.structs.asdict(sampling), **values})

    def apply(self, opts: RequestOptions) -> RequestOptions:
        """A call's options under this session's sampling (fixed fields win, ``max_tokens`` clamped)."""
        max_tokens = opts.max_tokens
        if self.max_tokens is not None and max_tokens is not None:
            max_tokens = min(max_tokens, self.max_tokens)
        return dataclasses.replace(
            opts, sampling=self.fix(opts.sampling), max_tokens=max_tokens, max_tokens_cap=self.max_tokens
        )


_SESSION_FIELDS = {*_FIXED_FLOATS, "top_k", "seed", "max_tokens"}
