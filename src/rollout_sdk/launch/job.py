"""What every torchrun rank runs: ``run_job``.

Per rank (one process, one uvloop event loop)::

    init_process_group (gloo by default) ── device mesh (dp, tp)
    connect to torchrun's store (MASTER_ADDR:MASTER_PORT)
    rank 0 ........ publishes the job prefix and the number of servers
    TP leaders .... start an EngineServer (its engine spans the TP group), then register its address
    rank 0 ........ with a driver: runs the user's ``async main()`` (RolloutClient() finds the servers
                    through the store), then publishes {p}/shutdown
    every rank .... waits on: SIGTERM/SIGINT, or {p}/shutdown (a watcher thread on the store),
                    or its driver finishing; then servers drain and close, the process group is
                    destroyed, and the process exits 0 (1 when the driver failed)

Authentication: with a job secret in the environment (``ROLLOUT_SDK_SECRET_FILE``, inherited by every
rank from torchrun on each node; never put in the store) servers require CURVE keys, the driver's client
holds the control key, and every store value the job writes is sealed (``seal``); the shutdown watcher
ignores a shutdown key that is not.  Across nodes (servers bind 0.0.0.0) a job without a secret refuses
to start.  A job without a secret (one node, servers on loopback) still seals its store values: local
rank 0 makes a key for the job and writes it to a 0600 file in a 0700 directory of this user's
(:func:`job_key_path`); after a barrier every rank reads it (``ROLLOUT_SDK_JOB_KEY_FILE`` in their
environment), so the job acts on no record from the network (docs/security.md).

TP members other than the leader hold no engine: they stay in the process group (for collectives such as
weight sync) and wait for shutdown without blocking anything.  A rank that dies makes torchrun stop the
others and exit non-zero, naming the rank (torchrun's own failure handling; the entry is wrapped in
``@record`` so the error summary carries the traceback).  An engine that dies inside a live server does not
end the job: the TP leader rebuilds it in place (same process, same process group) up to
``max_engine_restarts`` times and registers the new server, which clients add by themselves
(``StoreDiscovery.watch``) once it serves their weights; past the bound the server keeps answering
EngineDeadError and clients route around it::

    TP leader ... engine keeper: waits on the engine's death (engine.wait_dead)
                  then: closes the server (its requests fail over), builds a new engine and server on a
                  new port, registers it ({p}/server/<dp>, {p}/member/<k>); bound: max_engine_restarts
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._aio import cancel_and_wait, first_exception
from .._transport import local_ip
from ..auth import HOW_TO_ENABLE, JobSecret, is_loopback
from ..discovery.env import ENV_NUM_SERVERS, ENV_PREFIX, ENV_STORE
from ..discovery.keyfiles import key_dir, key_file_name, private_dir, remove_stale
from ..discovery.store import (
    ENV_JOB_KEY_FILE,
    ROOT,
    ServerRecord,
    StoreKeys,
    connect_store,
    in_daemon_thread,
    register_server,
    seal,
    unseal,
    wait_keys,
)
from ..engines import registry
from ..engines.base import Engine
from ..engines.registry import EngineConfigs
from ..errors import ConfigError
from ..metrics import MetricsEndpoint, start_metrics_endpoint
from ..server import EngineServer, ServerConfig
from ..server.metrics import ServerMetrics
from .cli import THREADS_GRACE_S, run_async
from .layout import Layout

__all__ = ["LaunchConfig", "run_job"]

log = logging.getLogger("rollout_sdk.launch")

Main = Callable[[], Coroutine[Any, Any, Any]]


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """How a torchrun job lays out and serves its engines."""

    #: GPUs (ranks) per engine; the world size must be a multiple
    tp: int = 1
    #: engine backend: "cpu", "sglang" or "fake"
    engine: str = "cpu"
    #: model directory for the cpu / sglang engines (cpu default: the embedded tiny model)
    model: str | None = None
    #: interface servers bind; default 127.0.0.1 on one node, 0.0.0.0 across nodes
    host: str | None = None
    #: address published for clients; default the bind host, or this node's IP when binding 0.0.0.0
    advertise_host: str | None = None
    #: torch.distributed backend of the job's process group ("gloo" or "nccl")
    dist_backend: str = "gloo"
    #: how long the driver waits for every server to register
    discovery_timeout_s: float = 600.0
    #: seconds in-flight requests get when the job stops
    drain_timeout_s: float = 5.0
    #: root of the store keys (change it to run two jobs on one store)
    store_prefix: str = ROOT
    #: serve Prometheus /metrics on every serving rank (None: off; 0: a free port, published in the
    #: server's store record; N: port N + the rank's local rank)
    metrics_port: int | None = None
    #: times a TP leader rebuilds its engine after it dies (0: never; the server then answers engine_dead)
    max_engine_restarts: int = 3

    def __post_init__(self) -> None:
        if self.max_engine_restarts < 0:
            raise ConfigError("max_engine_restarts", self.max_engine_restarts, "must be >= 0")
        if self.engine not in ("cpu", "sglang", "fake"):
            raise ConfigError("engine", self.engine, "must be 'cpu', 'sglang' or 'fake'")
        if self.dist_backend not in ("gloo", "nccl"):
            raise ConfigError("dist_backend", self.dist_backend, "must be 'gloo' or 'nccl'")


def make_engine(cfg: LaunchConfig, engines: EngineConfigs, layout: Layout) -> Engine:
    """This rank's engine (engines.registry), SGLang's TP layout defaulted from the job's."""
    if cfg.engine == "sglang" and layout.tp_spans_nodes:
        raise ConfigError("tp", layout.tp, f"exceeds the GPUs per node ({layout.local_world_size})")
    tp = {"tp_size": layout.tp, "base_gpu_id": layout.local_rank}
    return registry.make_engine(cfg.engine, engines, model=cfg.model, sglang_defaults=tp)


