"""Wire messages between clients and engine servers.

Every message is a tagged, frozen msgspec struct encoded as MessagePack, one message per ZMQ frame.
There are two endpoints and one decoder for each:

* the server decodes :data:`ClientMessage` (:func:`decode_client_message`);
* the client decodes :data:`ServerMessage` (:func:`decode_server_message`).

Requests carry token ids, never tensors or pickles; weights move over NCCL/gloo or CUDA IPC handles.

Schema evolution: a new field always gets a default, a field is never renamed or retyped, a tag is never
reused.  ``tests/data/protocol_v1.json`` holds recorded payloads that must keep decoding.

Validation happens in two layers.  Field-local rules (``temperature >= 0``) live in ``__post_init__`` and
fire both when a struct is built in user code and when it is decoded on the server, raising
:class:`~rollout_sdk.errors.InvalidRequestError` with the field and the value.  Rules that need the engine
(vocabulary size, context length) are checked by the server (:func:`check_against_limits`).
"""

from __future__ import annotations

import array
import math
import re
import sys
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec

from ..errors import InvalidRequestError, ProtocolError, RolloutError, WeightVersionError, error_code
from .checks import expect, expect_ids

__all__ = [
    "DEFAULT_MAX_CONTROL_BYTES",
    "DEFAULT_MAX_GENERATE_BYTES",
    "GREEDY_TEMPERATURE",
    "INFLIGHT_MODES",
    "MAX_GROUP_ID",
    "MAX_IMAGES",
    "MAX_IMAGE_BYTES",
    "MAX_INPUT_IDS",
    "MAX_KEEP_KV_S",
    "MAX_SESSION_HINTS",
    "MAX_STOP_TOKEN_IDS",
    "MAX_TENSORS",
    "MAX_TIMEOUT_S",
    "MAX_WEIGHT_VERSION",
    "PENALTY_RANGE",
    "Abort",
    "ClientMessage",
    "ControlReply",
    "ControlRequest",
    "DestroyWeightGroup",
    "EngineLimits",
    "ErrorReply",
    "FinishReason",
    "FlushCache",
    "GenerateRequest",
    "GenerateResult",
    "GetInfo",
    "InflightMode",
    "InitWeightGroup",
    "Lifecycle",
    "PauseGeneration",
    "PauseMode",
    "Ping",
    "Pong",
    "ReleaseMemory",
    "ResumeGeneration",
    "ResumeMemory",
    "RoutedExperts",
    "SamplingParams",
    "ServerInfo",
    "ServerMessage",
    "ServerStats",
    "SessionHint",
    "SessionHints",
    "SetWeightVersion",
    "Stepped",
    "TensorMeta",
    "Timings",
    "UpdateWeightsDistributed",
    "UpdateWeightsFromIpc",
    "check_against_limits",
    "check_inflight",
    "check_timeout",
    "check_weight_version",
    "decode_client_message",
    "decode_server_message",
    "encode",
    "error_reply",
    "expect_sampling",
    "flushes",
    "is_generate_frame",
    "mixed_tokens",
]

FinishReason = Literal["stop", "length", "abort"]
PauseMode = Literal["abort", "retract", "in_place"]
#: what a weight update does to the requests in flight: ``reprefill`` (exact: each continues as ``prompt +
#: tokens so far``, its KV recomputed on the new weights) or ``keep`` (each continues on the KV it has, computed
#: under older weights: nothing is recomputed; ``GenerateResult.kv_version_segments`` says which tokens)
InflightMode = Literal["reprefill", "keep"]
INFLIGHT_MODES: tuple[InflightMode, ...] = ("reprefill", "keep")
MemoryTag = Literal["weights", "kv_cache"]
_Tags = Annotated[list[MemoryTag], msgspec.Meta(max_length=8)]

_MAX_SEED = 2**63 - 1
#: temperatures below this are greedy in every engine: dividing a float32 logit by less overflows (SGLang's
#: own threshold is 1e-6)
GREEDY_TEMPERATURE = 1e-5
#: engines clamp a repetition penalty into this range: beyond it a float32 logit overflows
PENALTY_RANGE = (1e-6, 1e6)

# -- bounds --------------------------------------------------------------------------------------------
#: default limit on one encoded GenerateRequest (8 MiB: ~1.6M token ids at the widest encoding)
DEFAULT_MAX_GENERATE_BYTES = 8 << 20
#: default limit on one encoded control message, Ping or Abort (1 MiB: ~12k tensor metas in an update)
DEFAULT_MAX_CONTROL_BYTES = 1 << 20
#: images one request may carry (GenerateRequest.images), and the largest encoded image file
MAX_IMAGES = 16
MAX_IMAGE_BYTES = 4 << 20
#: the longest timeout any message may carry (seconds); nothing in the protocol waits without a bound
MAX_TIMEOUT_S = 3600.0
#: the most token ids one prompt may hold (2M: beyond every model's context); checked by msgspec while it
#: decodes, before a list is built, like every bound on a list below
MAX_INPUT_IDS = 1 << 21
#: the most stop token ids one request may name
MAX_STOP_TOKEN_IDS = 4096
#: characters of a request's ``group_id``
MAX_GROUP_ID = 256
#: the longest lease a request may ask for its session's KV (``keep_kv_s``), and for a tool wait hint
MAX_KEEP_KV_S = 3600.0
#: the largest weight version a request may ask for (``min_weight_version``)
MAX_WEIGHT_VERSION = 2**62
#: session hints in one SessionHints message
MAX_SESSION_HINTS = 4096
#: the most tensors (and buckets, and IPC handles) one weight update may describe
MAX_TENSORS = 1 << 16
#: the most dimensions of one tensor in an update
_MAX_DIMS = 16

