"""Issue 25's figures: the worst frames, memory, heartbeats under a flood, SIGTERM, fair share, poison.

Each part prints a table and the whole run is saved to ``bench/results/hardening.json``:

* ``stall``: a server process (``--serve``: an ``EngineServer`` around a ``FakeEngine``, 2 ms steps, on
  uvloop, with a loop-lag probe: a task sleeping 1 ms in a loop, recording how late each wake-up was) is
  sent, one at a time, each of the worst frames a peer can send; the table gives the probe's worst lag
  while each kind is handled, against an idle baseline.  Kinds: ``stop ids 8.3M`` (the issue's frame: 8.3M
  one-byte stop ids, 8 MiB), ``input_ids 2M`` (the largest accepted prompt, 3-byte ids: 6 MB), ``busy`` (a
  maximum-size frame refused busy while the same peer's first one waits: its rid is read by skipping the
  ids), ``control 1 MiB`` (an UpdateWeightsDistributed of ~12k tensor metas, decoded on the loop);
* ``memory``: the server's RSS (and peak) after 16 maximum-size requests (2M ids each), answered one after
  another, and the decode worker's RSS;
* ``heartbeat``: Ping round trips from a second client, idle and while one peer (a process of its own)
  floods maximum-size frames as fast as its socket takes them (never reading its replies);
* ``sigterm``: SIGTERM to exit, with a control call stuck in a worker thread (the fake engine's
  ``hang_init_weight_group``), for ``rollout-sdk serve``, a torchrun rank, and the embedded default;
* ``fairshare``: a real client's 512 concurrent requests (4 new tokens each), alone and after 3,000
  throwaway identities each sent one Ping;
* ``poison``: 3 servers, 300 innocent requests in flight, one request that kills every engine it reaches.

Run::

    python bench/hardening.py                 # every part (~2 minutes)
    python bench/hardening.py --parts stall,memory
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness
from harness import ServerProcs, child_pids, lag_window, log, pct, rss_kb

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("stall", "memory", "heartbeat", "sigterm", "fairshare", "poison")

# -- the server side ------------------------------------------------------------------------------------


async def _serve(args: argparse.Namespace) -> None:
    from rollout_sdk.engines.fake import FakeEngine, FakeEngineConfig
    from rollout_sdk.server import EngineServer, ServerConfig

    engine = FakeEngine(FakeEngineConfig(step_base_s=0.002, max_context=1 << 22))
    engine.requests_seen = collections.deque(maxlen=0)  # keep no history (it would hold the big prompts)
    await harness.serve(EngineServer(engine, ServerConfig()), lag_samples=args.samples)


# -- helpers --------------------------------------------------------------------------------------------


class Peer:
    def __init__(self, address: str, sndhwm: int | None = None) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if sndhwm is not None:  # before connecting: the pipe takes it then
            self.sock.setsockopt(zmq.SNDHWM, sndhwm)
        self.sock.connect(address)

    async def reply(self, *, pong: bool = False, timeout: float = 120.0) -> Any:
        """The next reply (skipping Pongs, or only a Pong with ``pong``)."""
        from rollout_sdk.protocol import decode_server_message

        while True:
            msg = decode_server_message(await asyncio.wait_for(self.sock.recv(), timeout))
            if (type(msg).__name__ == "Pong") == pong:
                return msg

    async def call(self, frame: bytes) -> Any:
        await self.sock.send(frame)
        return await self.reply()

    async def ping_rtt(self, seq: int) -> float:
        from rollout_sdk.protocol import Ping, encode

        t = time.perf_counter()
        await self.sock.send(encode(Ping(seq)))
        await self.reply(pong=True)
        return time.perf_counter() - t

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _max_prompt(rid: str) -> bytes:
    from rollout_sdk.protocol import MAX_INPUT_IDS, GenerateRequest, SamplingParams, encode

    ids = [1000 + (i % 60000) for i in range(MAX_INPUT_IDS - 16)]
    return encode(GenerateRequest(input_ids=ids, sampling=SamplingParams(max_new_tokens=1), rid=rid))


def _stop_flood(rid: str) -> bytes:
    n = (8 << 20) - 200  # the frame: one-byte stop ids up to the 8 MiB limit
    return msgspec.msgpack.encode(
        {"type": "generate", "input_ids": [1], "sampling": {"stop_token_ids": [7] * n}, "rid": rid}
    )


def _big_control(call_id: str) -> bytes:
    metas = [[f"model.layers.{i}.weight", "bfloat16", [4096, 128]] for i in range(12_000)]
    frame = msgspec.msgpack.encode(
        {"type": "update_weights_dist", "call_id": call_id, "group_name": "g", "buckets": [metas]}
    )
    assert len(frame) <= 1 << 20, len(frame)
    return frame


# -- parts ----------------------------------------------------------------------------------------------


async def _stall_and_memory(procs: ServerProcs, tmp: Path, parts: set[str]) -> dict[str, Any]:
    samples = tmp / "samples.json"
    proc, address = procs.spawn("server", [sys.executable, __file__, "--serve", "--samples", str(samples)])
    out: dict[str, Any] = {}
    windows: list[tuple[str, float, float]] = []
    peer = Peer(address)
    try:
        await peer.ping_rtt(0)
        t = time.time()
        await asyncio.sleep(2.0)
        windows.append(("idle", t, time.time()))
        if "stall" in parts:
            for kind, make in (("stop ids 8.3M", _stop_flood), ("input_ids 2M", _max_prompt)):
                frames = [make(f"{kind[:4]}{i}") for i in range(4)]
                t = time.time()
                for f in frames:
                    reply = await peer.call(f)
                windows.append((kind, t, time.time() + 0.2))
                await asyncio.sleep(0.3)
                out.setdefault("replies", {})[kind] = type(reply).__name__ + (
                    f" {reply.code} {reply.field}" if type(reply).__name__ == "ErrorReply" else ""
                )
            # busy: the same peer's second frame while its first waits (both sent at once)
            a, b = _max_prompt("busy-a"), _max_prompt("busy-b")
            t = time.time()
            for _ in range(3):
                await peer.sock.send(a)
                await peer.sock.send(b)
                replies = [await peer.reply(), await peer.reply()]
            windows.append(("busy (rid peeked)", t, time.time() + 0.2))
            out.setdefault("replies", {})["busy"] = sorted(getattr(r, "code", "result") for r in replies)
            await asyncio.sleep(0.3)
            t = time.time()
            for i in range(4):
                reply = await peer.call(_big_control(f"c{i}"))
            windows.append(("control 1 MiB", t, time.time() + 0.2))
            out.setdefault("replies", {})["control 1 MiB"] = f"{type(reply).__name__} {getattr(reply, 'code', '')}"
        if "memory" in parts:
            rss0 = rss_kb(proc.pid)
            frame = _max_prompt("m")
            for _ in range(16):
                reply = await peer.call(frame)
                assert type(reply).__name__ == "GenerateResult", reply
            await peer.ping_rtt(1)
            worker = [rss_kb(c) for c in child_pids(proc.pid)]
            out["memory"] = {
                "frame_MB": round(len(frame) / 1e6, 2),
                "rss_before_MB": round(rss0 / 1024, 1),
                "rss_after_16_MB": round(rss_kb(proc.pid) / 1024, 1),
                "rss_peak_MB": round(rss_kb(proc.pid, "VmHWM") / 1024, 1),
                "decode_worker_rss_MB": [round(w / 1024, 1) for w in worker],
            }
    finally:
        peer.close()
        procs.stop([proc])
    if "stall" in parts:
        rows = []
        for kind, t0, t1 in windows:
            lag = [x * 1000 for x in lag_window(samples, t0, t1)[0]]
            rows.append({"frame": kind, "samples": len(lag), "lag_p99_ms": pct(lag, 0.99), "lag_max_ms": max(lag)})
        out["stall"] = rows
    return out


async def _heartbeat(procs: ServerProcs, tmp: Path) -> list[dict[str, Any]]:
    samples = tmp / "hb.json"
    proc, address = procs.spawn("hb", [sys.executable, __file__, "--serve", "--samples", str(samples)])
    rows = []
    try:
        client = Peer(address)
        idle = [await client.ping_rtt(i) for i in range(200)]
        rows.append(_rtt_row("idle", idle))
        # the flooder is a process of its own (as an attacker would be), so it does not share this loop
        flooder = subprocess.Popen([sys.executable, __file__, "--flood", address], stdout=subprocess.PIPE, text=True)
        assert flooder.stdout is not None
        assert flooder.stdout.readline().startswith("FLOODING")
        await asyncio.sleep(1.0)
        flooded = []
        for i in range(200):
            flooded.append(await client.ping_rtt(1000 + i))
            await asyncio.sleep(0.01)
        flooder.send_signal(signal.SIGTERM)
        tail = (await asyncio.to_thread(flooder.communicate, None, 60))[0].split()
        sent = [int(tail[-1]) if tail else 0]
        rows.append({**_rtt_row("one peer floods max frames", flooded), "frames_sent": sent[0]})
        client.close()
    finally:
        procs.stop([proc])
    return rows


def _rtt_row(phase: str, rtts: list[float]) -> dict[str, Any]:
    """One heartbeat row: how many Pings, their round trips' p50, p99 and max in ms."""
    ms = [x * 1e3 for x in rtts]
    return {"phase": phase, "pings": len(ms), "p50_ms": pct(ms, 0.5), "p99_ms": pct(ms, 0.99), "max_ms": max(ms)}


