"""What one rollout produces, and the bookkeeping that builds it.

A :class:`Trajectory` holds the exact token ids the model saw and produced::

    prompt_ids | response_ids ........................................................
                 [model turn 1][glue: end of turn, tool results, gen prompt][model turn 2]...
    loss_mask    1 1 1 1 1 1 1  0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0  1 1 1 1 1 1
    logprobs     engine's        0 ...                                      engine's

``loss_mask``, ``logprobs`` and ``response_ids`` have the same length, token for token.  Model tokens carry
the engine's logprobs; tokens the loop added carry 0.  ``weight_versions`` lists ``(version, n)`` runs over
the model tokens, in order: a trajectory that spans a weight update says which tokens came from which
weights; ``kv_weight_versions`` (empty unless an ``inflight="keep"`` update left it older) the oldest weights of
the KV each token was sampled from, and ``mixed_kv_tokens`` how many tokens the two disagree on.
:class:`TrajectoryBuilder` is the one place that appends, so custom agent loops get the same bookkeeping.

Vision-language rollouts: the images the model saw are kept in order (``images``); a prompt or a tool
result marks each one once (``<|vision_start|><|image_pad|><|vision_end|>``) and the first engine call that
sees the mark expands it (``GenerateResult.input_ids``).  The builder then adopts the engine's ids: the
tokens an expansion adds are context (mask 0, logprob 0), and ``image_spans`` / ``image_grid_thw`` locate
every expanded image in :attr:`Trajectory.ids` (docs/multimodal.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from ..protocol import GenerateResult, Lifecycle, RoutedExperts, mixed_tokens
from ..protocol.segments import append_segments, result_segments

__all__ = ["TRAJECTORY_SCHEMA_VERSION", "ToolCallRecord", "Trajectory", "TrajectoryBuilder", "Turn"]

#: bumped when a field of :class:`Trajectory` or :class:`Turn` changes meaning or goes away (new fields
#: with defaults keep the version: old lines still load)
TRAJECTORY_SCHEMA_VERSION = 1


class ToolCallRecord(msgspec.Struct, kw_only=True):
    name: str
    arguments: dict[str, Any]
    ok: bool
    error_kind: str | None = None
    latency_s: float = 0.0


class Turn(msgspec.Struct, kw_only=True):
    """One model turn and what followed it."""

    index: int
    model_tokens: int
    finish_reason: str
    weight_version: int
    generate_s: float
    context_tokens: int = 0
    tool_calls: list[ToolCallRecord] = []
    parse_errors: list[str] = []
    tools_s: float = 0.0
    #: a reward given to this turn (the gateway's per-turn rewards); None: none given
    reward: float | None = None


class Trajectory(msgspec.Struct, kw_only=True):
    """One finished rollout.  ``finish_reason``: ``stop`` (the model answered), ``length`` (a turn hit its
    token limit), ``max_turns``, ``budget`` (response or context budget used up), ``stale`` (its staleness
    bound stopped it), ``abort``, ``error``."""

    id: str
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    finish_reason: str
    turns: list[Turn] = []
    weight_versions: list[tuple[int, int]] = []
    #: runs over the model tokens of the oldest weight version of the KV each was sampled from; empty when
    #: that is each token's own version (always, unless a ``keep`` update happened mid-turn)
    kv_weight_versions: list[tuple[int, int]] = []
    reward: float | None = None
    messages: list[dict[str, Any]] = []
    metrics: dict[str, float] = {}
    drift: str | None = None
    template_rewrites: bool = False
    error: str | None = None
    sample_index: int = -1
    #: the caller's own facts about this trajectory (dataset row, task id, ...); exported as is
    metadata: dict[str, Any] = {}
    #: one per engine call, in order: when it was queued, dispatched, answered, where, retries/failovers
    lifecycles: list[Lifecycle] = []
    #: one per engine call, for requests with ``return_routed_experts`` (MoE routing replay)
    routed_experts: list[RoutedExperts] = []
    #: the layout version of this struct in exports (JSONL lines, the gateway's trajectory records);
    #: lines written before the field existed have the same layout and load as version 1
    schema_version: int = TRAJECTORY_SCHEMA_VERSION
    #: vision-language rollouts: the encoded image files, in the order of their marks in ``ids``
    images: list[bytes] = []
    #: ``(start, length)`` in ``ids`` of each image the engine expanded, and its patch grid ``(t, h, w)``
    image_spans: list[tuple[int, int]] = []
    image_grid_thw: list[tuple[int, int, int]] = []

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def num_model_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def min_weight_version(self) -> int | None:
        return min((v for v, _ in self.weight_versions), default=None)

    @property
    def mixed_kv_tokens(self) -> int:
        """Model tokens sampled by weights newer than (part of) the KV they attended to (``keep`` updates):
        what a trainer filters or corrects with importance weights."""
        return mixed_tokens(self.weight_versions, self.kv_weight_versions)


class TrajectoryBuilder:
    """Appends model output and loop context, keeping ids, mask, logprobs and versions aligned."""

    def __init__(self, prompt_ids: list[int], traj_id: str, images: Sequence[bytes] = ()) -> None:
        self.id = traj_id
        self.prompt_ids = list(prompt_ids)
        #: every image marked in ``ids`` so far, in order (send them with the next generate call)
        self.images = list(images)
        self.image_spans: list[tuple[int, int]] = []
        self.image_grid_thw: list[tuple[int, int, int]] = []
        self.response_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[tuple[int, int]] = []
        self.kv_versions: list[tuple[int, int]] = []
        self.turns: list[Turn] = []

    @property
    def ids(self) -> list[int]:
        """The whole context: what the next generate call continues."""
        return self.prompt_ids + self.response_ids

    @property
    def num_ids(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def response_len(self) -> int:
        return len(self.response_ids)

    def add_turn(self, result: GenerateResult, *, index: int, generate_s: float) -> Turn:
        """One model turn: its :class:`Turn` (appended to :attr:`turns`, returned for what follows it) and
        its tokens (:meth:`add_model`).  Every multi-turn agent records a turn this one way."""
        turn = Turn(
            index=index,
            model_tokens=len(result.output_ids),
            finish_reason=result.finish_reason,
            weight_version=result.weight_version,
            generate_s=generate_s,
        )
        self.turns.append(turn)
        self.add_model(result)
        return turn

    def add_model(self, result: GenerateResult) -> None:
        """Append the engine's output tokens exactly as returned (mask 1, the engine's logprobs).  A result
        of a request with images first replaces the context with the engine's expanded ids."""
        if result.input_ids is not None:
            self._adopt_expansion(result)
        ids = result.output_ids
        self.response_ids.extend(ids)
        self.loss_mask.extend([1] * len(ids))
        lps = result.logprobs if result.logprobs is not None else [0.0] * len(ids)
        if len(lps) != len(ids):
            raise ValueError(f"engine returned {len(lps)} logprobs for {len(ids)} tokens")
        self.logprobs.extend(lps)
        append_segments(self.versions, result_segments(result))
        append_segments(self.kv_versions, result.kv_version_segments or result_segments(result))

    def add_context(self, ids: list[int], images: Sequence[bytes] = ()) -> None:
        """Append tokens the loop added (tool results, template glue): mask 0, logprob 0.  ``images``: the
        images ``ids`` marks, in order (e.g. a screenshot a tool returned)."""
        self.response_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.images.extend(images)

    def _adopt_expansion(self, result: GenerateResult) -> None:
        """Replace ``ids`` (which the request carried) with ``result.input_ids``, the same tokens with every
        image mark expanded; the tokens an expansion adds take the mask and logprob (0) of the mark's pad."""
        exp, cur = result.input_ids or [], self.ids
        src: list[int] = []  # for every expanded token, the position in cur it comes from
        i = j = 0
        for start, n in result.image_spans:
            gap = start - j
            pad = exp[start] if start < len(exp) else -1
            run = 0
            while i + gap + run < len(cur) and cur[i + gap + run] == pad:
                run += 1
            if gap < 0 or cur[i : i + gap] != exp[j:start] or run not in (1, n):
                raise ValueError(f"the engine's expanded ids do not extend this trajectory's ids near {start}")
            src.extend(range(i, i + gap))
            src.extend([i + gap] * n)
            i, j = i + gap + run, start + n
        if cur[i:] != exp[j:]:
            raise ValueError("the engine's expanded ids do not end as this trajectory's ids")
        src.extend(range(i, len(cur)))
        n_prompt = len(self.prompt_ids)
        mask, lps = self.loss_mask, self.logprobs
        self.prompt_ids = [t for t, k in zip(exp, src, strict=True) if k < n_prompt]
        resp = [(t, k - n_prompt) for t, k in zip(exp, src, strict=True) if k >= n_prompt]
        self.response_ids = [t for t, _ in resp]
        self.loss_mask = [mask[k] for _, k in resp]
        self.logprobs = [lps[k] for _, k in resp]
        self.image_spans = list(result.image_spans)
        self.image_grid_thw = list(result.image_grid_thw)

    def build(self, finish_reason: str, **fields: Any) -> Trajectory:
        calls = sum(len(t.tool_calls) for t in self.turns)
        tool_errors = sum(1 for t in self.turns for c in t.tool_calls if not c.ok)
        parse_errors = sum(len(t.parse_errors) for t in self.turns)
        metrics = {
            "turns": float(len(self.turns)),
            "model_tokens": float(sum(self.loss_mask)),
            "context_tokens": float(len(self.loss_mask) - sum(self.loss_mask)),
            "tool_calls": float(calls),
            "tool_errors": float(tool_errors),
            "parse_errors": float(parse_errors),
            "generate_s": sum(t.generate_s for t in self.turns),
            "tools_s": sum(t.tools_s for t in self.turns),
        }
        return Trajectory(
            id=self.id,
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids,
            loss_mask=self.loss_mask,
            logprobs=self.logprobs,
            finish_reason=finish_reason,
            turns=self.turns,
            weight_versions=list(self.versions),
            kv_weight_versions=list(self.kv_versions) if self.kv_versions != self.versions else [],
            metrics=metrics,
            images=self.images,
            image_spans=self.image_spans,
            image_grid_thw=self.image_grid_thw,
            **fields,
        )