# list types with their bounds (msgspec refuses a longer list while decoding: a typed error naming the field)
_InputIds = Annotated[list[int], msgspec.Meta(max_length=MAX_INPUT_IDS)]
_StopIds = Annotated[list[int], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)]
_Shape = Annotated[list[int], msgspec.Meta(max_length=_MAX_DIMS)]

# a tagged struct encodes as a map whose first key is "type": fixmap header, "type", then the tag
_GENERATE_PREFIX = b"\xa4type\xa8generate"


def is_generate_frame(data: bytes) -> bool:
    """Whether ``data`` is (claims to be) a GenerateRequest, read from its first bytes without decoding.

    Only the encoding msgspec writes (tag first) is recognised; anything else is treated as a control
    message, whose size limit is the smaller one, so a peer gains nothing by reordering keys.
    """
    return data[1:15] == _GENERATE_PREFIX and 0x80 <= data[0] <= 0x8F


def check_timeout(field: str, value: float | None, *, allow_none: bool = False) -> None:
    """Every timeout in the protocol (and the configs that feed it) is > 0 and at most MAX_TIMEOUT_S."""
    if value is None:
        if allow_none:
            return
        raise _bad(field, value, f"must be a number of seconds in (0, {MAX_TIMEOUT_S:.0f}]")
    if not 0.0 < value <= MAX_TIMEOUT_S:  # also rejects NaN
        raise _bad(field, value, f"must be in (0, {MAX_TIMEOUT_S:.0f}] seconds")


def check_inflight(inflight: Any, flush_cache: bool) -> None:
    """A weight update's ``inflight`` mode, and the one combination that contradicts itself."""
    if inflight not in INFLIGHT_MODES:
        raise _bad("inflight", inflight, f"must be one of {', '.join(INFLIGHT_MODES)}")
    if inflight == "keep" and flush_cache:
        raise _bad("flush_cache", flush_cache, "inflight='keep' goes on with the cached KV a flush would drop")


def flushes(inflight: InflightMode, flush_cache: bool | None) -> bool:
    """Whether a weight update drops the old KV: ``flush_cache``, or when None its mode's default (yes for
    ``reprefill``, no for ``keep``, whose requests go on with that KV)."""
    return inflight == "reprefill" if flush_cache is None else flush_cache


def mixed_tokens(version_runs: Sequence[tuple[int, int]], kv_runs: Sequence[tuple[int, int]]) -> int:
    """Tokens sampled by weights other than those of the KV they attended to: ``version_runs`` (which weights
    sampled each token) against ``kv_runs`` (the oldest weights of its KV), both ``(version, n)`` runs over the
    same tokens; an empty ``kv_runs`` means "the same as ``version_runs``" (0)."""
    if not kv_runs:
        return 0
    mixed, i, used = 0, 0, 0  # walk both run lists at once: O(runs), not O(tokens)
    for kv, n in kv_runs:
        while n > 0 and i < len(version_runs):
            v, m = version_runs[i]
            take = min(n, m - used)
            mixed += take if v != kv else 0
            n, used = n - take, used + take
            if used == m:
                i, used = i + 1, 0
    return mixed


def _bad(field: str, value: Any, reason: str) -> InvalidRequestError:
    return InvalidRequestError(field, value, reason)


# -- generation ------------------------------------------------------------------------------------


