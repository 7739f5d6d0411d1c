"""The in-process scheduler: one coroutine per request, dispatched to a server chosen by policy.

Concurrency (everything on the client's event loop; no thread, no lock)::

    caller coroutine (one per request: the caller's own ``await client.generate(...)``)
      │
      ├─ acquire() ......... takes a slot on a live server now, or waits in the client:
      │                        waits on: its waiter event (FIFO queue, bounded by max_waiting;
      │                                  QueueFullError beyond it)
      │                        unblocked by: release() of any slot, a server coming back (one waiter
      │                                      woken), a server dying (all woken, to re-check or fail)
      │                        bound: each server's admission window (admission.py: the engine's
      │                               running limit plus a short queue, less when KV-bound, capped by
      │                               max_in_flight_per_server when set); the rest wait here
      ├─ submit ............ one non-blocking ZMQ send
      ├─ await result ...... waits on: the future the connection's reader completes
      │                        unblocked by: the reply, the server being marked dead (socket dropped,
      │                                      heartbeat missed, engine dead), or cancellation
      │                        on cancel / timeout: Abort(rid) goes to the server, the slot is freed
      │                        on server death: a *suspect* from then on, retried on another server
      │                                      at once (a fresh budget: the death uses none of ``retries``,
      │                                      unless retries=0), on probation there: at most one suspect
      │                                      *on probation* per server (see "Suspects" below); a suspect
      │                                      whose server dies while it is on probation there is
      │                                      PoisonRequestError, never retried, and so is one that met 3
      │                                      deaths
      │                        on busy: the server is held for a back-off; acquire again (waits, or
      │                                 goes elsewhere); no retry is used up
      └─ release() ......... frees the slot, wakes the first waiter

Held servers (paused, memory released, busy) take no new request: callers wait in acquire(), bounded by
their own timeout (none by default: until the fleet is resumed).  A rid is in flight at most once per
client: a second request with it fails with DuplicateRequestError and the first is untouched.

Placement: a request with a ``group_id`` (a GRPO group: generate_many, rollouts) goes where the group's
first member went while that server has room (``in_flight < window``): the group is placed whole, so its
server prefills the shared prompt once, and groups, not samples, are what the policy balances.  A member
that finds no room there goes where the policy says (its new server prefills the prompt once as well).
A request with a ``session_id`` goes back to the server that served the session before
(prefix cache) unless that server's load exceeds ``(1 + affinity_margin) * min_load + affinity_slack``
or it no longer takes work (dead, removed, waiting for weights); then the session moves to the server the
policy picks, once, and the move is counted (``sessions_moved``, and the prompt tokens whose cached prefix
stays behind, ``prefix_tokens_lost``).  Everything else goes where the policy says.

The server set changes at run time (``add`` / ``remove``): a request only ever sees the servers that take
work at the moment it is placed.

Suspects (issue 36).  Every request in flight on a server when it dies (its *cohort*) is a suspect: one of
them may have killed it.  A suspect is retried at once, with every other suspect, at the survivors' normal
windows, but on each server at most one suspect is *on probation*: sent there, and not yet *cleared* by
the server answering (with tokens) a request that was sent to it after the suspect.  To clear the
probation soon whatever other traffic there is, a 1-token *probe* request follows the suspect onto its
server as soon as anyone waits for a slot (a suspect retried alone costs the engine nothing more).  Once
cleared, the suspect keeps running there and the server takes the next suspect::

    server B:  s1 probe1 | s1 cleared -> s2 probe2 | s2 cleared -> s3 ...   (s1, s2, s3 all still decoding)

so a cohort of n suspects re-enters the survivors at about one suspect per server every two engine steps
(the answer that clears one comes at the end of the step that admitted it; the next one, sent then, is
admitted at the step after next), and then decodes concurrently, as fresh requests would.  A request that
some server already answered a later request after (``ServerConnection.answered_seq``: it went through an
engine step there, so it is not a poison of the kind below) is retried at once with no probation at all:
with steady traffic that is most of a dead server's requests.

Paced probation (issue 36, a server whose ``ServerInfo.paces_probation``: fake and CPU engines).  There the
two steps per suspect become one: a suspect is sent with ``probation=True`` and any number of them go to
such a server at once; its server hands them to the engine one at a time, the next as soon as the step
that admitted the previous one has ended, so it is admitted at the very next step, and sends ``Stepped``
for each (server.py, "Probation").  A ``Stepped`` suspect is cleared.  When such a server dies, the one
suspect on probation there is the first one sent there with no ``Stepped`` yet: the engine held no other
unstepped (earlier ones had stepped, their Stepped replies left before the death's replies on the same
socket; later ones had not reached the engine).  The others are retried (a second death, not a
conviction).  No probe is sent.  The order argument needs the ``Stepped`` of the previous suspect to reach
the client: an engine death the server reports (EngineDeadError) sends it first; a server *process* that
the poison kills outright within the microseconds between queueing that ``Stepped`` and its socket
writing it could lose it, and then the innocent before the poison is convicted and the poison dies a
third time elsewhere (3 engines; the same cap as outside the model below).

Why a poison request kills at most 2 engines and fails no innocent.  A *poison* request kills every engine
it touches, before that engine answers any request sent to it after the poison (it dies in the step that
admits it: a prefill crash, an out-of-vocabulary id, a sampler fault; engines admit in arrival order: the
fake and CPU engines, and SGLang's default ``fcfs`` policy).  (1) Its first engine A dies: death 1 for it
and every request in flight there.  (2) As a suspect it goes to a server B only when B holds no other
suspect on probation; B dies before it answers the probe that follows the poison, so the poison is still
on probation there: death 2, on probation: PoisonRequestError, never sent again.  2 engines.  (3) Every
other request in flight on B at its death was either a fresh request (its first death) or a suspect
already cleared (B held one suspect on probation, the poison), or one that never needed probation (it
had been cleared before): a second death while cleared is not a conviction, only a retry, and only a
third death fails it.  The poison itself is never cleared (every engine it reaches dies first), so it
never skips probation.  No innocent fails unless further independent crashes add up to its third death
(or catch it on probation at its second).

Outside that model (a request that kills its engine only after a later request was answered there, or an
engine that admits out of order), the rule ``deaths >= 3`` still convicts it: at most 3 engines; an
innocent that happened to be on probation where it killed the second or third is failed with it.  For
such a workload ``SchedulerConfig(clear_suspects="finished")`` keeps every suspect on probation until it
finishes (issue 25's rule: at most 2 engines and no innocent failed for any poison, but the cohort goes
through one suspect per server at a time: recovery time ~ in-flight / survivors x request time).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec

from ..errors import (
    ConfigError,
    DuplicateRequestError,
    EngineDeadError,
    MessageTooLargeError,
    NoServersError,
    PoisonRequestError,
    QueueFullError,
    ServerBusyError,
    ServerShuttingDownError,
    ServerUnavailableError,
    WeightVersionError,
)
from ..protocol import GenerateRequest, GenerateResult, Lifecycle, SamplingParams, encode
from ..protocol.checks import check_config_types
from .admission import AdmissionConfig
from .connection import ServerConnection
from .policies import Policy, make_policy

__all__ = ["Scheduler", "SchedulerConfig", "ServerHandle"]

#: what policies see
ServerHandle = ServerConnection

_RETRYABLE = (ServerUnavailableError, EngineDeadError, ServerShuttingDownError)
_DEATHS = (ServerUnavailableError, EngineDeadError)
#: GRPO groups whose server is remembered (least recently placed forgotten first): far more than are in
#: flight at once, since a group's members are placed within moments of each other
_MAX_GROUPS = 65_536


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Routing, back-pressure and affinity settings."""

    #: "least_load", "round_robin", or a Policy object
    policy: str | Policy = "least_load"
    #: ceiling on the requests one client keeps in flight on one server (None: the engine's capacity
    #: decides, see admission.py); more wait in the client
    max_in_flight_per_server: int | None = None
    #: how the window follows the engine's capacity (its ``ceiling`` is max_in_flight_per_server)
    admission: AdmissionConfig | None = None
    #: requests allowed to wait in the client for a slot; QueueFullError beyond
    max_waiting: int = 1_000_000
    #: a session stays on its server while that server's load <= (1 + margin) * min load + slack
    affinity_margin: float = 0.5
    #: requests a session's server may carry above the margin before the session moves
    affinity_slack: int = 8
    #: sessions remembered (least recently used forgotten first)
    max_sessions: int = 200_000
    #: place a GRPO group's members (a shared ``group_id``) on one server, so its prompt is prefilled once
    #: there; False: every request where the policy says
    place_groups: bool = True
    #: when a suspect leaves probation on its server (module docstring, "Suspects"): "answered" once the
    #: server answered a request sent after it (a probe follows it), "finished" only when it finishes
    clear_suspects: Literal["answered", "finished"] = "answered"

    def __post_init__(self) -> None:
        check_config_types(self)  # a mistyped value fails here, naming the field, not deep inside
        self.admission_config()  # validates the ceiling
        if self.max_waiting < 0:
            raise ConfigError("max_waiting", self.max_waiting, "must be >= 0")
        if self.affinity_margin < 0:
            raise ConfigError("affinity_margin", self.affinity_margin, "must be >= 0")
        if self.max_sessions < 1:
            raise ConfigError("max_sessions", self.max_sessions, "must be >= 1")
        if self.clear_suspects not in ("answered", "finished"):
            raise ConfigError("clear_suspects", self.clear_suspects, "must be 'answered' or 'finished'")

    def admission_config(self) -> AdmissionConfig:
        base = self.admission or AdmissionConfig()
        if self.max_in_flight_per_server is None:
            return base
        return dataclasses.replace(base, ceiling=self.max_in_flight_per_server)


