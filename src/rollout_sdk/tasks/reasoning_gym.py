"""reasoning-gym datasets as a task source, scored by each dataset's own ``score_answer``.

reasoning-gym (``pip install 'rollout-sdk[envs]'``) generates procedural tasks from a seed, offline: no
dataset or model is downloaded.  :class:`ReasoningGymTask` maps one of its datasets onto what rollout-sdk
consumes::

    entry["question"]          -> sample["messages"] = [system?] + [{"role": "user", "content": question}]
    entry (the whole dict)     -> sample["entry"]   (what score_answer needs: answer, metadata)
    dataset.score_answer(a, e) -> reward: a = the final assistant message's content (ToolAgent / gateway
                                  trajectories), or the decoded completion (generate_many results)

It feeds ``rollout_group`` / ``client.rollouts`` (:meth:`samples` + :meth:`reward`, a ``RewardFn``) and
``generate_many`` (:meth:`prompts` + :meth:`score_text`).  Stop conditions and sampling are the agent's or
the caller's (reasoning-gym has none); tools are the agent's (reasoning-gym defines none).  Refused, each
a :class:`~rollout_sdk.errors.ConfigError` naming the field: an unknown dataset name (with the choices), a
config field the dataset does not have or a value it rejects, ``size < 1``, a sample without its entry.
The answer is passed to ``score_answer`` as the model wrote it: reasoning-gym's scorers accept some
slack (``products`` tolerates signs, commas and decimals) and give partial credit to an answer that
contains the right one (the base scorer: ``len(answer) / len(model text)``).

Example::

    task = ReasoningGymTask("products", size=64, seed=1, config={"min_digits": 2, "max_digits": 2})
    groups = await asyncio.gather(*(rollout_group(client, agent, s, group_size=8, reward=task.reward)
                                    for s in task.samples(8)))
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..agents.chat import ChatTemplate
from ..errors import ConfigError
from ..rollouts.trajectory import Trajectory

__all__ = ["ReasoningGymTask", "final_answer"]

#: the prefix that names a reasoning-gym dataset where a task is chosen by name (``demo --rl-task``)
PREFIX = "reasoning_gym:"


def final_answer(traj: Trajectory) -> str:
    """The content of the trajectory's last assistant message ("" if there is none)."""
    for m in reversed(traj.messages):
        if m.get("role") == "assistant":
            content = m.get("content") or ""
            return content if isinstance(content, str) else ""
    return ""


class ReasoningGymTask:
    """One reasoning-gym dataset: ``size`` entries generated from ``seed`` (reasoning-gym's own
    generator, deterministic), ``config`` the dataset's config fields (e.g. ``{"max_digits": 2}``)."""

    def __init__(
        self,
        dataset: str,
        *,
        size: int = 100,
        seed: int = 0,
        config: Mapping[str, Any] | None = None,
        system_prompt: str | None = None,
    ) -> None:
        try:
            import reasoning_gym  # optional: reasoning-gym
            from reasoning_gym.factory import DATASETS  # optional: reasoning-gym
        except ImportError as exc:
            raise ConfigError(
                "dataset", dataset, f"needs reasoning-gym: pip install 'rollout-sdk[envs]' ({exc})"
            ) from exc
        if not isinstance(dataset, str) or dataset not in DATASETS:
            choices = ", ".join(sorted(DATASETS)[:12])
            raise ConfigError("dataset", dataset, f"is not a reasoning-gym dataset (some of them: {choices}, ...)")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError("size", size, "must be an int >= 1")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError("seed", seed, "must be an int")
        fields = dict(config or {})
        for key in ("size", "seed"):
            if key in fields:
                raise ConfigError(f"config.{key}", fields[key], f"give {key}= to ReasoningGymTask instead")
        known = set(DATASETS[dataset][1].__dataclass_fields__)
        for key in fields:
            if key not in known:
                raise ConfigError(f"config.{key}", fields[key], f"is not a field of {dataset}'s config")
        try:
            self.dataset = reasoning_gym.create_dataset(dataset, size=size, seed=seed, **fields)
        except (AssertionError, ValueError, TypeError) as exc:  # the dataset's own validate()
            raise ConfigError("config", fields, f"{dataset} refused it: {exc}") from exc
        self.name = dataset
        self.size = size
        self.system_prompt = system_prompt

    @classmethod
    def from_name(cls, name: str, **kwargs: Any) -> ReasoningGymTask:
        """``"reasoning_gym:<dataset>"`` (the form ``demo --rl-task`` takes) -> the task."""
        if not name.startswith(PREFIX) or len(name) == len(PREFIX):
            raise ConfigError("task", name, f"must be {PREFIX}<dataset>")
        return cls(name[len(PREFIX) :], **kwargs)

    def entry(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.size:
            raise ConfigError("index", index, f"must be in [0, {self.size})")
        entry: dict[str, Any] = self.dataset[index]
        return entry

    def messages(self, entry: Mapping[str, Any]) -> list[dict[str, Any]]:
        head = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*head, {"role": "user", "content": entry["question"]}]

    def samples(self, n: int | None = None, *, start: int = 0) -> list[dict[str, Any]]:
        """Entries ``start .. start + n`` as rollout samples: ``{"messages", "entry", "index"}``."""
        n = self.size - start if n is None else n
        if n < 0 or start < 0 or start + n > self.size:
            raise ConfigError("n", n, f"start + n must be in [0, size={self.size}] (start={start})")
        out = []
        for i in range(start, start + n):
            e = self.entry(i)
            out.append({"messages": self.messages(e), "entry": e, "index": i})
        return out

    def prompts(self, tokenizer: Any, n: int | None = None, *, start: int = 0) -> list[list[int]]:
        """Token ids of each entry's chat prompt (generation prompt added), for ``generate_many``."""
        chat = ChatTemplate(tokenizer)
        return [chat.prompt_ids(s["messages"]) for s in self.samples(n, start=start)]

    def score_text(self, answer: str | None, entry: Mapping[str, Any]) -> float:
        """reasoning-gym's own ``score_answer`` (a float in [0, 1]; a non-finite score is refused)."""
        value = float(self.dataset.score_answer(answer, dict(entry)))
        if not math.isfinite(value):
            raise ConfigError("score", value, f"{self.name}.score_answer returned a non-finite score")
        return value

    def reward(self, traj: Trajectory, sample: Mapping[str, Any]) -> float:
        """A ``RewardFn``: ``score_answer`` of the trajectory's final answer against the sample's entry."""
        entry = sample.get("entry")
        if not isinstance(entry, Mapping):
            raise ConfigError("sample.entry", entry, "must be the reasoning-gym entry (from ReasoningGymTask.samples)")
        if traj.finish_reason not in ("stop", "max_turns"):
            return 0.0  # cut off (length, budget, abort, error): no final answer
        return self.score_text(final_answer(traj), entry)
