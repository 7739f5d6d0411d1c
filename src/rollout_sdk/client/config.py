"""What a :class:`~rollout_sdk.client.RolloutClient` is told (``ClientConfig``) and where it is in its
lifecycle (``ClientState``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .._aio import LifecycleState
from ..errors import ConfigError
from ..protocol.checks import check_config_types
from ..rollouts.generator import UseClientDefault
from .scheduler import SchedulerConfig

__all__ = ["ClientConfig", "ClientState"]


#: Where a :class:`RolloutClient` is in its lifecycle (``client.state``): the one
#: :class:`~rollout_sdk._aio.LifecycleState` that the server, the gateway and the bridge share.
ClientState = LifecycleState


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """Everything a :class:`RolloutClient` can be told.  The client takes each field (and each of
    :class:`SchedulerConfig`'s: policy, max_in_flight_per_server, ...) as a keyword argument
    (:meth:`with_options`)."""

    #: routing, back-pressure and affinity: the scheduler's own config, held as is
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    #: default per-call timeout in seconds (None: no timeout)
    timeout_s: float | None = None
    #: times a request is retried on another server when its server dies
    retries: int = 1
    #: seconds between the client's heartbeats to each server
    heartbeat_interval_s: float = 1.0
    #: a server that answers no heartbeat for this long is marked dead
    heartbeat_timeout_s: float = 10.0
    #: how long a server that was found has to answer (open(), add_server); an unresolvable host name
    #: fails at once, and a wait longer than 2 s is logged
    connect_timeout_s: float = 15.0
    #: how long open() waits for the discovery to find the servers (a torchrun job's servers registering,
    #: the embedded default's engines starting)
    discovery_timeout_s: float = 300.0
    #: embedded default only: how many in-process CPU servers to start
    num_embedded_servers: int = 1

    def __post_init__(self) -> None:
        check_config_types(self)  # a mistyped value fails here, naming the field, not deep inside
        if self.retries < 0:
            raise ConfigError("retries", self.retries, "must be >= 0")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ConfigError("timeout_s", self.timeout_s, "must be > 0 or None")
        if self.heartbeat_interval_s <= 0:
            raise ConfigError("heartbeat_interval_s", self.heartbeat_interval_s, "must be > 0")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(
                "heartbeat_timeout_s", self.heartbeat_timeout_s, "must be larger than heartbeat_interval_s"
            )
        for name in ("connect_timeout_s", "discovery_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, getattr(self, name), "must be > 0")
        if self.num_embedded_servers < 1:
            raise ConfigError("num_embedded_servers", self.num_embedded_servers, "must be >= 1")

    def with_options(self, **options: Any) -> ClientConfig:
        """This config with ``options`` replaced, the one place ``RolloutClient(**options)`` lands: any field
        of ClientConfig, or of :class:`SchedulerConfig` (those go into ``scheduler``); an option given as
        ``USE_CLIENT_DEFAULT`` keeps the config's value.  An unknown name is a TypeError, as in any call."""
        own_names = {f.name for f in dataclasses.fields(self)} - {"scheduler"}
        sched_names = {f.name for f in dataclasses.fields(SchedulerConfig)}
        unknown = sorted(set(options) - own_names - sched_names)
        if unknown:
            raise TypeError(f"RolloutClient() got unexpected keyword arguments: {', '.join(unknown)}")
        given = {k: v for k, v in options.items() if not isinstance(v, UseClientDefault)}
        own = {k: v for k, v in given.items() if k in own_names}
        sched = {k: v for k, v in given.items() if k in sched_names}
        if sched:
            own["scheduler"] = dataclasses.replace(self.scheduler, **sched)
        return dataclasses.replace(self, **own) if own else self
