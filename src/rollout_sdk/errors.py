"""Every exception rollout-sdk raises, in one tree.

::

    RolloutError                          base of everything below
    ├── ConfigError (ValueError)          a config field has a bad value (client, server, engine, launch)
    ├── InvalidRequestError (ValueError)  a request field has a bad value; ``.field`` and ``.value`` name it
    │   ├── DuplicateRequestError         a request with this rid is already in flight (the first one is kept)
    │   ├── MessageTooLargeError          the encoded message exceeds the server's size limit for its kind
    │   └── WeightVersionError            ``min_weight_version`` is newer than the weights a server holds
    ├── LifecycleError (RuntimeError)     a server, gateway or bridge is used outside its lifecycle (names the state)
    │   └── ClientStateError              the client is used outside its lifecycle (not open, closed, reopened)
    │       └── StreamClosedError         a closed stream (generate_many, rollouts) is iterated or entered again
    ├── ProtocolError                     bytes that are not a valid message of the endpoint
    ├── RequestTimeoutError (TimeoutError) a per-call timeout expired; the request was aborted on the server
    ├── QueueFullError                    the client's bound on waiting requests is reached (back-pressure)
    ├── TransportError                    the request could not be completed by the server it went to
    │   ├── ServerUnavailableError        that server was marked dead (socket dropped, heartbeat missed)
    │   ├── ServerShuttingDownError       that server is draining and refuses new work
    │   ├── NoServersError                no live server is left to route to
    │   ├── ServerBusyError               the server's admission cap (or this client's fair share) is full:
    │   │                                 back-pressure, the client waits or routes elsewhere
    │   └── PoisonRequestError            two servers died while serving this request; never retried again
    ├── EngineError                       the engine behind a server failed
    │   ├── EngineDeadError               the engine died; every request it held fails with this
    │   ├── EngineStartupError            the engine could not start (bad model path, out of memory, TP size)
    │   ├── UnsupportedOperationError     the backend has no such lifecycle hook (e.g. a pinned SGLang lacks it)
    │   ├── EngineBusyError               the operation needs an idle engine (e.g. releasing memory mid-flight)
    │   └── RequestFailedError            the engine failed this one request; it keeps serving the others
    ├── WeightUpdateError                 a weight update was refused or failed; ``.applied`` says what state
    │                                     the engine was left in
    ├── StalenessError                    work would mix weights more versions apart than its bound allows
    ├── DiscoveryError                    servers not found in time; ``.missing`` names the ranks
    ├── AuthenticationError               the CURVE handshake with a server failed (wrong or missing keys)
    ├── PermissionDeniedError             the credential's role may not send this message (generate-only)
    ├── RemoteError                       the server hit an unexpected error; its message is kept
    ├── ExportError (ValueError)          a trajectory that cannot be exported faithfully, or a JSONL line
    │                                     that is not one (``rollout_sdk.export``)
    ├── TemplateError                     the chat template cannot extend the conversation (``agents.chat``)
    ├── ToolArgumentError (ValueError)    a tool call's arguments do not fit its schema (``agents.tools``)
    └── GatewayError                      an HTTP request the gateway refuses, with its status
                                          (``gateway.errors``)

The last four live beside their layer (each module's ``__all__`` names it); the others are here.
Errors cross the wire as :class:`rollout_sdk.protocol.ErrorReply` with a ``code``; :func:`error_from_reply`
and :func:`error_code` are the one place where codes and classes meet.  Lower-level errors (ZMQ, msgspec,
SGLang) are mapped to this tree at the boundary that sees them (``_transport``, ``server``, the engines),
never deeper.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AuthenticationError",
    "ClientStateError",
    "ConfigError",
    "DiscoveryError",
    "DuplicateRequestError",
    "EngineBusyError",
    "EngineDeadError",
    "EngineError",
    "EngineStartupError",
    "InvalidRequestError",
    "LifecycleError",
    "MessageTooLargeError",
    "NoServersError",
    "PermissionDeniedError",
    "PoisonRequestError",
    "ProtocolError",
    "QueueFullError",
    "RemoteError",
    "RequestFailedError",
    "RequestTimeoutError",
    "RolloutError",
    "ServerBusyError",
    "ServerShuttingDownError",
    "ServerUnavailableError",
    "StalenessError",
    "StreamClosedError",
    "TransportError",
    "UnsupportedOperationError",
    "WeightUpdateError",
    "WeightVersionError",
    "error_code",
    "error_from_reply",
]


class RolloutError(Exception):
    """Base class of every error raised by rollout-sdk."""


class _BadValue(RolloutError, ValueError):
    """A named field has a bad value: ``field``, ``value`` and the ``reason`` it is refused."""

    def __init__(self, field: str, value: Any, reason: str) -> None:
        self.field = field
        self.value = value
        self.reason = reason
        super().__init__(self._message())

    def _message(self) -> str:
        return f"{self.field}={self.value!r}: {self.reason}"


class ConfigError(_BadValue):
    """A configuration field has a bad value."""


class InvalidRequestError(_BadValue):
    """A request field has a bad value.  ``field`` is a dotted path (``sampling.temperature``)."""

    def _message(self) -> str:
        return f"invalid request: {self.field}={_short(self.value)}: {self.reason}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.field, self.value, self.reason))


class DuplicateRequestError(InvalidRequestError):
    """A second request used the rid of one still in flight.  The second is refused; the first keeps running
    and gets its own result."""


class WeightVersionError(InvalidRequestError):
    """A request's ``min_weight_version`` is newer than the weights of the server it reached, or of every
    server the client knows (``value`` is the version asked for; the message names the versions held)."""


class MessageTooLargeError(InvalidRequestError):
    """The encoded message is larger than the server accepts for its kind (generate or control)."""


class LifecycleError(RolloutError, RuntimeError):
    """A component (server, gateway, bridge, client) was used outside its lifecycle: before it opened, after
    it closed, or opened twice.  ``state`` is the state it was in (``unopened``, ``opening``, ``open``,
    ``closing``, ``closed``) when one is known."""

    def __init__(self, message: str, state: str | None = None) -> None:
        self.state = state
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.state))


class ClientStateError(LifecycleError):
    """The client was used outside its lifecycle: before ``async with``, after close, or opened twice."""


class StreamClosedError(ClientStateError):
    """A closed ResultStream / RolloutStream was iterated or entered again: a stream runs once."""


class ProtocolError(RolloutError):
    """Bytes that are not a valid message for the endpoint that received them."""


class RequestTimeoutError(RolloutError, TimeoutError):
    """A per-call timeout expired.  The request was aborted on its server and its slot freed."""


class QueueFullError(RolloutError):
    """The client's bound on requests waiting for a server slot is reached."""


