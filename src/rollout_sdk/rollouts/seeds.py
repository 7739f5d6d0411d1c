"""The one function that decides every seed a rollout sends.

A request's ``SamplingParams.seed`` is the seed of one *sample*: member 0 of its group, its first turn,
its first segment.  Everything else derives from it::

    sample_seed(seed, member=k, turn=t, segment=s)

* ``member`` — the k-th sample of a group (``generate_many(group_size=...)``, ``rollouts(group_size=...)``,
  ``rollout_group(group_size=...)``): every API gives member k the same seed, so member k is the same sample
  whichever API produced it, and the members of a group are different samples.
* ``turn`` — the t-th model call of one trajectory (an agent loop's turns).
* ``segment`` — the s-th resumption of one generation after an abort (partial rollouts,
  :class:`~rollout_sdk.rollouts.continuation.Continuation`): a resumed sample is not a replay.

Coordinates at 0 leave the seed unchanged (``sample_seed(7) == 7``); each non-zero one is mixed in, in
the order member → turn → segment, with a 64-bit finaliser (splitmix64), so the result is
reproducible, stays in ``[0, 2**63 - 1]`` (the protocol's range) and has no additive collisions
(seed 7 member 1 is not seed 8).  Deriving in steps gives the same seed as deriving at once::

    sample_seed(sample_seed(7, member=2, turn=1), segment=3) == sample_seed(7, member=2, turn=1, segment=3)

which is how a continuation re-derives the seed of a request that already carries its member and turn.
"""

from __future__ import annotations

__all__ = ["sample_seed"]

_MASK64 = (1 << 64) - 1
_MAX_SEED = (1 << 63) - 1
_TAGS = (("member", 1), ("turn", 2), ("segment", 3))


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_seed(seed: int | None, *, member: int = 0, turn: int = 0, segment: int = 0) -> int | None:
    """The seed of member ``member``, turn ``turn``, segment ``segment`` of a sample seeded ``seed``.

    ``None`` stays ``None`` (an unseeded request stays unseeded: the engine draws its own randomness).
    """
    coords = {"member": member, "turn": turn, "segment": segment}
    for name, value in coords.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if seed is None:
        return None
    out = seed
    for name, tag in _TAGS:
        value = coords[name]
        if value:
            out = _splitmix64(out ^ _splitmix64((tag << 56) ^ value)) & _MAX_SEED
    return out
