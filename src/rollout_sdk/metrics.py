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
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from .protocol import GenerateResult, ServerStats

if TYPE_CHECKING:
    from .client import ClientStats

__all__ = [
    "ClientMetrics",
    "MetricsEndpoint",
    "ServerMetrics",
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


def render_metrics(*registries: CollectorRegistry) -> tuple[bytes, str]:
    """The text exposition of ``registries`` and its content type: what a ``/metrics`` handler returns."""
    return b"".join(generate_latest(r) for r in registries), CONTENT_TYPE_LATEST


class ClientMetrics(Collector):
    """A :class:`~rollout_sdk.RolloutClient`'s metrics (``client.metrics``).

    ``snapshot`` returns the client's :class:`~rollout_sdk.ClientStats` and its weight version; the client
    calls the ``observe_*`` methods as requests finish, weights move and tools run.
    """

    def __init__(self, snapshot: Callable[[], tuple[ClientStats, int]]) -> None:
        self._snapshot = snapshot
        self._hist: list[_Histogram] = []
        self.request_duration = self._histogram(
            "rollout_client_request_duration_seconds",
            "Dispatch to reply of requests that got a result, per server (client clock).",
            ("server",),
            LATENCY_BUCKETS,
        )
        self.queue_wait = self._histogram(
            "rollout_client_queue_wait_seconds",
            "Time requests waited in the client for a server slot (back-pressure).",
            (),
            LATENCY_BUCKETS,
        )
        self.ttft = self._histogram(
            "rollout_client_time_to_first_token_seconds",
            "Dispatch to first token, for engines that report it.",
            (),
            LATENCY_BUCKETS,
        )
        self.weight_update_duration = self._histogram(
            "rollout_client_weight_update_duration_seconds",
            "Wall time of update_weights calls that succeeded, by method.",
            ("method",),
            CONTROL_BUCKETS,
        )
        self.tool_duration = self._histogram(
            "rollout_agent_tool_duration_seconds", "Tool call latency, by tool.", ("tool",), TOOL_BUCKETS
        )
        # the token counters have one writer (the event loop) and are read whole on the scrape thread, so they
        # need no lock; the dicts below do (the scrape thread iterates them)
        self._lock = threading.Lock()
        self._output_tokens = 0
        self._prompt_tokens = 0
        self._updates: dict[tuple[str, str], int] = {}
        self._tools: dict[tuple[str, str], int] = {}
        self._known_tools: set[str] = set()
        self.registry = CollectorRegistry(auto_describe=False)  # no collect() at registration
        self.registry.register(self)

    def _histogram(self, name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...]) -> _Histogram:
        h = _Histogram(name, doc, labels, buckets)
        self._hist.append(h)
        return h

    # -- observations (event loop) ---------------------------------------------------------------

    def observe_result(self, result: GenerateResult) -> None:
        """A request finished with a result (also an abort result)."""
        lc = result.lifecycle
        if lc is not None:
            self.request_duration.observe(max(0.0, lc.finished_at - lc.dispatched_at), lc.server_id or "?")
            self.queue_wait.observe(max(0.0, lc.dispatched_at - lc.queued_at))
            if lc.first_token_at is not None:
                self.ttft.observe(max(0.0, lc.first_token_at - lc.dispatched_at))
        self._output_tokens += len(result.output_ids)
        self._prompt_tokens += result.prompt_tokens

    def observe_weight_update(self, method: str, seconds: float, *, ok: bool) -> None:
        if ok:
            self.weight_update_duration.observe(seconds, method)
        key = (method, "ok" if ok else "error")
        with self._lock:
            self._updates[key] = self._updates.get(key, 0) + 1

    def observe_tool_call(self, tool: str, seconds: float, *, error_kind: str | None) -> None:
        """One tool call.  Names of unknown tools are folded into one label value (``<unknown>``)."""
        if error_kind == "unknown_tool" or (
            tool not in self._known_tools and len(self._known_tools) >= _MAX_TOOL_LABELS
        ):
            tool = UNKNOWN_TOOL
        else:
            self._known_tools.add(tool)
        self.tool_duration.observe(seconds, tool)
        key = (tool, error_kind or "ok")
        with self._lock:
            self._tools[key] = self._tools.get(key, 0) + 1

    # -- collection (scrape thread) --------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        stats, version = self._snapshot()
        in_flight = GaugeMetricFamily(
            "rollout_client_requests_in_flight", "Requests sent and not yet answered, per server.", labels=["server"]
        )
        up = GaugeMetricFamily(
            "rollout_client_server_up", "1 while the server is alive for this client.", labels=["server"]
        )
        engine_running = GaugeMetricFamily(
            "rollout_client_engine_running", "Requests the server's engine decodes (last heartbeat).", labels=["server"]
        )
        engine_queued = GaugeMetricFamily(
            "rollout_client_engine_queued",
            "Requests waiting in the server's engine (last heartbeat).",
            labels=["server"],
        )
        requests = CounterMetricFamily(
            "rollout_client_requests",
            "Requests that ended, per server and outcome (completed, aborted, error).",
            labels=["server", "outcome"],
        )
        failovers = CounterMetricFamily(
            "rollout_client_failovers",
            "Requests moved to another server after this one failed them.",
            labels=["server"],
        )
        for s in stats.servers:
            sid = s.server_id
            in_flight.add_metric([sid], s.in_flight)
            up.add_metric([sid], 1.0 if s.alive else 0.0)
            engine_running.add_metric([sid], s.engine_running)
            engine_queued.add_metric([sid], s.engine_queued)
            requests.add_metric([sid, "completed"], s.completed)
            requests.add_metric([sid, "aborted"], s.aborted)
            requests.add_metric([sid, "error"], s.errors)
            failovers.add_metric([sid], s.failed_over)
        yield from (in_flight, up, engine_running, engine_queued, requests, failovers)
        yield GaugeMetricFamily(
            "rollout_client_requests_waiting", "Requests waiting in the client for a server slot.", value=stats.waiting
        )
        yield CounterMetricFamily("rollout_client_retries", "Requests retried on another server.", value=stats.retried)
        yield GaugeMetricFamily(
            "rollout_client_weight_version", "Last weight version pushed through this client.", value=version
        )
        out, prompt = self._output_tokens, self._prompt_tokens
        with self._lock:
            updates, tools = dict(self._updates), dict(self._tools)
        yield CounterMetricFamily("rollout_client_output_tokens", "Tokens generated (rate() is tokens/s).", value=out)
        yield CounterMetricFamily("rollout_client_prompt_tokens", "Prompt tokens of finished requests.", value=prompt)
        upd = CounterMetricFamily(
            "rollout_client_weight_updates",
            "update_weights calls, by method and outcome.",
            labels=["method", "outcome"],
        )
        for (method, outcome), n in sorted(updates.items()):
            upd.add_metric([method, outcome], n)
        yield upd
        calls = CounterMetricFamily(
            "rollout_agent_tool_calls",
            "Tool calls by tool and outcome (ok, or the error kind: unknown_tool, bad_arguments, raised, timeout).",
            labels=["tool", "outcome"],
        )
        for (tool, outcome), n in sorted(tools.items()):
            calls.add_metric([tool, outcome], n)
        yield calls
        for h in self._hist:
            yield h.collect()


