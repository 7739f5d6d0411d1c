"""The stall detector (server/stall.py): the rule on made-up samples, then a real server around a fake
engine that is slowed down while it runs (waits on conditions with generous deadlines, never on timing)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from rollout_sdk import RolloutClient, SamplingParams
from rollout_sdk.engines.fake import FakeEngine, FakeEngineConfig
from rollout_sdk.server import EngineServer, ServerConfig
from rollout_sdk.server.stall import Sample, StallDetector


def feed(d: StallDetector, start: float, seconds: int, *, rate: float, running: int, p0: int = 0) -> tuple[int, list]:
    """One sample a second at ``rate`` tokens/s per running request; returns (progress, lines)."""
    p, lines = p0, []
    for i in range(seconds):
        p += int(rate * running)
        line = d.observe(Sample(t=start + i, progress=p, running=running))
        if line:
            lines.append(line)
    return p, lines


def test_steady_progress_is_no_stall() -> None:
    d = StallDetector(window_s=5, history_s=60)
    _, lines = feed(d, 0, 60, rate=30, running=1024)
    assert not d.stalled and lines == [] and d.stalls == 0


def test_collapse_at_the_same_batch_size_is_a_stall_and_recovery_clears_it() -> None:
    d = StallDetector(window_s=5, ratio=0.25, history_s=60)
    p, _ = feed(d, 0, 30, rate=30, running=1024)
    p, lines = feed(d, 30, 20, rate=3, running=1024, p0=p)
    assert d.stalled and d.stalls == 1
    assert len(lines) == 1 and "collapsed" in lines[0] and "1024 running" in lines[0]
    _, lines = feed(d, 50, 20, rate=30, running=1024, p0=p)
    assert not d.stalled and d.stalls == 1 and len(lines) == 1 and "back" in lines[0]


def test_a_smaller_batch_going_faster_per_request_is_not_a_reference_for_a_big_one() -> None:
    """The tail of a pass: 8 requests decode much faster each than 1,024 do; a new big batch is no stall."""
    d = StallDetector(window_s=5, ratio=0.25, history_s=60)
    p, _ = feed(d, 0, 20, rate=200, running=8)
    _, lines = feed(d, 20, 30, rate=30, running=1024, p0=p)
    assert not d.stalled and lines == []


def test_nothing_running_is_never_a_stall_and_ends_one() -> None:
    d = StallDetector(window_s=5, history_s=60)
    p, _ = feed(d, 0, 20, rate=30, running=64)
    p, _ = feed(d, 20, 12, rate=1, running=64, p0=p)
    assert d.stalled
    line = d.observe(Sample(t=40, progress=p, running=0))
    assert not d.stalled and line is not None
    for i in range(30):  # idle: no progress, no stall
        assert d.observe(Sample(t=41 + i, progress=p, running=0)) is None
    assert not d.stalled


def feed_mix(
    d: StallDetector, start: float, seconds: int, *, rate: float, prefill: float, running: int, p0: tuple[int, int]
) -> tuple[tuple[int, int], list]:
    """As ``feed``, with ``prefill`` prompt tokens/s per running request counted too."""
    (p, q), lines = p0, []
    for i in range(seconds):
        p, q = p + int(rate * running), q + int(prefill * running)
        line = d.observe(Sample(t=start + i, progress=p, running=running, prefilled=q))
        if line:
            lines.append(line)
    return (p, q), lines


def test_a_prefill_burst_is_not_compared_with_decoding() -> None:
    """Issue 37: the demo's CPU engine decodes ~5x fewer tokens per request while it prefills 128 second
    turns; that window is compared only with windows of a similar prefill share, so it is no stall, and
    neither is the decoding after a prefill-heavy start; a collapse at the same mix still is."""
    d = StallDetector(window_s=5, ratio=0.25, history_s=60)
    pq, lines = feed_mix(d, 0, 15, rate=2, prefill=40, running=128, p0=(0, 0))  # first turns' prefill
    pq, more = feed_mix(d, 15, 15, rate=20, prefill=0, running=128, p0=pq)  # decoding
    lines += more
    pq, more = feed_mix(d, 30, 15, rate=3, prefill=60, running=100, p0=pq)  # second turns' prefill
    lines += more
    assert not d.stalled and lines == [] and d.stalls == 0
    _, lines = feed_mix(d, 45, 15, rate=2, prefill=0, running=100, p0=pq)  # decoding collapses
    assert d.stalled and len(lines) == 1 and "collapsed" in lines[0]


def test_without_a_prefill_count_the_burst_is_a_stall() -> None:
    """The same burst from an engine that does not count its prefills (progress only): the rule cannot
    tell it from a collapse; why the CPU engine counts them."""
    d = StallDetector(window_s=5, ratio=0.25, history_s=60)
    p, _ = feed(d, 0, 15, rate=20, running=128)
    _, lines = feed(d, 15, 15, rate=3, running=100, p0=p)
    assert d.stalled and len(lines) == 1


def test_a_late_tick_is_a_loop_stall_until_the_next_timely_one() -> None:
    d = StallDetector(window_s=5, loop_lag_s=2.0, history_s=60)
    assert d.observe(Sample(t=0, progress=None, running=3, lag_s=0.01)) is None
    line = d.observe(Sample(t=5, progress=None, running=3, lag_s=4.0))
    assert d.stalled and line is not None and "blocked" in line
    assert d.observe(Sample(t=5.5, progress=None, running=3, lag_s=0.01)) is not None
    assert not d.stalled and d.stalls == 1


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="ratio"):
        StallDetector(ratio=1.5)
    from rollout_sdk import ConfigError

    with pytest.raises(ConfigError, match="stall_ratio"):
        ServerConfig(stall_ratio=0)
    with pytest.raises(ConfigError, match="stall_window_s"):
        ServerConfig(stall_window_s=-1)


async def _until(cond, what: str, timeout: float = 120.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.02)
    assert cond(), what


@pytest.mark.parametrize("warns", [True, False])
async def test_a_server_reports_an_engine_that_slows_down_and_recovers(
    caplog: pytest.LogCaptureFixture, warns: bool
) -> None:
    """A fake engine decoding 32 long requests is slowed 50x mid-run: stats, metrics and one log line say
    so (a WARNING, or INFO with ``stall_warns=False``, as the embedded default logs it: issue 37); sped up
    again, the stall is over.  The requests all finish."""
    from rollout_sdk.metrics import render_metrics
    from rollout_sdk.server.metrics import ServerMetrics

    caplog.set_level(logging.INFO, logger="rollout_sdk.server")
    config = FakeEngineConfig(step_base_s=0.004, max_batch=64)
    engine = FakeEngine(config)
    metrics = ServerMetrics()
    config = ServerConfig(stall_window_s=0.5, server_id="stall-test", stall_warns=warns)
    server = EngineServer(engine, config, metrics=metrics)
    async with server, RolloutClient(servers=[server.address]) as client:
        sp = SamplingParams(max_new_tokens=100_000, ignore_eos=True)
        tasks = [asyncio.create_task(client.generate([1, 2, 3], sampling=sp)) for _ in range(32)]
        await _until(lambda: engine.progress() > 32 * 100, "the engine decodes")
        seen = engine.progress()
        await _until(lambda: engine.progress() > seen + 32 * 200, "a reference at full speed")
        # a loaded machine can slow the fake down by itself: start from a server that reports no stall, and
        # count from there
        await _until(lambda: not server.stats().stalled, "no stall before the slow-down")
        before = server.stats().stalls
        engine.step_scale = 50.0  # 50x slower steps
        await _until(lambda: server.stats().stalls > before, "the stall is reported")
        st = server.stats()
        assert st.stalled and "collapsed" in st.stall_reason
        assert b"rollout_server_engine_stalled" in render_metrics(metrics.registry)[0]
        said = [r for r in caplog.records if "stall: engine progress collapsed" in r.getMessage()]
        assert said and {r.levelno for r in said} == {logging.WARNING if warns else logging.INFO}
        engine.step_scale = 1.0
        await _until(lambda: not server.stats().stalled, "the stall is over")
        assert server.stats().stalls > before
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_the_embedded_default_logs_a_stall_as_information(tiny_model) -> None:
    """RolloutClient()'s embedded engine shares the user's machine: its stalls are INFO (issue 37: the demo
    printed a WARNING whenever the machine's other load slowed it); a served engine's stay WARNING."""
    from rollout_sdk import CpuEngineConfig
    from rollout_sdk.discovery import EmbeddedServers

    assert ServerConfig().stall_warns
    embedded = EmbeddedServers(CpuEngineConfig(model_path=str(tiny_model)))
    await embedded.open(300)
    try:
        assert [s.config.stall_warns for s in embedded.servers] == [False]
    finally:
        await embedded.close()
