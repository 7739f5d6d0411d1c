"""The tool model: a tiny Qwen2 trained locally, on CPU, to solve :mod:`.calculator` through a calculator.

Same architecture family, tokenizer (Qwen2.5's 151,936 tokens) and chat template as the embedded default,
so it runs on the CPU engine, through ``ToolAgent``, unchanged.  ``ensure_tool_model()`` builds it on first
use (a progress bar; a couple of minutes on two CPU cores) and caches it under ``$ROLLOUT_SDK_HOME``:

* ``stage="trained"``: supervised on trajectories a scripted expert produced *through ToolAgent itself*
  (the exact token ids, glue and loss masks the agent makes at run time); greedy, it solves held-back
  instances (the number is in ``task.json``, and ``tests/test_tool_model.py`` checks it with real calls).
  Once it has learned to copy the operands (``Recipe.own_steps``), three batches in four swap the
  prompt's system block (the tool definitions, the system prompt) for one of
  :func:`.calculator_schemas.training_tools`' random definitions of the calculator, so that any
  ``calculator(expression: str)`` a user or a framework writes is called
  (``tests/test_tool_model_gateway.py`` checks held-back definitions through the gateway with the real
  ``openai`` and ``anthropic`` clients).  Its directory's name, ``tool-calculator``, is the model's id
  where a server names a model by its directory (the gateway's ``/v1/models``).
* ``stage="undertrained"``: the starting point of the RL example: the trained model after a short
  fine-tune on demonstrations that answer *without* the tool, so it calls the calculator only part of
  the time: its fine-tune stops once it calls the tool first with probability <= 0.35 on held-back instances
  (sampled success 38% with AVX2 and with AVX-512 kernels); GRPO on its own rollouts teaches it to delegate again.

Training is fast because only the task's tokens (about 130 of 151,936) get their own embedding rows:
every other token shares one row (``rest``).  The softmax over the whole vocabulary is then computed
exactly from ``|task| + 1`` logits: the shared row's logit counts ``V - |task|`` times
(:class:`TaskHead`).  The words of the random definitions are left out of the task's tokens on purpose:
they share the ``rest`` row, so the model learns to read past words it has no row for, which is what a
definition it has never seen is made of.  The saved model is an ordinary full-vocabulary checkpoint (every
non-task row a copy of ``rest``), which the engines load like any other.  Every row of a batch has the same
system block (one definition), so the prompt prefix they share (~180-460 tokens) is run once per batch and
its KV cache shared by every row.  Training uses one thread and fixed seeds: the same bytes on any machine
with the same torch build *and the same vector instructions* (torch picks its CPU kernels by them: an AVX2
machine and an AVX-512 one train slightly different weights).  So no check may stand on one machine's
weights: v3 called the docs' definition on AVX2 CPUs and miscopied the operands on AVX-512 ones; v4's
random example expressions in descriptions pass every held-back check on both (docs/benchmarks.md#the-tool-model).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import json
import math
import os
import random
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ..models._cache import build_once, default_home
from ..models.tiny import GENERATION_CONFIG, TINY_MODEL_CONFIG, ensure_tiny_model
from ..protocol import GenerateResult

if TYPE_CHECKING:
    import torch

__all__ = [
    "STAGE_DIRS",
    "TOOL_MODEL_CONFIG",
    "Demonstrations",
    "Recipe",
    "TaskHead",
    "TrainingStopped",
    "cached_tool_model",
    "common_prefix",
    "demonstration_sets",
    "ensure_tool_model",
    "ensure_tool_model_async",
    "shared_prefix_hidden",
    "system_block",
    "train_stages",
]

#: bump when the recipe changes, so an old cached directory is not reused
_RECIPE = "v5"
VOCAB_SIZE = cast(int, TINY_MODEL_CONFIG["vocab_size"])

#: the embedded default's architecture and special tokens (its config), with RoPE's base at 10,000: the
#: copies the task needs are over a few dozen positions
TOOL_MODEL_CONFIG: dict[str, object] = {**TINY_MODEL_CONFIG, "rope_theta": 10000.0}
IM_END = 151645

STAGES = ("trained", "undertrained")
#: each stage's directory: its name is the model's id where a server names a model by its directory
#: (the gateway's ``/v1/models``)
STAGE_DIRS = {"trained": "tool-calculator", "undertrained": "tool-calculator-undertrained"}
IM_START = 151644


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """How the tool model is trained.  The defaults are the cached model (changing one changes the
    model: bump ``_RECIPE``); ``bench/tool_model_recipe.py`` trains variants to compare."""

    #: seeds the instance order, the batches, the guesses and the initialisation
    seed: int = 0
    #: supervised steps of the trained stage (batches of every training instance's demonstration) with the
    #: task's own calculator definition only: the model learns to copy the operands there, where every
    #: prompt is the same (with random definitions from the start the copy had not appeared after 1,000
    #: steps: docs/benchmarks.md#the-tool-model).  At most ``own_steps``; fewer once the loss of each of the
    #: last 20 steps is under ``own_loss`` (the copy is learned) ...
    own_steps: int = 800
    own_loss: float = 0.02
    #: ... then this many steps in which ``1 - canonical_fraction`` of the batches get one of
    #: ``schema_variants`` random definitions (and system prompts) each
    #: (:func:`.calculator_schemas.training_tools`)
    steps: int = 600
    canonical_fraction: float = 0.25
    schema_variants: int = 512
    batch: int = 32
    lr: float = 3e-3
    warmup: int = 100
    #: direct-answer demonstrations made for the under-trained stage (it trains on far fewer)
    direct_instances: int = 640
    #: the under-trained stage: at most this many more steps at ``lr * detune_lr_scale`` (small: the call
    #: probability falls off a cliff, from 0.97 to 0.02-0.24 in two steps at lr / 5) ...
    detune_steps: int = 200
    detune_lr_scale: float = 0.05
    #: ... on batches of which this fraction answer without the tool, until the mean probability that the
    #: model calls the calculator first on held-back instances (checked before every step) is at most
    #: ``detune_target``: a stop on the model's state, not a step count, because the weights
    #: differ by CPU (30 fixed steps left the whole trajectory's probability at 23% on AVX-512 kernels, 9%
    #: on AVX2 and 4% without vector instructions, where 8 steps of RL could not lift it)
    detune_direct_fraction: float = 0.8
    detune_target: float = 0.35
    #: held-back instances scored (teacher-forced) after each stage
    test_instances: int = 200


class TrainingStopped(Exception):
    """Training was stopped (``stop`` was set) before it finished; nothing was written to the cache."""


def ensure_tool_model(
    home: str | os.PathLike[str] | None = None,
    *,
    stage: str = "trained",
    progress: bool = True,
    stop: threading.Event | None = None,
) -> Path:
    """The tool model's directory (``stage`` "trained" or "undertrained"), trained first if not cached.

    Blocking (minutes on first use, with a progress bar on stderr unless ``progress=False``): call it
    off the event loop (:func:`ensure_tool_model_async` does, and stops the training when cancelled).
    Concurrent first uses (processes, threads) train once; the others wait.  Setting ``stop`` (from any
    thread) ends a training within one step with :class:`TrainingStopped`; the half-trained model is
    deleted, never cached.  In the main thread Ctrl-C does the same (KeyboardInterrupt).
    """
    dest = _dest(home, stage)
    root = dest.parent.parent
    build_once(dest, lambda tmp: _build(tmp, root, progress, stop), marker=f"{STAGE_DIRS['trained']}/task.json")
    return dest / STAGE_DIRS[stage]


def cached_tool_model(home: str | os.PathLike[str] | None = None, *, stage: str = "trained") -> Path | None:
    """The tool model's directory if it is cached already (no training), else None."""
    path = _dest(home, stage) / STAGE_DIRS[stage]
    return path if (path.parent / STAGE_DIRS["trained"] / "task.json").exists() else None


