"""The CPU engine: a Hugging Face causal LM on CPU with continuous batching.  The embedded default.

Concurrency::

    event loop thread                                   worker thread (one, owns the model and KV cache)
    ─────────────────                                   ───────────────────────────────────────────────
    generate(req) ── puts a _Seq in `waiting`, wakes the step loop, awaits its future
    abort(rid)    ── resolves the future now (tokens so far), flags the row; the worker drops it next step
    step loop     ── waits on: work to do (wake event) and not paused
                     picks new seqs (≤ max_running rows, ≤ max_prefill_tokens padded prompt tokens)
                     awaits ─────────────────────────▶ step(): drop finished rows, decode one token for
                                                       every running row, prefill the new ones, sample
                  ◀──────────────────── tokens ─────── (the GIL is released inside torch ops, so the
                     appends tokens, resolves the        loop keeps serving ZMQ while a step runs)
                     futures of finished seqs
    weight update / memory ─ queued on the same worker, so they run between two steps, never inside one

The batch KV cache is a transformers ``DynamicCache`` with rows left-padded to a common length: new rows
are prefilled together and concatenated in, finished rows are index-selected out and all-padding columns
trimmed.  (bench/cpu_batching.py measures this loop against transformers' own continuous-batching
manager; docs/design.md says why this one is kept.)

Sampling honours every SamplingParams field.  A request's randomness comes from its own generator (seeded
by ``seed`` when given), one uniform draw per token turned into a token by inverse-CDF, so a seeded
request reproduces token for token whatever else shares its batch.  Logprobs are those of the sampled
tokens under the distribution after penalties and temperature, before top-k/top-p/min-p.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import inspect
import logging
import os
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from .._aio import cancel_and_wait
from ..errors import (
    ConfigError,
    EngineBusyError,
    EngineDeadError,
    EngineStartupError,
    InvalidRequestError,
    WeightUpdateError,
)
from ..protocol import EngineLimits, GenerateRequest, GenerateResult, PauseMode, TensorMeta, Timings
from .base import Engine, EngineLoad, NamedTensors

if TYPE_CHECKING:
    import torch

__all__ = ["CpuEngine", "CpuEngineConfig"]

log = logging.getLogger("rollout_sdk.engines.cpu")
_HEAD_CHUNK = 32
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class CpuEngineConfig:
    """Configuration of :class:`CpuEngine`."""

    #: a local HF model directory; None builds/uses the embedded tiny Qwen2 model
    model_path: str | None = None
    #: rows decoded together per step
    max_running: int = 128
    #: padded prompt tokens prefilled per step (at least one request is always admitted)
    max_prefill_tokens: int = 4096
    #: "float32" or "bfloat16"
    dtype: str = "float32"
    #: torch intra-op threads; None leaves torch's default
    num_threads: int | None = None
    #: context length; None takes the model's max_position_embeddings
    max_context: int | None = None
    #: seeds the generators of requests that carry no seed
    seed: int = 0
    #: where the embedded tiny model is built (default $ROLLOUT_SDK_HOME or ~/.cache/rollout_sdk)
    home: str | None = None

    def __post_init__(self) -> None:
        if self.max_running < 1:
            raise ConfigError("max_running", self.max_running, "must be >= 1")
        if self.max_prefill_tokens < 1:
            raise ConfigError("max_prefill_tokens", self.max_prefill_tokens, "must be >= 1")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError("dtype", self.dtype, "must be float32, bfloat16 or float16")


class _Seq:
    """One request inside the engine.  Fields written by the loop thread unless noted."""

    __slots__ = (
        "done",
        "future",
        "logprobs",
        "out",
        "penalized",
        "prompt",
        "req",
        "rid",
        "rng",
        "segments",
        "stop_ids",
        "t0",
        "t_first",
    )

    def __init__(self, req: GenerateRequest, eos: Sequence[int], rng: random.Random, fut: asyncio.Future[Any]):
        sp = req.sampling
        self.req = req
        self.rid = req.rid
        self.prompt = req.input_ids
        self.out: list[int] = []
        self.logprobs: list[float] = []
        self.segments: list[list[int]] = []
        self.rng = rng  # drawn from by the worker only
        stops = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            stops.update(eos)
        self.stop_ids = stops
        self.penalized = sp.repetition_penalty != 1.0 or sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0
        self.future = fut
        self.t0 = time.perf_counter()
        self.t_first = 0.0
        self.done = False  # read by the worker to drop the row

    def context(self) -> list[int]:
        return self.prompt + self.out


class _Batch:
    """The running rows and their KV cache.  Touched only by the worker thread."""

    def __init__(self) -> None:
        self.rows: list[_Seq] = []
        self.cache: Any = None
        self.mask: torch.Tensor | None = None  # [B, T] 1 = real token
        self.next_pos: torch.Tensor | None = None  # [B]
        self.last_tok: torch.Tensor | None = None  # [B]

    def clear(self) -> None:
        self.rows = []
        self.cache = self.mask = self.next_pos = self.last_tok = None


class CpuEngine(Engine):
    """A transformers causal LM on CPU with continuous batching (see the module docstring)."""

    backend = "cpu"

    def __init__(self, config: CpuEngineConfig | None = None) -> None:
        super().__init__()
        self.config = config or CpuEngineConfig()
        self._model: Any = None
        self._body: Any = None
        self._head: Callable[[Any], Any] = _identity
        self._cache_kw = "past_key_values"
        self._limits: EngineLimits | None = None
        self._model_path = ""
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._batch = _Batch()
        self._reqs: dict[str, _Seq] = {}
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._wake = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._step_idle = asyncio.Event()
        self._step_idle.set()
        self._paused = False
        self._released: set[str] = set()
        self._offload_dir: tempfile.TemporaryDirectory[str] | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._rng = random.Random(self.config.seed)
        self._groups: dict[str, Any] = {}
        # the version the worker's weights are at; read by the worker when it samples
        self._model_version = 0

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cpu-engine")
        try:
            await self._in_worker(self._load)
        except Exception as exc:
            self._executor.shutdown(wait=False)
            self._executor = None
            raise EngineStartupError(f"cannot load model {self.config.model_path or '<tiny>'}: {exc}") from exc
        self._loop_task = asyncio.create_task(self._step_loop(), name="cpu-engine-steps")

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig

        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        path = self.config.model_path
        if path is None:
            from ..models.tiny import ensure_tiny_model

            path = str(ensure_tiny_model(self.config.home))
        if not Path(path, "config.json").exists():
            raise FileNotFoundError(f"{path!r} is not a model directory (no config.json)")
        dtype = getattr(torch, self.config.dtype)
        from ..models import quiet_weight_loading

        with quiet_weight_loading():  # no "Loading weights" bar in servers, ranks and examples
            model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
        model.eval()
        model.requires_grad_(False)
        cfg = model.config
        eos: list[int] = []
        try:
            gc = GenerationConfig.from_pretrained(path)
            eos = _as_list(gc.eos_token_id)
        except OSError:
            pass
        eos = eos or _as_list(getattr(cfg, "eos_token_id", None))
        vocab = int(model.get_output_embeddings().weight.shape[0])
        ctx = self.config.max_context or int(getattr(cfg, "max_position_embeddings", 2048))
        body = getattr(model, model.base_model_prefix, None)
        head = model.get_output_embeddings()
        # Split body and head only where the head is a plain projection of the last hidden state.
        plain_head = not any(
            getattr(cfg, a, None) for a in ("final_logit_softcapping", "logit_scale", "logits_scaling")
        )
        if body is not None and head is not None and plain_head:
            self._body, self._head = body, head
        else:
            self._body, self._head = None, _identity
        params = inspect.signature((self._body or model).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._model = model
        self._model_path = path
        self._limits = EngineLimits(vocab_size=vocab, max_context=ctx, eos_token_ids=eos)

    async def close(self) -> None:
        task, self._loop_task = self._loop_task, None
        await cancel_and_wait(task)
        for s in list(self._reqs.values()):
            self._finish(s, "abort")
        if self._executor is not None:
            ex, self._executor = self._executor, None
            await asyncio.get_running_loop().run_in_executor(None, ex.shutdown)
        for group in self._groups.values():
            _destroy_group(group)
        self._groups.clear()
        if self._offload_dir is not None:
            self._offload_dir.cleanup()
            self._offload_dir = None

    async def _in_worker(self, fn: Callable[..., T], *args: Any) -> T:
        if self._executor is None:
            raise EngineDeadError("the CPU engine is not running")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    @property
    def limits(self) -> EngineLimits:
        if self._limits is None:
            raise EngineDeadError("the CPU engine has not started")
        return self._limits

    @property
    def model_name(self) -> str:
        return self._model_path

    @property
    def model(self) -> Any:
        """The underlying transformers model (for tests and reference checks)."""
        return self._model

    # -- requests ----------------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        if req.rid in self._reqs:
            raise InvalidRequestError("rid", req.rid, "a request with this rid is already in flight")
        fut: asyncio.Future[GenerateResult] = asyncio.get_running_loop().create_future()
        seed = req.sampling.seed
        rng = random.Random(seed if seed is not None else self._rng.getrandbits(63))
        seq = _Seq(req, self.limits.eos_token_ids, rng, fut)
        self._reqs[seq.rid] = seq
        self._waiting.append(seq)
        self._wake.set()
        return await fut

    def abort(self, rid: str) -> None:
        seq = self._reqs.get(rid)
        if seq is not None:
            self._finish(seq, "abort")

    def running_rids(self) -> Sequence[str]:
        return list(self._reqs)

    def load(self) -> EngineLoad:
        queued = [s for s in self._waiting if not s.done]
        return EngineLoad(
            running=len(self._reqs) - len(queued),
            queued=len(queued),
            queued_tokens=sum(len(s.prompt) + len(s.out) for s in queued),
        )

    def _finish(self, seq: _Seq, reason: str, matched: int | None = None) -> None:
        if seq.done:
            return
        seq.done = True
        self._reqs.pop(seq.rid, None)
        if seq.future.done():
            return
        now = time.perf_counter()
        first = seq.t_first or now
        seq.future.set_result(
            GenerateResult(
                rid=seq.rid,
                output_ids=list(seq.out),
                finish_reason=reason,  # type: ignore[arg-type]
                prompt_tokens=len(seq.prompt),
                weight_version=self._weight_version,
                logprobs=list(seq.logprobs) if seq.req.return_logprobs else None,
                matched_stop=matched,
                version_segments=[(v, n) for v, n in seq.segments],
                timings=Timings(queue_s=first - seq.t0, ttft_s=first - seq.t0, total_s=now - seq.t0),
            )
        )

    # -- the step loop -----------------------------------------------------------------------------

    async def _step_loop(self) -> None:
        try:
            while True:
                if self._paused or self._released:
                    await self._resumed.wait()
                    continue
                admit = self._admit()
                if not admit and not any(not s.done for s in self._batch.rows):
                    self._wake.clear()
                    if not self._waiting:
                        await self._wake.wait()
                    continue
                self._step_idle.clear()
                try:
                    version, emitted = await self._in_worker(self._step, admit)
                finally:
                    self._step_idle.set()
                self._record(version, emitted)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.exception("CPU engine step failed; the engine is dead")
            err = EngineDeadError(f"CPU engine failed: {type(exc).__name__}: {exc}")
            self._mark_dead(err)
            for s in list(self._reqs.values()):
                self._reqs.pop(s.rid, None)
                s.done = True
                if not s.future.done():
                    s.future.set_exception(err)

    def _admit(self) -> list[_Seq]:
        cfg = self.config
        room = cfg.max_running - sum(1 for s in self._batch.rows if not s.done)
        admit: list[_Seq] = []
        longest = 0
        while self._waiting and len(admit) < room:
            s = self._waiting[0]
            if s.done:
                self._waiting.popleft()
                continue
            n = len(s.prompt) + len(s.out)
            if admit and max(longest, n) * (len(admit) + 1) > cfg.max_prefill_tokens:
                break
            longest = max(longest, n)
            admit.append(self._waiting.popleft())
        return admit

    def _record(self, version: int, emitted: list[tuple[_Seq, int, float]]) -> None:
        now = time.perf_counter()
        ctx = self.limits.max_context
        for seq, tok, lp in emitted:
            if seq.done:
                continue
            if not seq.out:
                seq.t_first = now
            seq.out.append(tok)
            seq.logprobs.append(lp)
            if seq.segments and seq.segments[-1][0] == version:
                seq.segments[-1][1] += 1
            else:
                seq.segments.append([version, 1])
            sp = seq.req.sampling
            n = len(seq.out)
            if tok in seq.stop_ids and n >= sp.min_new_tokens:
                self._finish(seq, "stop", tok)
            elif n >= sp.max_new_tokens or len(seq.prompt) + n >= ctx:
                self._finish(seq, "length")

    # -- worker side -------------------------------------------------------------------------------

    def _step(self, admit: list[_Seq]) -> tuple[int, list[tuple[_Seq, int, float]]]:
        import torch

        version = self._model_version
        b = self._batch
        emitted: list[tuple[_Seq, int, float]] = []
        with torch.inference_mode():
            self._drop_done_rows()
            if b.rows:
                assert b.mask is not None and b.next_pos is not None and b.last_tok is not None
                mask = torch.cat([b.mask, torch.ones(len(b.rows), 1, dtype=b.mask.dtype)], dim=1)
                last = self._forward_last(b.last_tok[:, None], mask, b.next_pos[:, None], b.cache)
                b.mask = mask
                b.next_pos = b.next_pos + 1
                toks, lps = self._head_and_sample(last, b.rows)
                b.last_tok = toks
                emitted.extend(zip(b.rows, toks.tolist(), lps.tolist(), strict=True))
            if admit:
                toks, lps = self._prefill(admit)
                emitted.extend(zip(admit, toks.tolist(), lps.tolist(), strict=True))
        return version, emitted

    def _drop_done_rows(self) -> None:
        b = self._batch
        if not b.rows:
            return
        keep = [i for i, s in enumerate(b.rows) if not s.done]
        if len(keep) == len(b.rows):
            return
        if not keep:
            b.clear()
            return
        import torch

        idx = torch.tensor(keep, dtype=torch.long)
        b.rows = [b.rows[i] for i in keep]
        b.cache.batch_select_indices(idx)
        assert b.mask is not None and b.next_pos is not None and b.last_tok is not None
        b.mask = b.mask[idx]
        b.next_pos = b.next_pos[idx]
        b.last_tok = b.last_tok[idx]
        # columns that are padding in every remaining row can go
        first = int(b.mask.any(dim=0).nonzero()[0])
        if first > 0:
            b.mask = b.mask[:, first:]
            for layer in _cache_layers(b.cache):
                layer.keys = layer.keys[:, :, first:, :]
                layer.values = layer.values[:, :, first:, :]

    def _prefill(self, admit: list[_Seq]) -> tuple[torch.Tensor, torch.Tensor]:
        import torch
        from transformers import DynamicCache

        ctxs = [s.context() for s in admit]
        width = max(len(c) for c in ctxs)
        ids = torch.zeros(len(ctxs), width, dtype=torch.long)
        mask = torch.zeros(len(ctxs), width, dtype=torch.long)
        for i, c in enumerate(ctxs):
            ids[i, width - len(c) :] = torch.tensor(c, dtype=torch.long)
            mask[i, width - len(c) :] = 1
        pos = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache(config=self._model.config)
        last = self._forward_last(ids, mask, pos, cache)
        toks, lps = self._head_and_sample(last, admit)
        self._merge(admit, cache, mask, pos[:, -1] + 1, toks)
        return toks, lps

    def _merge(
        self, rows: list[_Seq], cache: Any, mask: torch.Tensor, next_pos: torch.Tensor, last: torch.Tensor
    ) -> None:
        import torch

        b = self._batch
        if not b.rows:
            b.rows, b.cache, b.mask, b.next_pos, b.last_tok = list(rows), cache, mask, next_pos, last
            return
        assert b.mask is not None and b.next_pos is not None and b.last_tok is not None
        t_old, t_new = b.mask.shape[1], mask.shape[1]
        width = max(t_old, t_new)
        old_layers, new_layers = _cache_layers(b.cache), _cache_layers(cache)
        for lo, ln in zip(old_layers, new_layers, strict=True):
            lo.keys = torch.cat([_left_pad(lo.keys, width), _left_pad(ln.keys, width)], dim=0)
            lo.values = torch.cat([_left_pad(lo.values, width), _left_pad(ln.values, width)], dim=0)
        b.mask = torch.cat([_left_pad_2d(b.mask, width), _left_pad_2d(mask, width)], dim=0)
        b.next_pos = torch.cat([b.next_pos, next_pos])
        b.last_tok = torch.cat([b.last_tok, last])
        b.rows = b.rows + list(rows)

    def _forward_last(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any) -> torch.Tensor:
        """Run the model over ``ids`` (extending ``cache`` in place); return each row's last hidden state,
        or its logits when the model could not be split into body and head."""
        kw = {"input_ids": ids, "attention_mask": mask, "position_ids": pos, self._cache_kw: cache, "use_cache": True}
        if self._body is not None:
            hidden: torch.Tensor = self._body(**kw).last_hidden_state[:, -1, :]
            return hidden
        logits: torch.Tensor = self._model(**kw, logits_to_keep=1).logits[:, -1, :]
        return logits

    def _head_and_sample(self, hidden: torch.Tensor, rows: Sequence[_Seq]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and tokens for ``hidden`` ([n, H], last position of each row), in cache-sized chunks:
        a [rows, 150k] float32 block stays in cache at 32 rows and spills to memory at 128."""
        import torch

        from ._sampling import RowSampling, sample

        toks, lps = [], []
        for lo in range(0, len(rows), _HEAD_CHUNK):
            chunk = rows[lo : lo + _HEAD_CHUNK]
            logits = self._head(hidden[lo : lo + _HEAD_CHUNK]).float()
            vocab = logits.shape[1]
            specs = []
            for i, s in enumerate(chunk):
                sp = s.req.sampling
                if s.penalized:
                    _apply_penalties(logits[i], s, vocab)
                if sp.min_new_tokens and len(s.out) < sp.min_new_tokens and s.stop_ids:
                    logits[i, [t for t in s.stop_ids if t < vocab]] = float("-inf")
                specs.append(RowSampling(sp.temperature, sp.top_k, sp.top_p, sp.min_p, s.rng.random()))
            t, lp = sample(logits, specs)
            toks.append(t)
            lps.append(lp)
        return torch.cat(toks), torch.cat(lps)

    # -- pause / memory / weights --------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self._paused

    async def pause(self, mode: PauseMode = "abort") -> None:
        self._paused = True
        self._resumed.clear()
        await self._step_idle.wait()
        if mode == "abort":
            self.abort_all()
        elif mode == "retract":
            rows = await self._in_worker(self._retract)
            self._waiting.extendleft(reversed(rows))

    def _retract(self) -> list[_Seq]:
        """Drop the KV cache of every running row; the rows re-prefill (prompt + tokens so far) later."""
        rows = [s for s in self._batch.rows if not s.done]
        self._batch.clear()
        return rows

    async def resume(self) -> None:
        self._paused = False
        if not self._released:
            self._resumed.set()
        self._wake.set()

    async def flush_cache(self) -> None:
        # The CPU engine keeps no prefix cache across requests: nothing to flush.
        return None

    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        tags = list(tags or ("weights", "kv_cache"))
        if self._reqs and not self._paused:
            raise EngineBusyError(f"cannot release memory with {len(self._reqs)} request(s) in flight")
        # held by pause('retract') they keep only their tokens (re-prefilled on resume); in place, their KV
        held_kv = sum(not s.done for s in self._batch.rows)
        if held_kv:
            raise EngineBusyError(
                f"cannot release memory: {held_kv} request(s) held in place keep their KV cache "
                "(pause with mode='hold' or 'abort' first)"
            )
        self._resumed.clear()
        self._released.update(tags)
        await self._step_idle.wait()
        await self._in_worker(self._release, tags)

    def _release(self, tags: list[str]) -> None:
        import torch
        from safetensors.torch import save_file

        if "kv_cache" in tags:
            self._batch.clear()
        if "weights" in tags and self._offload_dir is None:
            self._offload_dir = tempfile.TemporaryDirectory(prefix="rollout-sdk-offload-")
            state = {k: v.contiguous() for k, v in _unique_params(self._model).items()}
            save_file(state, os.path.join(self._offload_dir.name, "weights.safetensors"))
            for p in _unique_params(self._model).values():
                p.data = torch.empty(0, dtype=p.dtype)

    async def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        tags = list(tags or ("weights", "kv_cache"))
        await self._in_worker(self._resume, tags)
        self._released.difference_update(tags)
        if not self._released and not self._paused:
            self._resumed.set()
            self._wake.set()

    def _resume(self, tags: list[str]) -> None:
        from safetensors.torch import load_file

        if "weights" in tags and self._offload_dir is not None:
            state = load_file(os.path.join(self._offload_dir.name, "weights.safetensors"))
            for name, p in _unique_params(self._model).items():
                p.data = state[name]
            self._offload_dir.cleanup()
            self._offload_dir = None

    async def set_weight_version(self, version: int) -> None:
        await self._in_worker(self._set_model_version, version)
        self._weight_version = version

    def _set_model_version(self, version: int) -> None:
        self._model_version = version

    async def update_weights(self, named: NamedTensors, *, version: int | None = None) -> None:
        if "weights" in self._released:
            raise WeightUpdateError("weights are released; resume_memory(['weights']) first", applied=False)
        await self._in_worker(self._apply_weights, list(named), version)
        if version is not None:
            self._weight_version = version

    def _apply_weights(self, named: list[tuple[str, torch.Tensor]], version: int | None) -> None:
        import torch

        from ..weights import Bucket
        from ..weights.manifest import check_metas, parameter_shapes

        problems = check_metas(parameter_shapes(self._model), [Bucket(named).metas])
        if problems:
            raise WeightUpdateError("; ".join(problems), applied=False)
        params = _unique_params(self._model)
        aliases = _tied_aliases(self._model)
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, tensor in named:
            if not tensor.dtype.is_floating_point:
                raise WeightUpdateError(
                    f"parameter {name!r}: dtype {tensor.dtype} is not floating point", applied=False
                )
            staged.append((params[aliases.get(name, name)], tensor))
        with torch.no_grad():
            for p, tensor in staged:
                p.copy_(tensor)
        if version is not None:
            self._model_version = version

    async def init_weight_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
    ) -> None:
        from ..weights import init_weight_group

        if group_name in self._groups:
            raise WeightUpdateError(f"weight group {group_name!r} already exists", applied=False)
        # Blocking rendezvous: runs in the default thread pool, not on the loop nor the model worker.
        group = await asyncio.to_thread(
            init_weight_group,
            master_address=master_address,
            master_port=master_port,
            rank=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
            timeout_s=timeout_s,
        )
        self._groups[group_name] = group

    async def update_weights_distributed(
        self, *, group_name: str, buckets: list[list[TensorMeta]], version: int | None, flush_cache: bool
    ) -> None:
        from ..weights import receive_buckets
        from ..weights.manifest import check_metas, parameter_shapes

        group = self._groups.get(group_name)
        if group is None:
            raise WeightUpdateError(f"no weight group {group_name!r}: call init_weight_group first", applied=False)
        problems = check_metas(parameter_shapes(self._model), buckets)
        # The collective must run on every rank even when the update is refused, or the sender hangs.
        named = await asyncio.to_thread(receive_buckets, group, buckets)
        if problems:
            raise WeightUpdateError("; ".join(problems), applied=False)
        await self._in_worker(self._apply_weights, named, version)
        if version is not None:
            self._weight_version = version

    async def destroy_weight_group(self, group_name: str) -> None:
        group = self._groups.pop(group_name, None)
        if group is not None:
            await asyncio.to_thread(_destroy_group, group)


