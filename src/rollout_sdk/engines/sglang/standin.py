"""SGLang's real tokenizer manager over a stand-in scheduler process: the SGLang request path on a CPU.

For tests and ``bench/request_path.py`` where no GPU is: everything on the server's side of SGLang is
SGLang's own code (``TokenizerManager``, ``io_struct``, its ZMQ sockets and msgpack wire), and only the
scheduler process is replaced by a small loop that speaks the scheduler's half of the same wire
(sglang 0.5.16): it receives ``TokenizedGenerateReqInput`` / ``BatchTokenizedGenerateReqInput`` /
``AbortReq`` / ``FlushCacheReqInput``, runs "decode steps" that append one token per running request, and
sends ``BatchTokenIDOutput`` every ``SGLANG_FORCE_STREAM_INTERVAL`` tokens and at the end, exactly as
SGLang's output streamer does for non-streaming requests with ``skip_tokenizer_init``.  Requests in the
waiting queue that are aborted are echoed back as ``AbortReq`` (as SGLang's scheduler does).  Its prefix
cache is a model of SGLang's under a burst: a prompt counts as cached once the step that admitted it has
run, so requests admitted in the same step all compute it, and a later request with the same prompt
reports all of it but the last token in ``cached_tokens`` (a flush empties it).  Like SGLang's radix cache
it is namespaced by the request's ``extra_key`` and keeps what a request computed when it ends (finished or
aborted): a continuation ``prompt + tokens so far`` under the same key finds all of it but its last token.

Tokens are a deterministic function of the whole sequence as received (its ids, and for images SGLang's
offsets and the pixels: :func:`standin_seed`), so the same request gives the same tokens on either path
and a continuation gives the tokens the whole request would have; logprobs are a function of the token.
Needs ``sglang`` importable (no GPU, no kernels).

::

    server process (event loop)                       stand-in scheduler process
    TokenizerManager --PUSH scheduler_input_ipc------>  PULL: requests, aborts, flush
      handle_loop    <--PULL tokenizer_ipc------------  PUSH: BatchTokenIDOutput, AbortReq, FlushCacheReqOutput
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import zlib
from array import array
from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq

from .inplace import KEY as inplace_key

__all__ = ["StandinEngine", "StandinScheduler", "standin_logprob", "standin_next", "standin_seed"]


_MASK = (1 << 61) - 1


def _roll(h: int, token: int) -> int:
    return (h * 1_000_003 + token + 1) & _MASK


def standin_seed(ids: list[int], mm: tuple[Any, ...] = ()) -> int:
    """The stand-in's state after a prompt: a rolling digest of every id (and, for images, each item's
    offsets and pixel digest, as the scheduler received them).  Equal outputs mean equal requests, and a
    continuation (``prompt + tokens so far``) is in the very state the whole request reached."""
    h = zlib.crc32(repr(mm).encode())
    for t in ids:
        h = _roll(h, t)
    return h


def standin_next(h: int, vocab_size: int, weights: int = 0) -> tuple[int, int]:
    """The stand-in's next token from its state and the weights that sample it (the number of weight updates
    the scheduler has seen), and the state after it."""
    mixed = h if weights == 0 else _roll(h, -weights)
    token = (mixed >> 7) % max(2, vocab_size - 2) + 1
    return token, _roll(h, token)


def _mm_digest(r: Any) -> tuple[Any, ...]:
    """Per multimodal item of a received request: SGLang's offsets and a digest of its pixels."""
    if hasattr(r, "unwrap_pickle_fields"):
        r.unwrap_pickle_fields()
    mm = r.mm_inputs
    items = (mm.get("mm_items") if isinstance(mm, dict) else getattr(mm, "mm_items", None)) or []
    out = []
    for item in items:
        feature: Any = getattr(item, "feature", None)
        pixels = zlib.crc32(feature.float().numpy().tobytes()) if hasattr(feature, "numpy") else 0
        out.append((tuple(tuple(o) for o in (item.offsets or ())), pixels))
    return tuple(out)


def standin_logprob(token: int) -> float:
    return -((token % 997) + 1) / 1000.0


