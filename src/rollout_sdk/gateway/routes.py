"""The HTTP surface: aiohttp routes, OpenAI response shapes, SSE, and the error boundary.

::

    POST /v1/chat/completions          POST /s/{session}/v1/chat/completions
    POST /v1/completions               POST /s/{session}/v1/completions
    POST /v1/responses                 POST /s/{session}/v1/responses      (OpenAI Responses API)
    POST /v1/messages                  POST /s/{session}/v1/messages       (Anthropic Messages API)
    GET  /v1/models[/{model}]          GET  /s/{session}/v1/models[/{model}]
    GET  /health                       GET  /metrics                       (Prometheus)
    POST /v1/sessions                  create a session: {"id", "base_url", "api_key"} (metadata, sampling)
    GET  /v1/sessions/{session}        its turns, branches, state
    GET  /v1/sessions/{session}/trajectory    its SessionRecord (records.py)
    POST /v1/sessions/{session}/reward {"reward": 1.0, "finish": true, "turn_rewards": [...]}
    POST /v1/sessions/{session}/finish {"reward": 1.0}  (reward optional)
    GET  /v1/trajectories/stream       finished sessions' records as they finish (NDJSON or SSE), at least once
    POST /v1/trajectories/ack          {"ids": [session, ...]}: those records were delivered

The session of a model call is the ``/s/{session}`` path segment, or else the API key (``Authorization:
Bearer <session>``), so an unmodified agent only changes ``base_url`` or ``api_key``.  The
``_errors`` middleware is the one place where exceptions become HTTP answers, always OpenAI-shaped JSON.
Each request runs in its own aiohttp handler task; a client that disconnects cancels its handler, which
aborts its generation on the engine (nothing is recorded for a turn that was never delivered).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import hmac
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Literal, Protocol

import msgspec
from aiohttp import web

from . import messages as messages_api
from . import responses as responses_api
from .bodies import SHAPE_CHECK_BYTES, Api, PromptLimits, check_body
from .config import GatewayConfig
from .errors import GatewayError, bad_request, error_body, to_gateway_error
from .records import ExportLease, SessionRecord, session_record
from .requests import AckRequest, FinishRequest, RewardRequest, SessionRequest, TurnReward, convert
from .sampling import SessionSampling
from .service import Outcome
from .sessions import Session, SessionStore

__all__ = ["GatewayApp", "build_app"]

log = logging.getLogger("rollout_sdk.gateway")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_GATEWAY: web.AppKey[GatewayApp] = web.AppKey("gateway")


class GatewayApp(Protocol):
    """What the routes ask of a gateway (:class:`~rollout_sdk.gateway.Gateway` is one; mypy checks it where
    ``Gateway`` builds its app).  Named here, so that the routes import no gateway module and the gateway,
    which opens them, is the only one of the two that imports the other."""

    config: GatewayConfig
    store: SessionStore
    model_name: str
    created: int
    export_streams: int

    async def serve_turn(
        self, session: Session, body: dict[str, Any], *, chat: bool, id_prefix: str = ...
    ) -> Outcome: ...
    def health(self) -> dict[str, Any]: ...
    def prompt_limits(self) -> PromptLimits | None: ...
    async def probe(self, texts: list[str], param: str) -> None: ...
    def metrics(self) -> tuple[bytes, str]: ...
    def session(
        self, session_id: str | None = ..., *, metadata: dict[str, Any] | None = ..., sampling: Any = ...
    ) -> Any: ...
    def turn_reward(
        self, session_id: str, value: float, *, turn: int | None = ..., response_id: str | None = ...
    ) -> None: ...
    def reward(self, session_id: str, value: float, *, finish: bool = ...) -> bool: ...
    def finish(self, session_id: str, *, reward: float | None = ...) -> bool: ...
    def session_record(self, session_id: str, *, per_turn: bool = ...) -> SessionRecord: ...
    def finished_sessions(
        self, heartbeat_s: float | None = ..., *, http: bool = ..., room: asyncio.Event | None = ...
    ) -> AsyncGenerator[Session | None, None]: ...
    def sent(self, session: Session, record: SessionRecord | None, lease: ExportLease | None) -> None: ...
    def release(self, lease: ExportLease) -> None: ...
    def ack(self, ids: list[str]) -> dict[str, list[str]]: ...


_STATUS_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 415: "unsupported_media_type"}


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), status=status, content_type="application/json")


def _error(request: web.Request, body: dict[str, Any], status: int) -> web.Response:
    if request.path.endswith("/v1/messages"):  # Anthropic's error shape is OpenAI's plus a top-level type
        body = {"type": "error", **body}
    return _json(body, status)


#: seconds between keep-alives on an idle export stream (how a gone trainer is noticed)
STREAM_HEARTBEAT_S = 15.0


#: after a request body this large, the C heap's free pages are handed back to the OS (glibc keeps them)
TRIM_AFTER_BYTES = 1 << 20


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    resp = await _answer(request, handler)
    if (request.content_length or 0) >= TRIM_AFTER_BYTES:
        await asyncio.to_thread(_trim_heap)  # the body and its decoded text are freed by now
    return resp


def _trim_heap() -> None:
    """``malloc_trim(0)``: glibc keeps freed blocks of a large body (its mmap threshold grows with them),
    so without it a 15 MiB call leaves the gateway ~15-30 MB larger.  A no-op off glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    if trim is not None:
        trim(0)