def run_job(main: Main | None, cfg: LaunchConfig, engines: EngineConfigs | None = None) -> int:
    """Run this rank's part of the job; return the process exit code."""
    import torch.distributed as dist  # lazy: cli-start
    from torch.distributed.device_mesh import init_device_mesh  # lazy: cli-start

    layout, secret = preflight(cfg)
    engines = engines or EngineConfigs()
    log.info("%s", layout.describe())
    dist.init_process_group(cfg.dist_backend)
    key_file: Path | None = None

    def remove_key() -> None:  # in the finally below, and before a hard exit (which skips every finally)
        if key_file is not None and layout.local_rank == 0:
            key_file.unlink(missing_ok=True)

    try:
        mesh = init_device_mesh(
            "cuda" if cfg.dist_backend == "nccl" else "cpu", (layout.dp, layout.tp), mesh_dim_names=("dp", "tp")
        )
        store_secret = secret
        if store_secret is None:  # no secret: a key of the job's own seals its store values
            store_secret, key_file = _share_job_key(layout, dist.barrier)
        store_address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        store = connect_store(store_address)
        rank_job = _RankJob(layout, cfg, engines, store, store_address, mesh, secret, store_secret=store_secret)
        # a thread stuck in a collective does not hold the rank past its bound (torchrun SIGKILLs at 30 s)
        return int(run_async(rank_job.run(main), threads_grace_s=THREADS_GRACE_S, before_hard_exit=remove_key))
    finally:
        remove_key()
        dist.destroy_process_group()


def job_key_path(layout: Layout, env: Mapping[str, str] | None = None) -> Path:
    """Where the ranks of this node find the per-job store key of a job without a secret: a directory of
    this user's (0700), the file named by the torchrun agent (every rank's parent: its pid and start time),
    its run id and restart count (``discovery/keyfiles.py``)."""
    env = os.environ if env is None else env
    name = key_file_name(
        os.getppid(), env.get("TORCHELASTIC_RUN_ID", "none"), env.get("TORCHELASTIC_RESTART_COUNT", "0")
    )
    return key_dir(env) / name


def _share_job_key(layout: Layout, barrier: Callable[[], Any]) -> tuple[JobSecret, Path]:
    """A job without a secret (one node: ``preflight``): local rank 0 makes a fresh key and writes it where
    only this user can read it; after a barrier every rank reads it.  It seals the job's store values and
    is set in the environment (:data:`ENV_JOB_KEY_FILE`) for the driver's discovery and its children.
    Key files of jobs that are gone (a rank killed with SIGKILL runs no ``finally``) are removed first."""
    path = job_key_path(layout)
    if layout.local_rank == 0:
        private_dir(path.parent)
        for stale in remove_stale(path.parent):
            log.info("removed the key file of a job that is gone: %s", stale)
        path.unlink(missing_ok=True)  # a stale one of a crashed run with the same agent
        JobSecret.generate().write(path)
    barrier()
    key = JobSecret.read(path)
    os.environ[ENV_JOB_KEY_FILE] = str(path)
    if layout.rank == 0:  # once per job, not once per rank
        log.info("no job secret: the job's store values are sealed with a key of its own (%s)", path)
    return key, path