@dataclass(frozen=True, kw_only=True)
class StandinScheduler:
    """How the stand-in scheduler behaves: seconds per decode step (slept, so it does not take a core from
    the processes it serves), at most ``max_running`` requests per step (the rest wait)."""

    step_s: float = 0.002
    max_running: int = 1024
    vocab_size: int = 151936
    #: answer like a scheduler with rollout-sdk's in-place patch (engines/sglang/inplace.py)
    inplace: bool = True
    #: a KV pool of this many tokens (None: unbounded): admission waits for room, and when the running
    #: requests outgrow it the newest is *retracted* as SGLang does (back to the front of the queue with its
    #: tokens, prefilled again when re-admitted); the last running request is never retracted
    kv_tokens: int | None = None


class _Req:
    __slots__ = (
        "cached",
        "digest",
        "ids",
        "key",
        "max_new",
        "n_prompt",
        "out",
        "rid",
        "sent",
        "state",
        "stop",
        "want_in",
        "want_lp",
    )

    def __init__(self, r: Any) -> None:
        self.rid: str = r.rid
        ids = list(r.input_ids)
        self.n_prompt = len(ids)
        self.state = standin_seed(ids, _mm_digest(r))
        self.digest = self.state
        self.key: str | None = getattr(r, "extra_key", None)  # SGLang's radix-cache namespace
        self.cached = 0
        self.ids = ids
        sp = r.sampling_params
        self.max_new = int(sp.max_new_tokens if sp.max_new_tokens is not None else 128)
        self.stop = set(sp.stop_token_ids or ())
        self.out: list[int] = []
        self.sent = 0
        self.want_lp = bool(r.return_logprob)
        self.want_in = bool(r.return_logprob) and r.logprob_start_len is not None and r.logprob_start_len >= 0


def _scheduler_main(input_ipc: str, output_ipc: str, cfg: StandinScheduler, ready: Any) -> None:  # pragma: no cover
    from sglang.srt.managers import io_struct as io  # optional: sglang

    parent = os.getppid()
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(input_ipc)
    push = ctx.socket(zmq.PUSH)
    push.connect(output_ipc)
    interval = int(os.environ.get("SGLANG_FORCE_STREAM_INTERVAL", "50"))

    waiting: deque[_Req] = deque()
    running: dict[str, _Req] = {}
    prefilled: set[tuple[str | None, int]] = set()  # the modelled prefix cache (module docstring)
    weights = 0  # the modelled weights: bumped by every weight update, mixed into each token it samples
    paused = False  # SGLang's in-place pause: nothing decodes, control calls and aborts of queued ones go on
    # what our scheduler patch records (inplace.py)
    inplace: dict[str, Any] = {"pauses": 0, "counts": None, "retracted": [], "finished": [], "queued": []}
    ready.set()

    def finish(req: _Req, reason: dict[str, Any]) -> tuple[_Req, dict[str, Any]]:
        running.pop(req.rid, None)
        if req.out:  # what it computed stays cached under its key (SGLang's cache_finished_req)
            prefilled.add((req.key, req.state))
        return req, reason

    while True:
        if os.getppid() != parent:
            return
        if pull.poll(0 if (running or waiting) and not paused else 100):
            while True:
                try:
                    msg = io.sock_recv(pull, zmq.NOBLOCK)
                except zmq.Again:
                    break
                if isinstance(msg, io.BatchTokenizedGenerateReqInput):
                    for r in msg.batch:
                        waiting.append(_Req(r))
                elif isinstance(msg, io.TokenizedGenerateReqInput):
                    waiting.append(_Req(msg))
                elif isinstance(msg, io.AbortReq):
                    prefix = msg.rid or ""
                    for w in [w for w in waiting if msg.abort_all or w.rid.startswith(prefix)]:
                        waiting.remove(w)
                        io.sock_send(
                            push,
                            io.AbortReq(
                                rid=w.rid, finished_reason={"type": "abort", "message": "abort in waiting queue"}
                            ),
                        )
                    for r in running.values():
                        if msg.abort_all or r.rid.startswith(prefix):
                            r.max_new = -1  # ends at this step with an abort
                elif isinstance(msg, io.FlushCacheReqInput):
                    ok = not running and not waiting
                    if ok:
                        prefilled.clear()
                    io.sock_send(push, io.FlushCacheReqOutput(success=ok))
                elif isinstance(msg, io.PauseGenerationReqInput):
                    paused = True
                    if msg.mode == "in_place":
                        counts = {rid: len(q.out) for rid, q in running.items()}  # queued ones: no KV yet
                        inplace = {
                            "pauses": inplace["pauses"] + 1,
                            "counts": counts,
                            "retracted": [w.rid for w in waiting if w.out],
                            "finished": [],  # a request that ends is dropped from `running` at once
                            "queued": [w.rid for w in waiting if not w.out],
                        }
                elif isinstance(msg, io.ContinueGenerationReqInput):
                    paused = False
                elif isinstance(msg, io.GetInternalStateReq):
                    state: dict[str, Any] = {"model_path": "standin"}
                    state["standin_retracted"] = [w.rid for w in waiting if w.out]
                    state |= {inplace_key: inplace} if cfg.inplace else {}
                    io.sock_send(push, io.GetInternalStateReqOutput(internal_state=state))
                elif isinstance(msg, io.UpdateWeightsFromTensorReqInput):
                    weights += 1
                    io.sock_send(push, io.UpdateWeightsFromTensorReqOutput(success=True, message="standin"))
        if paused:
            continue
        admitted: list[_Req] = []
        used = sum(r.n_prompt + len(r.out) for r in running.values()) if cfg.kv_tokens is not None else 0
        while waiting and len(running) < cfg.max_running:
            if (
                cfg.kv_tokens is not None
                and running
                and used + waiting[0].n_prompt + len(waiting[0].out) > cfg.kv_tokens
            ):
                break
            w = waiting.popleft()
            used += w.n_prompt + len(w.out)
            running[w.rid] = w
            admitted.append(w)
        for w in admitted:
            w.cached = w.n_prompt - 1 if (w.key, w.digest) in prefilled else 0
        for w in admitted:  # cached only after this step: requests admitted together all compute it
            prefilled.add((w.key, w.digest))
        if len(prefilled) > 100_000:
            prefilled.clear()
        if not running:
            continue
        if cfg.kv_tokens is not None:  # this step's tokens need room: retract the newest (SGLang's retract_decode)
            while len(running) > 1 and used + len(running) > cfg.kv_tokens:
                victim = running.pop(next(reversed(running)))
                used -= victim.n_prompt + len(victim.out)
                waiting.appendleft(victim)
        ended: list[tuple[_Req, dict[str, Any] | None]] = []
        for r in list(running.values()):
            if r.max_new < 0:
                ended.append(finish(r, {"type": "abort", "message": "Abort before decoding"}))
                continue
            if len(r.out) < r.max_new:
                tok, r.state = standin_next(r.state, cfg.vocab_size, weights)
                r.out.append(tok)
                if tok in r.stop:
                    ended.append(finish(r, {"type": "stop", "matched": tok}))
                    continue
            if len(r.out) >= r.max_new:
                ended.append(finish(r, {"type": "length", "length": r.max_new}))
            elif len(r.out) % interval == 0:
                ended.append((r, None))
        if ended:
            io.sock_send(push, _batch_output(io, ended))
        if cfg.step_s > 0:
            time.sleep(cfg.step_s)


