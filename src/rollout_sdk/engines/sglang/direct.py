"""Token-in/token-out requests straight to SGLang's scheduler, past its tokenizer manager.

A caller of ``sglang.Engine.async_generate`` pays, per request, for the tokenizer manager's Python on the
event loop: normalising a ``GenerateReqInput``, a ``ReqState`` with an event and time stats, the pause
condition and the model-update lock, ``_tokenize_one_request`` (for ids: validation and a
``TokenizedGenerateReqInput`` of ~40 fields), one ZMQ send per request, a waiter coroutine that wakes per
output chunk, and per chunk a ``meta_info`` dict with logprob tuples.  For requests that arrive as token
ids and never stream, none of that is needed: this path builds the ``TokenizedGenerateReqInput`` itself
(the same validation: context length, SGLang's own ``SamplingParams.verify``), sends every request made in
one loop iteration as one ``BatchTokenizedGenerateReqInput`` (at most ``BATCH`` each), and reads the scheduler's
``BatchTokenIDOutput`` for its own rids, appending ids and logprobs to plain lists and resolving one future
per request when it ends.  Everything else (other requests, control calls, images) stays with the
tokenizer manager, which keeps running its receive loop: this path hooks the two places where that loop
hands a scheduler message on (``_handle_batch_output`` and the ``AbortReq`` entry of its dispatcher),
takes the rids it owns and passes the rest through unchanged.

Written against sglang 0.5.16's ``io_struct`` (docs/design.md: how it stays compatible): ``install``
checks that the hooks and fields it relies on exist and refuses otherwise, so the engine falls back to
the tokenizer manager instead of failing requests.

::

    server loop:  submit() --> outbox --call_soon--> flush(): one BatchTokenizedGenerateReqInput --ZMQ--> scheduler
                  TM.handle_loop <--ZMQ-- BatchTokenIDOutput / AbortReq
                      |-- our rids: extend ids/logprobs; finished -> future.set_result(Done)
                      `-- other rids (rid_to_state): the tokenizer manager's own handler
"""

from __future__ import annotations

import asyncio
import functools
import logging
from array import array
from typing import Any

import msgspec

from .translate import Done

__all__ = ["SchedulerPath", "Unsupported"]

log = logging.getLogger("rollout_sdk.engines.sglang")
#: requests per message to the scheduler at most: a burst of thousands submitted in one loop iteration goes
#: out in pieces, so the scheduler is not idle while the rest are built (one 8,192-request message would be)
BATCH = 128


class Unsupported(RuntimeError):
    """The installed SGLang lacks what the direct path relies on."""


class _Req:
    __slots__ = ("future", "ids", "in_lps", "lps", "routed")

    def __init__(self, future: asyncio.Future[Done], logprobs: bool, prompt_logprobs: bool) -> None:
        self.future = future
        self.ids: list[int] = []
        self.lps: list[float] | None = [] if logprobs else None
        self.in_lps: list[float | None] | None = [] if prompt_logprobs else None
        self.routed: Any = None