async def _flood(address: str) -> None:
    """Send maximum-size frames as fast as the socket takes them, never reading replies, until SIGTERM."""
    peer = Peer(address, sndhwm=2)  # the flood goes at the socket's pace, not into this process's memory
    frames = [_max_prompt(f"fl{i}") for i in range(8)]
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("FLOODING", flush=True)
    sent = 0
    while not stop.is_set():
        await peer.sock.send(frames[sent % len(frames)], copy=False)
        sent += 1
        await asyncio.sleep(0)  # a send that did not wait never yields: let the signal handler run
    print("SENT", sent, flush=True)
    peer.close()


def _sigterm_one(name: str, argv: list[str], ready: str, then: Any, env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        try:
            m = harness.read_until(proc, ready, 600, seen=lines)
        except RuntimeError:
            raise RuntimeError(f"{name} ended before it was ready:\n" + "".join(lines[-30:])) from None
        then(m, proc, lines)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(180)
        dt = time.monotonic() - t0
        rest = proc.stdout.read()
        return {
            "path": name,
            "sigterm_to_exit_s": round(dt, 2),
            "exit_code": code,
            "abandoned_thread": "exiting without them" in rest,
        }
    finally:
        if proc.poll() is None:
            proc.kill()


def _hang_control(address: str, proc: subprocess.Popen[str], lines: list[str]) -> None:
    from rollout_sdk.protocol import InitWeightGroup, encode

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send(
        encode(InitWeightGroup(call_id="stuck", master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=2))
    )
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        lines.append(line)
        if "blocks a worker thread" in line or not line:
            break
    sock.close(0)
    ctx.term()


def _sigterm(sdk_home: str) -> list[dict[str, Any]]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", ROLLOUT_SDK_HOME=sdk_home)
    rows = [
        _sigterm_one(
            "rollout-sdk serve (fake, stuck control thread)",
            [sys.executable, "-m", "rollout_sdk", "serve", "--engine", "fake", "--fake-hang-init-weight-group"],
            r"READY (\S+)",
            lambda m, p, ls: _hang_control(m.group(1), p, ls),
            env,
        ),
        _sigterm_one(
            "torchrun rank (fake, stuck control thread)",
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "1",
                str(ROOT / "launch" / "serve.py"),
                "--engine",
                "fake",
                "--fake-hang-init-weight-group",
            ],
            r"serving at (tcp://\S+)",
            lambda m, p, ls: _hang_control(m.group(1), p, ls),
            env,
        ),
    ]
    embedded = (
        "import asyncio\nfrom rollout_sdk import RolloutClient, SamplingParams\n"
        "async def main():\n    async with RolloutClient() as c:\n"
        "        await c.generate([1, 2, 3], sampling=SamplingParams(max_new_tokens=2))\n"
        "        print('READY', flush=True)\n"
        "        while True:\n            await c.generate([1, 2, 3], sampling=SamplingParams(max_new_tokens=64))\n"
        "asyncio.run(main())\n"
    )
    rows.append(
        _sigterm_one(
            "embedded default (CPU engine, generating)",
            [sys.executable, "-c", embedded],
            r"READY",
            lambda *a: None,
            env,
        )
    )
    return rows


