"""A child process driven one JSON line at a time over stdin/stdout: both ends.

The GPU benches run the SDK's client in its own process, as a trainer would, and drive it one pass at a
time from the process that holds the engine.  The parent::

    client = await harness.ClientProc([sys.executable, __file__, "--client", address]).started()
    row = await client.run(mode="sdk", workload="grpo")    # one command out, one JSON row back
    client.close()                                          # {"quit": true}, then wait (kill if stuck)

The child (the same script, started with ``--client``)::

    pipe = await harness.Pipe.open()                        # the open-file limit raised, stdin read
    async with RolloutClient(...) as client:
        pipe.reply({"ready": True})                         # what started() waits for
        async for cmd in pipe:                              # until {"quit": true} or stdin's end
            pipe.reply(await one_pass(cmd))
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any


class ClientProc:
    """The parent's end: the child process, driven one command at a time over stdin/stdout."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1")
        )
        self.hello: dict[str, Any] = {}

    async def started(self) -> ClientProc:
        self.hello = await asyncio.to_thread(self._read)  # the server must keep serving the handshake
        return self

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"client process ended (exit {self.proc.poll()})")
        out: dict[str, Any] = json.loads(line)
        return out

    async def run(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return await asyncio.to_thread(self._read)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError, OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def raise_nofile() -> int:
    """Raise this process's open-file limit to its hard limit (thousands of connections); the soft limit after."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class Pipe:
    """The child's end: commands from stdin (async iteration), rows to stdout (:meth:`reply`)."""

    def __init__(self, reader: asyncio.StreamReader, nofile: int) -> None:
        self.reader = reader
        #: the open-file limit after :func:`raise_nofile`
        self.nofile = nofile

    @classmethod
    async def open(cls) -> Pipe:
        nofile = raise_nofile()
        reader = asyncio.StreamReader()
        await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        return cls(reader, nofile)

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        while line := await self.reader.readline():
            cmd: dict[str, Any] = json.loads(line)
            if cmd.get("quit"):
                return
            yield cmd

    @staticmethod
    def reply(row: dict[str, Any]) -> None:
        print(json.dumps(row), flush=True)
