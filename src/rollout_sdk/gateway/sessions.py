"""Sessions: each rollout's token history as a tree of served turns, matched against what agents re-send.

A black-box agent re-sends its whole conversation on every call.  The session keeps every turn it served
as a :class:`Node`: the tokens added before the turn (the whole prompt for a first turn, the template's
glue for later ones), the engine's result (exact ids, logprobs, weight-version segments) and the
normalised conversation *after* the turn (its messages and the assistant reply as returned).  A request
is matched by hashing the prefixes of its normalised messages::

    key_0 = H(kind, tools)          key_i = H(key_{i-1}, canonical(messages[i-1]))

and looking the keys up from the longest down: the deepest node whose conversation is a prefix of the
request is the parent, and only the messages after it are rendered and tokenized (appended to the
parent's exact ids).  No match renders the conversation from scratch.  When an agent edits history (a
changed earlier reply, a dropped turn), the match stops before the edit, so the new turn becomes a
sibling of the old one: the session *branches*, and every root-to-leaf path comes out as its own
:class:`~rollout_sdk.agents.Trajectory`.  ``n > 1`` choices are siblings too.

Concurrency: every method runs on the gateway's event loop and none awaits, so a request's match and its
commit are each atomic; requests of one session may run concurrently (their turns become siblings).

Lifecycle of a session::

    OPEN ──finish(reward) / idle timeout──▶ FINISHED ──trajectories taken──▶ (removed; its id stays refused)

Bounds: ``max_sessions`` open-or-finished-untaken sessions (429 beyond: the trainer is not draining), at
most ``max_turns`` nodes per session, and a bounded memory of taken ids.

Auto sessions (opened by a model call with an unknown key) are *provisional* until they serve a turn:
a call that fails, or is cancelled, before its session served anything leaves nothing behind
(:meth:`SessionStore.call`), so junk keys cannot fill the store.  They may hold at most
``max_auto_sessions`` of the ``max_sessions``: the rest is the trainer's (``POST /v1/sessions``,
``Gateway.session()``), which a flood of keys can therefore never starve.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import re
import secrets
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..agents import Trajectory, TrajectoryBuilder, Turn
from ..agents.chat import message_images
from ..agents.parsers import ToolCall, ToolCallParser
from ..protocol import GenerateResult, Lifecycle
from .errors import GatewayError, bad_request
from .sampling import SessionSampling

__all__ = ["Node", "Session", "SessionStore", "extend_key", "prefix_keys"]

_SESSION_ID = re.compile(r"^[A-Za-z0-9._~-]{1,128}$")


def prefix_keys(base: str, items: Iterable[str]) -> list[str]:
    """``keys[i]``: the key of ``items[:i]`` under ``base`` (``keys[0]`` is the base's).  ``items`` may
    be a generator: each item is dropped once hashed (a long message is not held twice)."""
    keys = [hashlib.blake2b(base.encode(), digest_size=16).hexdigest()]
    for item in items:
        keys.append(extend_key(keys[-1], item))
    return keys


#: a long item is hashed this many characters at a time (its UTF-8 form is never built whole)
_HASH_PIECE = 1 << 20


def extend_key(key: str, item: str) -> str:
    """The key of a conversation ``key`` stands for, followed by ``item``: the hash of ``key``, a NUL and
    ``item`` in UTF-8, taken a piece at a time (no copy of ``item`` beyond a piece)."""
    h = hashlib.blake2b((key + "\x00").encode(), digest_size=16)
    for pos in range(0, len(item), _HASH_PIECE):
        h.update(item[pos : pos + _HASH_PIECE].encode())
    return h.hexdigest()


@dataclass(kw_only=True, slots=True, eq=False, repr=False)
class Node:
    """One served turn (one choice of one request)."""

    uid: int
    parent: Node | None
    context_ids: list[int]
    result: GenerateResult
    #: the model's decoded text (for the template's end of turn) or, for completions, prompt + text
    text: str
    key: str
    #: the normalised conversation after this turn (chat); empty for completions
    messages: list[dict[str, Any]]
    turn: Turn
    #: one per engine call this turn took (several when a paused generation was continued)
    lifecycles: Sequence[Lifecycle] = ()
    #: the id the agent got for the call that served this turn (``chatcmpl-...``, ``resp_...``, ``msg_...``)
    response_id: str = ""
    #: this turn's own reward (per-turn rewards), None if none was given
    reward: float | None = field(default=None, init=False)
    children: int = field(default=0, init=False)
    depth: int = field(init=False)
    num_ids: int = field(init=False)

    def __post_init__(self) -> None:
        self.lifecycles = list(self.lifecycles)
        self.depth = 0 if self.parent is None else self.parent.depth + 1
        base = 0 if self.parent is None else self.parent.num_ids
        self.num_ids = base + len(self.context_ids) + len(self.result.output_ids)

    def ids(self) -> list[int]:
        """Every token of this path, up to and including this turn's output."""
        out: list[int] = []
        for n in self.path():
            out.extend(n.context_ids)
            out.extend(n.result.output_ids)
        return out

    def path(self) -> list[Node]:
        chain = []
        node: Node | None = self
        while node is not None:
            chain.append(node)
            node = node.parent
        return chain[::-1]


@dataclass(frozen=True, kw_only=True)
class SessionStats:
    id: str
    state: str
    turns: int
    branches: int
    in_flight: int
    reward: float | None
    metadata: dict[str, Any]


class Session:
    """One rollout's conversation tree.  Created by :class:`SessionStore`."""

    def __init__(
        self,
        sid: str,
        *,
        max_turns: int,
        metadata: dict[str, Any] | None = None,
        sampling: SessionSampling | None = None,
        auto: bool = False,
    ) -> None:
        self.id = sid
        #: opened by a model call with an unknown key (not by the trainer)
        self.auto = auto
        #: model calls of this session being handled now (from before validation to the answer)
        self.calls = 0
        self.metadata = dict(metadata or {})
        #: the trainer's sampling for this session (fixed fields and limits the agent cannot exceed)
        self.sampling = sampling
        self.max_turns = max_turns
        self.state = "open"
        self.reward: float | None = None
        self.end_reason = ""
        self.nodes: list[Node] = []
        self._by_key: dict[str, Node] = {}
        self.in_flight = 0
        #: a turn's glue was rendered locally because the template rewrites earlier turns
        self.template_rewrites = False
        self.last_used = time.monotonic()
        self.finished = asyncio.Event()
        self._next_call = 0

    # -- matching ----------------------------------------------------------------------------------

    def match(self, keys: Sequence[str]) -> tuple[Node | None, int]:
        """The deepest served turn whose conversation is ``items[:i]`` for the largest ``i``; ``(None, 0)``."""
        for i in range(len(keys) - 1, 0, -1):
            node = self._by_key.get(keys[i])
            if node is not None:
                return node, i
        return None, 0

    def match_ids(self, prompt: Sequence[int]) -> Node | None:
        """The deepest served turn whose whole token path is a prefix of ``prompt`` (token-id prompts)."""
        best: Node | None = None
        for node in self.nodes:
            if node.num_ids <= len(prompt) and (best is None or node.num_ids > best.num_ids):
                ids = node.ids()
                if list(prompt[: len(ids)]) == ids:
                    best = node
        return best

    def match_text(self, prompt: str) -> Node | None:
        """The deepest completion turn whose prompt + returned text is a prefix of ``prompt``."""
        best: Node | None = None
        for node in self.nodes:
            if not node.messages and prompt.startswith(node.text) and (best is None or len(node.text) > len(best.text)):
                best = node
        return best

    # -- bookkeeping -------------------------------------------------------------------------------

    def check_open(self) -> None:
        if self.state != "open":
            raise GatewayError(409, f"session {self.id!r} is finished", code="session_finished")

    def new_call_ids(self, calls: Sequence[ToolCall], parser: ToolCallParser | None) -> list[str]:
        """The ids the client gets for one turn's calls.  An id the model wrote (Kimi-K2's
        ``functions.f:IDX``, Mistral's ``"id"``) is kept as written: the format's template writes it back
        into the conversation, so any other id would replay other tokens than the model's.  Otherwise the
        format's required form counting the session's calls (Mistral's ``call00003``: its templates refuse
        other ids), or ``call_<session>_<n>``.  Generated ids never repeat in a session (Mistral's wrap
        after 100,000 calls)."""
        required = getattr(parser, "required_id", None)
        ids = []
        for call in calls:
            if call.id_in_text and call.id:
                ids.append(call.id)
                continue
            n, self._next_call = self._next_call, self._next_call + 1
            form = required(n) if required is not None else None
            ids.append(form if isinstance(form, str) and form else f"call_{self.id[:12]}_{n}")
        return ids

    def add(self, node: Node) -> None:
        """Record a served turn (atomic: no await)."""
        if len(self.nodes) >= self.max_turns:
            raise GatewayError(
                400, f"session {self.id!r} reached its limit of {self.max_turns} turns", code="too_many_turns"
            )
        self.nodes.append(node)
        if node.parent is not None:
            node.parent.children += 1
        self._by_key[node.key] = node

    def response_node(self, response_id: str, choice: int = 0) -> Node:
        """The turn served as choice ``choice`` of the call answered with ``response_id`` (400 if none)."""
        found = [n for n in self.nodes if n.response_id == response_id]
        if not 0 <= choice < len(found):
            raise bad_request(
                "response_id", f"session {self.id!r} served no response {response_id!r} (choice {choice})", "not_found"
            )
        return found[choice]

    def set_turn_reward(self, value: float, *, turn: int | None = None, response_id: str | None = None) -> Node:
        """Give one served turn its reward: by ``turn`` (its index in serving order) or by ``response_id``."""
        if (turn is None) == (response_id is None):
            raise bad_request("turn", "give a turn reward either a 'turn' index or a 'response_id'")
        if turn is not None:
            if not 0 <= turn < len(self.nodes):
                raise bad_request("turn", f"session {self.id!r} has turns 0..{len(self.nodes) - 1}, not {turn}")
            node = self.nodes[turn]
        else:
            assert response_id is not None
            node = self.response_node(response_id)
        node.reward = value
        return node

    @property
    def num_turns(self) -> int:
        return len(self.nodes)

    def leaves(self) -> list[Node]:
        return [n for n in self.nodes if n.children == 0]

    def stats(self) -> SessionStats:
        return SessionStats(
            id=self.id,
            state=self.state,
            turns=len(self.nodes),
            branches=len(self.leaves()),
            in_flight=self.in_flight,
            reward=self.reward,
            metadata=self.metadata,
        )

    def trajectories(self) -> list[Trajectory]:
        """One trajectory per root-to-leaf path (one per branch), in the order their last turns were served."""
        leaves = self.leaves()
        out = []
        for k, leaf in enumerate(leaves):
            path = leaf.path()
            traj_id = self.id if len(leaves) == 1 else f"{self.id}.b{k}"
            builder = TrajectoryBuilder(list(path[0].context_ids), traj_id, images=message_images(leaf.messages))
            for depth, node in enumerate(path):
                if depth:
                    builder.add_context(list(node.context_ids))
                # like ToolAgent: a turn's context_tokens are the tokens added *after* it (its glue)
                after = len(path[depth + 1].context_ids) if depth + 1 < len(path) else 0
                builder.turns.append(_copy_turn(node.turn, depth, after, node.reward))
                builder.add_model(node.result)
            traj = builder.build(
                leaf.result.finish_reason,
                messages=list(leaf.messages),
                reward=self.reward,
                template_rewrites=self.template_rewrites,
                metadata=dict(self.metadata),
                lifecycles=[lc for node in path for lc in node.lifecycles],
            )
            traj.metrics.update(
                branch=float(k),
                branches=float(len(leaves)),
                shared_prefix_turns=float(_shared_turns(leaf, leaves)),
                idle_finished=1.0 if self.end_reason == "idle" else 0.0,
            )
            out.append(traj)
        return out


def _copy_turn(turn: Turn, index: int, context_tokens: int, reward: float | None) -> Turn:
    return Turn(
        index=index,
        model_tokens=turn.model_tokens,
        finish_reason=turn.finish_reason,
        weight_version=turn.weight_version,
        generate_s=turn.generate_s,
        context_tokens=context_tokens,
        tool_calls=list(turn.tool_calls),
        parse_errors=list(turn.parse_errors),
        reward=reward,
    )


def _shared_turns(leaf: Node, leaves: list[Node]) -> int:
    """How many of this path's turns also lie on an earlier branch's path (trained twice if both are used)."""
    mine = {id(n) for n in leaf.path()}
    shared = 0
    for other in leaves:
        if other is leaf:
            break
        shared = max(shared, sum(1 for n in other.path() if id(n) in mine))
    return shared


class SessionStore:
    """The gateway's sessions, bounded.  Finished sessions wait in :attr:`finished` for the trainer."""

    def __init__(
        self, *, max_sessions: int, max_turns: int, max_auto_sessions: int | None = None, remember_ids: int = 100_000
    ) -> None:
        self.max_sessions = max_sessions
        #: room auto sessions may take (the rest is kept for sessions the trainer opens)
        self.max_auto_sessions = max_sessions if max_auto_sessions is None else min(max_auto_sessions, max_sessions)
        self.num_auto = 0
        self.max_turns = max_turns
        self.sessions: dict[str, Session] = {}
        self._taken: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._remember = remember_ids
        # unbounded, yet at most max_sessions live entries (a session is queued once at a time); an entry
        # acknowledged while it waited again is skipped by the consumer
        self.finished: asyncio.Queue[Session] = asyncio.Queue()

    def create(
        self,
        sid: str | None = None,
        metadata: dict[str, Any] | None = None,
        sampling: SessionSampling | None = None,
        *,
        auto: bool = False,
    ) -> Session:
        sid = sid or secrets.token_urlsafe(18)
        if not _SESSION_ID.match(sid) or sid in (".", ".."):
            # "." and ".." are dot segments: no /v1/sessions/{id}/... path can address them
            raise GatewayError(
                400,
                f"a session id is 1-128 characters of [A-Za-z0-9._~-], not '.' or '..'; got {sid[:140]!r}",
                param="session",
                code="bad_session",
            )
        if sid in self.sessions or sid in self._taken:
            raise GatewayError(409, f"session {sid!r} already exists", param="session", code="session_exists")
        if len(self.sessions) >= self.max_sessions:
            raise GatewayError(
                429,
                f"{len(self.sessions)} sessions are open or finished but not yet collected (max_sessions="
                f"{self.max_sessions}): finish sessions and take their trajectories",
                type="rate_limit_error",
                code="too_many_sessions",
            )
        if auto and self.num_auto >= self.max_auto_sessions:
            raise GatewayError(
                429,
                f"{self.num_auto} sessions opened by unknown keys are open or not yet collected (max_auto_sessions="
                f"{self.max_auto_sessions}; the rest of max_sessions is kept for sessions the trainer opens)",
                type="rate_limit_error",
                code="too_many_auto_sessions",
            )
        session = Session(sid, max_turns=self.max_turns, metadata=metadata, sampling=sampling, auto=auto)
        self.sessions[sid] = session
        self.num_auto += auto
        return session

    def get(self, sid: str, *, create: bool) -> Session:
        session = self.sessions.get(sid)
        if session is not None:
            return session
        if sid in self._taken:
            raise GatewayError(409, f"session {sid!r} is finished", code="session_finished")
        if not create:
            raise GatewayError(404, f"no session {sid!r}", param="session", code="session_not_found")
        return self.create(sid, auto=True)

    @contextlib.contextmanager
    def call(self, sid: str, *, create: bool) -> Iterator[Session]:
        """The session of one model call, for the call's whole handling: an auto session that has served
        no turn when its last call ends (failed, refused, cancelled) is forgotten, as if never opened."""
        session = self.get(sid, create=create)
        session.calls += 1
        try:
            yield session
        finally:
            session.calls -= 1
            if session.auto and session.calls == 0 and not session.nodes and session.state == "open":
                self._forget(session)

    def _forget(self, session: Session) -> None:
        if self.sessions.get(session.id) is session:
            del self.sessions[session.id]
            self.num_auto -= session.auto

    def finish(self, session: Session, *, reward: float | None = None, reason: str = "finished") -> bool:
        """Mark finished and queue it for the trainer.  False if it was already finished (idempotent)."""
        if reward is not None:
            session.reward = reward
        if session.state != "open":
            return False
        session.state = "finished"
        session.end_reason = reason
        session.finished.set()
        self.finished.put_nowait(session)
        return True

    def requeue(self, session: Session) -> None:
        """A consumer could not deliver a finished session (or it was never acknowledged): it goes back in
        the queue."""
        self.finished.put_nowait(session)

    def taken(self, session: Session) -> None:
        """The trainer has the session's trajectories: forget it, keep refusing its id."""
        self._forget(session)
        session.state = "exported"
        self._taken[session.id] = None
        while len(self._taken) > self._remember:
            self._taken.popitem(last=False)

    def was_taken(self, sid: str) -> bool:
        return sid in self._taken

    def idle(self, now: float, timeout_s: float) -> list[Session]:
        return [
            s
            for s in self.sessions.values()
            if s.state == "open" and s.in_flight == 0 and now - s.last_used > timeout_s
        ]
