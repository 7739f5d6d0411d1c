"""TRL on rollout-sdk servers: generation, logprobs and weight pushes through a :class:`RolloutBridge`.

Two plug-in points of TRL (checked against trl 1.16.0, the version the ``trl`` extra pins):

* ``GRPOTrainer(rollout_func=...)``: :class:`GRPORolloutFunc` tokenizes the prompts TRL hands it, generates
  one completion per prompt on the servers, and returns ``prompt_ids``, ``completion_ids`` and
  ``logprobs`` (plus ``weight_version`` per completion, which TRL forwards to reward functions).  Before
  generating it pushes the trainer's weights whenever the global step moved, as version = global step.

* ``AsyncGRPOTrainer(rollout_worker=..., weight_transfer=...)`` (``trl.experimental.async_grpo``):
  :class:`AsyncRolloutWorker` implements TRL's ``RolloutWorkerProtocol`` (a producer on the bridge's loop
  keeps ``max_inflight_groups`` groups generating, scores them with TRL-style reward functions, and puts
  ``RolloutSample`` objects in ``rollout_buffer``); :class:`WeightTransfer` implements
  ``WeightTransferProtocol`` (pause with hold, broadcast the trainer's tensors, resume; each sync is one
  weight version, equal to the trainer's ``model_version`` after it).

Example::

    from rollout_sdk.integrations.trl import GRPORolloutFunc, RolloutBridge

    with RolloutBridge(["tcp://10.0.0.5:40123"]) as bridge:
        trainer = GRPOTrainer(model=path, reward_funcs=reward, args=GRPOConfig(...), train_dataset=ds,
                              rollout_func=GRPORolloutFunc(bridge))
        trainer.train()

Concurrency of :class:`AsyncRolloutWorker`::

    bridge loop: producer task ── TaskGroup ── one task per group (<= max_inflight_groups at once)
                   each group: tokenize (thread) → n generates (concurrent) → decode + rewards (thread)
                   → put samples in rollout_buffer (a thread blocks while the queue is full: back-pressure)
    trainer thread: drains rollout_buffer; calls update_model_version / check_health / stop
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Literal

import numpy as np

from ..client import RolloutClient
from ..protocol import GenerateResult, SamplingParams
from .bridge import RolloutBridge

__all__ = ["AsyncRolloutWorker", "GRPORolloutFunc", "RolloutBridge", "WeightTransfer", "sampling_from_args"]

RewardFunc = Callable[..., Any]


def sampling_from_args(args: Any) -> SamplingParams:
    """The sampling TRL's (Async)GRPOConfig asks for: temperature, top-p/k, min-p, repetition penalty,
    ``max_completion_length``."""
    top_k = getattr(args, "top_k", None)
    min_p = getattr(args, "min_p", None)
    return SamplingParams(
        max_new_tokens=int(args.max_completion_length),
        temperature=float(getattr(args, "temperature", 1.0)),
        top_p=float(getattr(args, "top_p", 1.0) or 1.0),
        top_k=-1 if not top_k or top_k < 0 else int(top_k),
        min_p=float(min_p or 0.0),
        repetition_penalty=float(getattr(args, "repetition_penalty", 1.0) or 1.0),
    )


def _is_conversational(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], Mapping)


def _tokenize(tokenizer: Any, prompt: Any, chat_template_kwargs: Mapping[str, Any]) -> list[int]:
    if _is_conversational(prompt):
        ids = tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, return_dict=False, **chat_template_kwargs
        )
        return [int(t) for t in ids]
    if isinstance(prompt, str):
        return [int(t) for t in tokenizer.encode(prompt, add_special_tokens=False)]
    raise TypeError(f"a TRL prompt is a string or a list of chat messages, not {type(prompt).__name__}")


def _first_version(result: GenerateResult) -> int:
    """The oldest weights any token of ``result`` came from (what staleness is measured against)."""
    return result.version_segments[0][0] if result.version_segments else result.weight_version


# -- GRPOTrainer: rollout_func ---------------------------------------------------------------------


@dataclass(eq=False)
class GRPORolloutFunc:
    """A ``rollout_func`` for TRL's ``GRPOTrainer`` (see the module docstring).

    ``sampling``: default from the trainer's args (:func:`sampling_from_args`).  ``push_weights``: push the
    trainer's weights before generating whenever its global step changed (version = global step).
    ``weight_backend`` / ``weight_device``: the weight-update group (gloo for a CPU trainer, nccl with a
    CUDA device on GPUs).  Only the main process pushes; the others wait at a barrier first.
    """

    bridge: RolloutBridge
    _: KW_ONLY
    sampling: SamplingParams | None = None
    push_weights: bool = True
    weight_backend: str = "gloo"
    weight_device: Any = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    timeout: float | None = None
    pushed_versions: list[int] = field(default_factory=list, init=False)
    _synced_step: int | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.chat_template_kwargs = dict(self.chat_template_kwargs or {})  # a copy; None is accepted as empty

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        step = int(trainer.state.global_step)
        if self.push_weights and step != self._synced_step:
            self._push(trainer, step)
        tokenizer = trainer.processing_class
        prompt_ids = [_tokenize(tokenizer, p, self.chat_template_kwargs or {}) for p in prompts]
        sampling = self.sampling or sampling_from_args(trainer.args)
        timeout = self.timeout

        async def generate(client: RolloutClient) -> list[GenerateResult]:
            return list(
                await asyncio.gather(*(client.generate(ids, sampling=sampling, timeout=timeout) for ids in prompt_ids))
            )

        results = self.bridge.run(generate)
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": [list(r.output_ids) for r in results],
            "logprobs": [list(r.logprobs or [0.0] * len(r.output_ids)) for r in results],
            "weight_version": [_first_version(r) for r in results],
        }

    def _push(self, trainer: Any, step: int) -> None:
        accelerator = trainer.accelerator
        if accelerator.is_main_process:
            model = accelerator.unwrap_model(trainer.model)
            self.bridge.push_weights(
                model.named_parameters(), version=step, backend=self.weight_backend, device=self.weight_device
            )
            self.pushed_versions.append(step)
        accelerator.wait_for_everyone()
        self._synced_step = step


# -- AsyncGRPOTrainer: rollout worker and weight transfer ------------------------------------------


@dataclass(eq=False)
class WeightTransfer:
    """TRL's ``WeightTransferProtocol`` on rollout-sdk: ``pause`` (hold in-flight requests), ``send_weights``
    (one flattened-bucket broadcast, version + 1), ``resume`` (held requests continue on the new weights;
    their version segments say which tokens came from which)."""

    bridge: RolloutBridge
    _: KW_ONLY
    backend: str = "gloo"
    device: Any = None
    pause_mode: Literal["abort", "hold", "retract", "in_place"] = "hold"
    bucket_bytes: int = 512 << 20
    #: the weight version the engines serve (the number of syncs so far)
    version: int = field(default=0, init=False)
    last_update: dict[str, float] = field(default_factory=dict, init=False)

    def init_weight_transfer(self) -> None:
        self.bridge.ensure_weight_sync(backend=self.backend, device=self.device)

    def pause(self) -> None:
        mode = self.pause_mode

        async def pause(client: RolloutClient) -> None:
            await client.pause(mode)

        self.bridge.run(pause)

    def send_weights(self, iterator: Any) -> None:
        self.last_update = self.bridge.push_weights(
            iterator, version=self.version + 1, backend=self.backend, device=self.device, bucket_bytes=self.bucket_bytes
        )
        self.version += 1

    def resume(self) -> None:
        async def resume(client: RolloutClient) -> None:
            await client.resume()

        self.bridge.run(resume)

    def destroy(self) -> None:
        async def close(client: RolloutClient) -> None:
            await client.close_weight_sync()

        with contextlib.suppress(Exception):
            self.bridge.run(close)


class AsyncRolloutWorker:
    """TRL's ``RolloutWorkerProtocol`` on rollout-sdk (see the module docstring).

    ``dataset``: rows with a ``prompt`` (a string or chat messages); other columns go to the reward
    functions as keyword arguments, as in TRL.  ``reward_funcs``: TRL-style callables
    ``f(prompts=..., completions=..., completion_ids=..., **columns) -> list[float | None]`` (sync ones run
    in a thread; async ones are awaited).  Advantages are TRL's: ``(r - mean) / (std + 1e-8)`` per group,
    0 for a completion no function could score.
    """

    def __init__(
        self,
        bridge: RolloutBridge,
        *,
        dataset: Sequence[Mapping[str, Any]],
        reward_funcs: RewardFunc | Sequence[RewardFunc],
        processing_class: Any,
        num_generations: int,
        sampling: SamplingParams,
        max_inflight_groups: int = 8,
        queue_maxsize: int = 1024,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> None:
        if num_generations < 1:
            raise ValueError(f"num_generations must be >= 1, not {num_generations}")
        if max_inflight_groups < 1:
            raise ValueError(f"max_inflight_groups must be >= 1, not {max_inflight_groups}")
        if len(dataset) == 0:
            raise ValueError("dataset is empty")
        self.bridge = bridge
        self.dataset = dataset
        self.reward_funcs = list(reward_funcs) if isinstance(reward_funcs, Sequence) else [reward_funcs]
        self.tokenizer = processing_class
        self.num_generations = num_generations
        self.sampling = sampling
        self.max_inflight_groups = max_inflight_groups
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.timeout = timeout
        self.rollout_buffer: queue.Queue[Any] = queue.Queue(maxsize=queue_maxsize)
        self.metrics_queue: queue.Queue[dict[str, float]] = queue.Queue(maxsize=10_000)
        self.model_version = 0
        self.groups_done = 0
        self._future: Any = None
        self._stopping = threading.Event()
        self._last_progress = time.monotonic()

    # -- RolloutWorkerProtocol ---------------------------------------------------------------------

    def start(self) -> None:
        if self._future is not None:
            raise RuntimeError("AsyncRolloutWorker.start() was called twice")
        self._last_progress = time.monotonic()
        self._future = self.bridge.start(self._produce)

    def stop(self) -> None:
        self._stopping.set()
        fut, self._future = self._future, None
        if fut is not None:
            fut.cancel()
            with contextlib.suppress(BaseException):
                fut.result(timeout=30)

    def update_model_version(self, model_version: int) -> None:
        self.model_version = model_version

    def check_health(self, stale_after_s: float) -> None:
        fut = self._future
        if fut is None:
            raise RuntimeError("the rollout worker is not running (start() was not called, or it was stopped)")
        if fut.done():
            exc = None if fut.cancelled() else fut.exception()
            raise RuntimeError(f"the rollout worker stopped: {exc!r}") from exc
        idle = time.monotonic() - self._last_progress
        if idle > stale_after_s:
            raise RuntimeError(f"the rollout worker produced nothing for {idle:.0f}s (stale_after_s={stale_after_s})")

    # -- the producer (bridge loop) ----------------------------------------------------------------

    async def _produce(self, client: RolloutClient) -> None:
        slots = asyncio.Semaphore(self.max_inflight_groups)
        async with asyncio.TaskGroup() as tg:
            for group_id, row in enumerate(itertools.cycle(self.dataset)):
                await slots.acquire()
                if self._stopping.is_set():
                    return
                task = tg.create_task(self._group(client, group_id, row))
                task.add_done_callback(lambda _t: slots.release())

    async def _group(self, client: RolloutClient, group_id: int, row: Mapping[str, Any]) -> None:
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample  # optional: trl

        prompt = row["prompt"]
        prompt_ids = await asyncio.to_thread(_tokenize, self.tokenizer, prompt, self.chat_template_kwargs)
        results = await asyncio.gather(
            *(
                client.generate(prompt_ids, sampling=self.sampling, timeout=self.timeout)
                for _ in range(self.num_generations)
            )
        )
        samples = await asyncio.to_thread(self._score, group_id, row, prompt, prompt_ids, results, RolloutSample)
        for sample in samples:
            await asyncio.to_thread(self._put, sample)
        self.groups_done += 1
        self._last_progress = time.monotonic()
        with contextlib.suppress(queue.Full):
            self.metrics_queue.put_nowait(
                {"rollout_sdk/weight_version": float(min(_first_version(r) for r in results))}
            )

    def _score(
        self,
        group_id: int,
        row: Mapping[str, Any],
        prompt: Any,
        prompt_ids: list[int],
        results: Sequence[GenerateResult],
        sample_type: Any,
    ) -> list[Any]:
        """Decode, reward, advantage: blocking work, run in a thread (reward functions may be slow)."""
        texts = [self.tokenizer.decode(r.output_ids, skip_special_tokens=True) for r in results]
        completions: list[Any] = (
            [[{"role": "assistant", "content": t}] for t in texts] if _is_conversational(prompt) else texts
        )
        n = len(results)
        columns = {k: [v] * n for k, v in row.items() if k not in ("prompt", "completion")}
        kwargs = dict(prompts=[prompt] * n, completions=completions, completion_ids=[r.output_ids for r in results])
        table = []
        for fn in self.reward_funcs:
            got = fn(**kwargs, **columns)
            if asyncio.iscoroutine(got):
                got = asyncio.run(got)
            table.append([float("nan") if v is None else float(v) for v in got])
        arr = np.asarray(table, dtype=float).reshape(len(self.reward_funcs), n)
        unscored = np.all(np.isnan(arr), axis=0)
        rewards = np.nansum(arr, axis=0)
        rewards[unscored] = np.nan
        advantages = np.zeros(n)
        ok = ~unscored
        std = float(rewards[ok].std()) if ok.any() else float("nan")
        if ok.any():
            advantages[ok] = (rewards[ok] - rewards[ok].mean()) / (std + 1e-8)
        now = time.time()
        out = []
        for r, completion, adv, reward in zip(results, completions, advantages, rewards, strict=True):
            ids = prompt_ids + list(r.output_ids)
            mask = [0] * len(prompt_ids) + [1] * len(r.output_ids)
            old = [0.0] * len(prompt_ids) + list(r.logprobs or [0.0] * len(r.output_ids))
            out.append(
                sample_type(
                    prompt=prompt,
                    completion=completion,
                    input_ids=np.asarray(ids, dtype=np.int64),
                    completion_mask=np.asarray(mask, dtype=np.int64),
                    old_log_probs=np.asarray(old, dtype=np.float32),
                    advantage=float(adv),
                    model_version=_first_version(r),
                    group_id=group_id,
                    metrics={"reward": float(reward), "reward_std": std},
                    enqueued_at=now,
                )
            )
        return out

    def _put(self, sample: Any) -> None:
        while not self._stopping.is_set():
            try:
                self.rollout_buffer.put(sample, timeout=0.5)
                return
            except queue.Full:
                continue
