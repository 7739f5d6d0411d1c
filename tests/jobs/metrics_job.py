"""A torchrun job for tests/test_metrics.py: every serving rank exposes /metrics (--metrics-port 0), rank 0
drives a few requests, scrapes every rank's endpoint (found in the job's store) and writes a report.

    torchrun --standalone --nproc-per-node 2 tests/jobs/metrics_job.py --engine fake --metrics-port 0 --report r.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from rollout_sdk import RolloutClient, SamplingParams
from rollout_sdk.discovery.env import discovery_from_env
from rollout_sdk.launch import parse_launch_args, run


def _completed(url: str) -> float:
    with urllib.request.urlopen(url, timeout=30) as resp:
        text = resp.read().decode()
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "rollout_server_requests_total" and s.labels.get("outcome") == "completed"
    )


async def main() -> None:
    _, rest = parse_launch_args()
    p = argparse.ArgumentParser()
    p.add_argument("--report", required=True)
    report = p.parse_args(rest).report
    discovery = discovery_from_env()
    assert discovery is not None
    async with RolloutClient(discovery=discovery) as client:
        sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
        await asyncio.gather(*(client.generate([1, 2, 3], sampling=sp) for _ in range(10)))
        records = discovery.records  # type: ignore[attr-defined]
        scraped = {f"dp{r.dp_rank}": {"url": r.metrics_url} for r in records}
        for r in records:
            scraped[f"dp{r.dp_rank}"]["completed"] = await asyncio.to_thread(_completed, r.metrics_url)
    with open(report, "w") as f:
        json.dump(scraped, f)


if __name__ == "__main__":
    raise SystemExit(run(main))