class TransportError(RolloutError):
    """The server a request went to could not complete it."""


class ServerUnavailableError(TransportError):
    """The server was marked dead (its socket dropped or it missed heartbeats)."""


class ServerShuttingDownError(TransportError):
    """The server is shutting down and refuses new work."""


class NoServersError(TransportError):
    """No live server is left to route to."""


class ServerBusyError(TransportError):
    """The server refused a request at admission: its cap on accepted requests, or this client's fair share
    of it, is full.  Back-pressure: nothing ran; the scheduler waits for a slot or routes elsewhere."""


class PoisonRequestError(TransportError):
    """The request's server died while serving it, and so did the server it was retried on.  The request is
    treated as the likely cause and never sent again (resubmitting the same request fails at once)."""


class EngineError(RolloutError):
    """The engine behind a server failed."""


class EngineDeadError(EngineError):
    """The engine died.  Every request it held fails with this error, at once."""


class EngineStartupError(EngineError):
    """The engine could not start.  The message carries the backend's own message."""


class UnsupportedOperationError(EngineError):
    """The backend has no such operation (or its pinned version lacks it)."""


class EngineBusyError(EngineError):
    """The operation needs an engine with no request in flight."""


class RequestFailedError(EngineError):
    """The engine failed while processing this one request (the request alone, in isolation); the engine
    is healthy and keeps serving every other request.  Not retried: the same request would fail again."""


class WeightUpdateError(RolloutError):
    """A weight update failed.

    ``applied`` is ``False`` when the engine kept its old weights (it still serves), ``None`` when the
    engine could not tell and was marked unusable.
    """

    def __init__(self, message: str, *, applied: bool | None = False) -> None:
        self.applied = applied
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_weight_update_error, (str(self), self.applied))


def _rebuild_weight_update_error(message: str, applied: bool | None) -> WeightUpdateError:
    return WeightUpdateError(message, applied=applied)


class StalenessError(RolloutError):
    """Admitting this work would put tokens from weights more than ``max_staleness`` versions apart into
    one trajectory (or use a sample that old)."""


class DiscoveryError(RolloutError):
    """Servers were not found in time.  ``missing`` names what did not register."""

    def __init__(self, message: str, *, missing: list[str] | None = None) -> None:
        self.missing = list(missing or [])
        super().__init__(message)


class RemoteError(RolloutError):
    """The server hit an unexpected error while handling a message."""


class AuthenticationError(RolloutError):
    """The server refused this client's keys, or client and server disagree on whether to authenticate
    (see docs/security.md)."""


class PermissionDeniedError(RolloutError):
    """The credential is authenticated but its role may not send this message (a generate-only key sent
    a control message)."""


# -- wire mapping -------------------------------------------------------------------------------------

_CODES: dict[str, type[RolloutError]] = {
    "invalid_request": InvalidRequestError,
    "duplicate_rid": DuplicateRequestError,
    "too_large": MessageTooLargeError,
    "weight_version": WeightVersionError,
    "busy": ServerBusyError,
    "poison_request": PoisonRequestError,
    "protocol": ProtocolError,
    "engine_dead": EngineDeadError,
    "engine_startup": EngineStartupError,
    "unsupported": UnsupportedOperationError,
    "engine_busy": EngineBusyError,
    "request_failed": RequestFailedError,
    "shutting_down": ServerShuttingDownError,
    "weight_update": WeightUpdateError,
    "timeout": RequestTimeoutError,
    "remote": RemoteError,
    "permission_denied": PermissionDeniedError,
    "authentication": AuthenticationError,
}
_CLASSES = {cls: code for code, cls in _CODES.items()}


def error_code(exc: BaseException) -> str:
    """The wire code of ``exc`` (``remote`` for anything outside the tree)."""
    for cls in type(exc).__mro__:
        code = _CLASSES.get(cls)  # type: ignore[call-overload]
        if code is not None:
            return code
    return "remote"


def error_from_reply(
    code: str, message: str, field: str | None = None, value: Any = None, applied: bool | None = False
) -> RolloutError:
    """Rebuild the exception a server reported."""
    cls = _CODES.get(code, RemoteError)
    if issubclass(cls, InvalidRequestError):
        return cls(field or "?", value, message)
    if cls is WeightUpdateError:
        return WeightUpdateError(message, applied=applied)
    return cls(message)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
