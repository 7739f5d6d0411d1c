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
from .requests import ChatRequest, CompletionRequest, SessionSamplingFields, convert

__all__ = ["RequestOptions", "SessionSampling", "parse_options"]

#: OpenAI's range for ``temperature`` (the engines accept more; an agent sending 7 has a bug)
MAX_TEMPERATURE = 2.0

_SAMPLING_FLOATS = ("temperature", "top_p", "frequency_penalty", "presence_penalty", "min_p", "repetition_penalty")


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


def parse_options(
    body: dict[str, Any], *, chat: bool, max_n: int, stop_token_ids: Callable[[Sequence[str]], list[int]]
) -> RequestOptions:
    """Check and map the sampling fields of ``body`` (types, ranges and unknown fields:
    :class:`~.requests.ChatRequest` / :class:`~.requests.CompletionRequest`; here what a type cannot
    say).  ``stop_token_ids``: the ids of one-token stop strings."""
    req = convert(body, ChatRequest if chat else CompletionRequest)
    n = 1 if req.n is None else req.n
    if not 1 <= n <= max_n:
        raise bad_request("n", f"n must be in [1, {max_n}] on this gateway, got {n}", "n_out_of_range")
    if req.logit_bias:
        raise unsupported("logit_bias", "logit_bias is not supported by the engine protocol")
    if req.service_tier not in (None, "auto", "default"):
        raise unsupported("service_tier", f"service_tier {req.service_tier!r} is not supported")
    field = "max_tokens"
    if isinstance(req, ChatRequest):
        if req.top_logprobs:
            raise unsupported("top_logprobs", "top_logprobs > 0: the engines return the sampled token's logprob only")
        fmt = req.response_format
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            raise unsupported("response_format", "only response_format {'type': 'text'} is supported")
        if req.modalities is not None and req.modalities != ["text"]:
            raise unsupported("modalities", "only text output is supported")
        if req.parallel_tool_calls is False:
            raise unsupported("parallel_tool_calls", "parallel_tool_calls=false cannot be enforced on the model")
        if req.max_completion_tokens is not None:
            field = "max_completion_tokens"
        max_tokens = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
    else:
        assert isinstance(req, CompletionRequest)
        if req.logprobs not in (None, 0, 1):
            raise unsupported("logprobs", "logprobs must be 0 or 1: only the sampled token's logprob is returned")
        if req.echo:
            raise unsupported("echo", "echo is not supported")
        if req.suffix is not None:
            raise unsupported("suffix", "suffix (insertion) is not supported")
        if req.best_of not in (None, 1):
            raise unsupported("best_of", "best_of is not supported; use n")
        max_tokens = req.max_tokens
    values: dict[str, Any] = {name: v for name in _SAMPLING_FLOATS if (v := getattr(req, name)) is not None}
    _check_temperature(values.get("temperature"), "temperature")
    for name, key in (("top_k", "top_k"), ("min_tokens", "min_new_tokens"), ("seed", "seed")):
        if (v := getattr(req, name)) is not None:
            values[key] = v
    if req.ignore_eos is not None:
        values["ignore_eos"] = req.ignore_eos
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    values["stop_token_ids"] = sorted({*(req.stop_token_ids or []), *stop_token_ids(stop)})
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
        logprobs=bool(req.logprobs),
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.get("include_usage")),
    )


def _check_temperature(value: float | None, name: str) -> None:
    if value is not None and not 0.0 <= value <= MAX_TEMPERATURE:
        raise bad_request(name, f"{name} must be in [0, {MAX_TEMPERATURE:g}] (as in OpenAI's API), got {value!r}")


_FIXED_FLOATS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")


class SessionSampling(SessionSamplingFields, frozen=True):
    """Sampling a trainer fixes for one session when it creates it (``POST /v1/sessions {"sampling": ...}``).

    Every field given here **overrides** the agent's value for that field on every call of the session
    (the agent's own temperature, seed ... are ignored for it: on-policy sampling is the trainer's
    decision, not the agent framework's).  ``max_tokens`` is a **limit**: a call asking for more is
    **clamped** to it (refusing would break agents that always send their own ``max_tokens``); a call
    asking for less keeps its own.  ``seed`` seeds the session: turn ``t``, choice ``k`` gets
    ``sample_seed(seed, member=k, turn=t)`` like every other API of the SDK.

    The fields are :class:`~.requests.SessionSamplingFields`' (typed once, there); this adds the checks a
    type cannot say and what a session does with them, and is frozen.
    """

    @classmethod
    def from_json(cls, value: Any) -> SessionSampling | None:
        """Check a JSON object (400 naming ``sampling.<field>``); None stays None."""
        if value is None:
            return None
        out = convert(value, cls, where="sampling")
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
