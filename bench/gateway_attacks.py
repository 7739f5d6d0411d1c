"""The gateway under attack (issue 36): the real ``rollout-sdk gateway`` process on the embedded CPU engine.

Parts (``--parts``, all by default):

big     one 15 MiB call per API (chat, responses, messages, completions) whose text cannot fit the context: wall time to
        the answer, its status, and the gateway process's RSS before, at its peak (``VmHWM`` after
        ``clear_refs``) and after the answer
junk    450 calls with fresh keys and a bad body (each a 400), then the trainer's ``POST /v1/sessions``
stream  20 finished sessions; a consumer that connects to the export stream, reads nothing and goes away;
        how many the next consumer gets
deep    a body nested 1,000 deep on every POST route, and invalid JSON on the session endpoints: statuses
slow    300 connections that send a request body one byte a second: the gateway's open fds while they
        trickle, and how long until the gateway has closed them
shapes  15 MiB bodies of many tiny values (``[{},{},...]`` messages, token-id prompts, stop_token_ids,
        ``[[],[],...]`` input): the same columns as big (not in the default parts)
bind    ``rollout-sdk gateway --host 0.0.0.0`` without ``--admin-key``: exit code, first line, seconds

    python bench/gateway_attacks.py                                      # this checkout
    python bench/gateway_attacks.py --python /work/main/.venv/bin/python --parts big --apis chat \
        --out bench/results/gateway_attacks_before.json                  # another checkout (before)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import harness
from harness import log, num_fds, reset_peak, rss_kb

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


async def model_name(http: Any, url: str) -> str:
    async with http.get(f"{url}/v1/models") as r:
        return str((await r.json())["data"][0]["id"])


_HI = {"role": "user", "content": "hi"}
_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


async def part_big(http: Any, url: str, pid: int, apis: list[str], mib: float) -> list[dict[str, Any]]:
    name = await model_name(http, url)
    text = "word " * (int(mib * MiB) // 5 - 40)
    cases = []
    for api in apis:
        path, body = {
            "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
            "responses": ("/v1/responses", {"input": text}),
            "messages": ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": text}]}),
            "completions": ("/v1/completions", {"prompt": text}),
            # an assistant's text: counted from its last "think" on, not beside tool calls (templates may drop it)
            "chat-assistant": (
                "/v1/chat/completions",
                {"messages": [{"role": "assistant", "content": text}, {"role": "user", "content": "hi"}]},
            ),
            # not counted before decoding: reasoning before "</think>", content beside tool calls (the residue)
            "chat-reasoning": (
                "/v1/chat/completions",
                {"messages": [{"role": "assistant", "content": text + "</think>ok"}, _HI]},
            ),
            "chat-assistant-calls": (
                "/v1/chat/completions",
                {
                    "messages": [
                        {"role": "assistant", "content": text, "tool_calls": [_CALL]},
                        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
                    ]
                },
            ),
        }[api]
        cases.append((api, path, json.dumps({"model": name, **body}).encode()))
    return await _measure(http, url, pid, "big", cases)


async def part_shapes(http: Any, url: str, pid: int, mib: float) -> list[dict[str, Any]]:
    """Bodies of ``mib`` MiB made of many tiny JSON values (each a Python object of ~10-70x its bytes)."""
    name = await model_name(http, url)
    n = int(mib * MiB) // 3
    head = b'{"model": ' + json.dumps(name).encode()
    cases = [
        ("chat: messages of {}", "/v1/chat/completions", head + b', "messages": [' + b",".join([b"{}"] * n) + b"]}"),
        (
            "completions: prompt of ids",
            "/v1/completions",
            head + b', "prompt": [' + b",".join([b"1"] * (n * 3 // 2)) + b"]}",
        ),
        (
            "chat: stop_token_ids",
            "/v1/chat/completions",
            head
            + b', "messages": [{"role": "user", "content": "hi"}], "stop_token_ids": ['
            + b",".join([b"7"] * (n * 3 // 2))
            + b"]}",
        ),
        ("responses: input of []", "/v1/responses", head + b', "input": [' + b",".join([b"[]"] * n) + b"]}"),
    ]
    return await _measure(http, url, pid, "shapes", cases)


async def _measure(
    http: Any, url: str, pid: int, part: str, cases: list[tuple[str, str, bytes]]
) -> list[dict[str, Any]]:
    rows = []
    for api, path, raw in cases:
        before = rss_kb(pid)
        reset_peak(pid)
        t0 = time.perf_counter()
        async with http.post(
            url + path, data=raw, headers={"Content-Type": "application/json", "x-api-key": f"{part}-{len(rows)}"}
        ) as r:
            answer = await r.json()
            status = r.status
        wall = time.perf_counter() - t0
        peak, right_after = rss_kb(pid, "VmHWM"), rss_kb(pid)
        await asyncio.sleep(3)  # what stays once the call is over
        row = {
            "part": part,
            "api": api,
            "body_MiB": round(len(raw) / MiB, 2),
            "status": status,
            "code": answer.get("error", {}).get("code"),
            "wall_s": round(wall, 3),
            "rss_before_MB": round(before / 1024, 1),
            "rss_peak_MB": round(peak / 1024, 1),
            "peak_over_body": round((peak - before) * 1024 / len(raw), 2),
            "rss_after_MB": round(right_after / 1024, 1),
            "rss_3s_after_MB": round(rss_kb(pid) / 1024, 1),
        }
        log(str(row))
        rows.append(row)
    return rows


async def part_junk(http: Any, url: str) -> list[dict[str, Any]]:
    name = await model_name(http, url)
    statuses: dict[int, int] = {}
    for k in range(450):
        async with http.post(
            f"{url}/v1/chat/completions",
            json={"model": name, "messages": "junk"},
            headers={"Authorization": f"Bearer junk-{k}-{os.getpid()}"},
        ) as r:
            statuses[r.status] = statuses.get(r.status, 0) + 1
    async with http.get(f"{url}/health") as r:
        sessions = (await r.json())["sessions"]
    async with http.post(f"{url}/v1/sessions", json={}) as r:
        trainer = r.status
    row = {"part": "junk", "junk_statuses": statuses, "sessions_after": sessions, "trainer_create": trainer}
    log(str(row))
    return [row]


async def part_stream(http: Any, url: str) -> list[dict[str, Any]]:
    name = await model_name(http, url)
    ids = []
    for _ in range(20):
        async with http.post(f"{url}/v1/sessions", json={}) as r:
            sid = (await r.json())["id"]
        async with http.post(
            f"{url}/v1/chat/completions",
            json={"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            headers={"Authorization": f"Bearer {sid}"},
        ) as r:
            assert r.status == 200, await r.text()
        async with http.post(f"{url}/v1/sessions/{sid}/finish", json={}) as r:
            assert r.status == 200
        ids.append(sid)
    r = await http.get(f"{url}/v1/trajectories/stream")  # connects, reads nothing, goes away
    await asyncio.sleep(2)
    r.close()
    await asyncio.sleep(1)
    got: list[str] = []
    try:
        async with http.get(f"{url}/v1/trajectories/stream?limit=20") as r:
            async with asyncio.timeout(20):
                async for line in r.content:
                    if line.strip():
                        got.append(json.loads(line)["session"])  # noqa: PERF401 (kept if the wait times out)
    except TimeoutError:
        pass
    async with http.post(f"{url}/v1/trajectories/ack", json={"ids": got}) as r:
        acked = r.status
    row = {"part": "stream", "finished": 20, "next_consumer_got": len(set(got) & set(ids)), "ack_status": acked}
    log(str(row))
    return [row]


async def part_deep(http: Any, url: str) -> list[dict[str, Any]]:
    deep = b'{"messages": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    routes = [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/sessions",
        "/v1/sessions/x/reward",
        "/v1/sessions/x/finish",
    ]
    rows = []
    for path in routes:
        async with http.post(url + path, data=deep, headers={"Content-Type": "application/json"}) as r:
            rows.append({"part": "deep", "route": path, "body": "depth 1000", "status": r.status})
    async with http.post(f"{url}/v1/sessions", json={}) as r:
        sid = (await r.json())["id"]
    for path in ("/v1/sessions", f"/v1/sessions/{sid}/finish"):
        async with http.post(url + path, data=b'{"reward": ', headers={"Content-Type": "application/json"}) as r:
            rows.append({"part": "deep", "route": path, "body": "invalid JSON", "status": r.status})
    log(str(rows))
    return rows


async def part_slow(url: str, pid: int, n: int = 300) -> list[dict[str, Any]]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    base = num_fds(pid)
    conns = []
    for _ in range(n):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\nAuthorization: Bearer slow\r\n\r\n{"
        )
        conns.append((reader, writer))
    t0 = time.monotonic()

    async def trickle() -> None:
        while True:
            await asyncio.sleep(1)
            for _, w in conns:
                if not w.is_closing():
                    w.write(b" ")

    task = asyncio.create_task(trickle())
    await asyncio.sleep(3)
    open_fds = num_fds(pid)
    closed_at = None
    while time.monotonic() - t0 < 120:
        if num_fds(pid) <= base + 5:
            closed_at = time.monotonic() - t0
            break
        await asyncio.sleep(0.5)
    answers: dict[str, int] = {}
    for reader, _ in conns:
        try:
            head = await asyncio.wait_for(reader.read(12), 0.01)
            key = head.decode(errors="replace") or "EOF"
        except (TimeoutError, ConnectionError):
            key = "nothing yet"
        answers[key] = answers.get(key, 0) + 1
    task.cancel()
    for _, w in conns:
        w.close()
    row = {
        "part": "slow",
        "connections": n,
        "fds_before": base,
        "fds_while_trickling": open_fds,
        "all_closed_by_gateway_after_s": None if closed_at is None else round(closed_at, 1),
        "fds_at_end": num_fds(pid),
        "answers": answers,
    }
    log(str(row))
    return [row]


async def part_bind(python: str) -> list[dict[str, Any]]:
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        python, "-m", "rollout_sdk", "gateway", "--host", "0.0.0.0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    ready = False
    try:
        async with asyncio.timeout(180):
            while line := await proc.stdout.readline():
                if line.startswith(b"READY"):
                    ready = True
                    break
    except TimeoutError:
        pass
    if ready or proc.returncode is None:
        proc.terminate()
    await proc.wait()
    err = (await proc.stderr.read()).decode()
    lines = [line for line in err.splitlines() if line.strip()]
    row = {
        "part": "bind",
        "rc": proc.returncode,
        "ready": ready,
        "stderr_lines": len(lines),
        "first_line": lines[0] if lines else "",
        "s": round(time.monotonic() - t0, 2),
    }
    log(str(row))
    return [row]


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    import aiohttp

    rows: list[dict[str, Any]] = []
    parts = args.parts.split(",")
    if "bind" in parts:
        rows += await part_bind(args.python)
    served = [p for p in parts if p != "bind"]
    if not served:
        return rows
    argv = [args.python, "-m", "rollout_sdk", "gateway", "--max-sessions", "10000", *args.gateway_args.split()]
    with harness.ServerProcs.session("gw-attacks-", keep_logs=True) as procs:
        gw, base_url = await asyncio.to_thread(procs.spawn, "gateway", argv, 300)
        url = base_url.removesuffix("/v1")
        pid = gw.pid
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            if "big" in served:
                rows += await part_big(http, url, pid, args.apis.split(","), args.big_mib)
            if "shapes" in served:
                rows += await part_shapes(http, url, pid, args.big_mib)
            if "junk" in served:
                rows += await part_junk(http, url)
            if "deep" in served:
                rows += await part_deep(http, url)
            if "stream" in served:
                rows += await part_stream(http, url)
        if "slow" in served:
            rows += await part_slow(url, pid)
    return rows


if __name__ == "__main__":
    ap = harness.parser(__doc__, json="gateway_attacks", json_flag="--out")
    ap.add_argument("--python", default=sys.executable, help="the interpreter whose rollout_sdk runs the gateway")
    ap.add_argument("--parts", default="bind,big,junk,deep,stream,slow")
    ap.add_argument("--apis", default="chat,responses,messages")
    ap.add_argument("--big-mib", type=float, default=15.0, help="size of the big call's body")
    ap.add_argument("--gateway-args", default="", help="more flags for rollout-sdk gateway (one string)")
    a = ap.parse_args()
    result = harness.run(main(a), uvloop=False)
    meta = harness.save_results(a.out, result, vars(a))
    print(json.dumps({"meta": meta, "rows": result}, indent=1))
