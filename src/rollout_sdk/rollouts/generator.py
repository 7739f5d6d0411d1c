"""What the rollouts layer needs from whoever generates: a small protocol, not the client itself.

:class:`~rollout_sdk.client.RolloutClient` implements it; so can a test double, a gateway or a trainer
that routes requests its own way.  The rollouts layer (contexts, groups, streams) imports only this.
"""

from __future__ import annotations

from typing import Final, Protocol, final, runtime_checkable

import msgspec

from ..protocol import GenerateRequest, GenerateResult, SamplingParams, ServerInfo
from ..protocol.checks import expect_ids

__all__ = ["USE_CLIENT_DEFAULT", "Generator", "Prompt", "UseClientDefault", "as_request"]

Prompt = GenerateRequest | list[int]


@final
class UseClientDefault:
    """The type of :data:`USE_CLIENT_DEFAULT`: "use the client's configured value" (httpx's idiom).

    It is how ``timeout=USE_CLIENT_DEFAULT`` differs from ``timeout=None`` (no timeout at all).
    """

    _instance: UseClientDefault | None = None

    def __new__(cls) -> UseClientDefault:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "USE_CLIENT_DEFAULT"

    def __reduce__(self) -> str:
        return "USE_CLIENT_DEFAULT"


#: the one sentinel for "use the client's default" in every keyword that has a client-level default
USE_CLIENT_DEFAULT: Final = UseClientDefault()


@runtime_checkable
class Generator(Protocol):
    """Generates one response per request, and knows the current weight version."""

    @property
    def weight_version(self) -> int:
        """The weight version new requests run on (the last one pushed)."""
        ...

    async def generate(
        self, request: Prompt, /, *, timeout: float | UseClientDefault | None = USE_CLIENT_DEFAULT
    ) -> GenerateResult:
        """One response; cancelling the caller aborts the request."""
        ...

    def abort(self, rid: str) -> bool:
        """Abort one in-flight request: its ``generate`` returns ``finish_reason="abort"`` with its tokens."""
        ...

    def server_info(self) -> list[ServerInfo]:
        """What the servers said about themselves (limits such as the context length)."""
        ...


def as_request(
    prompt: Prompt, sampling: SamplingParams | None = None, session_id: str | None = None
) -> GenerateRequest:
    """A prompt (a GenerateRequest or a list of token ids) as a GenerateRequest; ``sampling`` and
    ``session_id``, when given, replace the request's."""
    if isinstance(prompt, GenerateRequest):
        changes: dict[str, object] = {}
        if sampling is not None:
            changes["sampling"] = sampling
        if session_id is not None:
            changes["session_id"] = session_id
        return msgspec.structs.replace(prompt, **changes) if changes else prompt  # type: ignore[arg-type]
    if isinstance(prompt, list | tuple):
        if not all(type(t) is int for t in prompt):  # one pass; the slow path names the bad id
            expect_ids("input_ids", prompt)
        return GenerateRequest(
            input_ids=list(prompt),
            sampling=sampling if sampling is not None else SamplingParams(),
            session_id=session_id,
        )
    raise TypeError(f"a prompt is a GenerateRequest or a list of token ids, not {type(prompt).__name__}")
