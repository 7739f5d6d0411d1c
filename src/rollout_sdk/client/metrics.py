"""Prometheus metrics of a client (``client.metrics``): the client's side of :mod:`rollout_sdk.metrics`."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..metrics import (
    _MAX_TOOL_LABELS,
    CONTROL_BUCKETS,
    LATENCY_BUCKETS,
    TOOL_BUCKETS,
    UNKNOWN_TOOL,
    _by_outcome,
    _counted,
    _Histogram,
)
from ..protocol import GenerateResult
from .stats import ClientStats


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
            failovers.add_metric([sid], s.failed_over)
        requests = _by_outcome(
            "rollout_client_requests",
            "Requests that ended, per server and outcome (completed, aborted, error).",
            ((s.server_id, s.completed, s.aborted, s.errors) for s in stats.servers),
        )
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
        yield _counted(
            "rollout_client_weight_updates",
            "update_weights calls, by method and outcome.",
            ["method", "outcome"],
            updates,
        )
        yield _counted(
            "rollout_agent_tool_calls",
            "Tool calls by tool and outcome (ok, or the error kind: unknown_tool, bad_arguments, raised, timeout).",
            ["tool", "outcome"],
            tools,
        )
        for h in self._hist:
            yield h.collect()
