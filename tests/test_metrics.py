"""Prometheus metrics: live /metrics endpoints scraped over HTTP (client, server, the serve CLI)."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rollout_sdk import EngineServer, RolloutClient, SamplingParams, ServerConfig
from rollout_sdk.client.metrics import ClientMetrics
from rollout_sdk.engines.fake import FakeEngine, FakeEngineConfig
from rollout_sdk.metrics import render_metrics, serve_metrics
from rollout_sdk.server.metrics import ServerMetrics

ROOT = Path(__file__).resolve().parents[1]


def _scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """name -> {sorted labels: value} for every sample of the exposition at ``url``."""
    with urllib.request.urlopen(url, timeout=30) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def _total(samples: dict[tuple[tuple[str, str], ...], float], **labels: str) -> float:
    want = set(labels.items())
    return sum(v for k, v in samples.items() if want <= set(k))


async def test_client_and_server_metrics_scraped_live() -> None:
    server_metrics = ServerMetrics()
    servers = [
        EngineServer(FakeEngine(FakeEngineConfig()), ServerConfig(server_id=f"m{i}"), metrics=server_metrics)
        for i in range(2)
    ]
    for s in servers:
        await s.__aenter__()
    try:
        async with RolloutClient([s.address for s in servers]) as client:
            sp = SamplingParams(max_new_tokens=5, ignore_eos=True)
            results = await asyncio.gather(*(client.generate([1, 2, 3], sampling=sp) for _ in range(12)))
            await client.set_weight_version(7)
            async with serve_metrics(client.metrics.registry, server_metrics.registry) as ep:
                got = await asyncio.to_thread(_scrape, ep.url)
    finally:
        for s in servers:
            await s.aclose()

    n_tokens = sum(len(r.output_ids) for r in results)
    assert n_tokens == 60
    # client side
    assert _total(got["rollout_client_requests_total"], outcome="completed") == 12
    assert _total(got["rollout_client_requests_total"], outcome="error") == 0
    assert _total(got["rollout_client_output_tokens_total"]) == n_tokens
    assert _total(got["rollout_client_prompt_tokens_total"]) == 36
    assert _total(got["rollout_client_request_duration_seconds_count"]) == 12
    per_server = {dict(k)["server"] for k in got["rollout_client_request_duration_seconds_count"]}
    assert per_server == {"m0", "m1"}
    assert _total(got["rollout_client_requests_in_flight"]) == 0
    assert _total(got["rollout_client_server_up"]) == 2
    assert _total(got["rollout_client_weight_version"]) == 7
    assert _total(got["rollout_client_retries_total"]) == 0
    # server side: the same requests as the servers counted them
    assert _total(got["rollout_server_requests_total"], outcome="completed") == 12
    assert _total(got["rollout_server_output_tokens_total"]) == n_tokens
    assert _total(got["rollout_server_request_duration_seconds_count"]) == 12
    assert _total(got["rollout_server_weight_version"]) == 14  # 7 on each server
    assert _total(got["rollout_server_control_duration_seconds_count"], operation="set_weight_version") == 2
    # every result carries its lifecycle, consistent with the client's clock
    for r in results:
        lc = r.lifecycle
        assert lc is not None and lc.server_id in ("m0", "m1") and lc.attempts == 1
        assert lc.queued_at <= lc.dispatched_at <= lc.finished_at


async def test_failovers_and_errors_are_counted() -> None:
    server_metrics = ServerMetrics()
    slow = FakeEngine(FakeEngineConfig(step_base_s=0.01))
    a = EngineServer(slow, ServerConfig(server_id="a"), metrics=server_metrics)
    b = EngineServer(FakeEngine(FakeEngineConfig()), ServerConfig(server_id="b"), metrics=server_metrics)
    await a.__aenter__()
    await b.__aenter__()
    try:
        async with RolloutClient([a.address, b.address], policy="round_robin", retries=1) as client:
            with pytest.raises(Exception, match="vocabulary"):
                await client.generate([10**9])  # a request's error, counted as one
            conn_a = next(c for c in client.servers if c.server_id == "a")
            sp = SamplingParams(max_new_tokens=10_000, ignore_eos=True)
            task = asyncio.ensure_future(client.generate([1, 2], sampling=sp, session_id="s"))
            client.scheduler._sessions["s"] = conn_a
            deadline = time.monotonic() + 60
            while conn_a.num_pending == 0:  # the request is on server a
                assert time.monotonic() < deadline
                await asyncio.sleep(0.005)
            conn_a.mark_dead("test: server a lost")  # the client fails it over to b
            result = await task
            body, ctype = render_metrics(client.metrics.registry)
    finally:
        await a.aclose()
        await b.aclose()
    assert ctype.startswith("text/plain")
    got = {
        s.name: s.value
        for fam in text_string_to_metric_families(body.decode())
        for s in fam.samples
        if dict(s.labels).get("server", "a") == "a"
    }
    assert result.lifecycle is not None
    assert result.lifecycle.attempts == 2
    assert result.lifecycle.failed_over_from == ["a"]
    assert result.lifecycle.server_id == "b"
    assert got["rollout_client_failovers_total"] == 1
    assert got["rollout_client_retries_total"] == 1
    assert got["rollout_client_server_up"] == 0
    errors = [
        s.value
        for fam in text_string_to_metric_families(body.decode())
        for s in fam.samples
        if s.name == "rollout_client_requests_total" and s.labels["outcome"] == "error"
    ]
    assert sum(errors) == 2  # the bad request, and the one that server a lost


def test_tool_metrics_fold_unknown_names() -> None:
    m = ClientMetrics(lambda: (_empty_stats(), 0))
    m.observe_tool_call("add", 0.01, error_kind=None)
    m.observe_tool_call("add", 0.02, error_kind="raised")
    for i in range(50):  # a model inventing names must not grow the label set
        m.observe_tool_call(f"made_up_{i}", 0.0, error_kind="unknown_tool")
    fams = {f.name: f for f in m.registry.collect()}
    calls = {tuple(sorted(s.labels.items())): s.value for s in fams["rollout_agent_tool_calls"].samples}
    assert calls[(("outcome", "ok"), ("tool", "add"))] == 1
    assert calls[(("outcome", "raised"), ("tool", "add"))] == 1
    assert calls[(("outcome", "unknown_tool"), ("tool", "<unknown>"))] == 50
    counts = [s for s in fams["rollout_agent_tool_duration_seconds"].samples if s.name.endswith("_count")]
    assert {s.labels["tool"] for s in counts} == {"add", "<unknown>"}


def test_nothing_lands_in_the_default_registry() -> None:
    RolloutClient(["tcp://127.0.0.1:1"])  # never opened
    ServerMetrics()
    names = {s.name for fam in prometheus_client.REGISTRY.collect() for s in fam.samples}
    assert not [n for n in names if n.startswith("rollout_")]
    # a user's own registry takes the client's collector
    mine = prometheus_client.CollectorRegistry()
    mine.register(RolloutClient(["tcp://127.0.0.1:1"]).metrics)
    assert any(f.name == "rollout_client_requests" for f in mine.collect())


def _empty_stats():
    from rollout_sdk import ClientStats

    return ClientStats(
        servers=[],
        in_flight=0,
        waiting=0,
        completed=0,
        aborted=0,
        errors=0,
        retried=0,
        latency_p50_s=None,
        latency_p90_s=None,
        latency_p99_s=None,
    )


@pytest.mark.slow
def test_serve_cli_metrics_endpoint(sdk_home: Path) -> None:
    """``rollout-sdk serve --metrics-port 0`` serves /metrics; a client's requests show up in it."""
    env = dict(os.environ, ROLLOUT_SDK_HOME=str(sdk_home), PYTHONUNBUFFERED="1")
    from conftest import start_cli

    proc = start_cli("serve", "--engine", "fake", "--metrics-port", "0", env=env)
    try:
        lines = _read_until(proc, "READY ", 90)
        url = next(ln.split()[1] for ln in lines if ln.startswith("METRICS "))
        address = lines[-1].split()[1]

        async def use() -> None:
            async with RolloutClient([address]) as client:
                for _ in range(3):
                    await client.generate([5, 6], sampling=SamplingParams(max_new_tokens=4, ignore_eos=True))

        asyncio.run(use())
        got = _scrape(url)
        assert _total(got["rollout_server_requests_total"], outcome="completed") == 3
        assert _total(got["rollout_server_output_tokens_total"]) == 12
        assert _total(got["rollout_server_engine_up"]) == 1
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()


