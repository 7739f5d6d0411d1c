"""SGLang's HTTP server as a peer: its command line, its start and stop, one ``/generate``, its flush and its
prefill counter; and an aiohttp stand-in over the fake engine for CPU dry runs."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from typing import Any

from harness import free_port, log, stop_group


def http_argv(model: str, port: int, a: argparse.Namespace, max_total_tokens: int) -> list[str]:
    """``python -m sglang.launch_server`` with the in-process engine's arguments (the bench's ``--attn``,
    ``--sampling``, ``--http-mem-fraction``, ``--graph-bs``, ``--max-running``) and KV pool."""
    return [
        sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--load-format", "dummy",
        "--skip-tokenizer-init", "--attention-backend", a.attn, "--sampling-backend", a.sampling,
        "--mem-fraction-static", str(a.http_mem_fraction), "--max-total-tokens", str(max_total_tokens),
        "--cuda-graph-max-bs-decode", str(a.graph_bs), "--disable-prefill-cuda-graph",
        "--random-seed", "0", "--log-level", "warning", "--host", "127.0.0.1", "--port", str(port),
    ] + (["--max-running-requests", str(a.max_running)] if a.max_running else [])  # fmt: skip


async def start(
    model: str, a: argparse.Namespace, max_total_tokens: int, log_path: str, *, extra: list[str] | None = None
) -> tuple[subprocess.Popen[Any], str]:
    """Start the server (:func:`http_argv` plus ``extra``) in its own process group, its output to
    ``log_path``, and wait until it answers: ``(process, URL)``.  Stop it with ``harness.stop_group``; one
    that never answers is stopped here."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out = open(log_path, "w")  # noqa: SIM115  (the server's, for as long as it runs)
    proc = subprocess.Popen(
        http_argv(model, port, a, max_total_tokens) + (extra or []),
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: stopped with all its children
    )
    try:
        await asyncio.to_thread(wait_http, url, proc, 900)
    except BaseException:  # not serving (or interrupted): stopped with its children, not left behind
        stop_group(proc)
        raise
    return proc, url


def wait_http(url: str, proc: subprocess.Popen[Any] | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the HTTP server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/get_model_info", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the HTTP server at {url} did not answer within {timeout:.0f}s")


async def generate(session: Any, url: str, prompt: list[int], n: int) -> dict[str, Any]:
    """One ``POST /generate`` (an aiohttp session): ``input_ids``, temperature 1, ``ignore_eos``, logprobs on."""
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True},
        "return_logprob": True,
    }
    async with session.post(url + "/generate", json=body) as resp:
        resp.raise_for_status()
        out: dict[str, Any] = await resp.json()
    return out


async def flush(url: str) -> None:
    """``POST /flush_cache``: the server's prefix cache emptied (failures ignored)."""
    req = urllib.request.Request(url + "/flush_cache", data=b"", method="POST")
    with contextlib.suppress(OSError):
        await asyncio.to_thread(lambda: urllib.request.urlopen(req, timeout=30).read())


def prefill_counter(http_url: str | None) -> float | None:
    """The scheduler's own count of prefill tokens computed (``--metrics``): SGLang's Prometheus counter,
    read from the in-process engine's multiprocess files or the HTTP server's /metrics."""
    try:
        if http_url:
            with urllib.request.urlopen(http_url + "/metrics", timeout=10) as r:
                text = r.read().decode()
            total = 0.0
            for line in text.splitlines():
                if line.startswith("sglang:realtime_tokens_total") and 'mode="prefill_compute"' in line:
                    total += float(line.rsplit(" ", 1)[1])
            return total
        path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if not path:
            return None
        from prometheus_client import CollectorRegistry
        from prometheus_client.multiprocess import MultiProcessCollector

        reg = CollectorRegistry()
        MultiProcessCollector(reg, path=path)
        total = 0.0
        for metric in reg.collect():
            for s in metric.samples:
                if s.name == "sglang:realtime_tokens_total" and s.labels.get("mode") == "prefill_compute":
                    total += s.value
        return total
    except Exception as exc:  # a cross-check only
        log(f"prefill counter unreadable: {type(exc).__name__}: {exc}")
        return None


async def fake_server(engine: Any) -> tuple[Any, str]:
    """CPU dry run only: an aiohttp stand-in for SGLang's /generate over the fake engine: ``(runner, URL)``;
    ``await runner.cleanup()`` stops it."""
    from aiohttp import web

    from rollout_sdk import GenerateRequest, SamplingParams

    seq = 0

    async def generate(request: web.Request) -> web.Response:
        nonlocal seq
        body = await request.json()
        sp = body["sampling_params"]
        seq += 1
        r = await engine.generate(
            GenerateRequest(
                input_ids=body["input_ids"],
                rid=f"http-{seq}",
                sampling=SamplingParams(max_new_tokens=sp["max_new_tokens"], ignore_eos=True),
            )
        )
        lps = [[lp, t, None] for lp, t in zip(r.logprobs or [], r.output_ids, strict=False)]
        return web.json_response({"output_ids": r.output_ids, "meta_info": {"output_token_logprobs": lps}})

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": "fake"})

    app = web.Application()
    app.add_routes([web.post("/generate", generate), web.get("/get_model_info", info)])
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"
