"""Admission from the engine's capacity: the controller's rule, and the client holding to it on real sockets."""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout_sdk import AdmissionConfig, AdmissionController, ConfigError, GenerateRequest, RolloutClient
from rollout_sdk.engines.fake import FakeEngineConfig


def _observe(c: AdmissionController, **kw: object) -> bool:
    args: dict[str, object] = {"max_running": 100, "running": 0, "queued": 0, "kv_usage": 0.1, "others": 0}
    args.update(kw)
    return c.observe(**args)  # type: ignore[arg-type]


def test_fallback_until_the_engine_reports_capacity() -> None:
    c = AdmissionController(AdmissionConfig(fallback=77))
    assert c.limit == 77
    _observe(c, max_running=None)
    assert c.limit == 77 and c.max_running is None


def test_window_is_running_limit_plus_queue() -> None:
    c = AdmissionController(AdmissionConfig(queue_fraction=0.25, min_queue=8))
    assert _observe(c, max_running=4096) is True  # 512 -> 4096 + 1024: grew
    assert c.limit == 4096 + 1024
    _observe(c, max_running=16)
    assert c.limit == 16 + 8  # the minimum queue wins on a small engine


def test_other_clients_load_is_subtracted() -> None:
    c = AdmissionController(AdmissionConfig(queue_fraction=0.0, min_queue=0))
    _observe(c, max_running=100, others=70)
    assert c.limit == 30
    _observe(c, max_running=100, others=500)
    assert c.limit == 1  # never below min_limit: a server must always make progress


def test_ceiling_caps_everything() -> None:
    c = AdmissionController(AdmissionConfig(ceiling=64))
    assert c.limit == 64
    _observe(c, max_running=4096)
    assert c.limit == 64


def test_kv_bound_server_gets_only_a_short_queue_with_hysteresis() -> None:
    c = AdmissionController(AdmissionConfig(queue_fraction=0.5, min_queue=4, kv_high=0.9, kv_low=0.7))
    _observe(c, max_running=100, running=60, queued=0, kv_usage=0.95)
    assert not c.kv_bound and c.limit == 150  # full KV but nothing queued: not yet bound
    _observe(c, max_running=100, running=60, queued=20, kv_usage=0.95)
    assert c.kv_bound and c.limit == 64  # runs 60, so 60 + a short queue
    _observe(c, max_running=100, running=70, queued=5, kv_usage=0.8)
    assert c.kv_bound and c.limit == 74  # between the thresholds: still bound
    assert _observe(c, max_running=100, running=70, queued=0, kv_usage=0.5) is True
    assert not c.kv_bound and c.limit == 150


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"ceiling": 0}, "max_in_flight_per_server=0"),
        ({"fallback": 0}, "admission.fallback=0"),
        ({"queue_fraction": -1.0}, "admission.queue_fraction=-1.0"),
        ({"min_queue": -1}, "admission.min_queue=-1"),
        ({"kv_low": 0.95, "kv_high": 0.9}, "admission.kv_low"),
        ({"min_limit": 0}, "admission.min_limit=0"),
    ],
)
def test_bad_config_names_the_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        AdmissionConfig(**kw)  # type: ignore[arg-type]


@given(
    max_running=st.one_of(st.none(), st.integers(-5, 1 << 20)),
    running=st.integers(-5, 1 << 20),
    queued=st.integers(-5, 1 << 20),
    kv=st.one_of(st.none(), st.floats(-1.0, 2.0, allow_nan=False)),
    others=st.integers(-5, 1 << 20),
    ceiling=st.one_of(st.none(), st.integers(1, 1 << 16)),
)
def test_limit_is_always_within_bounds(
    max_running: int | None, running: int, queued: int, kv: float | None, others: int, ceiling: int | None
) -> None:
    cfg = AdmissionConfig(ceiling=ceiling)
    c = AdmissionController(cfg)
    c.observe(max_running=max_running, running=running, queued=queued, kv_usage=kv, others=others)
    assert c.limit >= cfg.min_limit
    if ceiling is not None:
        assert c.limit <= ceiling
    if max_running is not None and max_running > 0 and not c.kv_bound:
        queue = max(cfg.min_queue, math.ceil(cfg.queue_fraction * max_running))
        assert c.limit <= max(cfg.min_limit, max_running + queue)


async def test_client_window_follows_the_servers_running_limit(fake_servers) -> None:
    gate = asyncio.Event()
    (server,) = await fake_servers(1, FakeEngineConfig(step_base_s=0.001, max_batch=8), gate=gate)
    admission = AdmissionConfig(queue_fraction=0.25, min_queue=2)
    async with RolloutClient(servers=[server.address], admission=admission) as client:
        conn = client.servers[0]
        assert conn.window.max_running == 8  # known from the handshake, before any request
        assert conn.window.limit == 10
        assert client.scheduler.window() == 10
        tasks = [
            asyncio.create_task(client.generate(GenerateRequest(input_ids=[1, 2, i + 3]), timeout=60))
            for i in range(30)
        ]
        while len(server.engine.requests_seen) < 10:  # type: ignore[attr-defined]
            await asyncio.sleep(0.005)
        assert conn.in_flight == 10
        assert client.scheduler.num_waiting == 20  # the rest wait in the client
        gate.set()
        assert len(await asyncio.gather(*tasks)) == 30
        assert len(server.engine.requests_seen) == 30  # type: ignore[attr-defined]


async def test_fixed_cap_is_only_a_ceiling(fake_servers) -> None:
    (server,) = await fake_servers(1, FakeEngineConfig(step_base_s=0.001, max_batch=8))
    async with RolloutClient(servers=[server.address], max_in_flight_per_server=3) as client:
        assert client.servers[0].window.limit == 3
    (instant,) = await fake_servers(1)  # reports no running limit: the fallback, under the ceiling
    async with RolloutClient(servers=[instant.address], max_in_flight_per_server=1000) as client:
        assert client.servers[0].window.max_running is None
        assert client.servers[0].window.limit == AdmissionConfig().fallback
