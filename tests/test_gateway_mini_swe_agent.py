"""mini-swe-agent (the real package: its ``DefaultAgent``, its litellm models and ``LocalEnvironment``'s
runner) against the gateway, over chat completions, the Responses API and the Messages API.

mini-swe-agent runs the shell commands the model writes.  Here the model is *scripted* (a fake engine
answers each turn with fixed tokens) and the environment is confined: every command runs in a throwaway
directory, and only if it is, character for character, one of an allow-list written in this file; any other
command is refused without running (the script writes one, to prove it).  Model text never reaches a shell
otherwise.  The session's trajectory is checked as every harness's is: tokens equal a fresh rendering with
mini-swe-agent's ``bash`` tool, loss mask, logprobs, per-turn rewards.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from rollout_sdk.agents import ChatTemplate
from test_gateway import Script, call, gateway_on

ALLOWED = ("printf 42 > answer.txt", "cat answer.txt", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat answer.txt")
FORBIDDEN = "touch ../escaped"  # what a policy might write: refused, never run
# what a model trained on the chat template writes: prose, a newline, the Hermes call
SCRIPT = [
    "I will write the answer to a file.\n" + call("bash", command=ALLOWED[0]),
    "Let me try to leave the directory.\n" + call("bash", command=FORBIDDEN),
    "Checking the file.\n" + call("bash", command=ALLOWED[1]),
    call("bash", command=ALLOWED[2]),
]


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> Any:
    from rollout_sdk.models import load_tokenizer

    return load_tokenizer(str(tiny_model))


@pytest.fixture
def mswea(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The package, imported without touching the user's config directory or printing a banner."""
    monkeypatch.setenv("MSWEA_GLOBAL_CONFIG_DIR", str(tmp_path / "mswea-config"))
    monkeypatch.setenv("MSWEA_SILENT_STARTUP", "1")
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    return pytest.importorskip("minisweagent")


def confined_environment(workdir: Path) -> Any:
    """mini-swe-agent's LocalEnvironment, confined: cwd is ``workdir`` and a command runs only if it is
    exactly one of ``ALLOWED``; anything else comes back as an error the model reads."""
    from minisweagent.environments.local import LocalEnvironment

    class Confined(LocalEnvironment):  # type: ignore[misc]
        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            self.refused: list[str] = []

        def execute(self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
            command = action.get("command", "")
            if command not in ALLOWED:
                self.refused.append(command)
                return {"output": "refused: not on the allow-list", "returncode": 126, "exception_info": ""}
            return super().execute(action, cwd=str(workdir), timeout=timeout)

    return Confined(cwd=str(workdir), timeout=10)


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_mini_swe_agent_runs_a_scripted_task_confined(fake_servers, tok, tmp_path, mswea, api) -> None:
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.models.litellm_model import LitellmModel
    from minisweagent.models.litellm_response_model import LitellmResponseModel
    from minisweagent.models.utils.actions_toolcall import BASH_TOOL

    workdir = tmp_path / "work"
    workdir.mkdir()
    async with gateway_on(fake_servers, tok, Script(tok, SCRIPT)) as (gw, client):
        s = gw.session(sampling={"temperature": 0.0})
        provider, base = ("anthropic", s.base_url.removesuffix("/v1")) if api == "messages" else ("openai", s.base_url)
        model_cls = LitellmResponseModel if api == "responses" else LitellmModel
        model = model_cls(
            model_name=f"{provider}/{gw.model_name}",
            model_kwargs={"api_base": base, "api_key": "unused", "max_tokens": 64},
            cost_tracking="ignore_errors",  # a local model has no price
        )
        env = confined_environment(workdir)
        agent = DefaultAgent(
            model, env, system_template="You can run bash.", instance_template="Task: {{task}}", step_limit=6
        )
        result = await asyncio.to_thread(agent.run, "write 42 to answer.txt and submit it")
        assert result["exit_status"] == "Submitted" and result["submission"].strip() == "42"
        assert (workdir / "answer.txt").read_text() == "42"
        assert env.refused == [FORBIDDEN] and not (tmp_path / "escaped").exists()
        # the refusal reached the model as the tool's answer
        assert any("refused: not on the allow-list" in json.dumps(m) for m in agent.messages)

        prefix = {"chat": "chatcmpl-", "responses": "resp_", "messages": "msg_"}[api]
        assert all(n.response_id.startswith(prefix) for n in gw.get_session(s.id).nodes)
        gw.turn_reward(s.id, 0.5, turn=1)
        gw.reward(s.id, 1.0)
        [t] = gw.session_record(s.id).trajectories
        report = ChatTemplate(tok, tools=[BASH_TOOL]).check_drift(
            t.messages, t.ids, loss_mask=t.loss_mask, prompt_len=len(t.prompt_ids)
        )
        assert report.ok, str(report)
        assert len(t.turns) == 4 and [c.arguments["command"] for u in t.turns for c in u.tool_calls] == [
            ALLOWED[0],
            FORBIDDEN,
            *ALLOWED[1:],
        ]
        assert len(t.loss_mask) == len(t.response_ids) == len(t.logprobs)
        model_lps = [lp for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m]
        assert model_lps == [lp for _, r in client.calls for lp in (r.logprobs or [])]  # the engine's, in order
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if not m)
        assert t.reward == 1.0 and [u.reward for u in t.turns] == [None, 0.5, None, None]