class SchedulerPath:
    """The direct path of one engine (see the module docstring).  Runs on the server's event loop."""

    def __init__(self, tm: Any) -> None:
        from sglang.srt.managers import io_struct  # optional: sglang
        from sglang.srt.sampling.sampling_params import SamplingParams  # optional: sglang

        self._tm = tm
        self._io = io_struct
        self._sampling_cls = SamplingParams
        self._reqs: dict[str, _Req] = {}
        self._outbox: list[Any] = []
        self._templates: dict[tuple[Any, ...], Any] = {}  # normalised SamplingParams per sampling dict
        self._flush_handle: asyncio.Handle | None = None
        self._orig_batch: Any = None
        self._orig_abort: Any = None
        self.sent = 0  # requests sent to the scheduler, and in how many messages (tests and stats)
        self.messages = 0

    # -- hooks into the tokenizer manager ----------------------------------------------------------

    def install(self) -> None:
        tm, io = self._tm, self._io
        dispatcher = getattr(tm, "_result_dispatcher", None)
        mapping: Any = getattr(dispatcher, "_mapping", None)
        needed = {
            "TokenizerManager._handle_batch_output": hasattr(tm, "_handle_batch_output"),
            "TokenizerManager._dispatch_to_scheduler": hasattr(tm, "_dispatch_to_scheduler"),
            "TokenizerManager.rid_to_state": isinstance(getattr(tm, "rid_to_state", None), dict),
            "the AbortReq entry of TokenizerManager._result_dispatcher": isinstance(mapping, dict)
            and io.AbortReq in mapping,
            "io_struct.BatchTokenizedGenerateReqInput": hasattr(io, "BatchTokenizedGenerateReqInput"),
            "TokenizedGenerateReqInput.input_ids": "input_ids"
            in getattr(io.TokenizedGenerateReqInput, "__struct_fields__", ()),
            "a single tokenizer worker": getattr(tm, "server_args", None) is not None
            and tm.server_args.tokenizer_worker_num == 1,
        }
        missing = [name for name, ok in needed.items() if not ok]
        if missing:
            raise Unsupported(f"this SGLang lacks what the direct path relies on: {', '.join(missing)}")
        self._orig_batch = tm._handle_batch_output
        self._orig_abort = mapping[io.AbortReq]
        tm._handle_batch_output = self._on_batch_output
        mapping[io.AbortReq] = self._on_abort
        cache = getattr(dispatcher, "_mro_cache", None)
        if isinstance(cache, dict):
            cache.clear()

    def uninstall(self) -> None:
        if self._orig_batch is None:
            return
        tm = self._tm
        tm._handle_batch_output = self._orig_batch
        tm._result_dispatcher._mapping[self._io.AbortReq] = self._orig_abort
        self._orig_batch = self._orig_abort = None

    # -- requests ----------------------------------------------------------------------------------

    def submit(
        self,
        sid: str,
        input_ids: list[int],
        sampling: dict[str, Any],
        *,
        return_logprob: bool,
        return_routed_experts: bool = False,
        logprob_start_len: int = -1,
        extra_key: str | None = None,
    ) -> asyncio.Future[Done]:
        """Queue one request for the scheduler (sent at the end of this loop iteration, with every other
        request submitted in it).  ``extra_key``: its prefix-cache namespace (the weight version, control.py).
        Raises ValueError where SGLang's tokenizer manager would."""
        tm = self._tm
        n = len(input_ids)
        context = int(tm.context_len)
        reserved = int(getattr(tm, "num_reserved_tokens", 0) or 0)
        if n + reserved >= context:
            raise ValueError(
                f"The input ({n + reserved} tokens) is longer than the model's context length ({context} tokens)."
            )
        max_new = sampling.get("max_new_tokens")
        if max_new is not None and max_new + n + reserved > context:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {context} tokens. "
                f"You requested a total of {max_new + n + reserved} tokens: {n + reserved} tokens from the input "
                f"messages and {max_new} tokens for the completion."
            )
        custom = sampling.get("custom_params")
        if custom is not None:  # per request (a session's pin, pins.py): not part of the shared template
            sampling = {k: v for k, v in sampling.items() if k != "custom_params"}
        sp = self._sampling(sampling)
        if custom is not None:
            sp = msgspec.structs.replace(sp, custom_params=custom)
        obj = self._io.TokenizedGenerateReqInput(
            rid=sid,
            input_text=None,
            input_ids=array("q", input_ids),
            input_embeds=None,
            mm_inputs=None,
            token_type_ids=None,
            sampling_params=sp,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=0,
            token_ids_logprob=None,
            stream=False,
            return_routed_experts=return_routed_experts,
            extra_key=extra_key,
        )
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Done] = loop.create_future()
        self._reqs[sid] = _Req(future, return_logprob, logprob_start_len >= 0)
        future.add_done_callback(functools.partial(self._forget, sid))
        self._outbox.append(obj)
        if len(self._outbox) >= BATCH:
            self.flush()  # the scheduler starts on these while this loop builds the rest
        elif self._flush_handle is None:
            self._flush_handle = loop.call_soon(self._flush_soon)
        return future

    def _sampling(self, sampling: dict[str, Any]) -> Any:
        """SGLang's ``SamplingParams`` for ``sampling``, normalised and verified once per distinct dict (RL
        requests share a handful) and copied per request: the scheduler writes into it (max_new_tokens)."""
        key = tuple((k, tuple(v) if isinstance(v, list | set | tuple) else v) for k, v in sampling.items())
        template = self._templates.get(key)
        if template is None:
            tm = self._tm
            preferred = getattr(tm, "preferred_sampling_params", None)
            template = self._sampling_cls(**({**preferred, **sampling} if preferred else sampling))
            template.normalize(None)
            template.verify(tm.model_config.vocab_size)
            if len(self._templates) >= 256:
                self._templates.clear()
            self._templates[key] = template
        stops = template.stop_token_ids
        return msgspec.structs.replace(
            template,
            stop_token_ids=set(stops) if stops else stops,
            stop_strs=list(template.stop_strs or ()),
            stop_regex_strs=list(template.stop_regex_strs or ()),
        )

    def _flush_soon(self) -> None:
        self._flush_handle = None
        self.flush()

    def flush(self) -> None:
        """Send what was submitted: one message for the whole batch."""
        batch, self._outbox = self._outbox, []
        if not batch:
            return
        for obj in batch:
            obj.wrap_pickle_fields()
        msg = batch[0] if len(batch) == 1 else self._io.BatchTokenizedGenerateReqInput(batch=batch)
        self.sent += len(batch)
        self.messages += 1
        self._tm._dispatch_to_scheduler(msg)

    def abort(self, sid: str) -> None:
        """Ask the scheduler to end ``sid`` (its future resolves with the tokens so far, reason abort)."""
        if sid not in self._reqs:
            return
        if self._outbox:
            self.flush()  # the request must reach the scheduler before its abort
        self._tm._dispatch_to_scheduler(self._io.AbortReq(rid=sid))

    def owns(self, sid: str) -> bool:
        return sid in self._reqs

    def _forget(self, sid: str, future: asyncio.Future[Done]) -> None:
        req = self._reqs.get(sid)
        if req is not None and req.future is future:
            del self._reqs[sid]  # cancelled by its caller: a late output for it is dropped

    # -- outputs -----------------------------------------------------------------------------------

    async def _on_batch_output(self, recv: Any) -> None:
        reqs = self._reqs
        if not reqs or type(recv) is not self._io.BatchTokenIDOutput:
            await self._orig_batch(recv)
            return
        theirs = self._tm.rid_to_state
        foreign: list[int] = []
        finished = recv.finished_reasons
        out_ids = recv.output_ids
        out_lps = recv.output_token_logprobs_val
        in_lps = recv.input_token_logprobs_val
        routed = getattr(recv, "routed_experts", None)
        for i, rid in enumerate(recv.rids):
            req = reqs.get(rid)
            if req is None:
                if rid in theirs:
                    foreign.append(i)
                continue  # a request of ours that was cancelled meanwhile: nothing waits for it
            req.ids.extend(out_ids[i])
            if req.lps is not None and out_lps is not None:
                req.lps.extend(out_lps[i])
            if req.in_lps is not None and in_lps is not None:
                req.in_lps.extend(in_lps[i])
            if routed and routed[i] is not None:
                req.routed = routed[i]
            reason = finished[i]
            if reason is not None:
                del reqs[rid]
                if not req.future.done():
                    cached = recv.cached_tokens[i] if recv.cached_tokens else 0
                    req.future.set_result(
                        Done(
                            ids=req.ids,
                            logprobs=req.lps,
                            finish=reason,
                            prompt_logprobs=req.in_lps,
                            routed=req.routed,
                            cached_tokens=cached,
                        )
                    )
        if foreign:
            await self._orig_batch(recv if len(foreign) == len(recv.rids) else _subset(recv, foreign))

    def _on_abort(self, recv: Any) -> Any:
        req = self._reqs.pop(recv.rid, None) if recv.rid else None
        if req is None:
            return self._orig_abort(recv)
        if not req.future.done():
            reason = recv.finished_reason or {
                "type": "abort",
                "message": recv.abort_message or "Abort in waiting queue",
            }
            req.future.set_result(
                Done(ids=req.ids, logprobs=req.lps, finish=reason, prompt_logprobs=req.in_lps, routed=req.routed)
            )
        return None


def _subset(recv: Any, keep: list[int]) -> Any:
    """``recv`` with only the requests at ``keep``: every per-request list (and the pickled per-request
    time stats / customized info) cut to those indices."""
    from sglang.srt.managers.io_struct import unwrap_from_pickle  # optional: sglang

    n = len(recv.rids)

    def cut(v: Any) -> Any:
        if isinstance(v, list) and len(v) == n:
            return [v[i] for i in keep]
        if isinstance(v, dict):
            return {k: cut(x) for k, x in v.items()}
        return v

    changes: dict[str, Any] = {}
    for name in recv.__struct_fields__:
        v = getattr(recv, name)
        if name in ("time_stats", "customized_info"):
            v = unwrap_from_pickle(v)
        new = cut(v)
        if new is not v or name in ("time_stats", "customized_info"):
            changes[name] = new
    return msgspec.structs.replace(recv, **changes)
