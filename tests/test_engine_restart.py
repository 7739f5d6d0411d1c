"""Under real torchrun: a TP leader whose engine dies rebuilds it in place, re-registers, and clients
that found the job through its store add the new server by themselves (issue 17)."""

from __future__ import annotations

import asyncio
import collections

import pytest

from rollout_sdk import RolloutClient, SamplingParams
from rollout_sdk.discovery.store import StoreDiscovery
from test_launch import _env, _start_service, tag  # noqa: F401  (tag is a fixture)

pytestmark = pytest.mark.slow


async def test_a_dead_engine_is_restarted_in_place_and_rejoins(sdk_home, tag) -> None:  # noqa: F811
    # 4 ranks, tp=2: two servers; each engine dies at its 10th request and is rebuilt (at most 3 times)
    job = _start_service(
        _env(sdk_home, tag),
        *("--tp", "2", "--engine", "fake", "--fake-die-after-requests", "10", "--max-engine-restarts", "3"),
    )
    try:
        sp = SamplingParams(max_new_tokens=4)
        async with RolloutClient(discovery=StoreDiscovery(job.store), retries=3, heartbeat_interval_s=0.2) as client:
            first = {c.server_id: c.incarnation for c in client.servers}
            assert sorted(first) == ["dp0", "dp1"]
            results = []
            for i in range(40):  # one at a time: each death is retried on the other server
                results.append(await client.generate([1, 2, i], sampling=sp, timeout=60))
                if i % 9 == 8:  # let the restarted servers rejoin before the next round of deaths
                    async with asyncio.timeout(60):
                        while sum(c.alive for c in client.servers) < 2:
                            await asyncio.sleep(0.05)
            st = client.stats()
        assert all(r.finish_reason == "length" and len(r.output_ids) == 4 for r in results)
        by_slot = collections.defaultdict(set)
        for r in results:
            by_slot[r.server_id].add(r.incarnation)
        # work was done by restarted engines, told apart from the ones that died
        assert sum(len(v) for v in by_slot.values()) >= 3, by_slot
        assert {s.server_id for s in st.retired} <= {"dp0", "dp1"} and st.retired
        assert any(s.incarnation != first[s.server_id] for s in st.servers)  # a restarted member serves
    finally:
        job.close()