# -- helpers ---------------------------------------------------------------------------------------


def _identity(x: Any) -> Any:
    return x


def _as_list(x: Any) -> list[int]:
    if x is None:
        return []
    if isinstance(x, int):
        return [x]
    return [int(v) for v in x]


def _cache_layers(cache: Any) -> list[Any]:
    return list(cache.layers)


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Left-pad a [B, H, T, D] tensor with zeros to T = width."""
    import torch

    pad = width - t.shape[2]
    if pad == 0:
        return t
    return torch.cat([t.new_zeros(t.shape[0], t.shape[1], pad, t.shape[3]), t], dim=2)


def _left_pad_2d(t: torch.Tensor, width: int) -> torch.Tensor:
    import torch

    pad = width - t.shape[1]
    if pad == 0:
        return t
    return torch.cat([t.new_zeros(t.shape[0], pad), t], dim=1)


def _apply_penalties(row: torch.Tensor, s: _Seq, vocab: int) -> None:
    import torch

    sp = s.req.sampling
    if sp.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(s.prompt) | set(s.out)), dtype=torch.long)
        seen = seen[seen < vocab]
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
    if s.out and (sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0):
        counts = torch.bincount(torch.tensor(s.out, dtype=torch.long), minlength=vocab)[:vocab].float()
        row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).float()


def _unique_params(model: Any) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def _tied_aliases(model: Any) -> dict[str, str]:
    """Names a checkpoint may use for a parameter that named_parameters() lists under another name."""
    aliases: dict[str, str] = {}
    by_id = {id(p): n for n, p in model.named_parameters()}
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical = by_id.get(id(p))
        if canonical is not None and canonical != name:
            aliases[name] = canonical
    out_emb = model.get_output_embeddings()
    in_emb = model.get_input_embeddings()
    if out_emb is not None and in_emb is not None and out_emb.weight is in_emb.weight:
        aliases.setdefault("lm_head.weight", by_id[id(in_emb.weight)])
    return aliases


def _destroy_group(group: Any) -> None:
    from ..weights.group import destroy_weight_group

    try:
        destroy_weight_group(group)
    except Exception:  # pragma: no cover - best effort at teardown
        log.debug("destroying weight group failed", exc_info=True)
