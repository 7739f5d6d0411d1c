"""Cost per request of the client's metrics and lifecycle, and of one histogram observation: our bucketing
(rollout_sdk.metrics._Histogram) against prometheus-client's Histogram, side by side in one run.

    python bench/metrics_overhead.py [--n 100000] [--reps 5]

Prints medians of --reps repetitions (microseconds per call).
"""

from __future__ import annotations

import timeit

import harness
import msgspec
from prometheus_client import Histogram

from rollout_sdk.client.metrics import ClientMetrics
from rollout_sdk.client.scheduler import _lifecycle
from rollout_sdk.metrics import LATENCY_BUCKETS, _Histogram
from rollout_sdk.protocol import GenerateResult, Timings
from rollout_sdk.server.metrics import ServerMetrics


def main() -> None:
    p = harness.parser(__doc__, reps=5)
    p.add_argument("--n", type=int, default=100_000)
    a = p.parse_args()
    ph = Histogram("x_seconds", "d", ("server",), registry=None, buckets=LATENCY_BUCKETS)
    oh = _Histogram("y_seconds", "d", ("server",), LATENCY_BUCKETS)
    cm = ClientMetrics(lambda: (None, 0))  # type: ignore[arg-type,return-value]
    sm = ServerMetrics()
    r = GenerateResult(
        rid="x",
        output_ids=list(range(128)),
        finish_reason="length",
        prompt_tokens=64,
        logprobs=[0.0] * 128,
        timings=Timings(ttft_s=0.01, total_s=0.5),
        server_id="s",
    )
    rr = msgspec.structs.replace(r, lifecycle=_lifecycle(r, 1.0, 1.1, 0.5, 1, []))
    cases = {
        "prometheus-client Histogram.labels(s).observe": lambda: ph.labels("s").observe(0.3),
        "rollout_sdk _Histogram.observe": lambda: oh.observe(0.3, "s"),
        "lifecycle on a result (Lifecycle + struct replace)": lambda: msgspec.structs.replace(
            r, lifecycle=_lifecycle(r, 1.0, 1.1, 0.5, 1, [])
        ),
        "ClientMetrics.observe_result (3 histograms, 2 counters)": lambda: cm.observe_result(rr),
        "ServerMetrics.observe_result (3 histograms, 2 counters)": lambda: sm.observe_result("s", r),
    }
    res: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(a.reps):  # alternate the cases inside each repetition
        for k, fn in cases.items():
            res[k].append(timeit.timeit(fn, number=a.n) / a.n * 1e6)
    rows = [(k, f"{harness.median(v):.2f}") for k, v in res.items()]
    print(harness.markdown(["what", f"median us/call ({a.reps} reps of {a.n})"], rows))


if __name__ == "__main__":
    main()
