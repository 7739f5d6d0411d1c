"""The CPU engine's model: loading it, running one batched step, sampling, and changing its weights.

Every method runs on the engine's one worker thread (never on the event loop), so the model, the batch
and its KV cache have a single owner.  A step decodes one token for every running row, prefills the newly
admitted rows and merges them into the batch (:mod:`.batch`), then turns the last position of each row
into logits in cache-sized chunks and samples (:mod:`.._sampling`).

The prefix cache (:mod:`.prefix_cache`): a finished row's KV is kept (cut out of the batch before
``drop_done`` drops it); an admitted row that finds a cached prefix is prefilled alone over a cache filled
from it (only its uncached suffix is forwarded, positions continuing), the others in one padded batch.

A Qwen2.5-VL model runs as its language model fed embeddings: a prefilled row with images gets its image
spans replaced by the vision tower's features and its M-RoPE positions from transformers' ``get_rope_index``
(per row, never the model's cached ``rope_deltas``, which belong to whatever batch ran last); its next
position is past its last one (text index + rope delta), so decode steps carry the delta in
``Batch.next_pos`` and pass plain ``[B, 1]`` positions, which the model spreads over the three axes.
"""

from __future__ import annotations

import inspect
import logging
import os
import tempfile
from collections.abc import Callable
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig
from transformers.cache_utils import DynamicLayer

from ...errors import WeightUpdateError
from ...models import quiet_weight_loading
from ...models.tiny import ensure_tiny_model
from ...models.vision import load_image_processor
from ...protocol import PENALTY_RANGE, EngineLimits, InflightMode
from ...protocol.engine_config import CpuEngineConfig
from ...weights import Bucket
from ...weights.manifest import check_metas, parameter_shapes
from .._sampling import RowSampling, sample
from .batch import Batch, prefill_inputs
from .prefix_cache import Hit, PrefixCache
from .sequence import Sequence
from .threads import threads_for, use_threads

__all__ = ["ModelRunner", "StepOutput"]

log = logging.getLogger("rollout_sdk.engines.cpu")
_HEAD_CHUNK = 32


class StepOutput(NamedTuple):
    """What one step made: the weight version it ran on, one ``(sequence, token, logprob)`` per row that
    sampled, the rows that failed on their own (each with its error; the engine fails just those), and the
    tokens it prefilled, cached ones not counted (the engine's ``prefill_progress()``)."""

    version: int
    emitted: list[tuple[Sequence, int, float]]
    failed: list[tuple[Sequence, BaseException]]
    prefilled: int = 0