def _new_enough(live: list[ServerConnection], want: int) -> list[ServerConnection]:
    """The live servers whose weights are at least version ``want``; none: the request is refused now."""
    ok = [s for s in live if s.reported_version >= want]
    if not ok:
        held = sorted({s.reported_version for s in live})
        raise WeightVersionError("min_weight_version", want, f"no live server holds it (they hold versions {held})")
    return ok


def _remember(lru: collections.OrderedDict[str, ServerConnection], key: str, conn: ServerConnection, most: int) -> None:
    """``key`` placed on ``conn``, most recent last; the least recently placed forgotten beyond ``most``."""
    lru[key] = conn
    lru.move_to_end(key)
    if len(lru) > most:
        lru.popitem(last=False)


class _Waiter:
    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = asyncio.Event()


class _Probation:
    """One suspect on probation on one server: cleared by an answer to a request sent there after it, or,
    on a server that paces probation, by its ``Stepped`` notice."""

    __slots__ = ("paced", "probe", "probe_rid", "rid", "seq", "stepped")

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.seq = -1  # send order of the suspect (set when sent)
        self.probe_rid = ""
        self.probe: asyncio.Future[GenerateResult] | None = None
        self.paced = False  # sent with probation=True to a server that paces probation
        self.stepped = False  # that server said it has been through an engine step