#: the logprob kinds SGLang's batch output carries that no stand-in request asks for (top-k, token ids)
_UNASKED_LOGPROBS = (
    "input_top_logprobs",
    "output_top_logprobs",
    "input_token_ids_logprobs",
    "output_token_ids_logprobs",
)


def _batch_output(io: Any, items: list[tuple[_Req, dict[str, Any] | None]]) -> Any:
    n = len(items)
    any_lp = any(r.want_lp for r, _ in items)
    out_lp: list[list[float]] = []
    out_idx: list[list[int]] = []
    in_lp: list[list[float | None]] = []
    in_idx: list[list[int]] = []
    deltas = []
    for r, _ in items:
        delta = r.out[r.sent :]
        r.sent = len(r.out)
        deltas.append(array("q", delta))
        out_lp.append([standin_logprob(t) for t in delta] if r.want_lp else [])
        out_idx.append(list(delta) if r.want_lp else [])
        first = r.want_in and r.n_prompt > 0
        if first:
            r.want_in = False  # once, with the first output (as SGLang's input_logprob_sent)
        in_lp.append([None, *(standin_logprob(t) for t in r.ids[1:])] if first else [])
        in_idx.append(list(r.ids) if first else [])
    empty: list[list[Any]] = [[] for _ in range(n)]
    # every logprob field is set when some request of the batch wants logprobs, else every one is None
    logprobs: dict[str, Any] = {
        "input_token_logprobs_val": in_lp,
        "input_token_logprobs_idx": in_idx,
        "output_token_logprobs_val": out_lp,
        "output_token_logprobs_idx": out_idx,
    }
    for unasked in _UNASKED_LOGPROBS:
        logprobs[f"{unasked}_val"] = logprobs[f"{unasked}_idx"] = empty
    return io.BatchTokenIDOutput(
        rids=[r.rid for r, _ in items],
        http_worker_ipcs=[None] * n,
        finished_reasons=[fr for _, fr in items],
        decoded_texts=[""] * n,
        decode_ids=[array("q") for _ in range(n)],
        read_offsets=[0] * n,
        output_ids=deltas,
        skip_special_tokens=[True] * n,
        spaces_between_special_tokens=[True] * n,
        no_stop_trim=[False] * n,
        prompt_tokens=[r.n_prompt for r, _ in items],
        reasoning_tokens=[0] * n,
        completion_tokens=[len(r.out) for r, _ in items],
        cached_tokens=[r.cached for r, _ in items],
        **(logprobs if any_lp else dict.fromkeys(logprobs)),
        output_token_entropy_val=None,
        output_token_sampling_mask=None,
        output_token_sampling_logprobs=None,
        output_hidden_states=None,
        routed_experts=None,
        indexer_topk=None,
        placeholder_tokens_idx=None,
        placeholder_tokens_val=None,
        retraction_counts=[0] * n,
    )