_SAMPLING_INTS = ("max_new_tokens", "min_new_tokens", "top_k")
_SAMPLING_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How to sample one response.  Defaults sample from the model's distribution at temperature 1.

    ``temperature == 0`` is greedy, and so is any temperature below :data:`GREEDY_TEMPERATURE` (1e-5):
    dividing float32 logits by a smaller one overflows, and the distribution is one-hot long before.
    ``top_k`` of 0 or -1 and ``top_p`` of 1 turn those filters off.  Logprobs are those of the
    distribution sampled from after temperature, before top-k/top-p/min-p (temperature 1 when greedy).
    ``seed`` makes one request reproducible whatever else is in the batch.

    Every value accepted here is safe in every engine (engines clamp a repetition penalty into
    ``[1e-6, 1e6]``, where a float32 logit cannot overflow).  Rejected, with
    :class:`~rollout_sdk.errors.InvalidRequestError` naming the field: non-finite temperature or penalties,
    values outside the ranges below, and (by the server, which knows the vocabulary,
    :func:`check_against_limits`) ``top_k`` beyond the vocabulary or ``min_new_tokens`` with stop ids
    (EOS included unless ``ignore_eos``) that cover the whole vocabulary, which leaves nothing to sample.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop_token_ids: _StopIds = []
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        # types first: msgspec checks them while decoding, not when user code builds the struct
        for name in _SAMPLING_INTS:
            expect(f"sampling.{name}", getattr(self, name), int)
        for name in _SAMPLING_FLOATS:
            expect(f"sampling.{name}", getattr(self, name), float)
        expect("sampling.ignore_eos", self.ignore_eos, bool)
        expect("sampling.seed", self.seed, int, optional=True)
        expect_ids("sampling.stop_token_ids", self.stop_token_ids)
        if self.max_new_tokens < 1:
            raise _bad("sampling.max_new_tokens", self.max_new_tokens, "must be >= 1")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise _bad("sampling.min_new_tokens", self.min_new_tokens, "must be in [0, max_new_tokens]")
        if not 0.0 <= self.temperature < math.inf:  # also rejects NaN
            raise _bad("sampling.temperature", self.temperature, "must be finite and >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise _bad("sampling.top_p", self.top_p, "must be in (0, 1]")
        if self.top_k < -1:
            raise _bad("sampling.top_k", self.top_k, "must be >= 1, or 0 / -1 for no limit")
        if not 0.0 <= self.min_p <= 1.0:
            raise _bad("sampling.min_p", self.min_p, "must be in [0, 1]")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise _bad("sampling.repetition_penalty", self.repetition_penalty, "must be finite and > 0")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise _bad("sampling.frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise _bad("sampling.presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        stops = self.stop_token_ids
        if len(stops) > MAX_STOP_TOKEN_IDS:  # built in user code (a decoded one is checked by msgspec)
            raise _bad("sampling.stop_token_ids", f"<{len(stops)} ids>", f"must hold at most {MAX_STOP_TOKEN_IDS} ids")
        if stops and min(stops) < 0:
            i = next(i for i, t in enumerate(stops) if t < 0)
            raise _bad(f"sampling.stop_token_ids[{i}]", stops[i], "must be >= 0")
        if self.seed is not None and not 0 <= self.seed <= _MAX_SEED:
            raise _bad("sampling.seed", self.seed, f"must be in [0, {_MAX_SEED}]")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


_DEFAULT_SAMPLING = SamplingParams()


def expect_sampling(
    value: Any, *, field: str = "sampling", optional: bool = True, error: type[RolloutError] = InvalidRequestError
) -> None:
    """``value`` is a :class:`SamplingParams` (or None when ``optional``); a dict of its fields is refused by
    name, with the way to build one, instead of failing deep inside the scheduler."""
    if isinstance(value, SamplingParams) or (value is None and optional):
        return
    hint = "; SamplingParams(**d) builds one from a dict" if isinstance(value, dict) else ""
    raise error(field, value, f"must be a SamplingParams (got {type(value).__name__}){hint}")  # type: ignore[call-arg]


class GenerateRequest(msgspec.Struct, tag="generate", frozen=True, kw_only=True, omit_defaults=True):
    """One generation: token ids in, token ids (and logprobs) out.

    ``rid`` is unique per client while the request is in flight; the client fills it when empty.
    ``session_id`` groups the turns of one multi-turn conversation so the scheduler keeps them on one
    server (prefix cache).  ``group_id`` names a GRPO group: requests that share it and their prompt are
    placed on one server together, and that server prefills the prompt once for all of them
    (``generate_many`` and ``rollouts`` set it; docs/design.md, "Group-native GRPO").
    """

    input_ids: _InputIds
    sampling: SamplingParams = _DEFAULT_SAMPLING
    rid: str = ""
    session_id: str | None = None
    return_logprobs: bool = True
    #: score the prompt instead of generating: the result's ``prompt_logprobs`` holds the logprob of each
    #: prompt token given the tokens before it, ``output_ids`` is empty and ``sampling`` is not used
    score_only: bool = False
    #: MoE models: return the experts each token was routed to (``GenerateResult.routed_experts``); engines
    #: that cannot refuse it with UnsupportedOperationError
    return_routed_experts: bool = False
    #: vision-language models: encoded image files (PNG, JPEG, WebP, ...), one per image mark of the prompt
    #: (``<|vision_start|><|image_pad|><|vision_end|>``), in order; the engine expands each mark into the
    #: image's tokens (docs/multimodal.md).  At most MAX_IMAGES, each at most MAX_IMAGE_BYTES.
    images: Annotated[
        list[Annotated[bytes, msgspec.Meta(max_length=MAX_IMAGE_BYTES)]], msgspec.Meta(max_length=MAX_IMAGES)
    ] = []
    #: the GRPO group this request is a member of (see above); at most MAX_GROUP_ID characters
    group_id: Annotated[str, msgspec.Meta(max_length=MAX_GROUP_ID)] | None = None
    #: agent sessions: keep this session's KV (prompt and output) in the engine's prefix cache for up to this
    #: many seconds after the request ends, because another turn will follow (a tool call); needs
    #: ``session_id``.  The next turn, :class:`SessionHints` (ended, or the tool wait) or the lease's end
    #: releases it; memory pressure demotes kept KV before anything running waits (docs/agents.md).
    keep_kv_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_KEEP_KV_S)] | None = None
    #: run only on weights of at least this version: the client sends it only to a server that reports them,
    #: the server refuses it (``WeightVersionError``) when its engine's weights are older; no server that
    #: holds them: refused at once with the versions the fleet has (docs/trainer.md, "In-flight updates")
    min_weight_version: Annotated[int, msgspec.Meta(ge=0, le=MAX_WEIGHT_VERSION)] | None = None
    #: a *suspect* on probation (client/scheduler.py, "Suspects"), sent only to a server whose ``ServerInfo``
    #: says ``paces_probation``: that server hands this client's probation requests to its engine one at a
    #: time, the next only once the engine step that admitted the previous one has ended, and tells the
    #: client when that is (:class:`Stepped`), so a death names the one probation request it can be
    probation: bool = False

    def __post_init__(self) -> None:
        mwv = self.min_weight_version
        if mwv is not None and (
            isinstance(mwv, bool) or not isinstance(mwv, int) or not 0 <= mwv <= MAX_WEIGHT_VERSION
        ):
            raise _bad("min_weight_version", mwv, f"must be an integer in [0, {MAX_WEIGHT_VERSION}]")
        if self.keep_kv_s is not None:
            if not isinstance(self.keep_kv_s, int | float) or not 0 < self.keep_kv_s <= MAX_KEEP_KV_S:
                raise _bad("keep_kv_s", self.keep_kv_s, f"must be in (0, {MAX_KEEP_KV_S:.0f}] seconds")
            if self.session_id is None:
                raise _bad("keep_kv_s", self.keep_kv_s, "needs a session_id (the session whose KV is kept)")
        if self.group_id is not None and not 0 < len(self.group_id) <= MAX_GROUP_ID:
            raise _bad("group_id", self.group_id[:40], f"must hold 1..{MAX_GROUP_ID} characters")
        if not self.input_ids:
            raise _bad("input_ids", self.input_ids, "must hold at least one token id")
        if len(self.input_ids) > MAX_INPUT_IDS:  # built in user code (a decoded one is checked by msgspec)
            raise _bad("input_ids", f"<{len(self.input_ids)} ids>", f"must hold at most {MAX_INPUT_IDS} ids")
        try:
            lowest = min(self.input_ids)
        except TypeError:
            i = next(i for i, t in enumerate(self.input_ids) if not isinstance(t, int))
            raise _bad(f"input_ids[{i}]", self.input_ids[i], "token ids must be integers") from None
        if lowest < 0:
            i = next(i for i, t in enumerate(self.input_ids) if t < 0)
            raise _bad(f"input_ids[{i}]", self.input_ids[i], "token ids must be >= 0")
        if len(self.images) > MAX_IMAGES:
            raise _bad("images", f"<{len(self.images)} images>", f"at most {MAX_IMAGES} images per request")
        for i, img in enumerate(self.images):
            if not isinstance(img, bytes) or not 0 < len(img) <= MAX_IMAGE_BYTES:
                size = len(img) if isinstance(img, bytes) else type(img).__name__
                raise _bad(f"images[{i}]", f"<{size} bytes>", f"must be an encoded image of 1..{MAX_IMAGE_BYTES} bytes")


