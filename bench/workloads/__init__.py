"""What the benches send, one workload a module: the RL step's (bench/gpu_rlstep.py), the fixed ones of
bench/gpu_rl.py and bench/gpu_soak.py, load_balance.py's long-tailed batches, multiturn.py's scripted agent.

* :mod:`workloads.work` -- what a pass sends (:class:`Work`: requests, or agent sessions) and its
  accounting: :func:`summarize` (tokens, prefill computed against the ideal, per engine), :func:`load_cv`;
* :mod:`workloads.grpo` -- ``grpoPxG`` / ``grpoPxGfN`` and ``grpo``: prompts x samples, one group each;
* :mod:`workloads.batch` -- ``long`` and ``short``: requests on their own;
* :mod:`workloads.agent` -- ``agent``: sessions of turns with tool waits, and :func:`run_agent` to drive them;
* :mod:`workloads.update` -- ``update``: a GRPO pass with a weight-version change half way (:func:`mid_update`);
* :mod:`workloads.fixed` -- gpu_rl.py's and gpu_soak.py's (prompt, new tokens) lists from a fixed seed;
* :mod:`workloads.lengths` -- load_balance.py's and gpu_fleet.py's long-tailed batches (response lengths);
* :mod:`workloads.tool_agent` -- multiturn.py's tool-calling agent on a scripted model (its turns, its tool
  and the tool's clock, its questions, the check).

:func:`make_work` builds an RL-step workload by name, deterministic from (name, shape, salt).  A new one is
a module with a function ``(name, draw, *, quick, big, salt) -> Work`` and a line in :data:`NAMED`; gpu_rlstep.py's
``--plan`` then takes its name.
"""

from __future__ import annotations

from collections.abc import Callable

from workloads import agent, batch, grpo, update
from workloads.work import Draw, Item, Out, Work, inferred_group_prefills, load_cv, summarize

#: the workloads by exact name: ``(name, draw, *, quick, big, salt) -> Work`` (big: the 0.5B shape, not 7B;
#: salt: the pass's, which names its groups)
NAMED: dict[str, Callable[..., Work]] = {
    "grpo": grpo.mixed,
    "long": batch.long,
    "short": batch.short,
    "agent": agent.sessions,
}


def make_work(name: str, *, shape: str, quick: bool, vocab: int, salt: str, shape_salt: str | None = None) -> Work:
    """Deterministic from (name, shape, salt): the salt makes each pass's prompts fresh; ``shape_salt``, where
    given, draws the lengths, prompt sizes and waits apart (:class:`Draw`: passes of one salt, one shape).
    Names: ``grpoPxG``, ``grpoPxGfN`` (also after an ``update`` prefix), ``update`` and those in :data:`NAMED`."""
    shape_seed = None if shape_salt is None else f"{name}-{shape}-shape-{shape_salt}"
    draw = Draw(f"{name}-{shape}-{salt}", vocab, shape_seed=shape_seed)
    base = name.removeprefix("update")
    if base.startswith("grpo") and "x" in base:
        return grpo.sized(name, base, draw, quick=quick, salt=salt)
    if name == "update":
        w = make_work(update.BASE, shape=shape, quick=quick, vocab=vocab, salt=update.salt(salt), shape_salt=shape_salt)
        w.name = name
        return w
    if name not in NAMED:
        raise ValueError(f"unknown workload {name!r}")
    return NAMED[name](name, draw, quick=quick, big=shape != "7b", salt=salt)


__all__ = [
    "NAMED",
    "Draw",
    "Item",
    "Out",
    "Work",
    "inferred_group_prefills",
    "load_cv",
    "make_work",
    "summarize",
]
