"""Where the time of one request goes on the server's event loop (CPU): a per-stage profile and req/s.

Why: on a GPU the server runs the engine's front end (SGLang's tokenizer manager) on its own event loop, so
every microsecond of the server's own per-request work is taken from the engine (issue 31).  This bench
measures that work, stage by stage, with a stand-in engine whose per-request CPU cost takes the place of
the front end's.

What runs
---------
Three processes, as on a GPU node: this driver; a **server** (this script with ``--serve``: an
``EngineServer`` on uvloop around the engine ``--engine`` names); and per cell a **client** (this script
with ``--client``): ``--clients`` DEALER connections (1, 4, 16) in one process, each keeping its share of
``--in-flight`` requests in flight (RL rollouts: thousands of short requests), resending a request as soon
as its reply arrives.  The client sends pre-encoded frames and reads only each reply's type and rid, so it
costs a few microseconds a request and the server's loop is the bottleneck.

The engine (``ENGINES``: a name -> a function that builds it; the seam for an ``sglang-standin``):

* ``fake`` (default): the batched :class:`~rollout_sdk.engines.fake.FakeEngine` (1 ms steps, as results
  come from a GPU batch by batch) with ``request_cost_s = --engine-cost-us``: CPU burnt on the loop per
  request, standing in for the tokenizer manager's Python.  Default 150 us: SGLang's tokenizer manager costs
  roughly 100-300 us of Python per request on its loop (issue 31); 150 us is the low middle of that.  With
  ``--engine-cost-us 0`` the table is the server alone.

The profile is measured, not estimated: in the server process this script wraps the server's own stage
functions and its socket's calls with a timer (nothing in src/ is timed when this bench is not running):

=========  ===========================================================================================
receive    the ROUTER socket's ``recv_multipart`` calls (the final ``zmq.Again`` of a batch included)
decode     ``decode_client_message`` (msgspec, with the protocol's validation)
dispatch   ``EngineServer._handle`` less what it calls below: admission, checks, the request's task
submit     the request's task, from its first step until it calls ``engine.generate``
result     from ``engine.generate`` returning until the task ends: translation, bookkeeping (less encode/send)
encode     ``encode`` of the replies (msgspec)
send       the ROUTER socket's ``send`` calls
gc         the garbage collector (``gc.callbacks``; subtracted from the stage it interrupted)
engine     the engine's own work on the loop: the stand-in cost, and (fake) making tokens and results
other      the loop thread's CPU time less all of the above: the event loop itself (callbacks, task
           switches, timers), the recv loop's own lines, and the engine's untimed lines
=========  ===========================================================================================

Each stage is microseconds of the loop thread's CPU time per completed request over the measured window
(the timer's own cost, calibrated at start, is taken out).  ``cpu/req`` is the loop thread's CPU per
request; ``req/s`` is what the client counted.

Run::

    python bench/request_path.py --quick                 # < 1 minute
    python bench/request_path.py                         # medians of 5 repetitions
    python bench/request_path.py --engine-cost-us 0      # the server alone
    python bench/request_path.py --gc-threshold none     # the collector at CPython's default (700)

Numbers go to ``--json`` (default ``bench/results/request_path.json``); the table is printed last.  Every
process this script starts is stopped at the end, also on Ctrl-C, SIGTERM or an error.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import harness
from harness import ServerProcs, log

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("receive", "decode", "dispatch", "submit", "result", "encode", "send", "engine", "gc")


# -- the engines ------------------------------------------------------------------------------------------


def _fake_engine(args: argparse.Namespace, clock: StageClock) -> Any:
    import collections

    from rollout_sdk.engines import fake

    engine = fake.FakeEngine(
        fake.FakeEngineConfig(step_base_s=0.001, max_batch=1 << 16, request_cost_s=args.engine_cost_us * 1e-6)
    )
    engine.requests_seen = collections.deque(maxlen=0)  # no test history: it would add garbage of its own
    # the engine's own work on the loop: the stand-in cost, and the fake's tokens and results
    fake._burn = _timed(clock, "engine", fake._burn)
    for name in ("_target", "_emit", "_finish"):
        setattr(engine, name, _timed(clock, "engine", getattr(engine, name)))
    return engine


#: ``--engine`` choices: a function of the parsed arguments and the stage clock that builds the engine (in
#: the server process) and times its own work on the loop as the ``engine`` stage
ENGINES: dict[str, Callable[[argparse.Namespace, StageClock], Any]] = {"fake": _fake_engine}


# -- the stage timer (server process) ---------------------------------------------------------------------


class StageClock:
    """Exclusive CPU time of the loop thread per stage: entering a stage pauses the one it was entered from
    (a stack).  Stages are entered and left only between awaits, so the stack is empty whenever the loop
    runs something else.  Thread CPU time, not wall time: on a shared machine the OS takes the core away
    at any moment (a send that wakes ZMQ's I/O thread, say), and that is not the server's work.

    The clock's own reads cost CPU (a system call here): :meth:`calibrate` measures what one empty stage
    and one read cost, and :meth:`corrected` takes them out."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.entries = dict.fromkeys(STAGES, 0)
        self.reads = 0
        self.stack: list[str] = []
        self.mark = 0.0
        self.done = 0
        self.gc_runs = [0, 0, 0]
        self._gc_t0 = 0.0
        self.empty_stage_s = 0.0
        self.read_s = 0.0

    def push(self, stage: str) -> None:
        now = _clock()
        if self.stack:
            self.seconds[self.stack[-1]] += now - self.mark
        self.stack.append(stage)
        self.entries[stage] += 1
        self.reads += 1
        self.mark = now

    def pop(self) -> None:
        now = _clock()
        if self.stack:
            self.seconds[self.stack.pop()] += now - self.mark
        self.reads += 1
        self.mark = now

    def pop_all(self) -> None:
        while self.stack:
            self.pop()

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        now = _clock()
        self.reads += 1
        if phase == "start":
            self._gc_t0 = now
            return
        dt = now - self._gc_t0
        self.seconds["gc"] += dt
        self.mark += dt  # not the interrupted stage's time
        self.gc_runs[info["generation"]] += 1

    def reset(self) -> None:
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.entries = dict.fromkeys(STAGES, 0)
        self.reads = 0
        self.done = 0
        self.gc_runs = [0, 0, 0]

    def calibrate(self, n: int = 20_000) -> None:
        gc.disable()
        try:
            self.reset()
            for _ in range(n):
                self.push("decode")
                self.pop()
            self.empty_stage_s = self.seconds["decode"] / n
            t0 = _clock()
            for _ in range(n):
                _clock()
            self.read_s = (_clock() - t0) / n
        finally:
            gc.enable()
            self.reset()

    def corrected(self) -> dict[str, float]:
        """Seconds per stage less the clock's own cost inside each entry."""
        return {k: max(0.0, v - self.entries[k] * self.empty_stage_s) for k, v in self.seconds.items()}


_clock = time.thread_time


class _TimedSocket:
    """The server's ROUTER socket with its receive and send calls timed; everything else passed through."""

    def __init__(self, sock: Any, clock: StageClock) -> None:
        self._sock = sock
        self.recv_multipart = _timed(clock, "receive", sock.recv_multipart)
        self.send = _timed(clock, "send", sock.send)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def _timed(clock: StageClock, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        clock.push(stage)
        try:
            return fn(*args, **kwargs)
        finally:
            clock.pop()

    return wrapper


def instrument(server: Any, engine: Any, clock: StageClock) -> Callable[[], None]:
    """Wrap the server's stage functions with ``clock``; returns what to call once the socket is bound."""
    from rollout_sdk.server import server as server_mod

    server_mod.decode_client_message = _timed(clock, "decode", server_mod.decode_client_message)
    server_mod.encode = _timed(clock, "encode", server_mod.encode)
    server._handle = _timed(clock, "dispatch", server._handle)
    run_generate = server._run_generate
    generate = engine.generate

    async def timed_run_generate(*args: Any) -> None:
        clock.push("submit")
        try:
            await run_generate(*args)
        finally:
            clock.pop_all()
            clock.done += 1

    async def timed_generate(req: Any) -> Any:
        clock.pop_all()  # submit ends: the engine has the request
        result = await generate(req)
        clock.push("result")
        return result

    server._run_generate = timed_run_generate
    engine.generate = timed_generate
    gc.callbacks.append(clock.on_gc)

    def on_bound() -> None:
        endpoint = server._endpoint
        endpoint._sock = _TimedSocket(endpoint._sock, clock)

    return on_bound


async def _serve(args: argparse.Namespace) -> None:
    import asyncio

    from rollout_sdk.server import EngineServer, ServerConfig

    clock = StageClock()
    clock.calibrate()
    engine = ENGINES[args.engine](args, clock)
    gc_kw: dict[str, Any] = {}  # "server": its default
    if args.gc_threshold != "server":
        gc_kw["gc_threshold"] = None if args.gc_threshold == "none" else args.gc_threshold
    server = EngineServer(engine, ServerConfig(max_requests=max(4096, 2 * args.in_flight), **gc_kw))
    on_bound = instrument(server, engine, clock)
    loop = asyncio.get_running_loop()
    marks: dict[str, float] = {}

    def command(line: str) -> None:  # on the loop: the driver's "reset" / "report"
        if line == "reset":
            clock.reset()
            marks.update(cpu=time.thread_time(), wall=time.perf_counter(), proc=time.process_time())
        elif line == "report":
            report = {
                "seconds": clock.corrected(),
                "clock_s": clock.reads * clock.read_s,  # the clock's own reads, taken out of the loop's CPU
                "done": clock.done,
                "gc_runs": clock.gc_runs,
                "loop_cpu_s": time.thread_time() - marks["cpu"],
                "process_cpu_s": time.process_time() - marks["proc"],
                "wall_s": time.perf_counter() - marks["wall"],
            }
            print(json.dumps(report), flush=True)

    def read_commands() -> None:  # a thread: stdin is blocking
        for line in sys.stdin:
            loop.call_soon_threadsafe(command, line.strip())

    def ready(address: str) -> None:
        on_bound()
        threading.Thread(target=read_commands, daemon=True).start()

    await harness.serve(server, on_ready=ready)


# -- the client (its own process) -------------------------------------------------------------------------


def _client(args: argparse.Namespace) -> None:
    import msgspec
    import zmq

    from rollout_sdk.protocol import GenerateRequest, SamplingParams, encode

    class Reply(msgspec.Struct):
        type: str = ""
        rid: str | None = None

    decode = msgspec.msgpack.Decoder(Reply).decode
    prompt = [1000 + (i * 7919) % 50_000 for i in range(args.prompt_tokens)]
    sp = SamplingParams(max_new_tokens=args.max_new_tokens)
    window = max(1, args.in_flight // args.clients)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socks = []
    for _ in range(args.clients):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(args.address)
        socks.append(s)
    frames = {f"r{k}": encode(GenerateRequest(input_ids=prompt, sampling=sp, rid=f"r{k}")) for k in range(window)}
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
        for frame in frames.values():
            s.send(frame)
    outstanding = window * len(socks)
    perf = time.perf_counter
    t_measure = perf() + args.warmup
    t_end = t_measure + args.duration
    measuring = False
    ok = errors = 0
    while outstanding:
        now = perf()
        if not measuring and now >= t_measure:
            measuring = True
            ok = errors = 0
            print("MEASURE", flush=True)
        sending = now < t_end
        if not sending and measuring and ok >= 0:
            print(f"DONE {ok} {errors} {now - t_measure:.6f}", flush=True)
            ok = -1  # reported; drain what is left
        events = poller.poll(1000 if sending else 100)
        if not events and not sending:
            break  # the rest is lost (a server that stopped answering): the report is out already
        for s, _ in events:
            while True:
                try:
                    data = s.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                reply = decode(data)
                if reply.rid is None or reply.rid not in frames:
                    continue  # a Pong, or an error without rid
                if ok >= 0:
                    if reply.type == "result":
                        ok += 1
                    else:
                        errors += 1
                if sending:
                    s.send(frames[reply.rid])
                else:
                    outstanding -= 1
    if ok >= 0:
        print(f"DONE {ok} {errors} {perf() - t_measure:.6f}", flush=True)
    for s in socks:
        s.close(0)
    ctx.term()


# -- the driver -------------------------------------------------------------------------------------------


def _cell(server: subprocess.Popen[str], address: str, clients: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--client",
        "--address",
        address,
        "--clients",
        str(clients),
        "--in-flight",
        str(args.in_flight),
        "--warmup",
        str(args.warmup),
        "--duration",
        str(args.duration),
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--max-new-tokens",
        str(args.max_new_tokens),
    ]
    client = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert server.stdin is not None and server.stdout is not None
    try:
        harness.read_until(client, "^MEASURE", 60)
        server.stdin.write("reset\n")
        server.stdin.flush()
        _, ok, errors, seconds = harness.read_until(client, "^DONE .*", 60 + args.duration).group(0).split()
        server.stdin.write("report\n")
        server.stdin.flush()
        report = json.loads(server.stdout.readline())
        client.wait(timeout=30)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
        if client.stdout is not None:
            client.stdout.close()
    done = max(1, report["done"])
    us = {k: 1e6 * v / done for k, v in report["seconds"].items()}
    cpu_us = 1e6 * (report["loop_cpu_s"] - report["clock_s"]) / done
    row = {
        "clients": clients,
        "req_s": int(ok) / float(seconds),
        "errors": int(errors),
        "server_done": report["done"],
        "cpu_us": cpu_us,
        "process_cpu_us": 1e6 * report["process_cpu_s"] / done,
        **us,
        "other": cpu_us - sum(us.values()),
        "gc_runs": report["gc_runs"],
    }
    log(
        f"clients={clients:<3d} {row['req_s']:8.0f} req/s  cpu/req {cpu_us:6.1f} us  "
        + " ".join(f"{k} {row[k]:.1f}" for k in (*STAGES, "other"))
        + f"  gc runs {report['gc_runs']}  errors {errors}"
    )
    return row


def _drive(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with ServerProcs.session("request_path-", keep_logs=True) as procs:
        for rep in range(args.reps):
            argv = [sys.executable, __file__, "--serve", "--engine", args.engine]
            argv += ["--engine-cost-us", str(args.engine_cost_us), "--in-flight", str(args.in_flight)]
            argv += ["--gc-threshold", str(args.gc_threshold)]
            server, address = procs.spawn(f"server-{rep}", argv, pipe_stdin=True)
            try:
                rows.extend({"rep": rep, **_cell(server, address, c, args)} for c in args.clients)
            finally:
                procs.stop([server])
    return rows


COLUMNS = ("req_s", "cpu_us", *STAGES, "other")


def table(rows: Sequence[dict[str, Any]], engine_cost_us: float) -> str:
    """Medians over repetitions, one line per client count."""
    out = []
    for clients in sorted({r["clients"] for r in rows}):
        med = harness.medians([r for r in rows if r["clients"] == clients], COLUMNS)
        out.append([clients, f"{med['req_s']:.0f}", f"{med['cpu_us']:.1f}", *(f"{med[s]:.1f}" for s in COLUMNS[2:])])
    note = f"(us per request; stand-in engine {engine_cost_us:g} us)\n"
    return note + harness.table(["clients", "req/s", "cpu/req", *STAGES, "other"], out, left=())


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = harness.parser(__doc__, quick=True, json="request_path")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--address", default="", help=argparse.SUPPRESS)
    p.add_argument("--engine", choices=sorted(ENGINES), default="fake")
    p.add_argument("--engine-cost-us", type=float, default=150.0, help="the stand-in's CPU per request (us)")
    p.add_argument(
        "--gc-threshold",
        type=lambda s: s if s in ("server", "none") else int(s),
        default="server",
        help="the server's ServerConfig.gc_threshold: 'server' (its default), 'none' (CPython's 700), or a number",
    )
    p.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    p.add_argument("--in-flight", type=int, default=2048, help="requests in flight, shared by the connections")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--duration", type=float, default=None, help="measured seconds per cell (full 3, quick 1.5)")
    p.add_argument("--warmup", type=float, default=None, help="seconds before each cell's window (full 1, quick 0.5)")
    p.add_argument("--reps", type=int, default=None, help="repetitions, a fresh server each (full 5, quick 3)")
    args = p.parse_args(argv)
    if isinstance(args.clients, int):
        args.clients = [args.clients]
    return harness.by_mode(args, duration=(3.0, 1.5), warmup=(1.0, 0.5), reps=(5, 3))


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.serve:
        harness.loop_runner()(_serve(args))
        return
    if args.client:
        args.clients = args.clients[0]
        _client(args)
        return
    t0 = time.time()
    with harness.sigterm_as_interrupt():
        rows = _drive(args)
    args_kept = {k: v for k, v in vars(args).items() if k not in ("serve", "client", "json")}
    meta = harness.save_results(args.json, rows, args_kept)
    print(table(rows, args.engine_cost_us))
    print(f"runtime {time.time() - t0:.0f} s; {meta['machine']}; numbers in {args.json}")


if __name__ == "__main__":
    main()