async def _fairshare(procs: ServerProcs, tmp: Path, identities: int) -> list[dict[str, Any]]:
    from rollout_sdk import RolloutClient, SamplingParams

    proc, address = procs.spawn("fair", harness.fake_server_argv("--fake-step-base-s", "0.002"))
    rows = []
    try:
        for label, n in (("alone", 0), (f"after {identities} throwaway identities (one Ping each)", identities)):
            t = time.perf_counter()
            for i in range(n):
                p = Peer(address)
                await p.ping_rtt(i)
                p.close()
            spam_s = time.perf_counter() - t
            async with RolloutClient(servers=[address]) as client:
                sp = SamplingParams(max_new_tokens=4)
                t = time.perf_counter()
                rs = await asyncio.gather(*(client.generate([5, 6, i % 1000 + 1], sampling=sp) for i in range(512)))
                dt = time.perf_counter() - t
            rows.append({"case": label, "requests": len(rs), "wall_s": round(dt, 3), "identities_s": round(spam_s, 1)})
    finally:
        procs.stop([proc])
    return rows


async def poison_case(**client_options: Any) -> dict[str, Any]:
    """Three fake servers, 300 innocent requests in flight on all of them, then a request that kills every
    engine it reaches (id 666): engines lost, innocents failed, what became of the poison.  Shared with
    bench/failover.py (``client_options``: e.g. ``clear_suspects``)."""
    from rollout_sdk import (
        EngineServer,
        GenerateRequest,
        PoisonRequestError,
        RolloutClient,
        SamplingParams,
        ServerConfig,
    )
    from rollout_sdk.engines.fake import FakeEngine, FakeEngineConfig

    loop = asyncio.get_running_loop()
    servers = []
    for i in range(3):
        engine = FakeEngine(FakeEngineConfig(step_base_s=0.002))

        def responder(req: GenerateRequest, engine: FakeEngine = engine) -> list[int]:
            if 666 in req.input_ids:
                loop.call_soon(engine.kill, "poisoned by request 666")
            return [9] * req.sampling.max_new_tokens

        engine.responder = responder
        s = EngineServer(engine, ServerConfig(server_id=f"p{i}"))
        await s.__aenter__()
        servers.append(s)
    try:
        async with RolloutClient(servers=[s.address for s in servers], **client_options) as client:
            sp = SamplingParams(max_new_tokens=40)
            t = time.perf_counter()
            innocents = [asyncio.ensure_future(client.generate([1, 2, 3, i], sampling=sp)) for i in range(300)]
            while not all(s.stats().in_flight > 0 for s in servers):
                await asyncio.sleep(0.005)
            try:
                await client.generate([1, 2, 666], sampling=SamplingParams(max_new_tokens=4))
                poison = "completed"
            except PoisonRequestError:
                poison = "PoisonRequestError"
            results = await asyncio.gather(*innocents, return_exceptions=True)
            dt = time.perf_counter() - t
            failed = collections.Counter(type(r).__name__ for r in results if isinstance(r, BaseException))
            retried = sum(
                1 for r in results if not isinstance(r, BaseException) and r.lifecycle and r.lifecycle.attempts > 1
            )
            return {
                "servers": 3,
                "innocents": 300,
                "engines_lost": sum(1 for s in servers if s.engine.dead is not None),
                "innocents_failed": sum(failed.values()),
                "failed_by_type": dict(failed),
                "innocents_retried": retried,
                "poison_request": poison,
                "wall_s": round(dt, 2),
                "max_suspects_running_per_server": client.scheduler.max_suspects_running,
            }
    finally:
        for s in servers:
            await s.aclose()


