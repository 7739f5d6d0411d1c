"""What crosses between our structs and SGLang's: sampling parameters in, a request's ids (and images)
in, the parts of a request joined into one GenerateResult out, and SGLang's load snapshot read as an
EngineLoad."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...errors import InvalidRequestError, RequestFailedError, RolloutError
from ...models.vision import cached_image_processor
from ...protocol import PENALTY_RANGE, GenerateRequest, GenerateResult, RoutedExperts, SamplingParams, Timings
from ...protocol.segments import append_segments
from ..base import EngineLoad, prompt_score_result
from .config import SglangEngineConfig

__all__ = [
    "Done",
    "Parts",
    "done_from_output",
    "expand_images",
    "load_from_snapshot",
    "prompt_inputs",
    "request_error",
    "sampling_params",
]


@dataclass(slots=True, kw_only=True)
class Done:
    """One SGLang request's end, whichever path it took: its output ids, logprobs (None unless asked),
    finish reason (SGLang's dict), prompt logprobs (score requests), routed experts (a tensor, or SGLang's
    base64 on the tokenizer manager's path) and timings where SGLang measured them."""

    ids: list[int]
    logprobs: list[float] | None
    finish: dict[str, Any] | None
    prompt_logprobs: list[float | None] | None = None
    routed: Any = None
    cached_tokens: int = 0
    queue_s: float | None = None
    e2e_s: float | None = None


def done_from_output(out: dict[str, Any], logprobs: bool) -> Done:
    """A :class:`Done` from the tokenizer manager's output dict (``async_generate``'s result)."""
    meta = out.get("meta_info", {})
    lps = [float(lp) if lp is not None else 0.0 for lp, *_ in meta.get("output_token_logprobs") or []]
    prompt = meta.get("input_token_logprobs")
    return Done(
        ids=list(out.get("output_ids") or []),
        logprobs=lps if logprobs else None,
        finish=meta.get("finish_reason"),
        prompt_logprobs=[e[0] for e in prompt] if prompt is not None else None,
        routed=meta.get("routed_experts"),
        cached_tokens=int(meta.get("cached_tokens") or 0),
        queue_s=float(meta.get("queue_time") or 0.0),
        e2e_s=float(meta.get("e2e_latency") or 0.0),
    )


def sampling_params(sp: SamplingParams, config: SglangEngineConfig) -> dict[str, Any]:
    """SGLang's sampling parameters for ``sp`` (tiny temperatures greedy, penalties clamped, as in every engine)."""
    if sp.min_new_tokens and config.skip_tokenizer_init:
        raise InvalidRequestError(
            "sampling.min_new_tokens", sp.min_new_tokens, "needs an SGLang engine with skip_tokenizer_init=False"
        )
    out: dict[str, Any] = {
        "max_new_tokens": sp.max_new_tokens,
        "temperature": 0.0 if sp.greedy else sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k if sp.top_k > 0 else -1,
        "min_p": sp.min_p,
        "repetition_penalty": min(max(sp.repetition_penalty, PENALTY_RANGE[0]), PENALTY_RANGE[1]),
        "frequency_penalty": sp.frequency_penalty,
        "presence_penalty": sp.presence_penalty,
        "ignore_eos": sp.ignore_eos,
    }
    if sp.min_new_tokens:
        out["min_new_tokens"] = sp.min_new_tokens
    if sp.stop_token_ids:
        out["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.seed is not None and config.deterministic:  # without it SGLang ignores the seed
        out["sampling_seed"] = sp.seed
    return out


async def expand_images(req: GenerateRequest, config: SglangEngineConfig) -> Any:
    """A request with images: its expansion (:class:`rollout_sdk.models.vision.VisionInputs`, the same code as
    the CPU engine's), made in a thread (decoding and resizing are blocking); None for a text request."""
    if not req.images:
        return None
    processor = await asyncio.to_thread(_image_processor, config.model_path)
    return await asyncio.to_thread(processor.expand, req.input_ids, list(req.images))


def prompt_inputs(req: GenerateRequest, parts: Parts, vision: Any) -> dict[str, Any]:
    """``GenerateReqInput`` fields (sglang 0.5.16) for the prompt of one part: ``input_ids`` (the prompt and
    the tokens earlier parts made), and for a request with images ``image_data``.

    Images are expanded by the SDK (:func:`expand_images`), never by SGLang: the expanded ids go in
    ``input_ids`` and the processor's outputs as one item of format ``processor_output`` (``pixel_values``,
    ``image_grid_thw``).  With ``input_ids`` given and every image preprocessed, SGLang's ``load_mm_data``
    takes its fast path (no decode of the ids to text, no re-tokenization); the image offsets are the
    ``<|image_pad|>`` runs of the ids, and the M-RoPE positions come from the ids and the grids
    (``MRotaryEmbedding.get_rope_index`` for Qwen2.5-VL).  Never suspends (the engine submits right after
    its gate).  ``parts`` keeps the expansion for the result's fields.
    """
    if vision is None:
        return {"input_ids": [*req.input_ids, *parts.ids]}

    parts.vision = vision
    item = {
        "format": "processor_output",
        "modality": "IMAGE",
        "pixel_values": vision.pixel_values,
        "image_grid_thw": torch.tensor(vision.grid_thw, dtype=torch.long),
    }
    return {"input_ids": [*vision.input_ids, *parts.ids], "image_data": [item]}


def _image_processor(model_path: str) -> Any:
    processor = cached_image_processor(model_path)
    if processor is None:
        raise InvalidRequestError("images", "<images>", f"model {model_path!r} takes no images (no image processor)")
    return processor


class Parts:
    """The parts of one request, joined: ids, logprobs and (version, tokens) segments."""

    def __init__(self, logprobs: bool) -> None:
        #: a request with images: its expansion (models.vision.VisionInputs), made by the first part
        self.vision: Any = None
        self.ids: list[int] = []
        self.logprobs: list[float] | None = [] if logprobs else None
        self.segments: list[tuple[int, int]] = []
        #: (oldest KV version, tokens) runs: differs from ``segments`` only after a ``keep`` update
        self.kv_segments: list[tuple[int, int]] = []
        #: prompt tokens later parts (continuations after a checkpoint) computed instead of taking them from
        #: the prefix cache: what an update made this request re-prefill
        self.reprefilled = 0
        self.queue_s: float | None = None
        self.e2e_s = 0.0
        self.count = 0
        self.cached_tokens = 0  # of the first part: prompt tokens SGLang took from its prefix cache
        self.matched: int | None = None
        self.routed: Any = None  # int32 [tokens, layers, top_k] over the sequence so far (MoE replay)

    def add_routed(self, routed: Any, seq_len: int, top_k: int) -> None:
        """SGLang's routed experts of one part: int32 ``[seq_len - 1, layers, top_k]`` (the last token is
        never fed forward), as a tensor (direct path) or base64 (tokenizer manager).  A later part
        re-prefills the sequence; keep what earlier parts measured and take only the new positions."""
        if routed is None:
            raise RequestFailedError("SGLang returned no routed experts (start it with enable_return_routed_experts)")
        if isinstance(routed, str | bytes):
            flat = np.frombuffer(base64.b64decode(routed), dtype=np.int32)
        else:
            flat = np.asarray(routed.numpy() if hasattr(routed, "numpy") else routed, dtype=np.int32).ravel()
        tokens = max(0, seq_len - 1)
        if tokens == 0 or top_k <= 0 or flat.size % (tokens * top_k):
            raise RequestFailedError(f"routed experts of {flat.size} ids do not fit {tokens} tokens x top_k {top_k}")
        arr = flat.reshape(tokens, flat.size // (tokens * top_k), top_k)
        self.routed = arr if self.routed is None else np.concatenate([self.routed, arr[len(self.routed) :]])

    def add(
        self,
        done: Done,
        version: int,
        kv_version: int | None = None,
        seq_len: int = 0,
        *,
        splits: Sequence[tuple[int, int]] = (),
    ) -> str:
        """One part's end: its tokens sampled by weights ``version`` from KV as old as ``kv_version`` (a
        continuation under ``keep`` that took its KV from the cache; None: ``version``); ``seq_len``: the
        tokens it was fed; ``splits``: ``(tokens, version)`` where an in-place update changed its weights
        while it ran (its KV stayed: all of its tokens count as sampled from KV of the oldest version)."""
        ids = done.ids
        self.ids += ids
        if self.logprobs is not None:
            self.logprobs += [float(lp) if lp is not None else 0.0 for lp in (done.logprobs or ())][: len(ids)]
        at, current = 0, version
        for n, new in splits:
            n = min(max(n, at), len(ids))
            append_segments(self.segments, ((current, n - at),))
            at, current = n, new
        append_segments(self.segments, ((current, len(ids) - at),))  # no run for a part without tokens
        append_segments(self.kv_segments, ((version if kv_version is None else kv_version, len(ids)),))
        if self.queue_s is None:
            self.queue_s = done.queue_s or 0.0
        if self.count == 0:
            self.cached_tokens = done.cached_tokens
        elif seq_len:
            # a continuation: all but its last token were computed before (its last one never was)
            self.reprefilled += max(0, seq_len - 1 - done.cached_tokens)
        self.e2e_s = done.e2e_s or 0.0
        self.count += 1
        fr = done.finish or {}
        self.matched = fr.get("matched") if isinstance(fr.get("matched"), int) else None
        kind = fr.get("type", "abort")
        return kind if kind in ("stop", "length", "abort") else "abort"

    def result(self, req: GenerateRequest, kind: str, t0: float, weight_version: int) -> GenerateResult:
        total = time.perf_counter() - t0
        return GenerateResult(
            rid=req.rid,
            output_ids=self.ids,
            finish_reason=kind,  # type: ignore[arg-type]
            prompt_tokens=len(req.input_ids) if self.vision is None else len(self.vision.input_ids),
            weight_version=self.segments[-1][0] if self.segments else weight_version,
            logprobs=self.logprobs,
            matched_stop=self.matched,
            version_segments=self.segments,
            kv_version_segments=self.kv_segments if self.kv_segments != self.segments else [],
            routed_experts=_routed(self.routed),
            cached_tokens=self.cached_tokens,
            timings=Timings(
                queue_s=self.queue_s or 0.0,
                ttft_s=0.0,
                total_s=self.e2e_s if self.count == 1 and self.e2e_s else total,
            ),
            **(self.vision.result_fields() if self.vision is not None else {}),
        )


def _routed(arr: Any) -> RoutedExperts | None:
    """SGLang's int32 routing as the wire's compact int16 (expert ids are far below 32768)."""
    if arr is None:
        return None

    t, layers, k = arr.shape
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int16).max):
        raise RequestFailedError(f"routed expert ids outside int16: [{arr.min()}, {arr.max()}]")
    return RoutedExperts(num_tokens=t, num_layers=layers, top_k=k, data=arr.astype("<i2").tobytes())


def score_result(req: GenerateRequest, done: Done, version: int, total_s: float, vision: Any = None) -> GenerateResult:
    """A score request's result from SGLang's prompt logprobs (the first entry, without context, is
    dropped); with images, over the expanded prompt (as the CPU engine scores it), with the expansion's
    fields."""
    prompt = req.input_ids if vision is None else vision.input_ids
    entries = list(done.prompt_logprobs or ())
    if len(entries) == len(prompt):
        entries = entries[1:]
    if len(entries) != len(prompt) - 1 or any(e is None for e in entries):
        raise RequestFailedError(f"SGLang returned {len(entries)} prompt logprobs for {len(prompt)} tokens")
    return prompt_score_result(
        req,
        [float(e) for e in entries if e is not None],
        weight_version=version,
        queue_s=done.queue_s or 0.0,
        total_s=total_s,
        vision=vision,
    )


def load_from_snapshot(s: Any, config: SglangEngineConfig) -> EngineLoad:
    """EngineLoad from SGLang's ``LoadSnapshot`` (sglang 0.5.16: managers/load_snapshot.py)."""

    def num(name: str) -> int | None:
        v = getattr(s, name, None)
        return int(v) if isinstance(v, int | float) and v > 0 else None

    usage = getattr(s, "token_usage", None)
    return EngineLoad(
        running=int(s.num_running_reqs),
        queued=int(s.num_waiting_reqs),
        queued_tokens=int(getattr(s, "num_waiting_uncached_tokens", 0) or 0),
        kv_usage=float(usage) if usage is not None else None,
        max_running_requests=num("max_running_requests") or config.max_running_requests,
        kv_capacity_tokens=num("max_total_num_tokens"),
        kv_used_tokens=int(getattr(s, "num_used_tokens", 0) or 0),
    )


def request_error(exc: Exception, field: str, value: Any, what: str = "request") -> RolloutError:
    """SGLang's exception for one request, in our tree: its own validation (ValueError: context length,
    parameter ranges) is the caller's InvalidRequestError naming ``field``; anything else fails this
    request alone (RequestFailedError): the engine dies only by a child's death."""
    if isinstance(exc, ValueError):
        return InvalidRequestError(field, value, str(exc))
    return RequestFailedError(f"SGLang failed the {what}: {type(exc).__name__}: {exc}")
