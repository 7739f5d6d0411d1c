"""What a trainer gets over HTTP: one :class:`SessionRecord` per session, schema-versioned.

``GET /v1/sessions/{id}/trajectory`` answers one record; ``GET /v1/trajectories/stream`` sends one per
finished session as they finish (NDJSON lines or SSE ``data:`` events).  A record holds the session's
trajectories exactly as :meth:`Gateway.trajectories` and the JSONL export give them (one per branch:
ids, loss mask, logprobs, weight versions, rewards, metadata, turns, lifecycles) and, per trajectory,
one :class:`TurnSlice` per turn (that turn's own output ids, logprobs, versions, the context before it
and its reward).  Decode with ``msgspec.json.decode(line, type=SessionRecord)``; the layout is
``schema_version`` :data:`SESSION_RECORD_VERSION` and follows msgspec's evolution rules (new fields get
defaults, so records written now keep loading).

Rewards: ``SessionRecord.reward`` (and every ``Trajectory.reward``) is the session's; ``Turn.reward`` /
``TurnSlice.reward`` a turn's own (``None`` where none was given).  The gateway never discounts: a
trainer that wants per-turn returns computes them, e.g. with :func:`discounted_returns`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from ..agents import Trajectory
from ..protocol.segments import append_segments, result_segments
from .sessions import Session

__all__ = [
    "SESSION_RECORD_VERSION",
    "ExportLease",
    "SessionRecord",
    "TurnSlice",
    "discounted_returns",
    "session_record",
]

#: bumped when a field of a record changes meaning or goes away
SESSION_RECORD_VERSION = 1


class TurnSlice(msgspec.Struct, kw_only=True):
    """One turn of one trajectory, cut out of the whole."""

    #: the turn's position on this trajectory's path (``Trajectory.turns[index]``)
    index: int
    #: the turn's index in the session's serving order: what ``{"turn": k}`` rewards address
    turn: int
    #: the id the agent got back for the call (``chatcmpl-...``, ``resp_...``, ``msg_...``)
    response_id: str
    #: tokens added before this turn (the whole prompt for the first; the template's glue after)
    context_ids: list[int]
    #: the model's own tokens of this turn (mask 1 in the trajectory) and their logprobs
    output_ids: list[int]
    logprobs: list[float]
    #: ``(version, n)`` runs over ``output_ids``
    weight_versions: list[tuple[int, int]]
    #: where ``output_ids`` start in ``Trajectory.ids`` (prompt + response)
    start: int
    reward: float | None = None
    #: ``(version, n)`` runs of the oldest weights of the KV each token was sampled from; empty: the same as
    #: ``weight_versions`` (unless an ``inflight="keep"`` update happened during the turn)
    kv_weight_versions: list[tuple[int, int]] = []


class SessionRecord(msgspec.Struct, kw_only=True):
    schema_version: int = SESSION_RECORD_VERSION
    session: str
    #: ``open``, ``finished`` or ``exported`` (its trajectories were taken: by trajectories(), the
    #: JSONL writer or a stream)
    state: str
    #: why it finished: ``finished`` (the API), ``idle``, ``closed`` (the gateway closed); "" while open
    end_reason: str = ""
    reward: float | None = None
    metadata: dict[str, Any] = {}
    trajectories: list[Trajectory] = []
    #: ``turns[k]``: the turns of ``trajectories[k]`` (empty when not asked for)
    turns: list[list[TurnSlice]] = []


def session_record(session: Session, *, per_turn: bool = True, state: str | None = None) -> SessionRecord:
    trajectories = session.trajectories()
    turns: list[list[TurnSlice]] = []
    if per_turn:
        for leaf in session.leaves():  # the order trajectories() uses
            slices, pos = [], 0
            for depth, node in enumerate(leaf.path()):
                pos += len(node.context_ids)
                result = node.result
                lps = list(result.logprobs) if result.logprobs is not None else [0.0] * len(result.output_ids)
                slices.append(
                    TurnSlice(
                        index=depth,
                        turn=node.uid,
                        response_id=node.response_id,
                        context_ids=list(node.context_ids),
                        output_ids=list(result.output_ids),
                        logprobs=lps,
                        weight_versions=append_segments([], result_segments(result)),
                        kv_weight_versions=list(result.kv_version_segments),
                        start=pos,
                        reward=node.reward,
                    )
                )
                pos += len(result.output_ids)
            turns.append(slices)
    return SessionRecord(
        session=session.id,
        state=state or session.state,
        end_reason=session.end_reason,
        reward=session.reward,
        metadata=dict(session.metadata),
        trajectories=trajectories,
        turns=turns,
    )


def discounted_returns(traj: Trajectory, gamma: float = 1.0) -> list[float]:
    """Per-turn returns of ``traj``: ``G_t = r_t + gamma * G_{t+1}``, where ``r_t`` is turn ``t``'s own
    reward (0 where none was given) and the session's reward (``traj.reward``) counts as the last turn's.

    Every model token of turn ``t`` then carries ``G_t`` (``gamma=1``: each turn's return is the sum of
    its own and every later reward).  This is the trainer's choice, not the gateway's: the gateway
    records rewards and never discounts.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma!r}")
    rewards = [t.reward or 0.0 for t in traj.turns]
    if rewards and traj.reward is not None:
        rewards[-1] += traj.reward
    out, g = [0.0] * len(rewards), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        g = rewards[t] + gamma * g
        out[t] = g
    return out


class ExportLease:
    """The records one export stream sent that wait for their acknowledgement; the stream takes a new
    session only while fewer than ``window`` wait (``room`` set): a consumer that reads but never
    acknowledges holds at most ``window`` sessions."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.records: dict[str, SessionRecord | None] = {}
        self.room = asyncio.Event()
        self.room.set()

    def add(self, sid: str, record: SessionRecord | None) -> None:
        self.records[sid] = record
        if len(self.records) >= self.window:
            self.room.clear()

    def remove(self, sid: str) -> SessionRecord | None:
        record = self.records.pop(sid, None)
        if len(self.records) < self.window:
            self.room.set()
        return record