def preflight(cfg: LaunchConfig) -> tuple[Layout, JobSecret | None]:
    """This rank's layout and the job secret; ConfigError when the servers would bind beyond loopback
    without one (or the secret file is unsafe)."""
    layout = Layout.from_env(cfg.tp)
    secret = JobSecret.from_env()
    host = bind_host(cfg, layout)
    if secret is None and not is_loopback(host):
        raise ConfigError("host", host, f"servers bind beyond loopback and need authentication: {HOW_TO_ENABLE}")
    if secret is None and layout.nnodes > 1:  # the job's own store key is shared through a file on one node
        raise ConfigError("nnodes", layout.nnodes, f"a job across nodes needs a job secret: {HOW_TO_ENABLE}")
    return layout, secret


def _try_get(store: Any, name: str) -> bytes | None:
    """The value of ``name``, or None when it is not there (a store ``get`` would block for it)."""
    try:
        return bytes(store.get(name)) if store.check([name]) else None
    except Exception:  # deleted between the check and the get: the get timed out
        return None


def bind_host(cfg: LaunchConfig, layout: Layout) -> str:
    """The interface servers bind: ``cfg.host``, else loopback on one node and every interface across nodes."""
    return cfg.host or ("0.0.0.0" if layout.nnodes > 1 else "127.0.0.1")


