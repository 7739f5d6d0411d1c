"""What CURVE authentication costs per request, in numbers other people's load on the cores does not move.

What is measured
----------------
1. **Instructions per request of a server** (valgrind's callgrind): a ``rollout-sdk serve --engine fake``
   process runs under callgrind, one ``RolloutClient`` in this process sends ``--requests`` sequential
   requests (64-token prompts, 4 new tokens) after 200 of warm-up; callgrind's counters are dumped before
   and after them (``callgrind_control -d``), and the second dump is split into the server's event-loop
   thread (``__libc_start_main``) and libzmq's threads (``start_thread``), with libsodium's two per-message
   calls named.  Auth off and on, alternated, ``--reps`` times.
2. **libzmq alone** (pyzmq, no rollout-sdk code): ``--messages`` 400-byte messages DEALER -> ROUTER over
   loopback TCP in this process, CPU of all its threads (getrusage) per message, CURVE off and on.

Instruction counts do not depend on the machine's load (a busy machine makes them slower to get, not
different); event-loop counts differ by ~5% between processes of the same code (timers, GC), so compare
off and on of one repetition.  Needs ``valgrind`` (and ``callgrind_control``) on the PATH.

Run::

    python bench/auth_cost.py                  # ~3 minutes on 2 cores
    python bench/auth_cost.py --reps 1 --requests 500
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import subprocess
from pathlib import Path

import harness
import zmq
from harness import ServerProcs

ROOT = Path(__file__).resolve().parent.parent
_PARTS = {"total": "PROGRAM TOTALS", "loop": "__libc_start_main", "zmq threads": "start_thread"}
_SODIUM = ("crypto_box_easy_afternm", "crypto_box_open_easy_afternm")


def _split(dump: str) -> dict[str, int]:
    """Inclusive instruction counts of a callgrind dump: total, event-loop thread, libzmq threads, libsodium."""
    text = subprocess.run(["callgrind_annotate", "--inclusive=yes", dump], capture_output=True, text=True).stdout
    got: dict[str, int] = {}
    for line in text.splitlines():
        for key, pattern in [*_PARTS.items(), *((f, f) for f in _SODIUM)]:
            if pattern in line and key not in got:
                got[key] = int(line.split()[0].replace(",", ""))
    return got


async def server_instructions(procs: ServerProcs, out: Path, auth: bool, n: int, tag: str) -> dict[str, float]:
    from rollout_sdk import JobSecret, RolloutClient, SamplingParams

    secret = JobSecret.generate()
    secret_file = out / f"{tag}.secret"
    secret.write(secret_file)
    argv = [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={out}/{tag}.%p",
        "--dump-instr=no",
        *harness.fake_server_argv(*(("--secret-file", str(secret_file)) if auth else ())),
    ]
    proc, address = await asyncio.to_thread(procs.spawn, tag, argv, 600.0)
    try:
        prompt, sp = list(range(1, 65)), SamplingParams(max_new_tokens=4)
        creds = secret.credentials("control") if auth else None
        async with RolloutClient(servers=[address], credentials=creds, connect_timeout_s=600) as client:
            for _ in range(200):
                await client.generate(prompt, sampling=sp)
            await asyncio.to_thread(
                subprocess.run, ["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True
            )
            for _ in range(n):
                await client.generate(prompt, sampling=sp)
            await asyncio.to_thread(
                subprocess.run, ["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True
            )
        last = sorted(out.glob(f"{tag}.{proc.pid}.*"), key=lambda p: p.stat().st_mtime)[-1]
        return {k: v / n for k, v in _split(str(last)).items()}
    finally:
        await asyncio.to_thread(procs.stop, [proc])


def zmq_cpu_per_message(curve: bool, messages: int) -> float:
    from zmq.auth.thread import ThreadAuthenticator

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    auth = None
    if curve:
        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
    server_pub, server_sec = zmq.curve_keypair()
    client_pub, client_sec = zmq.curve_keypair()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.setsockopt(zmq.RCVHWM, 0)
    dealer.setsockopt(zmq.SNDHWM, 0)
    if curve:
        router.setsockopt(zmq.CURVE_SERVER, 1)
        router.setsockopt(zmq.CURVE_SECRETKEY, server_sec)
        router.setsockopt(zmq.CURVE_PUBLICKEY, server_pub)
        dealer.setsockopt(zmq.CURVE_SERVERKEY, server_pub)
        dealer.setsockopt(zmq.CURVE_PUBLICKEY, client_pub)
        dealer.setsockopt(zmq.CURVE_SECRETKEY, client_sec)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    payload = b"y" * 400
    dealer.send(payload)
    router.recv_multipart()  # the handshake is done
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(messages):
        dealer.send(payload)
    for _ in range(messages):
        router.recv_multipart()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    dealer.close(0)
    router.close(0)
    if auth is not None:
        auth.stop()
    ctx.term()
    return (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / messages * 1e6


async def main(args: argparse.Namespace) -> None:
    rows: list[tuple[int, str, dict[str, float]]] = []
    with ServerProcs.session("auth-cost-") as procs:
        out = procs.logdir
        for rep, auth in harness.abba(args.reps, [False, True]):
            tag = f"{'on' if auth else 'off'}-{rep}"
            got = await server_instructions(procs, out, auth, args.requests, tag)
            rows.append((rep, "on" if auth else "off", got))
            harness.log(f"rep {rep} auth {rows[-1][1]}: {got}")
    cpu = {c: [zmq_cpu_per_message(c, args.messages) for _ in range(args.zmq_reps)] for c in (False, True)}

    cols = ["total", "loop", "zmq threads", *_SODIUM]
    print(f"\nserver instructions per request ({args.requests} requests at c=1 after 200 of warm-up):")
    ordered = sorted(rows, key=lambda r: (r[0], r[1] != "off"))
    table = [[rep, mode, *(f"{got.get(c, 0):,.0f}" for c in cols)] for rep, mode, got in ordered]
    print(harness.markdown(["rep", "auth", *cols], table))
    for rep in range(args.reps):
        off, on = (next(g for r, m, g in rows if r == rep and m == mode) for mode in ("off", "on"))
        print(
            f"rep {rep}: auth adds {on['total'] - off['total']:+,.0f} instructions per request "
            f"({on['total'] / off['total'] - 1:+.1%}): event loop {on['loop'] - off['loop']:+,.0f}, "
            f"libzmq threads {on.get('zmq threads', 0) - off.get('zmq threads', 0):+,.0f}"
        )
    print(
        f"\nlibzmq alone, {args.messages} 400-byte messages DEALER -> ROUTER (CPU of all threads, medians of "
        f"{args.zmq_reps}): {harness.median(cpu[False]):.2f} us/message without CURVE, "
        f"{harness.median(cpu[True]):.2f} with it"
    )


def parse_args() -> argparse.Namespace:
    p = harness.parser(__doc__, reps=2, reps_help="alternating off/on repetitions (ABBA order)")
    p.add_argument("--requests", type=int, default=1500, help="measured requests per server")
    p.add_argument("--messages", type=int, default=50_000, help="messages per libzmq-alone measurement")
    p.add_argument("--zmq-reps", type=int, default=5)
    return p.parse_args()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    harness.run(main(parse_args()))