async def _answer(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = (
            exc.text if exc.status != 413 else f"request body larger than the limit ({request.client_max_size} bytes)"
        )
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        return _error(
            request,
            error_body(exc.status, message or exc.reason, type=kind, code=_STATUS_CODES.get(exc.status)),
            exc.status,
        )
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        err = to_gateway_error(exc)
        if err.status >= 500 and err.code == "internal":
            log.exception("unexpected error serving %s %s", request.method, request.path)
        resp = _error(request, err.body(), err.status)
        if err.close:  # e.g. a body that never arrived: the connection is not reused (nor its rest read)
            resp.force_close()
        # err may be exc, whose traceback holds this frame (and the handler's, with the request body):
        # unbound, the cycle is gone and the body is freed now, not at the next garbage collection
        del err
        return resp


#: JSON bodies nested deeper than this are refused (msgspec itself stops near 1,000 with a RecursionError;
#: the template, canonical form and records recurse too, so the bound is checked once, after decoding)
MAX_JSON_DEPTH = 64


async def _read(request: web.Request) -> bytearray:
    """The request body, at most ``client_max_size`` bytes (413 beyond), in one buffer: sized from
    Content-Length when given, so a large body is held once while it arrives (aiohttp's ``read()`` grows
    a buffer and then copies it: twice the body at the peak)."""
    limit = request.client_max_size
    length = request.content_length
    if length is not None and length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=length)
    timeout_s = request.app[_GATEWAY].config.body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            if length is not None:
                buf, pos = bytearray(length), 0
                with memoryview(buf) as view:
                    while pos < length:
                        chunk = await request.content.readany()
                        if not chunk:
                            break
                        view[pos : pos + len(chunk)] = chunk
                        pos += len(chunk)
                del buf[pos:]
                return buf
            buf = bytearray()
            while chunk := await request.content.readany():
                buf += chunk
                if len(buf) > limit:
                    raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(buf))
            return buf
    except TimeoutError:
        raise GatewayError(
            408,
            f"the request body did not arrive within {timeout_s} s (body_timeout_s)",
            code="body_timeout",
            close=True,
        ) from None


async def _body(request: web.Request, *, optional: bool = False, api: Api = "other") -> dict[str, Any]:
    """The request's JSON object.  ``optional``: an empty body is ``{}``.  Every way a body can be bad is
    a 400 naming the reason (and the field, for nesting too deep): never a 5xx.  A large body is first
    weighed from its bytes (:func:`~.bodies.check_body`, off the loop): one whose objects would outweigh
    it, or whose ``api`` text no prompt can hold, is refused before it is decoded."""
    raw = await _read(request)
    if optional and (not raw or raw.isspace()):
        return {}
    try:
        if len(raw) >= SHAPE_CHECK_BYTES:
            gw = request.app[_GATEWAY]
            limits = gw.prompt_limits() if api != "other" else None
            probe = await asyncio.to_thread(check_body, raw, api, limits)
            # tokenizer work only for a call that names a session (one that names none is a 401 next)
            if probe is not None and (request.match_info.get("session") or _bearer(request)):
                await gw.probe(probe.texts, probe.param)
            del probe
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise bad_request(None, f"the request body is not valid JSON: {exc}", "invalid_json") from None
    except RecursionError:
        raise bad_request(
            None, f"the request body is nested more than {MAX_JSON_DEPTH} levels deep", "nested_too_deep"
        ) from None
    finally:
        del raw
    if not isinstance(body, dict):
        raise bad_request(None, "the request body must be a JSON object", "invalid_json")
    _check_depth(body)
    return body