def _dest(home: str | os.PathLike[str] | None, stage: str) -> Path:
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, not {stage!r}")
    root = Path(home) if home is not None else default_home()
    return root / "models" / f"tool-qwen2-{_RECIPE}"


async def ensure_tool_model_async(
    home: str | os.PathLike[str] | None = None, *, stage: str = "trained", progress: bool = True
) -> Path:
    """:func:`ensure_tool_model` in a worker thread.  Cancelling the caller (Ctrl-C under ``asyncio.run``)
    stops the training at its next step, so the interpreter's exit (which waits for worker threads) is
    not held up until the training ends."""
    stop = threading.Event()
    try:
        return await asyncio.to_thread(ensure_tool_model, home, stage=stage, progress=progress, stop=stop)
    finally:
        stop.set()  # a no-op once it has returned; on cancellation the thread sees it within one step


# -- the exact softmax over the task's rows -------------------------------------------------------


class TaskHead:
    """Full-vocabulary log-probabilities from the task's embedding rows and the one shared ``rest`` row.

    Exact for a model whose non-task rows are all equal (the tool model, and any fine-tune of it that
    leaves the embedding frozen): every non-task token has the same logit, so the log-partition needs
    only ``|task| + 1`` dot products.  ``compact(ids)`` maps token ids to row indices (non-task -> rest).
    """

    def __init__(self, task_token_ids: Sequence[int], vocab_size: int = VOCAB_SIZE) -> None:
        import torch  # lazy: cli-start

        ids = sorted(set(task_token_ids))
        self.ids = torch.tensor(ids, dtype=torch.long)
        self.size = len(ids) + 1
        self.rest = len(ids)
        self.n_rest = vocab_size - len(ids)
        members = set(ids)
        self.rest_token = next(t for t in range(vocab_size) if t not in members)
        self.index = torch.full((vocab_size,), self.rest, dtype=torch.long)
        self.index[self.ids] = torch.arange(len(ids))

    @classmethod
    def of(cls, model_dir: str | os.PathLike[str]) -> TaskHead:
        meta = json.loads(Path(model_dir, "task.json").read_text())
        return cls(meta["task_token_ids"])

    def compact(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.index[token_ids]

    def log_softmax(self, hidden: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        """``[..., |task| + 1]`` log-probs (the last column: each single non-task token's) from the final
        hidden states and the *full* ``[V, H]`` embedding."""
        return self.log_softmax_rows(hidden, embedding[self.ids], embedding[self.rest_token])

    def log_softmax_rows(self, hidden: torch.Tensor, rows: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
        import torch  # lazy: cli-start

        z = hidden @ rows.T
        z_rest = hidden @ rest
        log_z = torch.logsumexp(torch.cat([z, (z_rest + math.log(self.n_rest))[..., None]], dim=-1), dim=-1)
        return torch.cat([z, z_rest[..., None]], dim=-1) - log_z[..., None]


def shared_prefix_hidden(body: Any, prefix: torch.Tensor, suffixes: torch.Tensor) -> torch.Tensor:
    """Final hidden states of ``prefix + suffixes[i]`` for every row, with the prefix run once.

    ``body`` is the transformer without its head (``model.model`` of a ``Qwen2ForCausalLM``), ``prefix``
    ``[P]`` and ``suffixes`` ``[B, T]`` (right-padded).  Returns ``[B, T, H]``: the states at the suffix
    positions (position ``P - 1``, the prefix's last, is the first row of nothing: call with the prefix
    cut one token short if the first suffix token needs predicting).  Gradients flow through both parts.
    """
    out = body(input_ids=prefix[None], use_cache=True)
    # transformers renamed the output too; reading the old name logs a deprecation warning in newer versions
    cache = out.get("cache")
    if cache is None:
        cache = out.past_key_values
    cache.batch_repeat_interleave(suffixes.shape[0])
    # transformers renamed the argument (``past_key_values`` -> ``cache``); pass the one this version takes
    name = "cache" if "cache" in inspect.signature(body.forward).parameters else "past_key_values"
    return cast("torch.Tensor", body(input_ids=suffixes, **{name: cache}).last_hidden_state)


# -- building ----------------------------------------------------------------------------------------


def _build(out: Path, home: Path, progress: bool, stop: threading.Event | None) -> None:
    t0 = time.perf_counter()
    if progress:  # the first output of a first run: say what the next minutes are
        print("building the tool model (once): demonstrations, then training", file=sys.stderr, flush=True)
    tiny = ensure_tiny_model(home, progress=progress)
    from transformers import AutoTokenizer  # lazy: build

    tokenizer = AutoTokenizer.from_pretrained(str(tiny))
    recipe = Recipe()
    data = demonstration_sets(tokenizer, recipe, progress=progress)
    result = train_stages(data, recipe, progress=progress, stop=stop)
    seconds = time.perf_counter() - t0
    for stage, state in result["states"].items():
        d = out / STAGE_DIRS[stage]
        d.mkdir()
        _save(d, state, result["head"])
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copyfile(tiny / f, d / f)
        meta = {
            "recipe": _RECIPE,
            "stage": stage,
            "task": "rollout_sdk.tasks.calculator",
            "task_token_ids": result["head"].ids.tolist(),
            "steps": result["steps"][stage],
            "own_definition_steps": result["own_steps"],
            "heldout_teacher_forced_exact": result["exact"][stage],
            "held_back_schemas_teacher_forced_exact": result["held_back"][stage],
            "build_seconds": round(seconds, 1),
            "load_average_at_end": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        }
        (d / "task.json").write_text(json.dumps(meta, indent=2))


class _Scripted:
    """What ToolAgent needs of a RolloutContext, answering with a scripted expert's turns."""

    def __init__(self, tokenizer: Any, turns: list[str]) -> None:
        self.tokenizer = tokenizer
        self.turns = turns
        self.session_id = "expert"
        self.client = self  # the generator behind the context: no servers, no metrics

    def server_info(self) -> list[Any]:
        return []

    async def generate(self, input_ids: list[int], sampling: Any, images: Any = ()) -> Any:
        """RolloutContext.generate's signature (the tool model's demonstrations are text-only)."""
        out = [*self.tokenizer.encode(self.turns.pop(0), add_special_tokens=False), IM_END]
        return GenerateResult(
            rid="expert", output_ids=out, finish_reason="stop", prompt_tokens=len(input_ids), logprobs=[0.0] * len(out)
        )


Example = tuple[list[int], list[int]]  # ids, loss mask over ids


async def _demonstrations(
    tokenizer: Any, instances: Sequence[dict[str, Any]], *, direct: bool, seed: int, bar: Any
) -> list[Example]:
    """One demonstration per instance, made by running ToolAgent on a scripted expert: the right tool
    call then the answer read off its result, or (``direct``) a guessed answer without the tool."""
    from ..agents import RolloutContext, ToolAgent  # lazy: build
    from . import calculator  # lazy: build

    config = dataclasses.replace(calculator.agent_config(), max_context_tokens=4096)
    agent = ToolAgent(tokenizer, calculator.make_registry(), config)
    rng = random.Random(seed)
    out: list[Example] = []
    for sample in instances:
        if direct:  # a guess of about the right size, as a model that does not use the tool would write
            guess = int(sample["answer"] * rng.uniform(0.5, 1.5)) + rng.randint(-9, 9)
            turns = [f"The answer is {guess}."]
        else:
            call = {"name": "calculator", "arguments": {"expression": sample["expression"]}}
            turns = ["<tool_call>\n" + json.dumps(call) + "\n</tool_call>", f"The answer is {sample['answer']}."]
        traj = await agent.run(cast(RolloutContext, _Scripted(tokenizer, turns)), sample)
        out.append((traj.prompt_ids + traj.response_ids, [0] * len(traj.prompt_ids) + traj.loss_mask))
        bar.update(1)
    return out


@dataclass(frozen=True, kw_only=True)
class Demonstrations:
    """What the tool model is trained and scored on (:func:`demonstration_sets`)."""

    #: tool-use demonstrations of every training instance (ToolAgent's exact ids, with the task's own
    #: calculator definition), direct-answer ones, held-back ones
    train: list[Example]
    direct: list[Example]
    test: list[Example]
    #: the system block (tool definitions, system prompt) of the prompt for each random definition
    #: (:func:`.calculator_schemas.training_tools`): it replaces the demonstrations' own system block
    prefixes: list[list[int]]
    #: the same for each held-back definition (:data:`.calculator_schemas.HELD_BACK`), by label
    held_back: list[tuple[str, list[int]]]


def system_block(tokenizer: Any, tools: list[dict[str, Any]], system: str | None) -> list[int]:
    """The ids of a prompt's first block (the system message the template writes around ``tools``) for
    ``tools`` and a ``system`` prompt (None: the template's default).  A block ends at a special token,
    so it concatenates with the rest of any conversation's ids exactly."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    text = str(
        tokenizer.apply_chat_template(
            [*messages, {"role": "user", "content": "?"}], tools=tools, add_generation_prompt=True, tokenize=False
        )
    )
    return list(tokenizer.encode(text[: text.rindex("<|im_start|>user")], add_special_tokens=False))


def demonstration_sets(tokenizer: Any, recipe: Recipe, *, progress: bool = False) -> Demonstrations:
    """The demonstrations and system blocks of ``recipe``; a progress bar on stderr with ``progress``."""
    from . import calculator, calculator_schemas  # lazy: build

    train_instances = calculator.instances("train")
    random.Random(recipe.seed).shuffle(train_instances)
    test_instances = calculator.samples(recipe.test_instances, seed=recipe.seed, split="test")

    direct = train_instances[: recipe.direct_instances]
    total = len(train_instances) + len(direct) + len(test_instances) + recipe.schema_variants
    bar = _bar(total, progress, "demonstrations (once)", "demo")

    async def make() -> tuple[list[Example], list[Example], list[Example]]:
        return (
            await _demonstrations(tokenizer, train_instances, direct=False, seed=recipe.seed, bar=bar),
            await _demonstrations(tokenizer, direct, direct=True, seed=recipe.seed, bar=bar),
            await _demonstrations(tokenizer, test_instances, direct=False, seed=recipe.seed, bar=bar),
        )

    try:
        train, direct_demos, test = asyncio.run(make())
        rng = random.Random(f"schemas:{recipe.seed}")
        prefixes = []
        for _ in range(recipe.schema_variants):
            prefixes.append(system_block(tokenizer, *calculator_schemas.training_tools(rng)))
            bar.update(1)
    finally:
        bar.close()
    own = system_block(tokenizer, calculator.make_registry().schemas(), None)
    if train[0][0][: len(own)] != own:  # the agent's prompt must start with the block the recipe swaps
        raise RuntimeError("ToolAgent's prompt does not start with the chat template's system block")
    held_back = [
        (h.label, system_block(tokenizer, [_rendered(h.chat())], h.system)) for h in calculator_schemas.HELD_BACK
    ]
    return Demonstrations(train=train, direct=direct_demos, test=test, prefixes=prefixes, held_back=held_back)


def _rendered(tool: dict[str, Any]) -> dict[str, Any]:
    """A chat API tool as the gateway hands it to the template (client-side fields such as ``strict`` dropped)."""
    fn = tool["function"]
    return {"type": "function", "function": {k: fn[k] for k in ("name", "description", "parameters") if k in fn}}


def train_stages(
    data: Demonstrations,
    recipe: Recipe,
    *,
    progress: bool = False,
    on_eval: Callable[[int, float, dict[str, float]], None] | None = None,
    eval_every: int = 100,
    stop: threading.Event | None = None,
) -> dict[str, Any]:
    """Train both stages on ``data`` (:func:`demonstration_sets`) with one thread and fixed seeds (the
    same bytes on any machine with the same torch build).  ``on_eval(step, loss, scores)`` is called every
    ``eval_every`` steps of the first stage when given (scoring draws no random numbers).  ``stop``, when
    set, ends the training before its next step with :class:`TrainingStopped`."""
    import torch  # lazy: build

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic whatever the core count, and fastest for matrices this small
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(recipe.seed)
            return _train(data, recipe, progress, on_eval, eval_every, stop)
    finally:
        torch.set_num_threads(threads)


def _train(
    data: Demonstrations,
    recipe: Recipe,
    progress: bool,
    on_eval: Callable[[int, float, dict[str, float]], None] | None,
    eval_every: int,
    stop: threading.Event | None,
) -> dict[str, Any]:
    import torch  # lazy: build
    from transformers import Qwen2Config, Qwen2ForCausalLM  # lazy: build

    r = recipe
    train, direct, test = data.train, data.direct, data.test

    # the task's vocabulary: the demonstrations' tokens.  The words of the other definitions are not in
    # it: they share the ``rest`` row, as any word of a definition never seen will at run time
    head = TaskHead(sorted({t for ids, _ in train + direct + test for t in ids}))
    prefix_len = common_prefix([ids for ids, _ in train + direct + test]) - 1  # keep one prompt token to predict from
    own_block = train[0][0].index(IM_START, 1)  # where the system block ends (the user's turn starts)
    shared = train[0][0][own_block:prefix_len]  # what every row shares after the system block

    def prefix_of(block: Sequence[int]) -> torch.Tensor:
        return head.compact(torch.tensor([*block, *shared]))

    own = prefix_of(train[0][0][:own_block])
    prefixes = [prefix_of(b) for b in data.prefixes]
    held_back = [(label, prefix_of(b)) for label, b in data.held_back]
    skip = ("architectures", "model_type", "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
    fields: dict[str, Any] = {k: v for k, v in TOOL_MODEL_CONFIG.items() if k not in skip}
    model: Any = Qwen2ForCausalLM(Qwen2Config(vocab_size=head.size, **fields))
    model.train()
    body = model.model
    emb = body.embed_tokens.weight
    with torch.no_grad():
        emb[head.rest].zero_()  # every non-task token: embedding 0, logit 0 (kept so: see step())
    zero = torch.zeros(emb.shape[1])
    rng = random.Random(r.seed)

    def batch(examples: Sequence[Example]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(ids) for ids, _ in examples) - prefix_len
        ids = torch.full((len(examples), width), head.rest, dtype=torch.long)
        mask = torch.zeros(len(examples), width)
        for k, (seq, m) in enumerate(examples):
            ids[k, : len(seq) - prefix_len] = head.compact(torch.tensor(seq[prefix_len:]))
            mask[k, : len(seq) - prefix_len] = torch.tensor(m[prefix_len:], dtype=torch.float)
        return ids, mask

    def token_logprobs(ids: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        hidden = shared_prefix_hidden(body, prefix, ids)[:, :-1]
        logp = head.log_softmax_rows(hidden, emb[:-1], zero)
        return logp

    def loss_of(examples: Sequence[Example], prefix: torch.Tensor) -> Any:
        ids, mask = batch(examples)
        logp = token_logprobs(ids, prefix).gather(-1, ids[:, 1:, None]).squeeze(-1)
        m = mask[:, 1:]
        return -(logp * m).sum() / m.sum()

    def exact(examples: Sequence[Example] = test, prefix: torch.Tensor = own) -> dict[str, float]:
        """On held-back instances, teacher-forced: ``greedy``, the fraction whose every model token is the
        argmax (greedy decoding then writes exactly the expert's trajectory); ``sampled``, the mean
        probability that sampling at temperature 1 writes it."""
        model.eval()
        with torch.no_grad():
            ids, mask = batch(examples)
            logp = token_logprobs(ids, prefix)
            m = mask[:, 1:]
            ok = ((logp.argmax(-1) == ids[:, 1:]) | (m == 0)).all(-1)
            p = (logp.gather(-1, ids[:, 1:, None]).squeeze(-1) * m).sum(-1).exp()
        model.train()
        return {"greedy": round(float(ok.float().mean()), 4), "sampled": round(float(p.mean()), 4)}

    def call_probability(examples: Sequence[Example] = test[:100]) -> float:
        """The mean probability that the model's first token on held-back instances is the expert's (the
        call of the calculator: every test demonstration calls it): the under-trained stage's dial."""
        model.eval()
        with torch.no_grad():
            ids, mask = batch(examples)
            logp = token_logprobs(ids, own)
            first = mask[:, 1:].argmax(-1)  # the prediction of each row's first model token
            rows = torch.arange(len(examples))
            p = logp[rows, first, ids[rows, first + 1]].exp()
        model.train()
        return float(p.mean())

    def exact_held_back() -> dict[str, float]:
        """Greedy teacher-forced exact match with each held-back definition (on the first 50 instances)."""
        return {label: exact(test[:50], prefix)["greedy"] for label, prefix in held_back}

    opt = torch.optim.AdamW(model.parameters(), lr=r.lr, weight_decay=0.0, betas=(0.9, 0.98))

    def step_on(examples: Sequence[Example], prefix: torch.Tensor) -> Any:
        if stop is not None and stop.is_set():
            bar.close()
            raise TrainingStopped("the tool model's training was stopped; nothing was cached")
        loss = loss_of(examples, prefix)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            emb[head.rest].zero_()  # the shared row stays the fixed zero the saved checkpoint spreads out
        bar.update(1)
        return loss

    bar = _bar(r.own_steps + r.steps + r.detune_steps, progress)
    states: dict[str, dict[str, torch.Tensor]] = {}
    scores: dict[str, dict[str, float]] = {}
    schema_scores: dict[str, dict[str, float]] = {}
    recent: collections.deque[float] = collections.deque(maxlen=20)
    switched: int | None = None  # the step the random definitions came in
    step = 0
    while switched is None or step < switched + r.steps:
        if switched is None and (step >= r.own_steps or (len(recent) == recent.maxlen and max(recent) < r.own_loss)):
            switched = step  # the copy is learned (or the own phase is over): the definitions come in
            bar.total = step + r.steps + r.detune_steps
        # warm-up, then constant; the last two thirds of the mixed phase decay to 0 (a cosine)
        frac = 0.0 if switched is None else (step - switched) / r.steps
        decay = 1.0 if frac < 1 / 3 else 0.5 * (1 + math.cos(math.pi * (frac - 1 / 3) / (2 / 3)))
        for g in opt.param_groups:
            g["lr"] = r.lr * min(1.0, (step + 1) / r.warmup) * decay
        mixed = prefixes and switched is not None and rng.random() >= r.canonical_fraction
        prefix = rng.choice(prefixes) if mixed else own
        loss = float(step_on(rng.sample(train, r.batch), prefix).item())
        if prefix is own:
            recent.append(loss)
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss:.4f}")
        if on_eval is not None and step % eval_every == 0:
            held = exact_held_back()
            on_eval(step, loss, {**exact(), "schemas": min(held.values(), default=1.0)})
        step += 1
    trained_steps = step
    if on_eval is not None:
        held = exact_held_back()
        on_eval(step - 1, loss, {**exact(), "schemas": min(held.values(), default=1.0)})
    scores["trained"] = {**exact(), "call": round(call_probability(), 4)}
    schema_scores["trained"] = exact_held_back()
    states["trained"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # the RL starting point: a short fine-tune on demonstrations that mostly answer without the tool
    # (with the task's own definition: the one the RL example's agent uses)
    for g in opt.param_groups:
        g["lr"] = r.lr * r.detune_lr_scale
    detuned = 0
    while detuned < r.detune_steps and call_probability() > r.detune_target:
        k = round(r.batch * r.detune_direct_fraction)
        step_on(rng.sample(direct, k) + rng.sample(train, r.batch - k), own)
        detuned += 1
    bar.total = bar.n  # the stop may come before the planned steps
    scores["undertrained"] = {**exact(), "call": round(call_probability(), 4)}
    schema_scores["undertrained"] = exact_held_back()
    states["undertrained"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    bar.close()
    return {
        "states": states,
        "head": head,
        "exact": scores,
        "held_back": schema_scores,
        "steps": {"trained": trained_steps, "undertrained": trained_steps + detuned},
        "own_steps": switched,
    }


def common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    """How many leading tokens every sequence of ``seqs`` shares."""
    first = seqs[0]
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != first[i] for s in seqs):
            return i
    return n


def _save(out: Path, state: dict[str, torch.Tensor], head: TaskHead) -> None:
    """The compact model as an ordinary full-vocabulary checkpoint: non-task rows are copies of ``rest``."""
    from safetensors.torch import save_file  # lazy: build

    tensors: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name == "lm_head.weight":
            continue  # tied
        if name == "model.embed_tokens.weight":
            full = t[head.rest].expand(VOCAB_SIZE, t.shape[1]).clone()
            full[head.ids] = t[: head.rest]
            t = full
        tensors[name] = t.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(TOOL_MODEL_CONFIG, indent=2))
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))


class _NoBar:
    total = 0
    n = 0

    def update(self, n: int) -> None:
        return None

    def set_postfix(self, **kwargs: Any) -> None:
        return None

    def close(self) -> None:
        return None


def _bar(total: int, enabled: bool, desc: str = "training the tool model (once)", unit: str = "step") -> Any:
    if not enabled:
        return _NoBar()
    from tqdm import tqdm  # lazy: build

    return tqdm(total=total, desc=desc, unit=unit, mininterval=1.0)