class Timings(msgspec.Struct, frozen=True, omit_defaults=True):
    """Seconds, measured by the server: waiting for the engine, to the first token, in all."""

    queue_s: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0


class Lifecycle(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Where one request went and when (seconds since the epoch, on the client's clock).

    ``queued_at``: the client took the request; ``dispatched_at``: it was sent to the server that answered
    (the last attempt); ``first_token_at``: its first token, where the engine reports time to first token
    (placed on the client's clock from the server's durations, so clocks of different machines never mix);
    ``finished_at``: the reply arrived.  ``attempts`` counts sends (1 + retries); ``failed_over_from`` names
    the servers that failed it before, in order.  Filled by the client, never sent by a server.
    """

    queued_at: float
    dispatched_at: float
    finished_at: float
    server_id: str
    first_token_at: float | None = None
    attempts: int = 1
    failed_over_from: list[str] = []

    @property
    def latency_s(self) -> float:
        return self.finished_at - self.queued_at


class RoutedExperts(msgspec.Struct, frozen=True, kw_only=True):
    """MoE routing of one request: for every token, the ``top_k`` experts of each of ``num_layers`` layers.

    Carried compactly as little-endian ``int16`` in ``data``, laid out ``[num_tokens, num_layers, top_k]``
    (2 bytes per entry instead of ~3-9 as a MessagePack list).  Use :meth:`to_list` or :meth:`to_numpy`.
    """

    num_tokens: int
    num_layers: int
    top_k: int
    data: bytes

    def __post_init__(self) -> None:
        for name in ("num_tokens", "num_layers", "top_k"):
            if getattr(self, name) < 0:
                raise _bad(f"routed_experts.{name}", getattr(self, name), "must be >= 0")
        want = 2 * self.num_tokens * self.num_layers * self.top_k
        if len(self.data) != want:
            raise _bad("routed_experts.data", f"<{len(self.data)} bytes>", f"must hold {want} bytes (int16)")

    @classmethod
    def from_nested(cls, experts: list[list[list[int]]]) -> RoutedExperts:
        """From ``experts[token][layer][k]`` (every token with the same layers and k)."""
        num_tokens = len(experts)
        num_layers = len(experts[0]) if num_tokens else 0
        top_k = len(experts[0][0]) if num_layers else 0
        flat = array.array("h")
        for t, layers in enumerate(experts):
            if len(layers) != num_layers or any(len(k) != top_k for k in layers):
                raise _bad(f"routed_experts[{t}]", "<ragged>", f"must be {num_layers} layers x {top_k} experts")
            for ks in layers:
                flat.extend(ks)
        if sys.byteorder != "little":  # pragma: no cover
            flat.byteswap()
        return cls(num_tokens=num_tokens, num_layers=num_layers, top_k=top_k, data=flat.tobytes())

    def to_list(self) -> list[list[list[int]]]:
        """``[token][layer][k]`` expert ids."""
        flat = array.array("h")
        flat.frombytes(self.data)
        if sys.byteorder != "little":  # pragma: no cover
            flat.byteswap()
        n, k = self.num_layers, self.top_k
        return [
            [list(flat[(t * n + layer) * k : (t * n + layer + 1) * k]) for layer in range(n)]
            for t in range(self.num_tokens)
        ]

    def to_numpy(self) -> Any:
        """A ``(num_tokens, num_layers, top_k)`` int16 array (numpy)."""
        import numpy as np  # door: numpy

        return np.frombuffer(self.data, dtype="<i2").reshape(self.num_tokens, self.num_layers, self.top_k)


class GenerateResult(msgspec.Struct, tag="result", frozen=True, kw_only=True, omit_defaults=True):
    """The outcome of one :class:`GenerateRequest`.

    ``logprobs[i]`` is the log-probability of ``output_ids[i]`` (``None`` when not asked for).
    ``finish_reason`` is ``stop`` (EOS or a stop token, named in ``matched_stop``), ``length``
    (``max_new_tokens`` reached) or ``abort`` (aborted; ``output_ids`` holds the tokens made so far).
    ``version_segments`` lists ``(weight_version, num_tokens)`` runs over ``output_ids`` in order: one run
    unless the weights changed while the request was held in flight.  ``kv_version_segments`` lists, in the
    same way, the *oldest* weight version of the KV each token was sampled from: empty when that is the
    version that sampled it, for every token (always, unless a ``keep`` update let the request go on with its
    KV computed under older weights; see :attr:`kv_weight_version`).
    """

    rid: str
    output_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    weight_version: int = 0
    logprobs: list[float] | None = None
    matched_stop: int | None = None
    version_segments: list[tuple[int, int]] = []
    timings: Timings = Timings()
    server_id: str = ""
    #: ``score_only`` requests: logprob of ``input_ids[i + 1]`` given ``input_ids[: i + 1]`` (one fewer
    #: than the prompt's tokens: the first token has no context)
    prompt_logprobs: list[float] | None = None
    #: ``return_routed_experts`` requests: the experts of every token the model was fed (prompt and output
    #: tokens, all but the last output token, which is never fed forward)
    routed_experts: RoutedExperts | None = None
    #: filled by the client: when and where the request ran
    lifecycle: Lifecycle | None = None
    #: prompt tokens the engine took from its prefix cache instead of computing them (0 where the engine
    #: does not say); ``prompt_tokens - cached_tokens`` is the prefill this request cost
    cached_tokens: int = 0
    #: the server process that ran it (a restarted server has a new one; see ServerInfo.incarnation)
    incarnation: str = ""
    #: ``(kv_weight_version, num_tokens)`` runs over ``output_ids``: the oldest weights the KV each token was
    #: sampled from was computed under (prompt and earlier tokens included); empty: the same as
    #: ``version_segments`` (every token sampled from KV of the weights that sampled it)
    kv_version_segments: list[tuple[int, int]] = []
    #: requests with ``images``: the prompt as the model saw it, every image mark expanded into the image's
    #: ``<|image_pad|>`` tokens (``prompt_tokens`` counts these); None for a text-only request
    input_ids: list[int] | None = None
    #: requests with ``images``: ``(start, length)`` of each image's pad tokens in ``input_ids``
    image_spans: list[tuple[int, int]] = []
    #: requests with ``images``: each image's patch grid ``(t, h, w)`` (the processor's ``image_grid_thw``);
    #: the image takes ``t * h * w / merge_size**2`` tokens
    image_grid_thw: list[tuple[int, int, int]] = []

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def kv_weight_version(self) -> int:
        """The oldest weight version any KV this request was sampled from was computed under."""
        runs = self.kv_version_segments or self.version_segments
        return min((v for v, _ in runs), default=self.weight_version)

    @property
    def mixed_kv_tokens(self) -> int:
        """Output tokens sampled by weights newer than (part of) the KV they attended to: what a ``keep``
        update leaves for a trainer to filter or correct (0 under ``reprefill``)."""
        return mixed_tokens(self.version_segments, self.kv_version_segments)


class Stepped(msgspec.Struct, tag="stepped", frozen=True):
    """The request ``rid`` (sent with ``probation=True``) has been through an engine step: the step that
    admitted it ended and the engine lives.  Sent before the request's result, and only for probation
    requests (a client that never sets ``probation`` never receives one)."""

    rid: str


class Abort(msgspec.Struct, tag="abort", frozen=True):
    """Abort one request (``rid``), or every request of this client when ``rid`` is empty."""

    rid: str = ""


class Ping(msgspec.Struct, tag="ping", frozen=True):
    """Heartbeat; answered by :class:`Pong` with the server's live stats."""

    seq: int


class ServerStats(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Live load, capacity and counters of one server and its engine, as of the moment it answered a Ping.

    Load (what runs now):

    * ``in_flight``: requests the server holds for every client (queued, running, or held by a pause);
    * ``client_in_flight``: of those, the ones sent by the client this Pong answers, so a client computes
      the load *others* put there (``in_flight - client_in_flight``) from one consistent snapshot;
    * ``running`` / ``queued``: requests the engine decodes now / has accepted and not yet started;
    * ``queued_tokens``: tokens the queued requests hold;
    * ``kv_used_tokens``: tokens the engine's KV cache holds now; ``kv_usage``: that as a fraction of
      ``kv_capacity_tokens`` where the engine knows it.

    Capacity (what the engine can run at once; for admission control):

    * ``max_running_requests``: the most requests the engine decodes at once (CPU: ``max_running``;
      SGLang: the scheduler's effective ``max_running_requests``); None where there is no fixed limit;
    * ``kv_capacity_tokens``: tokens the KV pool holds (SGLang: ``max_total_num_tokens``); None where the
      cache grows on demand (CPU engine).

    An idle server reports ``in_flight == running == queued == 0``.
    """

    server_id: str
    in_flight: int = 0
    client_in_flight: int = 0
    running: int = 0
    queued: int = 0
    queued_tokens: int = 0
    completed: int = 0
    aborted: int = 0
    errors: int = 0
    weight_version: int = 0
    engine_alive: bool = True
    paused: bool = False
    draining: bool = False
    kv_usage: float | None = None
    kv_used_tokens: int | None = None
    kv_capacity_tokens: int | None = None
    max_running_requests: int | None = None
    #: which process this is: a server restarted at the same address answers with a new one
    incarnation: str = ""
    #: the server's stall detector: the engine's progress collapsed while requests run, or its loop is
    #: blocked (``stall_reason`` says which); ``stalls`` counts them since start
    stalled: bool = False
    stalls: int = 0
    stall_reason: str = ""


class Pong(msgspec.Struct, tag="pong", frozen=True):
    seq: int
    stats: ServerStats


class EngineLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What the server checks requests against."""

    vocab_size: int
    max_context: int
    eos_token_ids: list[int] = []


class ServerInfo(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Static facts about a server: who it is, what it serves."""

    server_id: str
    backend: str
    model: str
    limits: EngineLimits
    dp_rank: int = 0
    tp_size: int = 1
    weight_version: int = 0
    pid: int = 0
    host: str = ""
    #: the server refuses larger encoded messages (0: not told, an older server)
    max_generate_bytes: int = 0
    max_control_bytes: int = 0
    #: random per server start: ``server_id`` names the slot (``dp0``), this names the process in it
    incarnation: str = ""
    #: the server honours ``GenerateRequest.probation`` (its engine reports when a request has been through
    #: a step): False for an older server or an engine that cannot tell (SGLang)
    paces_probation: bool = False


# -- control ---------------------------------------------------------------------------------------
# Every control message carries a ``call_id`` echoed in its ControlReply / ErrorReply.


class GetInfo(msgspec.Struct, tag="get_info", frozen=True):
    call_id: str


class PauseGeneration(msgspec.Struct, tag="pause", frozen=True):
    """``abort``: in-flight requests return now with their partial tokens (``finish_reason='abort'``).
    ``retract`` / ``in_place``: they are held and continue after :class:`ResumeGeneration`."""

    call_id: str
    mode: PauseMode = "abort"


class ResumeGeneration(msgspec.Struct, tag="resume", frozen=True):
    call_id: str


class FlushCache(msgspec.Struct, tag="flush_cache", frozen=True):
    call_id: str


class ReleaseMemory(msgspec.Struct, tag="release_memory", frozen=True):
    """Free the engine's GPU memory (``weights``, ``kv_cache``; all when ``tags`` is None).
    With ``wait`` the server waits for in-flight requests to finish instead of refusing."""

    call_id: str
    tags: _Tags | None = None
    wait: bool = False


class ResumeMemory(msgspec.Struct, tag="resume_memory", frozen=True):
    call_id: str
    tags: _Tags | None = None


class SessionHint(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a session does next, from the agent loop or the gateway: ``ended`` (release its kept KV now), or
    waiting on a tool expected to take about ``wait_s`` seconds (kept KV of sessions expected back later
    is demoted first under memory pressure)."""

    session_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_GROUP_ID)]
    ended: bool = False
    wait_s: Annotated[float, msgspec.Meta(ge=0, le=MAX_KEEP_KV_S)] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.session_id, str) or not 0 < len(self.session_id) <= MAX_GROUP_ID:
            raise _bad("session_id", str(self.session_id)[:40], f"must hold 1..{MAX_GROUP_ID} characters")
        if self.wait_s is not None and not 0 <= self.wait_s <= MAX_KEEP_KV_S:  # also NaN
            raise _bad("wait_s", self.wait_s, f"must be in [0, {MAX_KEEP_KV_S:.0f}] seconds")


class SessionHints(msgspec.Struct, tag="session_hints", frozen=True):
    """Hints for sessions placed on this server (advisory: unknown sessions are ignored)."""

    call_id: str
    hints: Annotated[list[SessionHint], msgspec.Meta(max_length=MAX_SESSION_HINTS)]


class SetWeightVersion(msgspec.Struct, tag="set_weight_version", frozen=True):
    call_id: str
    version: int


class InitWeightGroup(msgspec.Struct, tag="init_weight_group", frozen=True, kw_only=True):
    """Join a weight-update process group: the trainer is rank 0, this engine's ranks start at
    ``rank_offset``."""

    call_id: str
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "rollout_weights"
    backend: str = "gloo"
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        check_timeout("timeout_s", self.timeout_s)


class TensorMeta(msgspec.Struct, frozen=True, array_like=True):
    name: str
    dtype: str
    shape: _Shape


_Buckets = Annotated[
    list[Annotated[list[TensorMeta], msgspec.Meta(max_length=MAX_TENSORS)]], msgspec.Meta(max_length=MAX_TENSORS)
]


class _WeightUpdate(msgspec.Struct, frozen=True, kw_only=True):
    """What both ways of updating weights carry: the buckets' layout, the version they become, and what
    happens to the KV cache and the requests in flight."""

    call_id: str
    buckets: _Buckets
    version: int | None = None
    #: also drop the old KV at once; None: by ``inflight`` (yes for ``reprefill``, no for ``keep``, whose
    #: requests go on with that KV).  Not needed for correctness: prefix caches are namespaced by version.
    flush_cache: bool | None = None
    #: the requests in flight: re-prefilled on the new weights, or kept on their KV (``InflightMode``)
    inflight: InflightMode = "reprefill"

    def __post_init__(self) -> None:
        check_inflight(self.inflight, bool(self.flush_cache))

    @property
    def flushes(self) -> bool:
        """Whether this update drops the old KV (``flush_cache``, or its default for ``inflight``)."""
        return flushes(self.inflight, self.flush_cache)


class UpdateWeightsDistributed(_WeightUpdate, tag="update_weights_dist", frozen=True, kw_only=True):
    """Receive ``buckets`` by broadcast from the group's rank 0: one flattened tensor per bucket, the
    tensors of a bucket laid out back to back in order (all of one dtype per bucket)."""

    group_name: str


class UpdateWeightsFromIpc(_WeightUpdate, tag="update_weights_ipc", frozen=True, kw_only=True):
    """Colocated update: CUDA IPC handles of flattened buckets on the engine's GPU, no host copy."""

    handles: Annotated[list[bytes], msgspec.Meta(max_length=MAX_TENSORS)]


class DestroyWeightGroup(msgspec.Struct, tag="destroy_weight_group", frozen=True):
    call_id: str
    group_name: str = "rollout_weights"


ControlRequest = (
    GetInfo
    | PauseGeneration
    | ResumeGeneration
    | FlushCache
    | ReleaseMemory
    | ResumeMemory
    | SetWeightVersion
    | SessionHints
    | InitWeightGroup
    | UpdateWeightsDistributed
    | UpdateWeightsFromIpc
    | DestroyWeightGroup
)


class ControlReply(msgspec.Struct, tag="control_reply", frozen=True, omit_defaults=True):
    call_id: str
    message: str = ""
    info: ServerInfo | None = None
    weight_version: int | None = None
    elapsed_s: float = 0.0


class ErrorReply(msgspec.Struct, tag="error", frozen=True, kw_only=True, omit_defaults=True):
    """A typed error.  ``rid`` (generation) or ``call_id`` (control) says what it answers; neither is set
    for a message the server could not read at all."""

    code: str
    message: str
    rid: str | None = None
    call_id: str | None = None
    field: str | None = None
    value: Any = None
    applied: bool | None = False


ClientMessage = GenerateRequest | Abort | Ping | ControlRequest
ServerMessage = GenerateResult | ErrorReply | Pong | ControlReply | Stepped

# -- codecs ----------------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_client_decoder: msgspec.msgpack.Decoder[ClientMessage] = msgspec.msgpack.Decoder(ClientMessage)  # type: ignore[arg-type]
_server_decoder: msgspec.msgpack.Decoder[ServerMessage] = msgspec.msgpack.Decoder(ServerMessage)  # type: ignore[arg-type]
_any_decoder = msgspec.msgpack.Decoder()
_PATH = re.compile(r"at `\$(?P<path>[^`]*)`")


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_server_message(data: bytes) -> ServerMessage:
    """Decode a server's reply.  Raises :class:`ProtocolError` on anything else."""
    try:
        return _server_decoder.decode(data)
    except msgspec.MsgspecError as exc:
        raise ProtocolError(f"unreadable reply from server: {exc}") from exc


def decode_client_message(data: bytes) -> ClientMessage:
    """Decode a message on the server's endpoint.

    Raises :class:`InvalidRequestError` (with field and value, and ``.rid`` / ``.call_id`` when they can be
    read) for a well-formed message with a bad field, :class:`ProtocolError` for anything unreadable or of
    an unknown type.
    """
    try:
        return _client_decoder.decode(data)
    except msgspec.ValidationError as exc:
        raw = _try_raw(data)
        cause = exc.__cause__
        if isinstance(cause, InvalidRequestError):
            err = cause
        else:
            path = _field_path(str(exc))
            if path in ("type", ""):
                what = f"unknown message type {_lookup(raw, path)!r}" if path else "not a message"
                err_p = ProtocolError(f"{what}: {exc}")
                _attach_ids(err_p, raw)
                raise err_p from exc
            reason = str(exc).split(" - at ")[0]
            value = _lookup(raw, path)
            if isinstance(value, list) and "length" in reason:  # a list over its bound: say how long
                value = f"<{len(value)} items>"
            err = InvalidRequestError(path or "?", value, reason)
        _attach_ids(err, raw)
        raise err from exc
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"not a MessagePack message: {exc}") from exc


def _try_raw(data: bytes) -> Any:
    try:
        return _any_decoder.decode(data)
    except msgspec.MsgspecError:
        return None


def _attach_ids(err: RolloutError, raw: Any) -> None:
    rid = raw.get("rid") if isinstance(raw, dict) else None
    call_id = raw.get("call_id") if isinstance(raw, dict) else None
    err.rid = rid if isinstance(rid, str) else None  # type: ignore[attr-defined]
    err.call_id = call_id if isinstance(call_id, str) else None  # type: ignore[attr-defined]


def _field_path(message: str) -> str:
    m = _PATH.search(message)
    if m is None:
        missing = re.search(r"missing required field `([^`]+)`", message)
        return missing.group(1) if missing else ""
    return m.group("path").lstrip(".")


def _lookup(raw: Any, path: str) -> Any:
    """Follow ``a.b[3]`` in an untyped decode; ``None`` where the path does not lead anywhere."""
    node = raw
    for key, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", path):
        try:
            node = node[key] if key else node[int(index)]
        except (KeyError, IndexError, TypeError):
            return None
    return node


def error_reply(exc: BaseException, *, rid: str | None = None, call_id: str | None = None) -> ErrorReply:
    """The wire form of ``exc``."""
    field = value = None
    message = str(exc)
    if isinstance(exc, InvalidRequestError):
        field, value, message = exc.field, _clip(exc.value), exc.reason
    applied = getattr(exc, "applied", False)
    return ErrorReply(
        code=error_code(exc),
        message=message,
        rid=rid if rid is not None else getattr(exc, "rid", None),
        call_id=call_id if call_id is not None else getattr(exc, "call_id", None),
        field=field,
        value=value,
        applied=applied,
    )


def _clip(value: Any) -> Any:
    """Keep error replies small: long lists and strings are cut, odd types become their repr."""
    if isinstance(value, list) and len(value) > 16:
        return [_clip(v) for v in value[:16]] + ["..."]
    if isinstance(value, str | bytes) and len(value) > 200:
        return value[:200]
    if value is None or isinstance(value, bool | int | float | str | bytes | list | dict):
        return value
    return repr(value)


def check_weight_version(req: GenerateRequest, held: int, where: str = "the engine") -> None:
    """Refuse ``req`` when it needs newer weights than ``held`` (its ``min_weight_version``)."""
    want = req.min_weight_version
    if want is not None and held < want:
        raise WeightVersionError("min_weight_version", want, f"{where} holds weight version {held}")


def check_against_limits(req: GenerateRequest, limits: EngineLimits) -> None:
    """The checks that need the engine: vocabulary and context length."""
    hi = max(req.input_ids)
    if hi >= limits.vocab_size:
        i = req.input_ids.index(hi)
        raise InvalidRequestError(f"input_ids[{i}]", hi, f"token id out of vocabulary (size {limits.vocab_size})")
    for i, tok in enumerate(req.sampling.stop_token_ids):
        if tok >= limits.vocab_size:
            raise InvalidRequestError(
                f"sampling.stop_token_ids[{i}]", tok, f"token id out of vocabulary (size {limits.vocab_size})"
            )
    sp = req.sampling
    if sp.top_k > limits.vocab_size:
        raise InvalidRequestError("sampling.top_k", sp.top_k, f"exceeds the vocabulary ({limits.vocab_size} tokens)")
    if sp.min_new_tokens > 0:
        stops = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            stops.update(limits.eos_token_ids)
        if len(stops) >= limits.vocab_size:
            raise InvalidRequestError(
                "sampling.stop_token_ids",
                f"<{len(sp.stop_token_ids)} ids>",
                f"stop ids{'' if sp.ignore_eos else ' and EOS'} cover the whole vocabulary "
                f"({limits.vocab_size} tokens): nothing is left to sample before min_new_tokens={sp.min_new_tokens}",
            )
    n = len(req.input_ids)
    if req.score_only:
        if n > limits.max_context:
            raise InvalidRequestError(
                "input_ids", f"<{n} tokens>", f"longer than the context ({limits.max_context} tokens)"
            )
        return
    if n >= limits.max_context:
        raise InvalidRequestError(
            "input_ids", f"<{n} tokens>", f"prompt longer than the context ({limits.max_context} tokens)"
        )
    if n + req.sampling.max_new_tokens > limits.max_context:
        raise InvalidRequestError(
            "sampling.max_new_tokens",
            req.sampling.max_new_tokens,
            f"prompt ({n}) + max_new_tokens exceeds the context ({limits.max_context} tokens)",
        )
