"""The HTTP surface: aiohttp routes, OpenAI response shapes, SSE, and the error boundary.

::

    POST /v1/chat/completions          POST /s/{session}/v1/chat/completions
    POST /v1/completions               POST /s/{session}/v1/completions
    GET  /v1/models                    GET  /s/{session}/v1/models
    GET  /health
    POST /v1/sessions                  create a session: {"id", "base_url", "api_key"}
    GET  /v1/sessions/{session}        its turns, branches, state
    POST /v1/sessions/{session}/reward {"reward": 1.0, "finish": true}
    POST /v1/sessions/{session}/finish {"reward": 1.0}  (reward optional)

The session of a model call is the ``/s/{session}`` path segment, or else the API key (``Authorization:
Bearer <session>``), so an unmodified agent only changes ``base_url`` or ``api_key``.  The
``_errors`` middleware is the one place where exceptions become HTTP answers, always OpenAI-shaped JSON.
Each request runs in its own aiohttp handler task; a client that disconnects cancels its handler, which
aborts its generation on the engine (nothing is recorded for a turn that was never delivered).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from .errors import GatewayError, bad_request, error_body, to_gateway_error
from .service import Outcome

if TYPE_CHECKING:
    from .gateway import Gateway

__all__ = ["build_app"]

log = logging.getLogger("rollout_sdk.gateway")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway")
_STATUS_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 415: "unsupported_media_type"}


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), status=status, content_type="application/json")


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = (
            exc.text if exc.status != 413 else f"request body larger than the limit ({request.client_max_size} bytes)"
        )
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        return _json(
            error_body(exc.status, message or exc.reason, type=kind, code=_STATUS_CODES.get(exc.status)), exc.status
        )
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        err = to_gateway_error(exc)
        if err.status >= 500 and err.code == "internal":
            log.exception("unexpected error serving %s %s", request.method, request.path)
        return _json(err.body(), err.status)


async def _body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()  # raises 413 past client_max_size
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise bad_request(None, f"the request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(None, "the request body must be a JSON object", "invalid_json")
    return body


def _bearer(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return request.headers.get("X-Api-Key") or None


class _Routes:
    def __init__(self, gateway: Gateway) -> None:
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
        body = await _body(request)
        session = self.gw.store.get(self._session_id(request), create=self.gw.config.auto_sessions)
        outcome = await self.gw.serve_turn(session, body, chat=chat)
        if outcome.options.stream:
            return await self._stream(request, outcome, chat)
        return _json(_chat_body(outcome) if chat else _completion_body(outcome))

    async def _stream(self, request: web.Request, outcome: Outcome, chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for chunk in (_chat_chunks if chat else _completion_chunks)(outcome):
            await resp.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # -- handlers ----------------------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def models(self, request: web.Request) -> web.StreamResponse:
        model = {"id": self.gw.model_name, "object": "model", "created": self.gw.created, "owned_by": "rollout-sdk"}
        return _json({"object": "list", "data": [model]})

    async def health(self, request: web.Request) -> web.StreamResponse:
        return _json(self.gw.health())

    async def create_session(self, request: web.Request) -> web.StreamResponse:
        self._admin(request)
        raw = await request.read()
        body = msgspec.json.decode(raw) if raw.strip() else {}
        if not isinstance(body, dict):
            raise bad_request(None, "the request body must be a JSON object", "invalid_json")
        meta = body.get("metadata")
        if meta is not None and not isinstance(meta, dict):
            raise bad_request("metadata", "metadata must be an object", "invalid_type")
        sid = body.get("id")
        if sid is not None and not isinstance(sid, str):
            raise bad_request("id", "id must be a string", "invalid_type")
        handle = self.gw.session(sid, metadata=meta)
        return _json({"id": handle.id, "base_url": handle.base_url, "api_key": handle.api_key}, 201)

    async def session_info(self, request: web.Request) -> web.StreamResponse:
        self._admin(request)
        session = self.gw.store.get(request.match_info["session"], create=False)
        return _json(msgspec.to_builtins(session.stats()))

    async def reward(self, request: web.Request) -> web.StreamResponse:
        self._admin(request)
        body = await _body(request)
        value = body.get("reward")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad_request("reward", f"reward must be a number, got {value!r}", "invalid_type")
        finish = body.get("finish", True)
        if not isinstance(finish, bool):
            raise bad_request("finish", "finish must be a boolean", "invalid_type")
        sid = request.match_info["session"]
        done = self.gw.reward(sid, float(value), finish=finish)
        return _json({"id": sid, "reward": float(value), "finished": done})

    async def finish(self, request: web.Request) -> web.StreamResponse:
        self._admin(request)
        raw = await request.read()
        body = msgspec.json.decode(raw) if raw.strip() else {}
        value = body.get("reward") if isinstance(body, dict) else None
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise bad_request("reward", f"reward must be a number, got {value!r}", "invalid_type")
        sid = request.match_info["session"]
        self.gw.finish(sid, reward=None if value is None else float(value))
        return _json({"id": sid, "finished": True})


def build_app(gateway: Gateway) -> web.Application:
    app = web.Application(client_max_size=gateway.config.max_body_bytes, middlewares=[_errors])
    app[_GATEWAY] = gateway
    r = _Routes(gateway)
    for prefix in ("", "/s/{session}"):
        app.router.add_post(prefix + "/v1/chat/completions", r.chat)
        app.router.add_post(prefix + "/v1/completions", r.completions)
        app.router.add_get(prefix + "/v1/models", r.models)
    app.router.add_get("/health", r.health)
    app.router.add_post("/v1/sessions", r.create_session)
    app.router.add_get("/v1/sessions/{session}", r.session_info)
    app.router.add_post("/v1/sessions/{session}/reward", r.reward)
    app.router.add_post("/v1/sessions/{session}/finish", r.finish)
    return app


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


def _chat_body(o: Outcome) -> dict[str, Any]:
    return {
        "id": o.id,
        "object": "chat.completion",
        "created": o.created,
        "model": o.model,
        "choices": [
            {
                "index": c.index,
                "message": c.message,
                "finish_reason": c.finish_reason,
                "logprobs": _chat_logprobs(c.logprobs),
            }
            for c in o.choices
        ],
        "usage": _usage(o),
    }


def _chat_chunks(o: Outcome) -> list[dict[str, Any]]:
    head = {"id": o.id, "object": "chat.completion.chunk", "created": o.created, "model": o.model}
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
    return {
        "id": o.id,
        "object": "text_completion",
        "created": o.created,
        "model": o.model,
        "choices": [
            {
                "index": c.index,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "logprobs": _completion_logprobs(c.logprobs),
            }
            for c in o.choices
        ],
        "usage": _usage(o),
    }


def _completion_chunks(o: Outcome) -> list[dict[str, Any]]:
    body = _completion_body(o)
    chunks = [{**body, "choices": [ch]} for ch in body.pop("choices")]
    chunks = [{k: v for k, v in ch.items() if k != "usage"} for ch in chunks]
    if o.options.include_usage:
        chunks.append({**{k: v for k, v in body.items() if k != "usage"}, "choices": [], "usage": _usage(o)})
    return chunks
