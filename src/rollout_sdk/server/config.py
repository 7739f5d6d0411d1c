"""``ServerConfig``: how an :class:`~rollout_sdk.server.EngineServer` binds, identifies itself, and the
bounds it serves under (docs/reliability.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ..auth import HOW_TO_ENABLE, ServerAuth, is_loopback
from ..errors import ConfigError
from ..protocol import DEFAULT_MAX_CONTROL_BYTES, DEFAULT_MAX_GENERATE_BYTES, MAX_TIMEOUT_S
from ..protocol.checks import check_config_types

__all__ = ["ServerConfig"]


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """How a server binds and identifies itself."""

    #: interface to bind ("0.0.0.0" for every interface)
    host: str = "127.0.0.1"
    #: 0 picks a free port (the only sensible choice unless a firewall demands otherwise)
    port: int = 0
    #: the host clients should use; defaults to ``host`` (or this machine's IP when binding 0.0.0.0)
    advertise_host: str | None = None
    #: stable name in stats, results and metrics labels; defaults to ``dp<dp_rank>@<host>:<port>`` (the
    #: rank and the bound address: the same after a restart on the same address)
    server_id: str | None = None
    #: seconds in-flight requests get to finish on stop() before they are aborted
    drain_timeout_s: float = 5.0
    #: stop() returns within this many seconds, whatever is pending (drain included)
    shutdown_timeout_s: float = 10.0
    #: bound on every control call (a ReleaseMemory that waits for idle, an engine hook that hangs)
    control_timeout_s: float = 900.0
    dp_rank: int = 0
    tp_size: int = 1
    #: largest encoded GenerateRequest accepted (bytes); larger frames are refused before decoding
    max_generate_bytes: int = DEFAULT_MAX_GENERATE_BYTES
    #: largest encoded control message, Ping or Abort accepted (bytes)
    max_control_bytes: int = DEFAULT_MAX_CONTROL_BYTES
    #: GenerateRequests larger than this are decoded in a worker process, off the event loop
    offload_decode_bytes: int = 256 << 10
    #: offloaded decodes waiting at once; beyond that the recv loop waits for one to finish
    max_offloaded_decodes: int = 8
    #: requests accepted at once (running or queued in the engine); more are answered ``busy``
    max_requests: int = 4096
    #: a client silent this long (no message, not even a Ping) is gone: its requests are aborted
    client_timeout_s: float = 30.0
    #: the stall detector (server/stall.py): an engine whose tokens/s per running request falls below
    #: ``stall_ratio`` x what a batch of its size made within the last 15 minutes, over ``stall_window_s``,
    #: is reported stalled (stats, metrics, one log line); so is a tick of the server's loop later than
    #: ``stall_loop_lag_s``.  It samples every ``stall_window_s / 10``; None turns it off
    stall_window_s: float | None = 10.0
    stall_ratio: float = 0.25
    stall_loop_lag_s: float = 2.0
    #: a stall's line is a WARNING (False: INFO, as the embedded default logs it: its engine shares the
    #: user's own machine, where a collapse is mostly that machine's other load; stats and metrics still
    #: report it)
    stall_warns: bool = True
    #: the garbage collector's youngest-generation threshold while the server serves (process-wide: the
    #: interpreter has one; only ever raised, and put back on stop).  With thousands of requests in flight
    #: the default 700 runs a collection every few dozen requests and a full one every few seconds
    #: (bench/request_path.py: ~20 us of a ~110 us request; docs/design.md).  None leaves it alone
    gc_threshold: int | None = 10_000

    #: CURVE keys and roles (``ServerAuth.from_env()``, ``JobSecret.server_auth()``); None: no
    #: authentication, which only a loopback bind allows
    auth: ServerAuth | None = None

    def __post_init__(self) -> None:
        check_config_types(self)  # a mistyped value fails here, naming the field, not deep inside
        if self.auth is None and not is_loopback(self.host):
            raise ConfigError("host", self.host, f"binding beyond loopback needs authentication: {HOW_TO_ENABLE}")
        for name in ("drain_timeout_s", "shutdown_timeout_s", "control_timeout_s", "client_timeout_s"):
            value = getattr(self, name)
            if not 0.0 < value <= MAX_TIMEOUT_S:
                raise ConfigError(name, value, f"must be in (0, {MAX_TIMEOUT_S:.0f}] seconds")
        if self.drain_timeout_s >= self.shutdown_timeout_s:
            raise ConfigError("drain_timeout_s", self.drain_timeout_s, "must be < shutdown_timeout_s")
        for name in ("max_generate_bytes", "max_control_bytes", "max_requests", "max_offloaded_decodes"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "must be >= 1")
        if self.stall_window_s is not None and not 0.0 < self.stall_window_s <= MAX_TIMEOUT_S:
            raise ConfigError("stall_window_s", self.stall_window_s, f"must be in (0, {MAX_TIMEOUT_S:.0f}] s or None")
        if not 0.0 < self.stall_ratio < 1.0:
            raise ConfigError("stall_ratio", self.stall_ratio, "must be in (0, 1)")
        if not 0.0 < self.stall_loop_lag_s <= MAX_TIMEOUT_S:
            raise ConfigError("stall_loop_lag_s", self.stall_loop_lag_s, f"must be in (0, {MAX_TIMEOUT_S:.0f}] seconds")
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", self.port, "must be in [0, 65535] (0: a free port)")
        if self.dp_rank < 0 or self.tp_size < 1:
            raise ConfigError("dp_rank/tp_size", (self.dp_rank, self.tp_size), "must be >= 0 and >= 1")
        if self.gc_threshold is not None and self.gc_threshold < 1:
            raise ConfigError("gc_threshold", self.gc_threshold, "must be >= 1, or None to leave the collector alone")
        if self.offload_decode_bytes < 0:
            raise ConfigError("offload_decode_bytes", self.offload_decode_bytes, "must be >= 0")