class ServerMetrics(Collector):
    """Metrics of the :class:`~rollout_sdk.EngineServer` objects attached to it (label ``server``).

    Pass one to ``EngineServer(..., metrics=m)``: the server attaches itself while it serves.  Several
    servers in one process (the embedded default) share one ``ServerMetrics``.
    """

    def __init__(self) -> None:
        self._servers: dict[str, Callable[[], ServerStats]] = {}
        self._lock = threading.Lock()
        self._tokens: dict[str, list[int]] = {}  # server -> [prompt, output]
        self._control_errors: dict[tuple[str, str], int] = {}
        self.request_duration = _Histogram(
            "rollout_server_request_duration_seconds",
            "Receipt to reply of requests, measured by the server.",
            ("server",),
            LATENCY_BUCKETS,
        )
        self.queue_duration = _Histogram(
            "rollout_server_queue_duration_seconds",
            "Time requests waited inside the engine before their first step.",
            ("server",),
            LATENCY_BUCKETS,
        )
        self.ttft = _Histogram(
            "rollout_server_time_to_first_token_seconds",
            "Receipt to first token, for engines that report it.",
            ("server",),
            LATENCY_BUCKETS,
        )
        self.control_duration = _Histogram(
            "rollout_server_control_duration_seconds",
            "Control calls that succeeded (weight updates, pause, memory), by operation.",
            ("server", "operation"),
            CONTROL_BUCKETS,
        )
        self.registry = CollectorRegistry(auto_describe=False)  # no collect() at registration
        self.registry.register(self)

    def attach(self, server_id: str, stats: Callable[[], ServerStats]) -> None:
        with self._lock:
            self._servers[server_id] = stats
            self._tokens.setdefault(server_id, [0, 0])

    def detach(self, server_id: str) -> None:
        with self._lock:
            self._servers.pop(server_id, None)

    def observe_result(self, server_id: str, result: GenerateResult) -> None:
        t = result.timings
        self.request_duration.observe(t.total_s, server_id)
        self.queue_duration.observe(t.queue_s, server_id)
        if t.ttft_s > 0:
            self.ttft.observe(t.ttft_s, server_id)
        with self._lock:
            counts = self._tokens.setdefault(server_id, [0, 0])
            counts[0] += result.prompt_tokens
            counts[1] += len(result.output_ids)

    def observe_control(self, server_id: str, operation: str, seconds: float, *, ok: bool) -> None:
        if ok:
            self.control_duration.observe(seconds, server_id, operation)
        else:
            with self._lock:
                key = (server_id, operation)
                self._control_errors[key] = self._control_errors.get(key, 0) + 1

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            servers = list(self._servers.items())
            tokens = {k: list(v) for k, v in self._tokens.items()}
            control_errors = dict(self._control_errors)
        fams: dict[str, GaugeMetricFamily] = {}

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return fams.setdefault(name, GaugeMetricFamily(name, doc, labels=["server"]))

        requests = CounterMetricFamily(
            "rollout_server_requests",
            "Requests answered, by outcome (completed, aborted, error).",
            labels=["server", "outcome"],
        )
        stalls = CounterMetricFamily(
            "rollout_server_engine_stalls",
            "Stalls the stall detector declared (server/stall.py).",
            labels=["server"],
        )
        for sid, snapshot in servers:
            s = snapshot()
            stalls.add_metric([sid], s.stalls)
            gauge("rollout_server_requests_in_flight", "Requests the server holds now.").add_metric([sid], s.in_flight)
            gauge("rollout_server_engine_running", "Requests the engine decodes now.").add_metric([sid], s.running)
            gauge("rollout_server_engine_queued", "Requests waiting inside the engine.").add_metric([sid], s.queued)
            gauge("rollout_server_engine_queued_tokens", "Tokens those queued requests hold.").add_metric(
                [sid], s.queued_tokens
            )
            gauge("rollout_server_weight_version", "Weight version the engine serves.").add_metric(
                [sid], s.weight_version
            )
            gauge("rollout_server_engine_up", "1 while the engine is alive.").add_metric([sid], float(s.engine_alive))
            gauge("rollout_server_paused", "1 while generation is paused.").add_metric([sid], float(s.paused))
            gauge("rollout_server_draining", "1 while the server shuts down.").add_metric([sid], float(s.draining))
            gauge(
                "rollout_server_engine_stalled", "1 while the stall detector sees the engine's progress collapsed."
            ).add_metric([sid], float(s.stalled))
            if s.kv_usage is not None:
                gauge("rollout_server_kv_cache_usage_ratio", "Fraction of the KV cache in use.").add_metric(
                    [sid], s.kv_usage
                )
            requests.add_metric([sid, "completed"], s.completed)
            requests.add_metric([sid, "aborted"], s.aborted)
            requests.add_metric([sid, "error"], s.errors)
        yield from fams.values()
        yield requests
        yield stalls
        prompt = CounterMetricFamily(
            "rollout_server_prompt_tokens", "Prompt tokens of answered requests.", labels=["server"]
        )
        output = CounterMetricFamily(
            "rollout_server_output_tokens", "Tokens generated (rate() is tokens/s).", labels=["server"]
        )
        for sid, (p, o) in sorted(tokens.items()):
            prompt.add_metric([sid], p)
            output.add_metric([sid], o)
        yield prompt
        yield output
        errs = CounterMetricFamily(
            "rollout_server_control_errors", "Control calls that failed, by operation.", labels=["server", "operation"]
        )
        for (sid, op), n in sorted(control_errors.items()):
            errs.add_metric([sid, op], n)
        yield errs
        for h in (self.request_duration, self.queue_duration, self.ttft, self.control_duration):
            yield h.collect()


# -- the HTTP endpoint ------------------------------------------------------------------------------


class MetricsEndpoint:
    """A ``/metrics`` HTTP endpoint on its own thread (prometheus-client's server).  ``close()`` stops it."""

    def __init__(self, registries: Iterable[CollectorRegistry], host: str, port: int) -> None:
        from prometheus_client import start_http_server

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
