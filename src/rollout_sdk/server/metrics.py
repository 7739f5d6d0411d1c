"""Prometheus metrics of the engine servers of a process: the server's side of :mod:`rollout_sdk.metrics`."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..metrics import CONTROL_BUCKETS, LATENCY_BUCKETS, _by_outcome, _counted, _Histogram
from ..protocol import GenerateResult, ServerStats


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

        snapshots = [(sid, snapshot()) for sid, snapshot in servers]
        stalls = CounterMetricFamily(
            "rollout_server_engine_stalls",
            "Stalls the stall detector declared (server/stall.py).",
            labels=["server"],
        )
        for sid, s in snapshots:
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
        yield from fams.values()
        yield _by_outcome(
            "rollout_server_requests",
            "Requests answered, by outcome (completed, aborted, error).",
            ((sid, s.completed, s.aborted, s.errors) for sid, s in snapshots),
        )
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
        yield _counted(
            "rollout_server_control_errors",
            "Control calls that failed, by operation.",
            ["server", "operation"],
            control_errors,
        )
        for h in (self.request_duration, self.queue_duration, self.ttft, self.control_duration):
            yield h.collect()
