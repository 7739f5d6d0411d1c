"""verifiers (prime-rl's environments library, the classic ``vf.Environment`` stack of 0.3.x) on rollout-sdk
through the gateway.

A verifiers environment drives its own rollouts: it calls an OpenAI-compatible client once per model turn
(``Environment.get_model_response`` -> ``vf.Client.get_response(..., state=state)``), runs its tools or
``env_response`` between turns, then scores the group with its ``Rubric``.  This adapter leaves all of that
unchanged and only gives each rollout its own gateway session, so the gateway records every turn as exact
tokens::

    env.run_group(inputs, client=<per-rollout session client>, ...)   verifiers, unchanged
      each model call: Authorization: Bearer <session>                 session = "vf-" + state["trajectory_id"]
    rubric reward      -> Gateway.reward(session)                      Trajectory.reward (every branch)
    rubric metrics     -> Trajectory.metrics
    Gateway.session_record(session).trajectories, then Gateway.ack     exact ids, loss mask, logprobs, versions

Maps: messages, tools (the environment's ``tool_defs`` go out as OpenAI ``tools``; the gateway renders them
with the model's chat template and parses the calls back into ``tool_calls``), sampling (the environment's
``sampling_args`` as chat-completion fields; ``sampling=`` fixes fields per session, whatever the
environment sends), stop conditions (the environment's own: ``max_turns``, no tool call, its ``@stop``
methods), rewards (the rubric's ``reward`` and ``metrics`` of each rollout).

Refuses (:class:`~rollout_sdk.errors.ConfigError`, naming the field): an environment that is not a classic
``vf.Environment`` (``env``); an environment in server mode (``env.env_client``: its rollouts would run in
another process, out of the gateway's reach); an empty group (``inputs``); ``group_size < 1``; a gateway that
is not open.  A rollout that never reached the model (an error before its first call) has no session and no
trajectories: its :class:`VerifiersRollout` says so (``trajectories == []``, ``output["error"]``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from ..errors import ClientStateError, ConfigError
from ..gateway import Gateway
from ..gateway.errors import GatewayError
from ..gateway.sampling import SessionSampling
from ..rollouts.trajectory import Trajectory

__all__ = ["VerifiersRollout", "VerifiersRunner"]

_PREFIX = "vf-"


@dataclass(frozen=True)
class VerifiersRollout:
    """One rollout of the environment: verifiers' own output (``RolloutOutput``: prompt, completion,
    reward, metrics, ...) and the gateway's trajectories of it (one per branch; usually one)."""

    output: dict[str, Any]
    trajectories: list[Trajectory]
    session: str | None


def _client_class() -> type:
    """The session-routing client, built on verifiers' own OpenAI chat client (imported only when used)."""
    import verifiers as vf  # optional: verifiers

    class SessionChatClient(vf.OpenAIChatCompletionsClient):  # type: ignore[misc,name-defined]
        """verifiers' chat-completions client; each call carries its rollout's session as the API key."""

        def __init__(self, openai_client: Any, runner: VerifiersRunner, opened: set[str]) -> None:
            super().__init__(openai_client)
            self._runner = runner
            self._opened = opened

        async def get_response(self, prompt: Any, model: str, sampling_args: Any, tools: Any = None, **kw: Any) -> Any:
            state = kw.get("state")
            if state is None or not state.get("trajectory_id"):
                raise ConfigError("state", None, "a model call without its rollout's state cannot be routed")
            sid = self._runner._open(state, self._opened)
            kw["extra_headers"] = {"Authorization": f"Bearer {sid}"}
            return await super().get_response(prompt, model, sampling_args, tools, **kw)

    return SessionChatClient


