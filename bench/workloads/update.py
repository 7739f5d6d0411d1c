"""``update``: a GRPO pass with a weight-version change half way through it.

The SDK's exact update path without the copy (pause with retract, version bump, resume); raw SGLang's
through its tokenizer manager (``pause_generation(retract)`` / ``continue_generation``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

#: the pass the update lands in
BASE = "grpo2048x8"


def salt(pass_salt: str) -> str:
    """The base pass's salt: its prompts differ from a plain ``grpo2048x8`` pass's."""
    return f"update-{pass_salt}"


async def mid_update(engines: Sequence[Any], *, after_s: float, raw_sglang: bool = False) -> dict[str, Any]:
    """After ``after_s`` (``--update-after-s``) every engine's weights "change": ``raw_sglang``, through SGLang's
    tokenizer manager; otherwise the SDK's own path through its engine.  ``{"at_s", "took_s"}``."""
    await asyncio.sleep(after_s)
    t0 = time.perf_counter()
    for eng in engines:
        if raw_sglang:
            from sglang.srt.managers.io_struct import ContinueGenerationReqInput, PauseGenerationReqInput

            await eng.tm.pause_generation(PauseGenerationReqInput(mode="retract"))
            await eng.tm.continue_generation(ContinueGenerationReqInput())
        else:
            await eng.pause("retract")
            await eng.set_weight_version(eng.weight_version + 1)
            await eng.resume()
    return {"at_s": after_s, "took_s": round(time.perf_counter() - t0, 3)}