class StandinEngine:
    """What ``sglang.Engine(**server_args)`` gives the SDK (``tokenizer_manager``, ``shutdown()``), built from
    SGLang's real ``TokenizerManager`` and a :class:`StandinScheduler` process.  Pass
    ``StandinEngine.launcher(cfg)`` as ``SglangEngine(..., launcher=...)``."""

    def __init__(self, server_args: dict[str, Any], scheduler: StandinScheduler | None = None) -> None:
        from sglang.srt.managers.tokenizer_manager import TokenizerManager  # optional: sglang
        from sglang.srt.server_args import PortArgs, ServerArgs  # optional: sglang

        keep = ("model_path", "skip_tokenizer_init", "context_length", "max_running_requests", "random_seed")
        args = {k: server_args[k] for k in keep if k in server_args}
        args.setdefault("log_level", "error")
        sa = ServerArgs(**args, device="cpu", load_format="dummy")
        pa = PortArgs.init_new(sa)
        cfg = scheduler or StandinScheduler()
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        self._proc = ctx.Process(
            target=_scheduler_main,
            args=(pa.scheduler_input_ipc_name, pa.tokenizer_ipc_name, cfg, ready),
            name="standin-scheduler",
            daemon=True,
        )
        self._proc.start()
        try:
            self.tokenizer_manager = TokenizerManager(sa, pa)
            self.tokenizer_manager.max_req_input_len = self.tokenizer_manager.context_len - 1
            deadline = time.monotonic() + 120
            while not ready.wait(0.2) and self._proc.is_alive() and time.monotonic() < deadline:
                pass
        except BaseException:
            self.shutdown()
            raise
        if not ready.is_set():
            code = self._proc.exitcode
            self.shutdown()
            raise RuntimeError(f"the stand-in scheduler did not start (exit code {code}; see its stderr)")

    @staticmethod
    def launcher(scheduler: StandinScheduler | None = None) -> Any:
        def launch(**server_args: Any) -> StandinEngine:
            return StandinEngine(server_args, scheduler)

        return launch

    async def async_generate(
        self, *, input_ids: list[int], sampling_params: dict[str, Any], return_logprob: bool = False
    ) -> dict[str, Any]:
        """What ``sglang.Engine.async_generate`` does for one request of token ids."""
        from sglang.srt.managers.io_struct import GenerateReqInput  # optional: sglang

        obj = GenerateReqInput(input_ids=input_ids, sampling_params=sampling_params, return_logprob=return_logprob)
        gen = self.tokenizer_manager.generate_request(obj, None)
        try:
            out: dict[str, Any] = await gen.__anext__()
            return out
        finally:
            await gen.aclose()

    def shutdown(self) -> None:
        tm = getattr(self, "tokenizer_manager", None)
        sock = getattr(tm, "recv_from_detokenizer", None)
        if sock is not None and not sock.closed:
            # the tokenizer manager's ZMQ context, with every socket of it (and no linger): left to the
            # garbage collector, its term() would block on the open sockets
            sock.context.destroy(linger=0)
        if self._proc.is_alive():
            self._proc.terminate()
        self._proc.join(10)