class VerifiersRunner:
    """Runs a verifiers environment's rollouts on rollout-sdk through an open :class:`Gateway`.

    ``model``: the model name the environment sends (default: the gateway's).  ``sampling``: fields fixed
    for every session (a :class:`~rollout_sdk.gateway.SessionSampling` or its JSON form), e.g. a seed.
    ``metadata``: exported with every trajectory (the rollout's ``example_id`` is added).
    """

    def __init__(
        self,
        gateway: Gateway,
        env: Any,
        *,
        model: str | None = None,
        sampling: SessionSampling | Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        from verifiers.legacy.envs.environment import Environment  # optional: verifiers

        if not isinstance(env, Environment):
            raise ConfigError("env", type(env).__name__, "must be a verifiers Environment (vf.SingleTurnEnv, ...)")
        if getattr(env, "env_client", None) is not None:
            raise ConfigError("env.env_client", "set", "an environment in server mode runs its rollouts elsewhere")
        self.gateway = gateway
        self.env = env
        self.model = model
        try:
            self.sampling = SessionSampling.from_json(dict(sampling)) if isinstance(sampling, Mapping) else sampling
            if self.sampling is not None:
                self.sampling.check()
        except GatewayError as exc:  # the gateway's 400 for a bad field: the same message, as a ConfigError
            raise ConfigError(exc.param or "sampling", sampling, exc.message) from None
        self.metadata = dict(metadata or {})

    def _open(self, state: Any, opened: set[str]) -> str:
        """The rollout's session, opened at its first model call (later calls find it in ``opened``, the
        sessions of one ``run_group`` call)."""
        sid = _PREFIX + str(state["trajectory_id"])
        if sid not in opened:
            meta = {**self.metadata, "example_id": state.get("example_id")}
            self.gateway.session(sid, metadata=meta, sampling=self.sampling)
            opened.add(sid)
        return sid

    async def run_group(
        self,
        inputs: Sequence[Mapping[str, Any]],
        *,
        group_size: int = 1,
        sampling_args: Mapping[str, Any] | None = None,
    ) -> list[VerifiersRollout]:
        """Each input ``group_size`` times as one verifiers group (scored together by the rubric, as
        verifiers' own ``generate`` does), in input order."""
        import openai  # optional: openai

        if not inputs:
            raise ConfigError("inputs", [], "give at least one rollout input")
        if group_size < 1:
            raise ConfigError("group_size", group_size, "must be >= 1")
        self.gateway._check_open()
        group = [copy.deepcopy(dict(i)) for i in inputs for _ in range(group_size)]
        for k, row in enumerate(group):
            row.setdefault("example_id", k // group_size)
        oa = openai.AsyncOpenAI(base_url=self.gateway.url, api_key="per-rollout", max_retries=0)
        opened: set[str] = set()
        client = _client_class()(oa, self, opened)
        sids: list[str] = []
        try:
            outputs = await self.env.run_group(
                group,
                client,
                self.model or self.gateway.model_name,
                dict(sampling_args or {}),
                state_columns=["trajectory_id"],
            )
            results = []
            for out in outputs:
                sid = _PREFIX + str(out["trajectory_id"])
                if sid not in opened:
                    results.append(VerifiersRollout(dict(out), [], None))
                    continue
                sids.append(sid)
                results.append(VerifiersRollout(dict(out), self._collect(sid, out), sid))
            return results
        finally:
            await oa.close()
            self._release(opened, sids)

    def _collect(self, sid: str, out: Mapping[str, Any]) -> list[Trajectory]:
        reward = out.get("reward")
        reward = float(reward) if isinstance(reward, (int, float)) and math.isfinite(reward) else 0.0
        self.gateway.reward(sid, reward)
        metrics = {
            k: float(v)
            for k, v in (out.get("metrics") or {}).items()
            if isinstance(v, (int, float)) and math.isfinite(v)
        }
        record = self.gateway.session_record(sid)
        self.gateway.ack([sid])
        return [msgspec.structs.replace(t, metrics={**t.metrics, **metrics}) for t in record.trajectories]

    def _release(self, opened: set[str], collected: list[str]) -> None:
        """Every session this group opened leaves the gateway, also after an error or a cancellation."""
        done = set(collected)
        for sid in opened:
            if sid in done:
                continue
            try:
                self.gateway.finish(sid)
                self.gateway.ack([sid])
            except (ClientStateError, GatewayError):  # the gateway closed meanwhile: nothing left to release
                pass
