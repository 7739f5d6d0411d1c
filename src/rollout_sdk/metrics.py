"""Prometheus metrics for clients, servers and agent tools, on registries the caller owns.

Nothing here touches ``prometheus_client``'s global default registry: each :class:`ClientMetrics` and
:class:`ServerMetrics` keeps its own :class:`~prometheus_client.CollectorRegistry` (``.registry``) and is
itself a collector, so a user's own exporter can take it either way::

    my_registry.register(client.metrics)                    # one collector among the user's own
    body, content_type = render_metrics(client.metrics.registry)   # or render it (a gateway does this)

    async with serve_metrics(client.metrics.registry, port=0) as endpoint:   # or an HTTP /metrics
        print(endpoint.url)                                                  # http://127.0.0.1:PORT/metrics

Counts that the client and server keep anyway (requests by outcome, failovers, in-flight, queued) are read
at scrape time from their ``stats()`` snapshots, so there is one source of truth and no hot-path cost;
durations are observed into histograms as they happen.  Every name follows Prometheus conventions
(base units, ``_total`` counters, ``_seconds`` histograms); docs/observability.md lists them all.  Tokens
per second is ``rate(rollout_client_output_tokens_total[1m])``.

Concurrency: observations happen on the owner's event loop; scrapes run on the HTTP endpoint's thread.
Histograms are bucketed here (:class:`_Histogram`, ~0.5 us an observation against ~7 us for
prometheus-client's ``Histogram.observe`` measured on the dev machine, and a request makes three) and exposed
through prometheus-client's ``HistogramMetricFamily``.  A scrape copies the counts it reads, so one
exposition is consistent (``_count`` equals the ``+Inf`` bucket); ``_sum`` may lag by the observation in
progress.  The stats snapshots read plain ints and lists that the event loop mutates, which under the GIL
gives a consistent-enough view for monitoring (never for control).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import math
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = [
    "MetricsEndpoint",
    "render_metrics",
    "serve_metrics",
    "start_metrics_endpoint",
]

#: request latencies from milliseconds (tiny CPU requests) to many minutes (long-tail GPU rollouts)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
#: weight updates and control calls: tens of milliseconds (IPC) to minutes (a cold NCCL group)
CONTROL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
#: tool calls: sub-millisecond Python functions to sandboxed code runs
TOOL_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60)
#: label value for tool names the model made up (keeps label cardinality bounded)
UNKNOWN_TOOL = "<unknown>"
_MAX_TOOL_LABELS = 256


class _Histogram:
    """A labelled histogram with fixed buckets: ``observe`` is a bisect and two additions."""

    def __init__(self, name: str, doc: str, labelnames: tuple[str, ...], buckets: tuple[float, ...]) -> None:
        self.name = name
        self.doc = doc
        self.labelnames = list(labelnames)
        self.bounds = tuple(buckets)
        self._series: dict[tuple[str, ...], list[float]] = {}  # labels -> [count per bucket..., +Inf, sum]

    def observe(self, value: float, *labels: str) -> None:
        if not math.isfinite(value):
            return
        series = self._series.get(labels)
        if series is None:
            series = self._series[labels] = [0.0] * (len(self.bounds) + 2)
        series[bisect.bisect_left(self.bounds, value)] += 1
        series[-1] += value

    def collect(self) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        for labels, series in list(self._series.items()):
            snap = list(series)
            cumulative, buckets = 0.0, []
            for bound, n in zip((*self.bounds, math.inf), snap[:-1], strict=True):
                cumulative += n
                buckets.append(("+Inf" if bound == math.inf else repr(float(bound)), cumulative))
            fam.add_metric(list(labels), buckets, sum_value=snap[-1])
        return fam


def _counted(name: str, doc: str, labels: list[str], counts: Mapping[tuple[str, str], int]) -> CounterMetricFamily:
    """A labelled counter family with one sample per key of ``counts`` (a copy the scrape took), in key order."""
    family = CounterMetricFamily(name, doc, labels=labels)
    for key, n in sorted(counts.items()):
        family.add_metric(list(key), n)
    return family


def _by_outcome(name: str, doc: str, ended: Iterable[tuple[str, int, int, int]]) -> CounterMetricFamily:
    """Requests that ended on each server by outcome, from ``(server, completed, aborted, errors)`` rows of
    stats snapshots (the client's and the server's both count them)."""
    family = CounterMetricFamily(name, doc, labels=["server", "outcome"])
    for server, completed, aborted, errors in ended:
        family.add_metric([server, "completed"], completed)
        family.add_metric([server, "aborted"], aborted)
        family.add_metric([server, "error"], errors)
    return family


def render_metrics(*registries: CollectorRegistry) -> tuple[bytes, str]:
    """The text exposition of ``registries`` and its content type: what a ``/metrics`` handler returns."""
    return b"".join(generate_latest(r) for r in registries), CONTENT_TYPE_LATEST


# -- the HTTP endpoint ------------------------------------------------------------------------------


class MetricsEndpoint:
    """A ``/metrics`` HTTP endpoint on its own thread (prometheus-client's server).  ``close()`` stops it."""

    def __init__(self, registries: Iterable[CollectorRegistry], host: str, port: int) -> None:
        regs = list(registries)
        registry = regs[0] if len(regs) == 1 else _merged(regs)
        self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        self.host = host
        self.port: int = self._httpd.server_port
        self._closed = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and join the thread (blocks up to the server's 0.5 s poll).  Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)


def _merged(registries: list[CollectorRegistry]) -> CollectorRegistry:
    merged = CollectorRegistry(auto_describe=False)
    merged.register(_Union(registries))
    return merged


class _Union(Collector):
    def __init__(self, registries: list[CollectorRegistry]) -> None:
        self._registries = registries

    def collect(self) -> Iterator[Metric]:
        for r in self._registries:
            yield from r.collect()


def start_metrics_endpoint(*registries: CollectorRegistry, host: str = "127.0.0.1", port: int = 0) -> MetricsEndpoint:
    """Serve ``registries`` at ``http://host:port/metrics`` (port 0 picks a free one: see ``.port``)."""
    if not registries:
        raise ValueError("start_metrics_endpoint() needs at least one registry")
    return MetricsEndpoint(registries, host, port)


@contextlib.asynccontextmanager
async def serve_metrics(
    *registries: CollectorRegistry, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[MetricsEndpoint]:
    """``async with serve_metrics(reg) as ep:`` a ``/metrics`` endpoint for the block's lifetime."""
    endpoint = await asyncio.to_thread(start_metrics_endpoint, *registries, host=host, port=port)
    try:
        yield endpoint
    finally:
        await endpoint.aclose()
