"""Errors as an OpenAI-compatible client expects them, and the one place rollout-sdk errors become HTTP.

Every error the gateway answers with has OpenAI's shape::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "n", "code": "n_too_large"}}

:class:`GatewayError` is a :class:`~rollout_sdk.errors.RolloutError` (so it sits in the project's one
exception tree) that carries the HTTP status.  :func:`to_gateway_error` maps everything else
(``InvalidRequestError`` from a request field, back-pressure, dead servers, timeouts) at the HTTP boundary,
and only there.
"""

from __future__ import annotations

from typing import Any

from ..errors import (
    ClientStateError,
    EngineError,
    InvalidRequestError,
    QueueFullError,
    RequestTimeoutError,
    RolloutError,
    StalenessError,
    TransportError,
)

__all__ = ["GatewayError", "bad_request", "error_body", "to_gateway_error"]


class GatewayError(RolloutError):
    """An HTTP error in OpenAI's shape.  ``param`` names the request field, ``code`` is machine-readable."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        close: bool = False,
    ) -> None:
        self.status = status
        #: close the connection after answering (its request was not read whole)
        self.close = close
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        super().__init__(message)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(param: str | None, message: str, code: str = "invalid_value") -> GatewayError:
    """A 400 naming the field (``messages[2].role``) and saying what is wrong with it."""
    return GatewayError(400, message, param=param, code=code)


def unsupported(param: str, message: str) -> GatewayError:
    return GatewayError(400, message, param=param, code="unsupported_parameter")


def error_body(status: int, message: str, *, type: str, code: str | None = None) -> dict[str, Any]:
    return GatewayError(status, message, type=type, code=code).body()


def to_gateway_error(exc: BaseException) -> GatewayError:
    """The HTTP form of ``exc`` (anything that escapes a handler)."""
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, InvalidRequestError):
        field = exc.field.removeprefix("sampling.")
        return GatewayError(400, f"{exc.field}={exc.value!r}: {exc.reason}", param=field, code="invalid_value")
    if isinstance(exc, QueueFullError):
        return GatewayError(429, str(exc), type="rate_limit_error", code="queue_full")
    if isinstance(exc, RequestTimeoutError):
        return GatewayError(504, str(exc), type="timeout_error", code="timeout")
    if isinstance(exc, StalenessError):
        return GatewayError(409, str(exc), type="invalid_request_error", code="stale")
    if isinstance(exc, TransportError | EngineError | ClientStateError):
        return GatewayError(503, f"{type(exc).__name__}: {exc}", type="server_error", code="unavailable")
    return GatewayError(500, "internal error in the gateway (see its log)", type="server_error", code="internal")