class ModelRunner:
    """The model, its batch and the weight version it holds.  Worker thread only."""

    def __init__(self, config: CpuEngineConfig) -> None:
        self.config = config
        self.model: Any = None
        self._prefilled = 0  # tokens the current step prefilled (StepOutput.prefilled)
        self.model_path = ""
        self.limits: EngineLimits | None = None
        self.batch = Batch()
        #: the version the weights are at; stamped on every token a step makes
        self.version = 0
        #: bumped at every change of weights (or version): the prefix cache's namespace (issue 41)
        self.kv_generation = 0
        self._body: Any = None
        self._head: Callable[[Any], Any] = _identity
        self._cache_kw = "past_key_values"
        self._offload_dir: tempfile.TemporaryDirectory[str] | None = None
        #: a vision-language model (Qwen2.5-VL): its inner model (vision tower, language model, rope index)
        self._vl: Any = None
        #: its image processor (models.vision.ImageProcessor); None for a text-only model
        self.vision: Any = None
        #: KV of finished rows by token prefix (prefix_cache.py); off with prefix_cache_tokens 0 or None
        self.prefix_cache = PrefixCache(config.prefix_cache_tokens or 0)
        #: rows in the batch that were prefilled from a cache entry (its id: a prefix their own supersedes)
        self._hit_of: dict[Sequence, int] = {}
        #: rows in the batch whose KV was (partly) computed under weights since changed: never cached
        self._stale_kv: set[Sequence] = set()

    # -- loading -----------------------------------------------------------------------------------

    def load(self) -> EngineLimits:
        path = self.config.model_path
        if path is None:
            path = str(ensure_tiny_model(self.config.home))
        if not Path(path, "config.json").exists():
            raise FileNotFoundError(f"{path!r} is not a model directory (no config.json)")
        threads = threads_for(path, self.config.num_threads)
        if threads is not None:  # this worker's own (threads.py: one for a small model)
            use_threads(threads)
        dtype = getattr(torch, self.config.dtype)

        self.vision = load_image_processor(path)
        auto: Any = AutoModelForCausalLM
        if self.vision is not None:
            from transformers import AutoModelForImageTextToText  # optional: transformers-vision

            auto = AutoModelForImageTextToText
        with quiet_weight_loading():  # no "Loading weights" bar in servers, ranks and examples
            model: Any = auto.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
        model.eval()
        model.requires_grad_(False)
        cfg = model.config
        eos: list[int] = []
        try:
            gc = GenerationConfig.from_pretrained(path)
            eos = _as_list(gc.eos_token_id)
        except OSError:
            pass
        eos = eos or _as_list(getattr(cfg, "eos_token_id", None))
        vocab = int(model.get_output_embeddings().weight.shape[0])
        ctx = self.config.max_context or int(getattr(cfg.get_text_config(), "max_position_embeddings", 2048))
        body = getattr(model, model.base_model_prefix, None)
        head = model.get_output_embeddings()
        # Split body and head only where the head is a plain projection of the last hidden state.
        plain_head = not any(
            getattr(cfg, a, None) for a in ("final_logit_softcapping", "logit_scale", "logits_scaling")
        )
        if body is not None and head is not None and plain_head:
            self._body, self._head = body, head
        else:
            self._body, self._head = None, _identity
        if self.vision is not None:
            self._vl = model.model
            self._body = self._vl.language_model  # fed embeddings (images scattered in) and 3D positions
        # the prefix cache cuts rows out of plain full-attention layers; a sliding window or a multimodal
        # RoPE (positions that are not token indices) would need more than that
        probe = DynamicCache(config=cfg)
        if self._vl is not None or any(type(layer) is not DynamicLayer for layer in probe.layers):
            self.prefix_cache.disable()
        params = inspect.signature((self._body or model).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.model = model
        self.model_path = path
        self.limits = EngineLimits(vocab_size=vocab, max_context=ctx, eos_token_ids=eos)
        return self.limits

    def close(self) -> None:
        self._clear_batch()
        self.prefix_cache.clear()
        if self._offload_dir is not None:
            self._offload_dir.cleanup()
            self._offload_dir = None

    # -- one step ----------------------------------------------------------------------------------

    def step(self, admit: list[Sequence]) -> StepOutput:
        """Decode one token for every running row, prefill ``admit``.

        A failure is pinned on the request that causes it: a row whose sampling fails fails alone; a
        batched prefill that fails is retried row by row; a batched decode that fails drops the batch's KV
        cache (it may be half extended) and every row re-prefills as ``prompt + tokens so far``, row by row
        if need be.  A row that fails on its own fails; the engine is broken (this raises) only when a
        one-token canary forward fails too.
        """

        version = self.version
        b = self.batch
        emitted: list[tuple[Sequence, int, float]] = []
        failed: list[tuple[Sequence, BaseException]] = []
        self._prefilled = 0
        with torch.inference_mode():
            self.drop_done()
            if b.rows:
                try:
                    ids, mask, pos = b.decode_inputs()
                    last = self._forward_last(ids, mask, pos, b.cache)
                except Exception:
                    log.warning("CPU engine: a batched decode failed; re-prefilling its rows", exc_info=True)
                    admit = self.retract() + admit
                else:
                    toks, lps, bad = self._head_and_sample(last, b.rows)
                    b.advance(mask, toks)
                    emitted.extend(_good(b.rows, toks, lps, bad))
                    failed.extend(bad.items())
            if admit:
                cold = self._prefill_hits(admit, emitted, failed)
                if cold:
                    e, f = self._prefill_isolated(cold)
                    emitted.extend(e)
                    failed.extend(f)
            if failed:
                self._canary()  # raises when the engine itself is broken
        return StepOutput(version, emitted, failed, self._prefilled)

    def drop_done(self) -> None:
        """Drop the finished rows from the batch, their KV kept in the prefix cache first."""
        b = self.batch
        if not any(s.done for s in b.rows):
            return
        self._keep_finished()
        b.drop_done()
        if self._hit_of or self._stale_kv:
            rows = set(b.rows)
            self._hit_of = {s: i for s, i in self._hit_of.items() if s in rows}
            self._stale_kv &= rows

    def _keep_finished(self) -> None:
        """Each finished text row's KV into the prefix cache: its first ``n`` tokens (prompt and output but
        the last token, or all of them for a row aborted after its last token was fed), under its namespace;
        a turn with ``keep_kv_s`` under its session (pinned while the session is kept)."""
        b, cache = self.batch, self.prefix_cache
        if not cache.enabled or b.mask is None:
            return
        for i, s in enumerate(b.rows):
            if not s.done or s.vision is not None or s in self._stale_kv or s.num_tokens - 1 > cache.capacity_tokens:
                continue  # (a row larger than the cache is not even copied out)
            n, kv = b.row_kv(i)
            if n == 0 or n > s.num_tokens:
                continue
            session = s.req.session_id if s.req.keep_kv_s is not None else None
            cache.insert(s.cache_ns, s.token_ids[:n], kv, session=session, replaces=self._hit_of.get(s))

    def _prefill_hits(
        self,
        admit: list[Sequence],
        emitted: list[tuple[Sequence, int, float]],
        failed: list[tuple[Sequence, BaseException]],
    ) -> list[Sequence]:
        """Prefill each row of ``admit`` that finds a cached prefix alone, from it; return the others.  A
        row whose prefill from the cache fails is returned with them (prefilled cold: no entry is trusted
        over a request)."""
        cache = self.prefix_cache
        if not cache.enabled:
            return admit
        cold: list[Sequence] = []
        for s in admit:
            s.cache_ns = self.cache_ns  # the weights its KV is computed under from now on
            hit = cache.lookup(s.cache_ns, s.token_ids) if s.vision is None else None
            if hit is None:
                cold.append(s)
                continue
            try:
                toks, lps, bad = self._prefill_hit(s, hit)
            except Exception:
                log.warning("CPU engine: a prefill from the prefix cache failed; prefilling it cold", exc_info=True)
                cold.append(s)
                continue
            emitted.extend(_good([s], toks, lps, bad))
            failed.extend(bad.items())
        return cold

    def _prefill_hit(self, s: Sequence, hit: Hit) -> tuple[torch.Tensor, torch.Tensor, dict[Sequence, BaseException]]:
        """Prefill ``s`` alone over a cache holding ``hit``'s KV: only the tokens past it are forwarded."""
        ctx = s.token_ids
        m = hit.num_tokens
        cache = DynamicCache(ddp_cache_data=hit.kv, config=self.model.config)
        ids = torch.tensor([ctx[m:]], dtype=torch.long)
        mask = torch.ones(1, len(ctx), dtype=torch.long)
        pos = torch.arange(m, len(ctx), dtype=torch.long)[None]
        last = self._forward_last(ids, mask, pos, cache)
        self._prefilled += len(ctx) - m
        toks, lps, bad = self._head_and_sample(last, [s])
        self.batch.admit([s], cache, mask, torch.tensor([len(ctx)]), toks)
        s.kv_version = self.version  # cached under this version's namespace: its KV is this version's
        self._hit_of[s] = hit.entry_id
        if not s.out:  # its first prefill (a retracted row's re-prefill reports nothing new)
            s.cached_tokens = min(m, s.num_prompt_tokens)
        return toks, lps, bad

    def _clear_batch(self) -> None:
        self.batch.clear()
        self._hit_of.clear()
        self._stale_kv.clear()

    def _prefill_isolated(
        self, admit: list[Sequence]
    ) -> tuple[list[tuple[Sequence, int, float]], list[tuple[Sequence, BaseException]]]:
        groups = [admit]
        emitted: list[tuple[Sequence, int, float]] = []
        failed: list[tuple[Sequence, BaseException]] = []
        while groups:
            group = groups.pop()
            try:
                toks, lps, bad = self._prefill(group)
            except Exception as exc:
                if len(group) == 1:
                    failed.append((group[0], exc))
                else:  # which row: prefill them one by one
                    groups.extend([s] for s in reversed(group))
                continue
            emitted.extend(_good(group, toks, lps, bad))
            failed.extend(bad.items())
        return emitted, failed

    def _canary(self) -> None:
        """A one-token forward on a fresh cache: if this fails, no request is to blame."""

        one = torch.zeros(1, 1, dtype=torch.long)
        self._forward_last(one, torch.ones_like(one), one, DynamicCache(config=self.model.config))

    def retract(self) -> list[Sequence]:
        """Drop the KV cache of every running row; the rows re-prefill (prompt + tokens so far) later."""
        rows = self.batch.live_rows()
        if self.batch.mask is not None:
            self._keep_finished()
        self._clear_batch()
        return rows

    def _prefill(self, admit: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, dict[Sequence, BaseException]]:
        ids, mask, pos = prefill_inputs(admit)
        cache = DynamicCache(config=self.model.config)
        x = ids
        if self._vl is not None:
            pos = self._mrope_positions(ids, pos, admit)  # [3, B, T]; text rows: three equal rows
            x = self._embed(ids, admit)  # the rows' images scattered in
        last = self._forward_last(x, mask, pos, cache)
        self._prefilled += sum(s.num_tokens for s in admit)
        toks, lps, bad = self._head_and_sample(last, admit)
        # the next token's position: past the last one (a text token: its three rope positions are equal;
        # with images that is the text index plus the row's rope delta, carried on in every decode step)
        nxt = (pos[0] if pos.dim() == 3 else pos)[:, -1] + 1
        self.batch.admit(admit, cache, mask, nxt, toks)
        for s in admit:  # their KV is all of this version now (a re-prefill recomputed it)
            s.kv_version = self.version
        return toks, lps, bad

    def _mrope_positions(self, ids: torch.Tensor, pos: torch.Tensor, rows: Seq[Sequence]) -> torch.Tensor:
        """Qwen2.5-VL's multimodal RoPE positions ``[3, B, T]`` of left-padded ``ids``: transformers'
        ``get_rope_index`` for each row with images (its image spans as the token types), the plain
        positions on all three axes for the others."""

        pos3 = pos[None].expand(3, -1, -1).clone()
        width = ids.shape[1]
        for b, s in enumerate(rows):
            v = s.vision
            if v is None:
                continue
            off = width - s.num_tokens
            row = ids[b : b + 1, off:]
            types = torch.zeros_like(row, dtype=torch.int)
            for start, n in v.spans:
                types[0, start : start + n] = 1
            grid = torch.tensor(v.grid_thw, dtype=torch.long)
            p3, _ = self._vl.get_rope_index(row, types, image_grid_thw=grid)
            pos3[:, b, off:] = p3[:, 0]
        return pos3

    def _embed(self, ids: torch.Tensor, rows: Seq[Sequence] | None) -> torch.Tensor:
        """Token embeddings of left-padded ``ids``, each image's span replaced by its vision-tower features."""

        embeds: torch.Tensor = self._body.embed_tokens(ids)
        width = ids.shape[1]
        for b, s in enumerate(rows or ()):
            v = s.vision
            if v is None:
                continue
            off = width - s.num_tokens
            grid = torch.tensor(v.grid_thw, dtype=torch.long)
            feats = self._vl.get_image_features(v.pixel_values.to(embeds.dtype), grid).pooler_output
            for (start, n), f in zip(v.spans, feats, strict=True):
                embeds[b, off + start : off + start + n] = f.to(embeds.dtype)
        return embeds

    def _forward_last(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any) -> torch.Tensor:
        """Run the model over ``ids`` (extending ``cache`` in place); return each row's last hidden state,
        or its logits when the model could not be split into body and head.  A VL model is fed embeddings:
        ``ids`` may already be those (a prefill, its images scattered in by :meth:`_embed`)."""
        kw = {"input_ids": ids, "attention_mask": mask, "position_ids": pos, self._cache_kw: cache, "use_cache": True}
        if self._vl is not None:
            del kw["input_ids"]
            kw["inputs_embeds"] = ids if ids.is_floating_point() else self._embed(ids, None)
        if self._body is not None:
            hidden: torch.Tensor = self._body(**kw).last_hidden_state[:, -1, :]
            return hidden
        logits: torch.Tensor = self.model(**kw, logits_to_keep=1).logits[:, -1, :]
        return logits

    def _head_and_sample(
        self, hidden: torch.Tensor, rows: Seq[Sequence]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[Sequence, BaseException]]:
        """Logits and tokens for ``hidden`` ([n, H], last position of each row), in cache-sized chunks:
        a [rows, 150k] float32 block stays in cache at 32 rows and spills to memory at 128.  A row whose
        penalties or sampling raise is returned in the dict (its token is a placeholder, never used)."""

        toks, lps = [], []
        bad: dict[Sequence, BaseException] = {}
        for lo in range(0, len(rows), _HEAD_CHUNK):
            chunk = rows[lo : lo + _HEAD_CHUNK]
            logits = self._head(hidden[lo : lo + _HEAD_CHUNK]).float()
            vocab = logits.shape[1]
            specs = []
            for i, s in enumerate(chunk):
                sp = s.sampling
                try:
                    if s.is_penalized:
                        _apply_penalties(logits[i], s, vocab)
                    if s.stops_banned:
                        logits[i, [t for t in s.stop_ids if t < vocab]] = float("-inf")
                except Exception as exc:
                    bad[s] = exc
                    logits[i] = 0.0
                specs.append(RowSampling(sp.temperature, sp.top_k, sp.top_p, sp.min_p, s.rng.random()))
            try:
                t, lp = sample(logits, specs)
            except Exception:  # which row: sample them one by one
                t, lp = torch.zeros(len(chunk), dtype=torch.long), torch.zeros(len(chunk))
                for i, (s, spec) in enumerate(zip(chunk, specs, strict=True)):
                    try:
                        ti, li = sample(logits[i : i + 1].clone(), [spec])
                        t[i], lp[i] = ti[0], li[0]
                    except Exception as exc:
                        bad.setdefault(s, exc)
            toks.append(t)
            lps.append(lp)
        return torch.cat(toks), torch.cat(lps), bad

    # -- weights and memory ------------------------------------------------------------------------

    def score_prompt(self, input_ids: list[int], seq: Sequence | None = None) -> tuple[list[float], int]:
        """Logprob of each prompt token given the ones before it (one forward, no KV cache kept), and the
        weight version it ran on.  The head runs ``_HEAD_CHUNK`` positions at a time: never [n, vocab].
        ``seq``: a request with images (its expanded prompt is ``input_ids``)."""

        ids = torch.tensor([input_ids], dtype=torch.long)
        with torch.inference_mode():
            if self._vl is not None:
                rows = [seq] if seq is not None else []
                pos = self._mrope_positions(ids, torch.arange(ids.shape[1])[None], rows)
                embeds = self._embed(ids, rows)
                hidden = self._body(inputs_embeds=embeds, position_ids=pos, use_cache=False).last_hidden_state[0]
                head = self._head
            elif self._body is not None:
                hidden = self._body(input_ids=ids, use_cache=False).last_hidden_state[0]
                head = self._head
            else:
                hidden = self.model(input_ids=ids, use_cache=False).logits[0]
                head = _identity
            targets = ids[0, 1:]
            out: list[float] = []
            for lo in range(0, len(targets), _HEAD_CHUNK):
                logits = head(hidden[lo : min(lo + _HEAD_CHUNK, len(targets))]).float()
                lp = torch.log_softmax(logits, dim=-1)
                out.extend(lp.gather(1, targets[lo : lo + _HEAD_CHUNK, None])[:, 0].tolist())
        return out, self.version

    def apply_weights(
        self, named: list[tuple[str, torch.Tensor]], version: int | None, inflight: InflightMode = "keep"
    ) -> list[Sequence]:
        """Load named tensors, all or nothing (checked against the model's manifest first).  ``reprefill``:
        the running rows' KV is dropped and they are returned, to be prefilled again (``prompt + tokens so
        far``) on the new weights; ``keep``: they go on with their KV (its version stays on each row)."""

        problems = check_metas(parameter_shapes(self.model), [Bucket(named).metas])
        if problems:
            raise WeightUpdateError("; ".join(problems), applied=False)
        params = _unique_params(self.model)
        aliases = _tied_aliases(self.model)
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, tensor in named:
            if not tensor.dtype.is_floating_point:
                raise WeightUpdateError(
                    f"parameter {name!r}: dtype {tensor.dtype} is not floating point", applied=False
                )
            staged.append((params[aliases.get(name, name)], tensor))
        # a row going on (keep) attends to KV of the old weights: it is never cached under the new version's
        # namespace; new requests look up only that namespace (Sequence.cache_ns, set at each prefill)
        self._stale_kv.update(self.batch.rows)
        retracted = self.retract() if inflight == "reprefill" else []
        self.kv_generation += 1  # a new prefix-cache namespace, version or not
        with torch.no_grad():
            for p, tensor in staged:
                p.copy_(tensor)
        if version is not None:
            self.version = version
        return retracted

    def set_version(self, version: int) -> None:
        if version != self.version:
            self.kv_generation += 1  # weights loaded some other way: a new namespace
        self.version = version

    @property
    def cache_ns(self) -> str:
        """The prefix-cache namespace of the weights held now (Sequence.cache_ns)."""
        return f"w{self.kv_generation}"

    def release(self, tags: list[str]) -> None:
        """Free the KV cache and/or offload the weights to a temporary safetensors file."""

        if "kv_cache" in tags:
            self._clear_batch()
            self.prefix_cache.clear()
        if "weights" in tags and self._offload_dir is None:
            self._offload_dir = tempfile.TemporaryDirectory(prefix="rollout-sdk-offload-")
            state = {k: v.contiguous() for k, v in _unique_params(self.model).items()}
            save_file(state, os.path.join(self._offload_dir.name, "weights.safetensors"))
            for p in _unique_params(self.model).values():
                p.data = torch.empty(0, dtype=p.dtype)

    def restore(self, tags: list[str]) -> None:
        if "weights" in tags and self._offload_dir is not None:
            state = load_file(os.path.join(self._offload_dir.name, "weights.safetensors"))
            for name, p in _unique_params(self.model).items():
                p.data = state[name]
            self._offload_dir.cleanup()
            self._offload_dir = None


# -- helpers ---------------------------------------------------------------------------------------


def _identity(x: Any) -> Any:
    return x


def _as_list(x: Any) -> list[int]:
    if x is None:
        return []
    if isinstance(x, int):
        return [x]
    return [int(v) for v in x]


def _apply_penalties(row: torch.Tensor, s: Sequence, vocab: int) -> None:
    sp = s.sampling
    if sp.repetition_penalty != 1.0:
        lo, hi = PENALTY_RANGE
        penalty = min(max(sp.repetition_penalty, lo), hi)  # beyond these a float32 logit overflows
        seen = torch.tensor(sorted(set(s.prompt) | set(s.out)), dtype=torch.long)
        seen = seen[seen < vocab]
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / penalty, vals * penalty)
    if s.out and (sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0):
        counts = torch.bincount(torch.tensor(s.out, dtype=torch.long), minlength=vocab)[:vocab].float()
        row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).float()


def _unique_params(model: Any) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def _tied_aliases(model: Any) -> dict[str, str]:
    """Names a checkpoint may use for a parameter that named_parameters() lists under another name."""
    aliases: dict[str, str] = {}
    by_id = {id(p): n for n, p in model.named_parameters()}
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical = by_id.get(id(p))
        if canonical is not None and canonical != name:
            aliases[name] = canonical
    out_emb = model.get_output_embeddings()
    in_emb = model.get_input_embeddings()
    if out_emb is not None and in_emb is not None and out_emb.weight is in_emb.weight:
        aliases.setdefault("lm_head.weight", by_id[id(in_emb.weight)])
    return aliases


def _good(
    rows: Seq[Sequence], toks: torch.Tensor, lps: torch.Tensor, bad: dict[Sequence, BaseException]
) -> list[tuple[Sequence, int, float]]:
    return [(s, t, lp) for s, t, lp in zip(rows, toks.tolist(), lps.tolist(), strict=True) if s not in bad]