def _check_depth(body: dict[str, Any]) -> None:
    """400 naming the first field nested deeper than :data:`MAX_JSON_DEPTH` (iterative: no recursion, and
    only containers are visited one by one)."""
    stack: list[tuple[Any, int, Any, Any]] = [(body, 1, None, None)]  # (value, depth, parent entry, key)
    while stack:
        entry = stack.pop()
        value, depth, _, _ = entry
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in items:
            if isinstance(child, dict | list):
                if depth >= MAX_JSON_DEPTH:
                    raise bad_request(
                        _path(entry, key), f"nested more than {MAX_JSON_DEPTH} levels deep", "nested_too_deep"
                    )
                if child:
                    stack.append((child, depth + 1, entry, key))


def _path(entry: tuple[Any, int, Any, Any], key: Any) -> str:
    keys = [key]
    while entry[2] is not None:
        keys.append(entry[3])
        entry = entry[2]
    out = ""
    for k in reversed(keys):
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out


def _bearer(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return request.headers.get("X-Api-Key") or None


class _Routes:
    def __init__(self, gateway: GatewayApp) -> None:
        self.gw = gateway

    # -- helpers -----------------------------------------------------------------------------------

    def _session_id(self, request: web.Request) -> str:
        sid = request.match_info.get("session") or _bearer(request)
        if not sid:
            raise GatewayError(
                401,
                "no session: open one with POST /v1/sessions (it answers with the session's base_url and "
                "api_key), then send that key as the API key (Authorization: Bearer <key>) or use the base URL "
                "/s/<session>/v1",
                code="missing_session",
            )
        return sid

    def _admin(self, request: web.Request) -> None:
        key = self.gw.config.admin_key
        if key is not None and not hmac.compare_digest((_bearer(request) or "").encode(), key.encode()):
            raise GatewayError(401, "this endpoint needs the gateway's admin key", code="invalid_admin_key")

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await _body(request, api="chat" if chat else "completions")
        with self.gw.store.call(self._session_id(request), create=self.gw.config.auto_sessions) as session:
            outcome = await self.gw.serve_turn(session, body, chat=chat)
        if outcome.options.stream:
            return await self._stream(request, outcome, chat)
        return _json(_chat_body(outcome) if chat else _completion_body(outcome))

    async def _stream(self, request: web.Request, outcome: Outcome, chat: bool) -> web.StreamResponse:
        resp = await _sse(request)
        for chunk in (_chat_chunks if chat else _completion_chunks)(outcome):
            await resp.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _events(self, request: web.Request, events: list[tuple[str, dict[str, Any]]]) -> web.StreamResponse:
        """Typed SSE events (``event:`` and ``data:`` lines), as the Responses and Messages APIs send."""
        resp = await _sse(request)
        for kind, data in events:
            await resp.write(b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n")
        await resp.write_eof()
        return resp

    # -- handlers ----------------------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request, api="responses")
        with self.gw.store.call(self._session_id(request), create=self.gw.config.auto_sessions) as session:
            chat, echo = responses_api.to_chat(body, session)
            with _fields_named(responses_api.CHAT_NAMES):
                outcome = await self.gw.serve_turn(session, chat, chat=True, id_prefix="resp_")
        if outcome.options.stream:
            return await self._events(request, responses_api.response_events(outcome, echo))
        return _json(responses_api.response_body(outcome, echo))

    async def messages(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request, api="messages")
        chat = messages_api.to_chat(body)
        with (
            self.gw.store.call(self._session_id(request), create=self.gw.config.auto_sessions) as session,
            _fields_named(messages_api.CHAT_NAMES),
        ):
            outcome = await self.gw.serve_turn(session, chat, chat=True, id_prefix="msg_")
        if outcome.options.stream:
            return await self._events(request, messages_api.message_events(outcome))
        return _json(messages_api.message_body(outcome))

    def _model(self) -> dict[str, Any]:
        return {"id": self.gw.model_name, "object": "model", "created": self.gw.created, "owned_by": "rollout-sdk"}

    async def models(self, request: web.Request) -> web.StreamResponse:
        return _json({"object": "list", "data": [self._model()]})

    async def model(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["model"]
        if name != self.gw.model_name:
            served = self.gw.model_name
            message = f"the model {name!r} does not exist; this gateway serves {served!r}"
            raise GatewayError(404, message, code="model_not_found")
        return _json(self._model())

    async def health(self, request: web.Request) -> web.StreamResponse:
        return _json(self.gw.health())

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        body, content_type = await asyncio.to_thread(self.gw.metrics)
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def create_session(self, request: web.Request) -> web.StreamResponse:
        self._admin(request)
        body = convert(await _body(request, optional=True), SessionRequest)
        sampling = SessionSampling.from_json(body.sampling)
        handle = self.gw.session(body.id, metadata=body.metadata, sampling=sampling)
        return _json({"id": handle.id, "base_url": handle.base_url, "api_key": handle.api_key}, 201)

    async def session_info(self, request: web.Request) -> web.StreamResponse:
        self._admin(request)
        session = self.gw.store.get(request.match_info["session"], create=False)
        return _json(msgspec.to_builtins(session.stats()))

    async def reward(self, request: web.Request) -> web.StreamResponse:
        """``{"reward": x}`` the session's reward; ``{"turn_rewards": [{"turn": k | "response_id": id,
        "reward": x}, ...]}`` turns' own.  Finishes the session unless ``"finish": false``."""
        self._admin(request)
        body = convert(await _body(request), RewardRequest)
        if body.reward is None and body.turn_rewards is None:
            raise bad_request("reward", "give a 'reward' or 'turn_rewards'", "missing_required_parameter")
        sid = request.match_info["session"]
        for k, item in enumerate(_turn_rewards(body.turn_rewards, self.gw.config.max_turns_per_session)):
            try:
                self.gw.turn_reward(sid, item.reward, turn=item.turn, response_id=item.response_id)
            except GatewayError as exc:
                exc.param = f"turn_rewards[{k}].{exc.param}" if exc.param else f"turn_rewards[{k}]"
                raise
        if body.reward is not None:
            done = self.gw.reward(sid, body.reward, finish=body.finish)
        else:
            done = self.gw.finish(sid) if body.finish else False
        return _json({"id": sid, "reward": body.reward, "finished": done})

    async def trajectory(self, request: web.Request) -> web.StreamResponse:
        self._admin(request)
        per_turn = _query_flag(request, "per_turn", True)
        return _json(self.gw.session_record(request.match_info["session"], per_turn=per_turn))

    async def trajectory_stream(self, request: web.Request) -> web.StreamResponse:
        """Finished sessions' records as they finish, each to one consumer at a time, until ``limit``
        records (if given) or the gateway closes.  **At least once**: a record sent stays in the gateway
        until acknowledged (``POST /v1/trajectories/ack``); one not acknowledged within
        ``export_ack_timeout_s`` goes back to the queue, and so do the stream's unacknowledged records at
        once when the consumer goes away (a failed write, a closed connection).  At most ``window``
        (``?window=N``, default 256) records of a stream wait for acknowledgement; then it takes no more.
        ``?ack=false``: at most once instead (a record leaves when written: the old behaviour, for
        consumers that cannot acknowledge).  A record goes out only as fast as the trainer reads (TCP
        back-pressure); finished sessions meanwhile wait in the store (bounded by max_sessions)."""
        self._admin(request)
        gw = self.gw
        if gw.config.trajectories_jsonl:
            raise GatewayError(
                409,
                "this gateway writes finished sessions to trajectories_jsonl; read that file, or GET "
                "/v1/sessions/{id}/trajectory",
                code="exported_to_jsonl",
            )
        fmt = request.query.get("format", "ndjson")
        if fmt not in ("ndjson", "sse"):
            raise bad_request("format", f"format must be 'ndjson' or 'sse', not {fmt!r}")
        limit = _query_int(request, "limit")
        per_turn = _query_flag(request, "per_turn", False)
        ack = _query_flag(request, "ack", True)
        window = _query_int(request, "window") or 256
        if window > gw.config.max_sessions:
            raise bad_request("window", f"window must be at most max_sessions ({gw.config.max_sessions})")
        if gw.export_streams >= gw.config.max_export_streams:
            raise GatewayError(
                429,
                f"{gw.export_streams} export streams are open (max_export_streams)",
                type="rate_limit_error",
                code="too_many_streams",
            )
        gw.export_streams += 1
        lease = ExportLease(window) if ack else None
        try:
            content_type = "application/x-ndjson" if fmt == "ndjson" else "text/event-stream"
            resp = web.StreamResponse(headers={"Content-Type": content_type, "Cache-Control": "no-cache"})
            await resp.prepare(request)
            room = lease.room if lease is not None else None
            finished = gw.finished_sessions(heartbeat_s=STREAM_HEARTBEAT_S, http=True, room=room)
            try:
                async with contextlib.aclosing(finished):
                    await self._send_records(resp, finished, fmt, per_turn, limit, lease)
                await resp.write_eof()
            except BaseException:
                if lease is not None:  # the consumer went away: what it did not acknowledge goes back now
                    gw.release(lease)
                raise
            return resp
        finally:
            gw.export_streams -= 1

    async def _send_records(
        self,
        resp: web.StreamResponse,
        finished: AsyncGenerator[Any, None],
        fmt: str,
        per_turn: bool,
        limit: int | None,
        lease: ExportLease | None = None,
    ) -> None:
        gw, sent = self.gw, 0
        async for session in finished:
            if session is None:
                await resp.write(b"\n" if fmt == "ndjson" else b": keep-alive\n\n")
                continue
            record = _record(session, per_turn)
            line = msgspec.json.encode(record)
            try:
                await resp.write(line + b"\n" if fmt == "ndjson" else b"data: " + line + b"\n\n")
            except BaseException:
                gw.store.requeue(session)
                raise
            gw.sent(session, record if per_turn else None, lease)
            sent += 1
            if limit is not None and sent >= limit:
                return

    async def ack(self, request: web.Request) -> web.StreamResponse:
        """``{"ids": [session, ...]}``: these records were delivered; they leave the gateway."""
        self._admin(request)
        ids = convert(await _body(request), AckRequest).ids
        if len(ids) > self.gw.config.max_sessions:
            raise bad_request("ids", f"at most max_sessions ({self.gw.config.max_sessions}) ids", "too_many_items")
        return _json(self.gw.ack(ids))

    async def finish(self, request: web.Request) -> web.StreamResponse:
        self._admin(request)
        body = convert(await _body(request, optional=True), FinishRequest)
        sid = request.match_info["session"]
        self.gw.finish(sid, reward=body.reward)
        return _json({"id": sid, "finished": True})


def build_app(gateway: GatewayApp) -> web.Application:
    app = web.Application(client_max_size=gateway.config.max_body_bytes, middlewares=[_errors])
    app[_GATEWAY] = gateway
    r = _Routes(gateway)
    for prefix in ("", "/s/{session}"):
        app.router.add_post(prefix + "/v1/chat/completions", r.chat)
        app.router.add_post(prefix + "/v1/completions", r.completions)
        app.router.add_post(prefix + "/v1/responses", r.responses)
        app.router.add_post(prefix + "/v1/messages", r.messages)
        app.router.add_get(prefix + "/v1/models", r.models)
        app.router.add_get(prefix + "/v1/models/{model}", r.model)
    app.router.add_get("/health", r.health)
    app.router.add_get("/metrics", r.metrics)
    app.router.add_post("/v1/sessions", r.create_session)
    app.router.add_get("/v1/sessions/{session}", r.session_info)
    app.router.add_get("/v1/sessions/{session}/trajectory", r.trajectory)
    app.router.add_get("/v1/trajectories/stream", r.trajectory_stream)
    app.router.add_post("/v1/trajectories/ack", r.ack)
    app.router.add_post("/v1/sessions/{session}/reward", r.reward)
    app.router.add_post("/v1/sessions/{session}/finish", r.finish)
    return app


@contextlib.contextmanager
def _fields_named(names: dict[str, str]) -> Any:
    """Errors of the chat call an API was translated into name that API's field (``stop[0]`` ->
    ``stop_sequences[0]``)."""
    try:
        yield
    except GatewayError as exc:
        param = exc.param or ""
        head = param.split("[", 1)[0]
        if head in names:
            exc.param = names[head] + param[len(head) :]
        raise


async def _sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


def _record(session: Any, per_turn: bool) -> SessionRecord:
    return session_record(session, per_turn=per_turn, state="exported")


def _query_flag(request: web.Request, name: str, default: bool) -> bool:
    value = request.query.get(name)
    if value is None:
        return default
    if value.lower() not in ("1", "0", "true", "false"):
        raise bad_request(name, f"{name} must be true/false or 1/0, not {value!r}")
    return value.lower() in ("1", "true")


def _query_int(request: web.Request, name: str) -> int | None:
    value = request.query.get(name)
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise bad_request(name, f"{name} must be an integer >= 1, not {value!r}")
    return int(value)


def _turn_rewards(items: list[Any] | None, max_items: int) -> list[TurnReward]:
    """The checked items; at most ``max_items`` (a session serves no more turns than that), counted
    before any is converted."""
    if items is None:
        return []
    if len(items) > max_items:
        raise bad_request(
            "turn_rewards",
            f"{len(items)} turn rewards: a session has at most {max_items} turns (max_turns_per_session)",
            "too_many_items",
        )
    return convert(items, list[TurnReward], where="turn_rewards")


# -- response shapes --------------------------------------------------------------------------------


def _usage(o: Outcome) -> dict[str, int]:
    return {
        "prompt_tokens": o.prompt_tokens,
        "completion_tokens": o.completion_tokens,
        "total_tokens": o.prompt_tokens + o.completion_tokens,
    }


def _chat_logprobs(lps: list[tuple[str, float]] | None) -> dict[str, Any] | None:
    if lps is None:
        return None
    return {
        "content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []} for t, lp in lps],
        "refusal": None,
    }


def _head(o: Outcome, kind: str) -> dict[str, Any]:
    """What every OpenAI response body and stream chunk starts with: the response's id, kind and model."""
    return {"id": o.id, "object": kind, "created": o.created, "model": o.model}


def _completions_body(
    o: Outcome,
    kind: str,
    content: Literal["message", "text"],
    logprobs: Callable[[list[tuple[str, float]] | None], dict[str, Any] | None],
) -> dict[str, Any]:
    """A non-streaming body: chat and text completions differ only in their kind, which field of a
    :class:`Choice` a choice carries (``message`` or ``text``) and the shape of its logprobs."""
    choices = [
        {
            "index": c.index,
            content: getattr(c, content),
            "finish_reason": c.finish_reason,
            "logprobs": logprobs(c.logprobs),
        }
        for c in o.choices
    ]
    return {**_head(o, kind), "choices": choices, "usage": _usage(o)}


def _chat_body(o: Outcome) -> dict[str, Any]:
    return _completions_body(o, "chat.completion", "message", _chat_logprobs)


def _chat_chunks(o: Outcome) -> list[dict[str, Any]]:
    head = _head(o, "chat.completion.chunk")
    chunks: list[dict[str, Any]] = []
    for c in o.choices:
        msg = c.message or {}
        chunks.append(
            {
                **head,
                "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
            }
        )
        if msg.get("content") or c.logprobs:
            delta = {"content": msg.get("content") or ""}
            chunks.append(
                {
                    **head,
                    "choices": [
                        {
                            "index": c.index,
                            "delta": delta,
                            "logprobs": _chat_logprobs(c.logprobs),
                            "finish_reason": None,
                        }
                    ],
                }
            )
        for j, call in enumerate(msg.get("tool_calls") or []):
            delta_calls = [{"index": j, **call}]
            chunks.append(
                {**head, "choices": [{"index": c.index, "delta": {"tool_calls": delta_calls}, "finish_reason": None}]}
            )
        chunks.append({**head, "choices": [{"index": c.index, "delta": {}, "finish_reason": c.finish_reason}]})
    if o.options.include_usage:
        chunks.append({**head, "choices": [], "usage": _usage(o)})
    return chunks


def _completion_logprobs(lps: list[tuple[str, float]] | None) -> dict[str, Any] | None:
    if lps is None:
        return None
    offsets, pos = [], 0
    for t, _ in lps:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": [t for t, _ in lps],
        "token_logprobs": [lp for _, lp in lps],
        "top_logprobs": None,
        "text_offset": offsets,
    }


def _completion_body(o: Outcome) -> dict[str, Any]:
    return _completions_body(o, "text_completion", "text", _completion_logprobs)


def _completion_chunks(o: Outcome) -> list[dict[str, Any]]:
    body = _completion_body(o)
    chunks = [{**body, "choices": [ch]} for ch in body.pop("choices")]
    chunks = [{k: v for k, v in ch.items() if k != "usage"} for ch in chunks]
    if o.options.include_usage:
        chunks.append({**{k: v for k, v in body.items() if k != "usage"}, "choices": [], "usage": _usage(o)})
    return chunks