async def _drive(args: argparse.Namespace) -> dict[str, Any]:
    parts = set(args.parts.split(","))
    out: dict[str, Any] = {}
    with ServerProcs.session("hardening-", keep_logs=True) as procs:
        tmp = procs.logdir
        if parts & {"stall", "memory"}:
            log("stall / memory")
            out.update(await _stall_and_memory(procs, tmp, parts))
        if "heartbeat" in parts:
            log("heartbeat under a flood")
            out["heartbeat"] = await _heartbeat(procs, tmp)
        if "sigterm" in parts:
            log("sigterm")
            out["sigterm"] = await asyncio.to_thread(_sigterm, args.sdk_home)
        if "fairshare" in parts:
            log("fair share")
            out["fairshare"] = await _fairshare(procs, tmp, args.identities)
        if "poison" in parts:
            log("poison")
            out["poison"] = await poison_case()
    return out


def _print(out: dict[str, Any]) -> None:
    for key, value in out.items():
        print(f"\n## {key}")
        rows = value if isinstance(value, list) else [value]
        print(harness.records(rows) if rows and isinstance(rows[0], dict) else value)


def main() -> None:
    p = harness.parser(__doc__, json="hardening", json_flag="--out")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--flood", default="", help=argparse.SUPPRESS)
    p.add_argument("--samples", default="")
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--identities", type=int, default=3000)
    p.add_argument(
        "--sdk-home", default=os.environ.get("ROLLOUT_SDK_TEST_HOME", os.environ.get("ROLLOUT_SDK_HOME", ""))
    )
    args = p.parse_args()
    if args.flood:
        asyncio.run(_flood(args.flood))
        return
    if args.serve:
        harness.loop_runner()(_serve(args))
        return
    out = harness.run(_drive(args), uvloop=False)
    _print(out)
    meta = harness.save_results(args.out, [out], {"parts": args.parts, "identities": args.identities})
    print(f"\n{meta['date']}, {meta['machine']}")


if __name__ == "__main__":
    main()