class _RankJob:
    def __init__(
        self,
        layout: Layout,
        cfg: LaunchConfig,
        engines: EngineConfigs,
        store: Any,
        store_address: str,
        mesh: Any,
        secret: JobSecret | None = None,
        *,
        store_secret: JobSecret | None = None,
    ) -> None:
        self.secret = secret  # the job's secret: servers authenticate with it
        # seals the store values: the job secret's key, else the job's own key (None only in unit tests)
        store_secret = store_secret if store_secret is not None else secret
        self.store_key = store_secret.store_key if store_secret is not None else None
        self.layout = layout
        self.cfg = cfg
        self.engines = engines
        self.store = store
        self.store_address = store_address
        self.mesh = mesh
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.keys = StoreKeys(f"{cfg.store_prefix}/a{restart}")
        self.server: EngineServer | None = None
        self.metrics_endpoint: MetricsEndpoint | None = None
        self._server_metrics: ServerMetrics | None = None  # one per rank, kept across engine restarts
        self.engine_restarts = 0
        self._stop = asyncio.Event()
        self._stop_reason = ""
        self._loop: asyncio.AbstractEventLoop | None = None

    def stop(self, reason: str) -> None:
        if not self._stop.is_set():
            self._stop_reason = reason
            self._stop.set()

    async def run(self, main: Main | None) -> int:
        layout = self.layout
        loop = self._loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop, signal.Signals(sig).name)
        if layout.is_driver:
            await asyncio.to_thread(self._publish_job)
            log.info(
                "rollout-sdk job: %d server(s) of tp=%d; store %s (ROLLOUT_SDK_STORE=%s finds them)",
                layout.dp,
                layout.tp,
                self.store_address,
                self.store_address,
            )
        try:
            async with asyncio.TaskGroup() as tg:  # the rank's tasks: shutdown watch, engine keeper, driver
                return await self._run_tasks(tg, main)
        except BaseExceptionGroup as group:
            raise first_exception(group) from group

    async def _run_tasks(self, tg: asyncio.TaskGroup, main: Main | None) -> int:
        layout, cfg = self.layout, self.cfg
        # Wakes when any rank publishes {p}/shutdown; this rank publishes it too when it stops, which
        # also ends its own wait.
        watcher = tg.create_task(in_daemon_thread(self._watch_shutdown), name="shutdown-watch")
        code = 0
        keeper: asyncio.Task[None] | None = None
        try:
            if layout.is_leader:
                await self._start_server()
                keeper = tg.create_task(self._keep_engine(), name="engine-keeper")
            driver: asyncio.Task[int] | None = None
            if layout.is_driver and main is not None:
                os.environ[ENV_STORE] = self.store_address
                os.environ[ENV_NUM_SERVERS] = str(layout.dp)
                os.environ[ENV_PREFIX] = cfg.store_prefix
                driver = tg.create_task(self._drive(main), name="driver")
            await self._stop.wait()
            log.info("rank %d stopping: %s", layout.rank, self._stop_reason)
            if driver is not None:
                if not driver.done():
                    driver.cancel()
                try:
                    code = await driver
                except asyncio.CancelledError:
                    code = 1 if self._stop_reason != "driver finished" else 0
        finally:
            if keeper is not None:
                await cancel_and_wait(keeper)
            if not await asyncio.to_thread(self._shutdown_published):  # store calls block: off the loop
                reason = f"rank {layout.rank}: {self._stop_reason or 'stopped'}"
                await asyncio.to_thread(self._set, self.keys.shutdown, reason.encode())
            if self.server is not None:
                await self.server.aclose()
            if self.metrics_endpoint is not None:
                await self.metrics_endpoint.aclose()
            await watcher
        return code

    async def _drive(self, main: Main) -> int:
        """The driver's exit code (its failure is logged here, not raised into the rank's task group); its
        end, whatever it is, stops the rank."""
        try:
            await main()
            return 0
        except Exception:
            log.exception("the driver failed")
            return 1
        finally:
            self.stop("driver finished")

    def _set(self, name: str, body: bytes) -> None:
        """Write a store value, sealed with the job secret when there is one (blocking)."""
        self.store.set(name, seal(self.store_key, name, body))

    def _shutdown_published(self) -> bool:
        """A valid (signed, when the job has a secret) shutdown is already in the store."""
        name = self.keys.shutdown
        return bool(self.store.check([name])) and unseal(self.store_key, name, self.store.get(name)) is not None

    def _publish_job(self) -> None:
        self._set(StoreKeys.latest(self.cfg.store_prefix), self.keys.prefix.encode())
        self._set(self.keys.num_servers, str(self.layout.dp).encode())

    def _watch_shutdown(self) -> None:
        # A connection of its own: a TCPStore client serves one request at a time, and this one blocks.
        store = connect_store(self.store_address)
        name = self.keys.shutdown
        while not wait_keys(store, [name], float("inf")):
            data = _try_get(store, name)
            if data is None:  # another rank's watcher cleared a forgery meanwhile
                continue
            reason = unseal(self.store_key, name, data)
            if reason is not None:
                assert self._loop is not None
                self._loop.call_soon_threadsafe(self.stop, f"job shutdown: {reason.decode(errors='replace')}")
                return
            # Not signed with the job secret: ignore it, and clear it so that the wait can go on.  A signed
            # value written in the one round trip between the second get and the delete would be lost: the
            # store has no compare-and-delete (docs/security.md, "what the store does not protect").
            log.warning("ignored a shutdown key in the store that is not signed with the job secret")
            if _try_get(store, name) == data:
                store.delete_key(name)

    def _metrics_url(self, advertise: str) -> str:
        if self.metrics_endpoint is None:
            return ""
        host = f"[{advertise}]" if ":" in advertise else advertise
        return f"http://{host}:{self.metrics_endpoint.port}/metrics"

    async def _keep_engine(self) -> None:
        """Rebuild this rank's engine in place when it dies, at most ``max_engine_restarts`` times."""
        while True:
            assert self.server is not None
            exc = await self.server.engine.wait_dead()
            if self.engine_restarts >= self.cfg.max_engine_restarts:
                log.error(
                    "dp %d: engine died (%s) after %d restart(s); not restarting again (max_engine_restarts=%d)",
                    self.layout.dp_rank,
                    exc,
                    self.engine_restarts,
                    self.cfg.max_engine_restarts,
                )
                return
            self.engine_restarts += 1
            log.warning(
                "dp %d: engine died (%s); restarting it (%d of %d)",
                self.layout.dp_rank,
                exc,
                self.engine_restarts,
                self.cfg.max_engine_restarts,
            )
            old, self.server = self.server, None
            await old.aclose()  # its requests are answered (engine_dead); clients fail them over
            await self._start_server()

    async def _start_server(self) -> None:
        layout, cfg = self.layout, self.cfg
        host = bind_host(cfg, layout)
        advertise = cfg.advertise_host or (local_ip() if host in ("0.0.0.0", "*") else host)
        engine = make_engine(cfg, self.engines, layout)
        if cfg.metrics_port is not None and self._server_metrics is None:
            self._server_metrics = ServerMetrics()
            port = cfg.metrics_port + layout.local_rank if cfg.metrics_port > 0 else 0
            self.metrics_endpoint = await asyncio.to_thread(
                start_metrics_endpoint, self._server_metrics.registry, host=host, port=port
            )
        self.server = EngineServer(
            engine,
            ServerConfig(
                host=host,
                advertise_host=advertise,
                server_id=f"dp{layout.dp_rank}",
                drain_timeout_s=cfg.drain_timeout_s,
                dp_rank=layout.dp_rank,
                tp_size=layout.tp,
                auth=self.secret.server_auth() if self.secret is not None else None,
            ),
            metrics=self._server_metrics,
        )
        await self.server.__aenter__()
        record = ServerRecord(
            address=self.server.address,
            dp_rank=layout.dp_rank,
            tp_size=layout.tp,
            global_rank=layout.rank,
            node_rank=layout.node_rank,
            pid=os.getpid(),
            backend=engine.backend,
            model=engine.model_name,
            metrics_url=self._metrics_url(advertise),
            incarnation=self.server.incarnation,
        )
        await asyncio.to_thread(register_server, self.store, self.keys, record, self.store_key)
        log.info("dp %d serving at %s", layout.dp_rank, self.server.address)