#: probe requests (module docstring, "Suspects"): the smallest request an engine answers with a token
_PROBE_SAMPLING = SamplingParams(max_new_tokens=1)


class Scheduler:
    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.policy = make_policy(self.config.policy)
        self.servers: list[ServerConnection] = []
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._sessions: collections.OrderedDict[str, ServerConnection] = collections.OrderedDict()
        self._groups: collections.OrderedDict[str, ServerConnection] = collections.OrderedDict()
        self.latencies: collections.deque[float] = collections.deque(maxlen=10_000)
        self.retried = 0
        #: called with every result (its ``lifecycle`` filled), e.g. by the client's metrics
        self.on_result: Callable[[GenerateResult], None] | None = None
        self.poisoned = 0
        self._rids: set[str] = set()  # rids in flight in this client
        #: the suspect on probation on each server (at most one each)
        self._probation: dict[ServerConnection, _Probation] = {}
        #: on servers that pace probation: the suspects sent there and not yet stepped, in send order
        self._paced: dict[ServerConnection, list[_Probation]] = {}
        self._send_seq = itertools.count()  # send order of every request of this client (all servers)
        self._probe_ids = itertools.count()
        self.probes_sent = 0
        self.suspects_cleared = 0
        #: most suspects sent and not yet finished at once on one server (how concurrent a recovery was)
        self.max_suspects_running = 0
        self._suspects_running: collections.Counter[ServerConnection] = collections.Counter()
        self.sessions_moved = 0
        self.prefix_tokens_lost = 0

    # -- server set --------------------------------------------------------------------------------

    def add(self, conn: ServerConnection) -> None:
        conn.on_stepped = self._stepped
        self.servers.append(conn)
        self.on_server_change(conn)

    def remove(self, conn: ServerConnection) -> None:
        """Forget a server (its sessions move at their next request)."""
        if conn in self.servers:
            self.servers.remove(conn)
        for w in self._waiters:  # re-check: it may have been the last one
            w.event.set()

    def on_server_change(self, conn: ServerConnection) -> None:
        """A server died or came back: let waiters re-check (and fail if nothing is left)."""
        if conn.alive:
            self._wake_next()
        else:
            for w in self._waiters:
                w.event.set()

    def window(self) -> int:
        """Requests the live servers admit from this client now, together (at least 1)."""
        return max(1, sum(s.window.limit for s in self.servers if s.accepting))

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    def live_servers(self) -> list[ServerConnection]:
        return [s for s in self.servers if s.accepting]

    # -- slots -------------------------------------------------------------------------------------

    async def acquire(
        self, req: GenerateRequest, exclude: Sequence[ServerConnection] = (), *, suspect: _Probation | None = None
    ) -> ServerConnection:
        """A slot on a live server; a ``suspect`` (in flight at a server's death) only on a server with no
        other suspect on probation: a death there while it is on probation names it alone."""
        if not self._waiters:
            conn = self._try_take(req, exclude, suspect)
            if conn is not None:
                return conn
        if len(self._waiters) >= self.config.max_waiting:
            raise QueueFullError(
                f"{len(self._waiters)} requests already wait for a slot (max_waiting={self.config.max_waiting})"
            )
        waiter = _Waiter()
        self._waiters.append(waiter)
        if len(self._waiters) == 1:
            waiter.event.set()  # first in line: look once more before sleeping
        try:
            while True:
                await waiter.event.wait()
                waiter.event.clear()
                if self._waiters and self._waiters[0] is not waiter:
                    # woken because a server died: only check that some server is still alive
                    if not self.live_servers():
                        raise NoServersError(self._no_servers_message())
                    continue
                conn = self._try_take(req, exclude, suspect)
                if conn is not None:
                    return conn
        finally:
            self._waiters.remove(waiter)
            self._wake_next()

    def _try_take(
        self, req: GenerateRequest, exclude: Sequence[ServerConnection], suspect: _Probation | None = None
    ) -> ServerConnection | None:
        live = [s for s in self.servers if s.accepting]
        if not live:
            raise NoServersError(self._no_servers_message())
        if req.min_weight_version is not None:
            live = _new_enough(live, req.min_weight_version)
        free = [s for s in live if s.in_flight < s.window.limit and not s.held]
        if suspect is not None:  # a server that paces probation takes any number (module docstring)
            held = [s for s in free if s in self._probation]
            free = [s for s in free if s not in self._probation or self._paces(s)]
            if not free:  # this suspect waits for a probation to end: have each one cleared soon
                for s in held:
                    self._send_probe(s, self._probation[s])
        if exclude:
            preferred = [s for s in free if s not in exclude]
            free = preferred or free
        if not free:
            return None
        conn = self._place(req, free)
        if suspect is not None and not self._paces(conn):
            self._probation[conn] = suspect
        conn.in_flight += 1
        conn.outstanding_tokens += len(req.input_ids) + req.sampling.max_new_tokens
        return conn

    def _place(self, req: GenerateRequest, free: list[ServerConnection]) -> ServerConnection:
        gid = req.group_id
        if gid is not None and self.config.place_groups:
            return self._place_group(gid, req, free)
        return self._place_session(req, free)

    def _place_session(self, req: GenerateRequest, free: list[ServerConnection]) -> ServerConnection:
        sid = req.session_id
        if sid is None:
            return self.policy.choose(free, req)
        sessions = self._sessions
        conn = sessions.get(sid)
        if conn is not None and conn in free:
            cfg = self.config
            floor = min(s.load for s in free)
            if conn.load <= (1.0 + cfg.affinity_margin) * floor + cfg.affinity_slack:
                sessions.move_to_end(sid)
                return conn
        chosen = self.policy.choose(free, req)
        if conn is not None and conn is not chosen:
            self.sessions_moved += 1
            self.prefix_tokens_lost += len(req.input_ids)
        _remember(sessions, sid, chosen, self.config.max_sessions)
        return chosen

    def _place_group(self, gid: str, req: GenerateRequest, free: list[ServerConnection]) -> ServerConnection:
        """A GRPO group's members follow its first one while that server has room (module docstring)."""
        conn = self._groups.get(gid)
        if conn is not None and conn in free:
            self._groups.move_to_end(gid)
            if req.session_id is not None:  # a member's later turns follow it there (its prefix cache)
                _remember(self._sessions, req.session_id, conn, self.config.max_sessions)
            return conn
        chosen = self._place_session(req, free)  # the first member: its session's server, or the policy's
        _remember(self._groups, gid, chosen, _MAX_GROUPS)
        return chosen

    def release(self, conn: ServerConnection, req: GenerateRequest, *, suspect: _Probation | None = None) -> None:
        if suspect is not None and suspect.paced:
            line = self._paced.get(conn)
            if line is not None and suspect in line:
                line.remove(suspect)
                if not line:
                    del self._paced[conn]
        elif suspect is not None:
            self._end_probation(conn, suspect)
        conn.in_flight -= 1
        if conn.in_flight == 0:
            conn.notify_idle()
        conn.outstanding_tokens -= len(req.input_ids) + req.sampling.max_new_tokens
        self._wake_next()

    # -- suspects on probation ---------------------------------------------------------------------

    def _paces(self, conn: ServerConnection) -> bool:
        """Suspects go to ``conn`` paced (any number at once, cleared by ``Stepped``): module docstring."""
        return conn.paces_probation and self.config.clear_suspects == "answered"

    def _on_probation(self, conn: ServerConnection, suspect: _Probation | None) -> bool:
        if suspect is None:
            return False
        if suspect.paced:  # the first not yet stepped there: the only one its engine held unstepped
            line = self._paced.get(conn)
            return line is not None and bool(line) and line[0] is suspect and not suspect.stepped
        return self._probation.get(conn) is suspect

    def _stepped(self, conn: ServerConnection, rid: str) -> None:
        """``conn`` says the probation request ``rid`` has been through an engine step: cleared."""
        line = self._paced.get(conn)
        if line is None:
            return
        for i, suspect in enumerate(line):
            if suspect.rid == rid:
                suspect.stepped = True
                del line[i]
                if not line:
                    del self._paced[conn]
                self.suspects_cleared += 1
                return

    def _end_probation(self, conn: ServerConnection, suspect: _Probation) -> None:
        if self._probation.get(conn) is suspect:
            del self._probation[conn]
            probe = suspect.probe
            if probe is not None and not probe.done():  # the suspect ended first: its probe is not needed
                conn.cancel(suspect.probe_rid)
                self._rids.discard(suspect.probe_rid)
            self._wake_next()

    def _answered(self, conn: ServerConnection, seq: int) -> None:
        """``conn`` answered, with tokens, the request it was sent as number ``seq``: a suspect on
        probation there that was sent before it is cleared."""
        conn.answered_seq = max(conn.answered_seq, seq)
        if self.config.clear_suspects != "answered":
            return
        suspect = self._probation.get(conn)
        if suspect is not None and 0 <= suspect.seq < seq:
            self.suspects_cleared += 1
            self._end_probation(conn, suspect)

    def _send_probe(self, conn: ServerConnection, suspect: _Probation) -> None:
        """A 1-token request behind the suspect: its answer clears the suspect (module docstring).  Sent only
        when someone waits (a suspect alone costs the engine nothing more), once per suspect."""
        if self.config.clear_suspects != "answered" or suspect.probe_rid or suspect.seq < 0:
            return
        rid = f"probe-{next(self._probe_ids)}-{suspect.rid}"[:200]
        if rid in self._rids:  # a caller's rid: no probe (other answers clear the suspect)
            return
        req = GenerateRequest(input_ids=[0], sampling=_PROBE_SAMPLING, rid=rid)
        try:
            fut = conn.submit(rid, encode(req))
        except (ServerUnavailableError, MessageTooLargeError):  # without it, other answers clear the suspect
            return
        seq = next(self._send_seq)
        suspect.probe_rid, suspect.probe = rid, fut
        self._rids.add(rid)  # in flight in this client: a caller's request with this rid is a duplicate
        self.probes_sent += 1

        def done(f: asyncio.Future[GenerateResult]) -> None:
            self._rids.discard(rid)
            if f.cancelled() or f.exception() is not None:
                return
            if f.result().finish_reason != "abort":
                self._answered(conn, seq)

        fut.add_done_callback(done)

    def _wake_next(self) -> None:
        if self._waiters:
            self._waiters[0].event.set()

    def forget_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def session_server(self, session_id: str) -> ServerConnection | None:
        return self._sessions.get(session_id)

    def _no_servers_message(self) -> str:
        if not self.servers:
            return "no servers configured"
        reasons = "; ".join(f"{s.address}: {_why_not(s)}" for s in self.servers)
        return f"no live server left ({reasons})"

    # -- one request -------------------------------------------------------------------------------

    async def run(self, req: GenerateRequest, payload: bytes, retries: int) -> GenerateResult:
        """Place, send and await one request, failing over to another server while retries remain.

        The result carries its :class:`~rollout_sdk.protocol.Lifecycle` (when it was queued, dispatched,
        answered; where; which servers failed it first)."""
        rid = req.rid
        if rid in self._rids:
            raise DuplicateRequestError("rid", rid, "a request with this rid is already in flight in this client")
        self._rids.add(rid)
        try:
            return await self._run(req, payload, retries)
        finally:
            self._rids.discard(rid)

    async def _run(self, req: GenerateRequest, payload: bytes, retries: int) -> GenerateResult:
        attempt = 0  # retries so far
        used = 0  # of them, those that count against ``retries`` (a death while serving it does not)
        deaths = 0  # servers that died while serving this request
        cleared = False  # a server answered a request sent after this one: it went through an engine step
        exclude: tuple[ServerConnection, ...] = ()
        queued_at = time.time()
        failed_over_from: list[str] = []
        while True:
            suspect = _Probation(req.rid) if deaths > 0 and not cleared else None
            conn = await self.acquire(req, exclude, suspect=suspect)
            dispatched_at = time.time()
            t0 = time.perf_counter()
            sent = False
            seq = -1
            try:
                paced = suspect is not None and self._paces(conn)
                fut = conn.submit(req.rid, encode(msgspec.structs.replace(req, probation=True)) if paced else payload)
                sent = True
                seq = next(self._send_seq)
                if suspect is not None:
                    suspect.seq = seq
                    if paced:  # its server hands it to the engine in its turn and says when it stepped
                        suspect.paced = True
                        self._paced.setdefault(conn, []).append(suspect)
                    elif self._waiters:  # others wait (suspects among them, maybe): clear this one soon
                        self._send_probe(conn, suspect)
                    self._suspects_running[conn] += 1
                    self.max_suspects_running = max(self.max_suspects_running, self._suspects_running[conn])
                try:
                    result = await fut
                except asyncio.CancelledError:
                    conn.cancel(req.rid)
                    raise
            except ServerBusyError:
                conn.on_busy()  # back-pressure: wait for a slot here or elsewhere
                continue
            except _RETRYABLE as exc:
                conn.errors += 1
                if isinstance(exc, _DEATHS):
                    if conn.alive:
                        conn.mark_dead(str(exc))
                    if sent:
                        deaths += 1
                        on_probation = self._on_probation(conn, suspect)
                        cleared = cleared or (
                            self.config.clear_suspects == "answered"
                            and (conn.answered_seq > seq or (suspect is not None and suspect.stepped))
                        )
                        if deaths >= 3 or (deaths >= 2 and on_probation):
                            self.poisoned += 1
                            why = "while it was on probation there" if on_probation else f"its death {deaths}"
                            raise PoisonRequestError(
                                f"request {req.rid}: server {conn.server_id} died while serving it ({why}), and so "
                                f"did the server it ran on before; not retried again ({exc})"
                            ) from exc
                if used >= retries:
                    raise
                if not (sent and isinstance(exc, _DEATHS)):  # a death's retry is bounded by the rule above
                    used += 1
                attempt += 1
                conn.failed_over += 1
                self.retried += 1
                failed_over_from.append(conn.server_id)
                exclude = (conn,)
                continue
            except asyncio.CancelledError:
                conn.aborted += 1
                raise
            except BaseException:
                conn.errors += 1
                raise
            finally:
                if suspect is not None and sent:
                    self._suspects_running[conn] -= 1
                    if self._suspects_running[conn] <= 0:
                        del self._suspects_running[conn]
                self.release(conn, req, suspect=suspect)
            if result.finish_reason != "abort":
                self._answered(conn, seq)
            dt = time.perf_counter() - t0
            conn.latencies.append(dt)
            self.latencies.append(dt)
            if result.finish_reason == "abort":
                conn.aborted += 1
            else:
                conn.completed += 1
            # the result was decoded from this request's reply and nobody else holds it: set it in place
            msgspec.structs.force_setattr(
                result, "lifecycle", _lifecycle(result, queued_at, dispatched_at, dt, attempt + 1, failed_over_from)
            )
            if self.on_result is not None:
                self.on_result(result)
            return result


def _lifecycle(
    result: GenerateResult,
    queued_at: float,
    dispatched_at: float,
    elapsed_s: float,
    attempts: int,
    failed_over_from: list[str],
) -> Lifecycle:
    """Client timestamps; the first token is placed from the server's durations (no clock mixing)."""
    finished_at = dispatched_at + elapsed_s  # one wall-clock read per request, durations from perf_counter
    t = result.timings
    first_token_at = None
    if t.ttft_s > 0 and result.output_ids:
        first_token_at = max(dispatched_at, finished_at - max(0.0, t.total_s - t.ttft_s))
    return Lifecycle(
        queued_at=queued_at,
        dispatched_at=dispatched_at,
        finished_at=finished_at,
        server_id=result.server_id,
        first_token_at=first_token_at,
        attempts=attempts,
        failed_over_from=failed_over_from,
    )


def _why_not(s: ServerConnection) -> str:
    if not s.alive:
        return s.dead_reason
    if s.removing:
        return "being removed"
    if not s.admitted:
        return s.admission or "not admitted"
    return "draining"