def _read_until(proc: subprocess.Popen[str], prefix: str, timeout: float) -> list[str]:
    """Lines of ``proc``'s stdout up to the one starting with ``prefix`` (read on a thread: no select on a
    buffered pipe, which would miss lines already in the buffer)."""
    assert proc.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout or ()], daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        seen.append(line)
        if line.startswith(prefix):
            return seen
    raise RuntimeError(f"no {prefix!r} line; output:\n{''.join(seen)}")


@pytest.mark.slow
def test_torchrun_launch_serves_metrics_per_rank(tmp_path: Path, sdk_home: Path) -> None:
    """``--metrics-port 0`` under torchrun: each serving rank publishes its endpoint in the store."""
    report = tmp_path / "report.json"
    env = dict(os.environ, ROLLOUT_SDK_HOME=str(sdk_home), PYTHONUNBUFFERED="1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    job = [str(ROOT / "tests" / "jobs" / "metrics_job.py"), "--engine", "fake", "--metrics-port", "0"]
    proc = subprocess.run(
        [*torchrun, *job, "--report", str(report)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(report.read_text())
    assert sorted(got) == ["dp0", "dp1"]
    assert all(v["url"].startswith("http://127.0.0.1:") and v["url"].endswith("/metrics") for v in got.values())
    assert sum(v["completed"] for v in got.values()) == 10


async def test_agent_tool_calls_land_in_the_client_metrics(fake_servers, tiny_model: Path) -> None:
    from rollout_sdk.agents import AgentConfig, RolloutContext, ToolAgent
    from rollout_sdk.models import load_tokenizer
    from test_agents import USER, Script, _client, call, registry

    tok = load_tokenizer(str(tiny_model))
    script = Script(tok, [call("add", a=1, b=2), call("divide", a=1, b=2), "12"])
    client, _ = await _client(fake_servers, script)
    async with client:
        traj = await ToolAgent(tok, registry(), AgentConfig()).run(RolloutContext(client), USER)
        fams = {f.name: f for f in client.metrics.registry.collect()}
    assert [c.name for t in traj.turns for c in t.tool_calls] == ["add", "divide"]
    calls = {tuple(sorted(s.labels.items())): s.value for s in fams["rollout_agent_tool_calls"].samples}
    assert calls == {(("outcome", "ok"), ("tool", "add")): 1, (("outcome", "unknown_tool"), ("tool", "<unknown>")): 1}
