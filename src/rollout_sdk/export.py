"""Trajectory export: JSONL, one :class:`~rollout_sdk.agents.Trajectory` per line, and its loader.

Each line is the trajectory as JSON (msgspec): ids (``prompt_ids`` + ``response_ids``), ``loss_mask``,
``logprobs``, version segments (``weight_versions``), ``reward``, ``metadata`` (the caller's), ``metrics``,
``turns`` and tool calls, ``messages``, the lifecycle of each engine call (``lifecycles``: queued,
dispatched, first token, finished, server, retries, failovers) and, for MoE routing replay,
``routed_experts`` (int16 bytes, base64 in JSON) and ``schema_version`` (the layout's version).  Every
field is written, defaults included.  The schema follows the structs' evolution rules (new fields get
defaults), so files written now keep loading, and lines written before ``schema_version`` existed load
as version 1 (the same layout).

    write_jsonl(batch.trajectories, "rollouts.jsonl", append=True)     # from a training loop
    for traj in iter_jsonl("rollouts.jsonl"): ...                      # later, for analysis or replay

Writing is blocking file I/O: from async code call it through ``asyncio.to_thread``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from typing import IO, Any

import msgspec

from .errors import RolloutError
from .protocol import GenerateResult
from .protocol.segments import result_segments
from .rollouts.trajectory import Trajectory

__all__ = ["ExportError", "iter_jsonl", "read_jsonl", "trajectory_from_result", "write_jsonl"]

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Trajectory)


class ExportError(RolloutError, ValueError):
    """A trajectory that cannot be written faithfully, or a line that is not a trajectory."""


def trajectory_from_result(
    prompt_ids: list[int],
    result: GenerateResult,
    *,
    id: str | None = None,
    reward: float | None = None,
    metadata: dict[str, Any] | None = None,
    sample_index: int = -1,
) -> Trajectory:
    """One single-turn trajectory from a prompt and its :class:`GenerateResult` (every output token is
    a model token: mask 1, the engine's logprobs)."""
    n = len(result.output_ids)
    segments = result_segments(result)
    return Trajectory(
        id=id or result.rid,
        prompt_ids=list(prompt_ids),
        response_ids=list(result.output_ids),
        loss_mask=[1] * n,
        logprobs=list(result.logprobs) if result.logprobs is not None else [0.0] * n,
        finish_reason=result.finish_reason,
        weight_versions=segments,
        kv_weight_versions=list(result.kv_version_segments),
        reward=reward,
        metadata=dict(metadata or {}),
        metrics={"model_tokens": float(n)},
        sample_index=sample_index,
        lifecycles=[result.lifecycle] if result.lifecycle is not None else [],
        routed_experts=[result.routed_experts] if result.routed_experts is not None else [],
    )


def _check(traj: Trajectory) -> None:
    n = len(traj.response_ids)
    if len(traj.loss_mask) != n or len(traj.logprobs) != n:
        raise ExportError(
            f"trajectory {traj.id!r}: response_ids ({n}), loss_mask ({len(traj.loss_mask)}) and logprobs "
            f"({len(traj.logprobs)}) must have the same length"
        )
    for i, lp in enumerate(traj.logprobs):
        if not math.isfinite(lp):  # JSON has no inf/NaN: it would come back as null and not load
            raise ExportError(f"trajectory {traj.id!r}: logprobs[{i}] is {lp!r}; only finite logprobs export")
    if traj.reward is not None and not math.isfinite(traj.reward):
        raise ExportError(f"trajectory {traj.id!r}: reward is {traj.reward!r}; only finite rewards export")


def write_jsonl(
    trajectories: Iterable[Trajectory], path: str | os.PathLike[str] | IO[bytes], *, append: bool = False
) -> int:
    """Write ``trajectories`` one per line to ``path`` (or a binary file object); returns how many.

    Every trajectory is checked first (aligned lengths, finite logprobs and reward) and a bad one raises
    :class:`ExportError` naming it, before anything of it is written.  ``append`` adds to an existing file.
    """
    if hasattr(path, "write"):
        return _write(trajectories, path)  # type: ignore[arg-type]
    with open(path, "ab" if append else "wb") as f:  # type: ignore[arg-type]
        return _write(trajectories, f)


def _write(trajectories: Iterable[Trajectory], f: IO[bytes]) -> int:
    n = 0
    buf = bytearray()
    for traj in trajectories:
        _check(traj)
        _encoder.encode_into(traj, buf, len(buf))
        buf += b"\n"
        n += 1
        if len(buf) > 1 << 20:
            f.write(buf)
            buf.clear()
    f.write(buf)
    return n


def iter_jsonl(path: str | os.PathLike[str]) -> Iterator[Trajectory]:
    """Yield the trajectories of a JSONL export, in order.  A bad line raises :class:`ExportError` with
    its line number; blank lines are skipped."""
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield _decoder.decode(line)
            except msgspec.MsgspecError as exc:
                raise ExportError(f"{os.fspath(path)}:{lineno}: not a trajectory: {exc}") from exc


def read_jsonl(path: str | os.PathLike[str]) -> list[Trajectory]:
    """Every trajectory of a JSONL export."""
    return list(iter_jsonl(path))
