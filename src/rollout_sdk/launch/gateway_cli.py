"""``rollout-sdk gateway``: the gateway as a process.

    rollout-sdk gateway                                  # embedded CPU engine, loopback, free port
    rollout-sdk gateway --servers tcp://10.0.0.5:40123 --port 8000 --trajectories-jsonl out.jsonl

Prints ``READY http://host:port/v1`` once listening (and writes that URL to ``--address-file``); stops
on SIGTERM / SIGINT, finishing every open session (written to ``--trajectories-jsonl`` when given).
Importing this module imports no HTTP stack.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import sys

from ..client import ClientConfig, RolloutClient
from ..errors import ConfigError
from ..gateway.config import GatewayConfig
from ..gateway.gateway import Gateway
from ..models.tiny import ensure_tiny_model
from ..protocol.engine_config import CpuEngineConfig
from .args import add_config_args, config_from_args, port_number, server_address, writable_file

__all__ = ["add_parser", "check", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    g = sub.add_parser(
        "gateway",
        usage="%(prog)s [--servers ADDR ...] [--port PORT] [options]",
        help="serve an OpenAI-compatible API that records every token (docs/gateway.md)",
        description="An OpenAI/Anthropic-compatible HTTP API in front of the engines that records every token "
        "of every session.  Prints READY http://host:port/v1 once listening.",
    )
    g.add_argument(
        "--servers",
        nargs="*",
        type=server_address,
        default=None,
        help="engine servers, tcp://host:port each (default: an embedded CPU engine)",
    )
    g.add_argument("--address-file", type=writable_file, default=None, help="write the base URL here once listening")
    add_config_args(g, GatewayConfig, title="gateway", extra_help=_GATEWAY_HELP)
    add_config_args(g, ClientConfig, prefix="client-", title="client")
    add_config_args(g, CpuEngineConfig, prefix="engine-", title="embedded CPU engine (without --servers)")


#: GatewayConfig fields whose source comment is shared with a neighbour, or absent
_GATEWAY_HELP = {
    "port": "the port to listen on (0: a free one)",
    "max_messages": "messages in one request (400 beyond)",
}


def check(args: argparse.Namespace) -> str | None:
    """The gateway's options, checked before anything starts: None, or the one line that says what is wrong."""
    try:
        port_number(str(args.port))
        if args.trajectories_jsonl is not None:
            writable_file(args.trajectories_jsonl)
        if args.tokenizer is not None and not os.path.isdir(os.path.expanduser(args.tokenizer)):
            return f"--tokenizer: {args.tokenizer!r} is not a directory"
        if args.engine_model_path is not None and not os.path.isdir(os.path.expanduser(args.engine_model_path)):
            return f"--engine-model-path: {args.engine_model_path!r} is not a directory"
        config_from_args(GatewayConfig, args)
        config_from_args(ClientConfig, args, prefix="client-")
        config_from_args(CpuEngineConfig, args, prefix="engine-")
    except argparse.ArgumentTypeError as exc:
        return str(exc)
    except ConfigError as exc:
        return str(exc)
    return None


async def run(args: argparse.Namespace) -> int:
    config = config_from_args(GatewayConfig, args)
    client_cfg = config_from_args(ClientConfig, args, prefix="client-")
    engine = None if args.servers else config_from_args(CpuEngineConfig, args, prefix="engine-")
    if engine is not None and engine.model_path is None:
        engine = await _tiny_model_engine(engine)
    elif engine is not None:  # a first line at once (the engine's own start says every few seconds it goes on)
        print(f"gateway: serving the embedded CPU engine with {engine.model_path}", file=sys.stderr, flush=True)
    else:
        print(f"gateway: connecting to {', '.join(args.servers)}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    client = RolloutClient(servers=args.servers or None, engine=engine, config=client_cfg)
    async with client, Gateway(client, config=config) as gw:
        if args.address_file:
            await asyncio.to_thread(_write_address, args.address_file, gw.url)
        print(f"READY {gw.url}", flush=True)
        await stop.wait()
    return 0


async def _tiny_model_engine(engine: CpuEngineConfig) -> CpuEngineConfig:
    """The embedded default model, said once as information (the client's own line is a warning, meant for
    code that forgot ``servers=``; here the default is what ``rollout-sdk gateway`` with no flags asks for)."""
    path = await asyncio.to_thread(ensure_tiny_model, engine.home)
    print(
        "gateway: serving the embedded CPU engine with the tiny Qwen2 model (random weights, for trying the API: "
        'replies are arbitrary tokens); --engine-model-path "$(rollout-sdk make-model tool)" serves the trained '
        "tool model (it calls a calculator tool), --servers ... or --engine-model-path PATH a real model",
        file=sys.stderr,
        flush=True,
    )
    return dataclasses.replace(engine, model_path=str(path))


def _write_address(path: str, url: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(url)
    os.replace(tmp, path)
