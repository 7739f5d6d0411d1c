"""Large frames: the size limits checked before a frame is decoded, and GenerateRequests too big to decode
on the event loop, decoded in a worker process instead (docs/reliability.md).

    decode worker .... a spawned process (made on first use) that decodes GenerateRequests larger than
                        ``offload_decode_bytes``; at most ``max_offloaded_decodes`` wait for it, at most one
                        per peer: a large frame beyond either is answered ``busy`` (its rid read by a
                        decoder that skips the ids, :func:`peek_rid`); the recv loop never waits for it

A frame larger than the bigger size limit never reaches Python (ZMQ MAXMSGSIZE); one larger than its
kind's limit is refused before decoding (:func:`oversize`).  The ids of a request decoded off the loop come
back as uint32 bytes and become Python ints a chunk at a time (:func:`ids_from_uint32`), and are freed a
chunk at a time once answered (:func:`free_ids_in_chunks`): one pass over millions of ints would stall
the loop.  The ints are shared: one table of the vocabulary's ints (:class:`IntTable`) serves every large
request, so such a request's ids cost 8 bytes each (a pointer) instead of 36 (a pointer and an int).
"""

from __future__ import annotations

import array
import asyncio
import concurrent.futures
import multiprocessing
import os
import sys
from typing import Any

import msgspec

from ..errors import MessageTooLargeError, ProtocolError, RolloutError
from ..protocol import (
    EngineLimits,
    GenerateRequest,
    check_against_limits,
    decode_client_message,
    encode,
    error_reply,
    is_generate_frame,
)
from .lifeline import die_with_parent

__all__ = [
    "DecodeWorker",
    "IntTable",
    "decode_generate_frame",
    "free_ids_in_chunks",
    "ids_from_uint32",
    "oversize",
    "peek_rid",
]

#: token ids are turned into Python ints (and freed) this many at a time, yielding in between (~0.1 ms each)
_IDS_CHUNK = 4096
#: the decode worker's niceness: it is background work, and on a machine with few cores the OS must not let
#: it preempt the serving event loop (measured: p99 loop lag 5.7 -> 3.7 ms, docs/benchmarks-changelog.md)
_WORKER_NICENESS = 10


def oversize(payload: bytes, max_generate_bytes: int, max_control_bytes: int) -> MessageTooLargeError | None:
    """The error for a frame over its kind's size limit (checked before decoding it), or None."""
    n = len(payload)
    if n <= max_control_bytes and n <= max_generate_bytes:
        return None
    generate = is_generate_frame(payload)
    limit = max_generate_bytes if generate else max_control_bytes
    if n <= limit:
        return None
    what = "GenerateRequest" if generate else "control message"
    return MessageTooLargeError("message", f"<{n} bytes>", f"a {what} may take {limit} bytes")


class _RidOnly(msgspec.Struct):
    rid: str = ""


_rid_decoder = msgspec.msgpack.Decoder(_RidOnly)


def peek_rid(payload: bytes) -> str | None:
    """The ``rid`` of an encoded GenerateRequest, read without building its ids (msgspec skips them)."""
    try:
        return _rid_decoder.decode(payload).rid
    except msgspec.MsgspecError:
        return None


class DecodeWorker:
    """The worker process that decodes large GenerateRequests, and the bound on decodes waiting for it:
    at most ``max_waiting`` in all and one per peer (:meth:`try_reserve`)."""

    def __init__(self, max_waiting: int) -> None:
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._max = max_waiting
        self._waiting: set[bytes] = set()  # peers with a decode waiting

    def try_reserve(self, ident: bytes) -> bool:
        """Take a slot for this peer's frame, at once: False when the peer already has a decode waiting or
        ``max_waiting`` are (the frame is answered ``busy``; nothing waits)."""
        if ident in self._waiting or len(self._waiting) >= self._max:
            return False
        self._waiting.add(ident)
        return True

    def release(self, ident: bytes) -> None:
        """Give back the slot :meth:`try_reserve` gave this peer, once its frame is handled."""
        self._waiting.discard(ident)

    async def decode(self, payload: bytes, limits: EngineLimits) -> tuple[bool, bytes, bytes]:
        """:func:`decode_generate_frame` in the worker process (started on first use, off the loop)."""
        if self._pool is None:
            pool = self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=_background_priority
            )
            # the first submit forks the worker (milliseconds): in a thread, not on the event loop
            await asyncio.to_thread(lambda: pool.submit(_ready).result())
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, decode_generate_frame, payload, limits)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _background_priority() -> None:
    """In the decode worker, first: leave when the server is gone, whatever ended it (``server/lifeline.py``), and
    lower its priority below the server's."""
    die_with_parent()
    try:
        os.nice(_WORKER_NICENESS)
    except OSError:  # not permitted here: decode at normal priority
        pass


def _ready() -> bool:
    return True


def decode_generate_frame(data: bytes, limits: EngineLimits) -> tuple[bool, bytes, bytes]:
    """In the decode worker: decode and check one large GenerateRequest.

    Returns ``(True, the request without its ids (encoded), the ids as uint32 bytes)``, or ``(False, an
    encoded ErrorReply, b"")``.  Bytes both ways: cheap to pass between processes, cheap to read back.
    """
    req: Any = None
    try:
        req = decode_client_message(data)
        if not isinstance(req, GenerateRequest):
            raise ProtocolError("expected a GenerateRequest")
        check_against_limits(req, limits)
    except RolloutError as exc:
        rid = req.rid if isinstance(req, GenerateRequest) else None
        return False, encode(error_reply(exc, rid=rid)), b""
    head = msgspec.structs.replace(req, input_ids=[0])
    return True, encode(head), array.array("I", req.input_ids).tobytes()  # ids < vocab_size < 2**32


class IntTable:
    """The ints ``0 .. vocab_size - 1``, made once (in a thread) and shared by every large request's ids."""

    #: a larger vocabulary gets no table (its ids are made one by one)
    MAX_SIZE = 1 << 22

    def __init__(self) -> None:
        self._ints: list[int] | None = None
        self._size = 0

    async def get(self, vocab_size: int) -> list[int] | None:
        if vocab_size > self.MAX_SIZE:
            return None
        if self._ints is None or self._size != vocab_size:
            self._ints = await asyncio.to_thread(list, range(vocab_size))
            self._size = vocab_size
        return self._ints


async def ids_from_uint32(raw_ids: bytes, table: list[int] | None = None) -> list[int]:
    """The ids :func:`decode_generate_frame` sent back, as Python ints, made a chunk at a time: taken from
    ``table`` (every id is below its length: checked in the worker) or made one by one without it."""
    view = memoryview(raw_ids).cast("I")
    ids: list[int] = []
    for i in range(0, len(view), _IDS_CHUNK):
        chunk = view[i : i + _IDS_CHUNK]
        ids.extend(map(table.__getitem__, chunk) if table is not None else chunk.tolist())
        await asyncio.sleep(0)
    return ids


async def free_ids_in_chunks(req: GenerateRequest) -> None:
    """Free a large request's ids a chunk at a time (one ``del`` of millions of ints stalls the loop), but
    only once nothing else holds the request (the refs left are this frame, the caller's, getrefcount's).
    An engine may hold it a moment after answering (until its next step): look again for up to ~1 s."""
    for _ in range(100):
        if sys.getrefcount(req) <= 3 and sys.getrefcount(req.input_ids) <= 2:
            break
        await asyncio.sleep(0.01)
    else:
        return  # kept (a test fake's history, say): leave it alone
    ids = req.input_ids
    while ids:
        del ids[-_IDS_CHUNK:]
        await asyncio.sleep(0)
