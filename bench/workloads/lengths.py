"""Long-tailed response lengths: one synchronous RL step's batch (bench/load_balance.py, bench/gpu_fleet.py).

Lognormal (seeded), rounded, clipped to ``[1, cap]`` (RL always has a response-length cap).  ``skewed``:
B=512, median 64 tokens, sigma 1.0, cap 1024; ``throughput``: B=2048, median 24, sigma 0.5, cap 256 (eight
batches' worth per server, so the servers are throughput-bound rather than bound by the longest request).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    name: str
    batch: int
    median: float
    sigma: float
    cap: int

    def lengths(self, seed: int) -> list[int]:
        """The batch's response lengths, the same for a seed on every run and machine."""
        rng = random.Random(seed)
        mu = math.log(self.median)
        return [min(self.cap, max(1, round(rng.lognormvariate(mu, self.sigma)))) for _ in range(self.batch)]


WORKLOADS = {
    "skewed": Workload("skewed", batch=512, median=64, sigma=1.0, cap=1024),
    "throughput": Workload("throughput", batch=2048, median=24, sigma=0.5, cap=256),
}
