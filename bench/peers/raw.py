"""Raw SGLang: ``async_generate`` on the engine an ``SglangEngine`` wraps, in this process.

Every request with temperature 1, ``ignore_eos`` and logprobs on, as the SDK's sides send them.  On the
fake engine (CPU dry runs) the same call is its ``generate``, with a session id where one is given (the
fake models SGLang's prefix cache of sessions: plain LRU for raw).
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple


class RawOut(NamedTuple):
    """What one raw request returned."""

    output_ids: list[int]
    #: how many output logprobs came back
    logprobs: int
    prompt_tokens: int
    #: prompt tokens taken from the prefix cache
    cached_tokens: int


#: ``generate(prompt ids, new tokens, session id or None)``
RawGenerate = Callable[[list[int], int, str | None], Awaitable[RawOut]]


def raw_generate(engine: Any, *, sglang: bool) -> RawGenerate:
    """The raw call on ``engine``: SGLang's ``async_generate`` (``sglang``: a real or stand-in SGLang under
    the ``SglangEngine``), else the engine's own ``generate`` (the fake)."""
    if sglang:
        raw = engine._engine

        async def one(prompt: list[int], n: int, sid: str | None = None) -> RawOut:
            sp = {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True}
            o = await raw.async_generate(input_ids=prompt, sampling_params=sp, return_logprob=True)
            meta = o["meta_info"]
            return RawOut(
                list(o["output_ids"]),
                len(meta.get("output_token_logprobs") or []),
                int(meta.get("prompt_tokens") or len(prompt)),
                int(meta.get("cached_tokens") or 0),
            )

        return one
    from rollout_sdk import GenerateRequest, SamplingParams

    seq = itertools.count()

    async def one_fake(prompt: list[int], n: int, sid: str | None = None) -> RawOut:
        r = await engine.generate(
            GenerateRequest(
                input_ids=prompt,
                rid=f"raw-{next(seq)}",
                session_id=sid,
                sampling=SamplingParams(max_new_tokens=n, ignore_eos=True),
            )
        )
        return RawOut(list(r.output_ids), len(r.logprobs or []), r.prompt_tokens, r.cached_tokens)

    return one_fake
