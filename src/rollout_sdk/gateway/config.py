"""``GatewayConfig``: everything a gateway can be told, checked once when it is made.

Its own module so that the gateway's parts (the turn service, the HTTP routes, the command line) read the
one config object instead of copies of its fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..agents.parsers import get_reasoning_parser
from ..auth import is_loopback
from ..errors import ConfigError
from ..protocol import MAX_KEEP_KV_S

__all__ = ["GatewayConfig"]


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    """Everything a :class:`Gateway` can be told (also the ``rollout-sdk gateway`` options)."""

    #: where to listen: loopback and a free port by default
    host: str = "127.0.0.1"
    port: int = 0
    #: the listening socket's accept queue: a burst of agents connecting at once beyond it is dropped
    #: and retried by the kernel (the OS caps it at net.core.somaxconn)
    backlog: int = 1024
    #: open connections at once: one more is answered 503 (too_many_connections) and closed at accept
    max_connections: int = 4096
    #: a connection that has not sent a whole request head this long after it opened or after its last
    #: answer (idle keep-alive included) is closed
    header_timeout_s: float = 30.0
    #: a request body not fully received this long after its handler began reading it: 408, connection closed
    body_timeout_s: float = 60.0
    #: the model name clients must send (default: the served model directory's name)
    model_name: str | None = None
    #: the tokenizer / chat template (a local HF directory); default: the served model's, or the embedded one
    tokenizer: str | None = None
    #: open sessions plus finished ones whose trajectories are not yet taken (429 beyond)
    max_sessions: int = 10_000
    #: served turns per session (each choice of each call is one)
    max_turns_per_session: int = 1024
    #: largest ``n``
    max_n: int = 16
    max_messages: int = 4096
    #: request bodies above this get a 413
    max_body_bytes: int = 16 * 1024 * 1024
    #: model calls in flight at once (429 beyond)
    max_in_flight: int = 8192
    #: max_tokens when a request gives none (fitted to the context)
    default_max_tokens: int = 1024
    #: bound on one model call (None: no bound)
    request_timeout_s: float | None = 600.0
    #: a session with no call for this long is finished (None: never)
    session_idle_timeout_s: float | None = 3600.0
    #: a request with an unknown session key opens that session (else 404: create sessions first)
    auto_sessions: bool = True
    #: of max_sessions, how many sessions opened that way may hold at once (429 beyond); the rest is kept
    #: for sessions the trainer opens (POST /v1/sessions, Gateway.session()).  None: 90% of max_sessions
    max_auto_sessions: int | None = None
    #: if set, the session endpoints (create, reward, finish, info) need ``Authorization: Bearer <admin_key>``;
    #: required to listen beyond loopback (the same rule as ``rollout-sdk serve``)
    admin_key: str | None = None
    #: append finished trajectories to this file (then the gateway consumes them, not trajectories())
    trajectories_jsonl: str | None = None
    #: "auto" or "strict": what to do with templates that rewrite earlier turns (see ChatTemplate)
    template_strategy: str = "auto"
    #: the tool-call parser (rollout_sdk.agents.get_parser)
    parser: str = "hermes"
    #: the reasoning parser ("none", "think": a leading <think>...</think> is returned as reasoning:
    #: chat ``reasoning_content``, a Responses reasoning item, a Messages thinking block; tokens stay exact)
    reasoning_parser: str = "none"
    #: exported sessions whose records stay readable at GET /v1/sessions/{id}/trajectory (oldest dropped)
    keep_exported: int = 1024
    #: each call asks the engine to keep its session's KV this long after the reply (the agent runs its
    #: tools, then calls again: docs/agents.md, "KV kept through tool waits"); None: off
    keep_kv_s: float | None = 60.0
    #: GET /v1/trajectories/stream consumers at once (429 beyond)
    max_export_streams: int = 16
    #: a record sent on an export stream and not acknowledged (POST /v1/trajectories/ack) for this long goes
    #: back to the queue for the next consumer (at-least-once delivery: docs/gateway.md)
    export_ack_timeout_s: float = 60.0
    #: times an aborted generation (a trainer's pause) is continued from its tokens
    max_resumes: int = 8

    def __post_init__(self) -> None:
        if self.admin_key is None and not is_loopback(self.host):
            raise ConfigError(
                "host", self.host, "listening beyond loopback needs an admin key: pass --admin-key (admin_key=...)"
            )
        if self.admin_key is not None and not self.admin_key.strip():
            raise ConfigError("admin_key", "<empty>", "must not be empty")
        for name in (
            "max_sessions",
            "max_turns_per_session",
            "max_n",
            "max_messages",
            "max_body_bytes",
            "max_in_flight",
            "default_max_tokens",
            "backlog",
            "max_export_streams",
            "max_connections",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "must be >= 1")
        if not 0 <= self.port < 65536:
            raise ConfigError("port", self.port, "must be in [0, 65535]")
        for name in ("export_ack_timeout_s", "header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, getattr(self, name), "must be > 0")
        for name in ("request_timeout_s", "session_idle_timeout_s"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ConfigError(name, v, "must be > 0 or None")
        if self.template_strategy not in ("auto", "strict"):
            raise ConfigError("template_strategy", self.template_strategy, "must be 'auto' or 'strict'")
        if self.max_auto_sessions is not None and not 0 <= self.max_auto_sessions <= self.max_sessions:
            raise ConfigError("max_auto_sessions", self.max_auto_sessions, "must be in [0, max_sessions]")
        if self.max_resumes < 0:
            raise ConfigError("max_resumes", self.max_resumes, "must be >= 0")
        if self.keep_exported < 0:
            raise ConfigError("keep_exported", self.keep_exported, "must be >= 0")
        if self.keep_kv_s is not None and not 0 < self.keep_kv_s <= MAX_KEEP_KV_S:
            raise ConfigError("keep_kv_s", self.keep_kv_s, f"must be in (0, {MAX_KEEP_KV_S:.0f}] seconds, or None")
        get_reasoning_parser(self.reasoning_parser)  # a ConfigError naming it, before anything opens
