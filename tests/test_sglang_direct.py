"""The SGLang engine's direct path to the scheduler (engines/sglang/direct.py) against its tokenizer-manager
path, on SGLang's real TokenizerManager and io_struct over a stand-in scheduler process (standin.py).

Needs sglang importable (CPU is enough); skipped elsewhere.  The stand-in's tokens are a fixed function of
the sequence, so both paths (and a request checkpointed half way and continued) must give the same ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

pytest.importorskip("sglang.srt.managers.tokenizer_manager")

import pytest_asyncio

from rollout_sdk.engines.sglang import SglangEngine, SglangEngineConfig
from rollout_sdk.engines.sglang.standin import (
    StandinEngine,
    StandinScheduler,
    standin_logprob,
    standin_next,
    standin_seed,
)
from rollout_sdk.errors import InvalidRequestError
from rollout_sdk.protocol import GenerateRequest, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")
LONG = 4000  # tokens: runs for seconds in the stand-in (context 4096)


@contextlib.asynccontextmanager
async def engine(
    model: str,
    path: str = "direct",
    *,
    step_s: float = 0.0005,
    max_running: int = 1024,
    inplace: bool = True,
    kv_tokens: int | None = None,
    **config: object,
) -> AsyncIterator[SglangEngine]:
    cfg = SglangEngineConfig(model_path=model, request_path=path, freeze_gc=False, **config)  # type: ignore[arg-type]
    eng = SglangEngine(
        cfg,
        launcher=StandinEngine.launcher(
            StandinScheduler(
                step_s=step_s, max_running=max_running, vocab_size=_vocab(model), inplace=inplace, kv_tokens=kv_tokens
            )
        ),
    )
    await eng.start()
    try:
        yield eng
    finally:
        await eng.close()


def _vocab(model: str) -> int:
    import json
    from pathlib import Path

    cfg = json.loads((Path(model) / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])  # a VL config nests it


def expected(prompt: list[int], n: int, vocab: int, mm: tuple[object, ...] = ()) -> list[int]:
    out, h = [], standin_seed(prompt, mm)
    for _ in range(n):
        tok, h = standin_next(h, vocab)
        out.append(tok)
    return out


@pytest.fixture(scope="module")
def model(tiny_model: object) -> str:
    return str(tiny_model)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def eng(model: str) -> AsyncIterator[SglangEngine]:
    """One direct-path engine for the module: four requests run at a time, the rest wait."""
    async with engine(model, step_s=0.001, max_running=4) as e:
        assert e._path is not None
        yield e


def started(eng: SglangEngine, rid: str) -> bool:
    """The scheduler has sent tokens of ``rid`` (so it is running there, not waiting)."""
    flight = eng.flights.get(rid)
    part = eng._path._reqs.get(flight.sid) if flight is not None and eng._path is not None else None
    return part is not None and len(part.ids) > 0


def req(rid: str, prompt: list[int], n: int, **kw: object) -> GenerateRequest:
    return GenerateRequest(
        rid=rid, input_ids=prompt, sampling=SamplingParams(max_new_tokens=n, **kw), return_logprobs=True
    )


async def test_direct_and_tokenizer_manager_paths_agree(model: str, eng: SglangEngine) -> None:
    prompts = [[1 + i, 2 + i, 3 + i * 7] for i in range(40)]
    results = {}

    async def run(e: SglangEngine) -> list[tuple[object, ...]]:
        outs = await asyncio.gather(*(e.generate(req(f"r{i}", p, 5 + i % 70)) for i, p in enumerate(prompts)))
        return [(o.output_ids, o.logprobs, o.finish_reason) for o in outs]

    assert eng._path is not None
    sent, messages = eng._path.sent, eng._path.messages
    results["direct"] = await run(eng)
    assert eng._path.sent - sent == len(prompts) and not eng._path._reqs
    assert eng._path.messages - messages == 1  # submitted in one loop iteration: one message
    async with engine(model, "tokenizer_manager") as tm_eng:
        assert tm_eng._path is None
        results["tokenizer_manager"] = await run(tm_eng)
    assert results["direct"] == results["tokenizer_manager"]
    vocab = _vocab(model)
    for (ids, lps, reason), p, i in zip(results["direct"], prompts, range(len(prompts)), strict=True):
        assert ids == expected(p, 5 + i % 70, vocab)
        assert lps == [standin_logprob(t) for t in ids]
        assert reason == "length"


async def test_a_burst_goes_out_in_pieces(model: str, eng: SglangEngine) -> None:
    from rollout_sdk.engines.sglang.direct import BATCH

    assert eng._path is not None
    messages = eng._path.messages
    n = 2 * BATCH + 5
    outs = await asyncio.gather(*(eng.generate(req(f"burst{i}", [i + 1], 2)) for i in range(n)))
    assert [o.output_ids for o in outs] == [expected([i + 1], 2, _vocab(model)) for i in range(n)]
    assert eng._path.messages - messages == 3


async def test_abort_running_and_waiting_requests(model: str, eng: SglangEngine) -> None:
    assert eng._path is not None
    running = [asyncio.create_task(eng.generate(req(f"a{i}", [5, 6 + i], LONG))) for i in range(4)]
    await _until(lambda: all(started(eng, f"a{i}") for i in range(4)))
    waiting = asyncio.create_task(eng.generate(req("b", [7, 8], 10)))  # four run at a time: this one waits
    await _until(lambda: eng.flights.get("b") is not None and eng._path.owns(eng.flights["b"].sid))
    eng.abort("b")  # in the scheduler's waiting queue: SGLang echoes an AbortReq
    for i in range(4):
        eng.abort(f"a{i}")  # running: each ends with its tokens so far
    outs = await asyncio.gather(*running)
    rb = await waiting
    for i, ra in enumerate(outs):
        assert ra.finish_reason == "abort" and 0 < len(ra.output_ids) < LONG
        assert ra.output_ids == expected([5, 6 + i], len(ra.output_ids), _vocab(model))
    assert rb.finish_reason == "abort" and len(rb.output_ids) < 10
    assert not eng._path._reqs
    ok = await eng.generate(req("c", [9], 3))  # the engine keeps serving
    assert ok.output_ids == expected([9], 3, _vocab(model))


async def test_cancelled_caller_aborts_inside_the_scheduler(eng: SglangEngine) -> None:
    assert eng._path is not None
    task = asyncio.create_task(eng.generate(req("x", [3, 4], LONG)))
    await _until(lambda: started(eng, "x"))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not eng._path._reqs and not eng.flights
    # the scheduler dropped it: its flush succeeds only when nothing runs or waits there
    await _until_async(lambda: _flushed(eng))


async def test_checkpointed_request_continues_to_the_same_tokens(model: str, eng: SglangEngine) -> None:
    task = asyncio.create_task(eng.generate(req("p", [11, 12, 13], 2000)))
    await _until(lambda: started(eng, "p"))
    before = eng._weight_version
    await eng.pause("retract")  # checkpoint: aborted inside SGLang, its tokens kept
    await eng.set_weight_version(before + 1)
    await eng.resume()
    out = await task
    assert out.output_ids == expected([11, 12, 13], 2000, _vocab(model))
    assert out.finish_reason == "length"
    versions = [v for v, _ in out.version_segments]
    assert versions[0] == before and versions[-1] == before + 1
    assert sum(n for _, n in out.version_segments) == 2000


async def test_score_and_validation(model: str, eng: SglangEngine) -> None:
    ids = [4, 9, 16, 25, 36]
    out = await eng.generate(GenerateRequest(rid="s", input_ids=ids, score_only=True))
    assert out.prompt_logprobs == [standin_logprob(t) for t in ids[1:]]
    too_long = eng.limits.max_context
    with pytest.raises(InvalidRequestError):
        await eng.generate(req("long", [1] * too_long, 4))
    with pytest.raises(InvalidRequestError):
        await eng.generate(req("over", [1, 2], too_long))
    assert (await eng.generate(req("after", [1, 2], 2))).output_ids == expected([1, 2], 2, _vocab(model))


async def test_direct_and_tokenizer_manager_requests_share_one_batch(model: str, eng: SglangEngine) -> None:
    """Requests of both paths in flight at once: output batches hold rids of both."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    tm = eng.tm

    async def raw(i: int) -> list[int]:
        obj = GenerateReqInput(rid=f"raw-{i:028d}", input_ids=[i + 1, i + 2], sampling_params={"max_new_tokens": 60})
        out = await tm.generate_request(obj, None).__anext__()
        return list(out["output_ids"])

    mine = [eng.generate(req(f"d{i}", [i + 1, i + 2], 60)) for i in range(20)]
    theirs = [raw(i) for i in range(20)]
    outs = await asyncio.gather(*mine, *theirs)
    direct = [o.output_ids for o in outs[:20]]
    assert direct == outs[20:]
    assert direct == [expected([i + 1, i + 2], 60, _vocab(model)) for i in range(20)]
    assert not tm.rid_to_state and not eng._path._reqs


async def _until(cond, timeout: float = 120.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.01)


async def _until_async(cond, timeout: float = 120.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout):
        while not await cond():
            await asyncio.sleep(0.05)


async def _flushed(eng: SglangEngine) -> bool:
    try:
        await eng.flush_cache()
        return True
    except Exception:
        return False


# -- images: SGLang's real multimodal path of the tokenizer manager, with the SDK's expansion ------------


@pytest.fixture(scope="module")
def vl_model(sdk_home: object) -> str:
    from rollout_sdk.models import ensure_tiny_vl_model

    return str(ensure_tiny_vl_model(sdk_home))  # type: ignore[arg-type]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vl_eng(vl_model: str) -> AsyncIterator[SglangEngine]:
    async with engine(vl_model, step_s=0.001) as e:
        yield e


async def test_images_reach_the_scheduler_with_the_sdks_expansion(vl_model: str, vl_eng: SglangEngine) -> None:
    """An image request takes SGLang's multimodal path (image_data with a processor_output item); the
    scheduler gets the SDK's expanded ids (the stand-in scores exactly what it received) and the pixels
    (its tokens change with the image)."""
    from rollout_sdk.models.tiny_vl import noise_png
    from rollout_sdk.models.vision import IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID, load_image_processor

    prompt = [151644, 872, 198, VISION_START_ID, IMAGE_PAD_ID, VISION_END_ID, 100, 101]
    a, b = noise_png(56, 84, 1), noise_png(56, 84, 2)
    mine = load_image_processor(vl_model)
    assert mine is not None
    want = mine.expand(prompt, [a])

    def gen(rid: str, image: bytes) -> GenerateRequest:
        return GenerateRequest(rid=rid, input_ids=prompt, images=[image], sampling=SamplingParams(max_new_tokens=6))

    ra1, ra2, rb = await asyncio.gather(
        vl_eng.generate(gen("a1", a)), vl_eng.generate(gen("a2", a)), vl_eng.generate(gen("b", b))
    )
    assert ra1.input_ids == list(want.input_ids) and ra1.image_spans == list(want.spans)
    assert ra1.prompt_tokens == len(want.input_ids) and ra1.image_grid_thw == list(want.grid_thw)
    assert ra1.output_ids == ra2.output_ids and len(ra1.output_ids) == 6
    assert rb.output_ids != ra1.output_ids  # the pixels reached the scheduler
    scored = await vl_eng.generate(GenerateRequest(rid="s", input_ids=prompt, images=[a], score_only=True))
    assert scored.prompt_logprobs == [standin_logprob(t) for t in want.input_ids[1:]]
    assert scored.image_spans == list(want.spans)


async def test_engine_death_fails_direct_parts_as_the_engines_failure(model: str) -> None:
    """A child's death while direct-path parts run: generate and score both fail with EngineDeadError (the
    engine's failure, so the client fails over), never as this request's RequestFailedError."""
    from rollout_sdk.errors import EngineDeadError

    async with engine(model, step_s=0.002, max_running=1) as dying:  # the score waits behind the generate
        assert dying._path is not None
        gen = asyncio.create_task(dying.generate(req("g", [1, 2], LONG)))
        await _until(lambda: started(dying, "g"))
        score = asyncio.create_task(dying.generate(GenerateRequest(rid="s", input_ids=[1, 2, 3], score_only=True)))
        await _until(lambda: "s" in dying.flights and dying.flights["s"].running)
        dying._on_child_death("in a test")
        for task in (gen, score):
            with pytest.raises(EngineDeadError):
                await task
        assert not dying._path._reqs


async def test_the_decode_window_keeps_at_most_its_size_inside_sglang(model: str) -> None:
    """decode_window=4: never more than 4 of our requests inside SGLang at once, the rest queued in the
    server (reported as queued, the window as the running limit), the same tokens as without it."""
    prompts = [[3 + i, 9 + i] for i in range(20)]
    async with engine(model, step_s=0.001, decode_window=4) as e:
        assert e._path is not None and e.decode_window is not None and e.decode_window.size == 4
        path = e._path
        peak = 0
        submit = path.submit

        def counting_submit(*a: object, **kw: object) -> object:
            nonlocal peak
            fut = submit(*a, **kw)  # type: ignore[arg-type]
            peak = max(peak, len(path._reqs))
            return fut

        path.submit = counting_submit  # type: ignore[method-assign]
        tasks = [asyncio.create_task(e.generate(req(f"w{i}", p, 30))) for i, p in enumerate(prompts)]
        await _until(lambda: e.decode_window is not None and e.decode_window.waiting == 16)
        load = e.load()
        assert load.max_running_requests == 4 and load.queued >= 16
        outs = await asyncio.gather(*tasks)
        assert 1 <= peak <= 4
        assert e.decode_window.taken == 0 and e.decode_window.waiting == 0
    vocab = _vocab(model)
    assert [o.output_ids for o in outs] == [expected(p, 30, vocab) for p in prompts]


async def test_an_aborted_request_leaves_the_decode_window_queue(model: str) -> None:
    async with engine(model, step_s=0.001, decode_window=1) as e:
        first = asyncio.create_task(e.generate(req("first", [5, 6], LONG)))
        await _until(lambda: started(e, "first"))
        queued = asyncio.create_task(e.generate(req("queued", [7, 8], 4)))
        await _until(lambda: e.decode_window is not None and e.decode_window.waiting == 1)
        e.abort("queued")
        r = await asyncio.wait_for(queued, 60)
        assert r.finish_reason == "abort" and r.output_ids == []
        e.abort("first")
        await first
        after = await e.generate(req("after", [7, 8], 4))  # the window's one place is free again
        assert after.output_ids == expected([7, 8], 4, _vocab(model))


async def test_a_group_prompt_is_prefilled_once_inside_sglang(model: str) -> None:
    """Members of a group sent at once: without prefill-once each computes the prompt (the stand-in, like
    SGLang, caches a prompt only after the step that admitted it); with it, one prefill-only request
    computes it and every member takes all but its last token from the cache.  Same tokens either way."""
    n_prompt, g = 300, 4
    prompts = [[100 + 13 * k + j % 89 for j in range(n_prompt)] for k in range(3)]

    async def run(e: SglangEngine) -> list[tuple[list[int], int]]:
        reqs = [
            GenerateRequest(rid=f"g{k}m{m}", input_ids=p, group_id=f"grp{k}", sampling=SamplingParams(max_new_tokens=5))
            for k, p in enumerate(prompts)
            for m in range(g)
        ]
        outs = await asyncio.gather(*(e.generate(r) for r in reqs))
        return [(o.output_ids, o.cached_tokens) for o in outs]

    async with engine(model, prefill_once_min_tokens=None) as e:
        naive = await run(e)
    async with engine(model) as e:
        once = await run(e)
        assert e.prefill_once is not None and e.prefill_once.prefills == len(prompts)
        assert e.prefill_once_tokens == len(prompts) * n_prompt
    assert all(cached == 0 for _, cached in naive)
    assert all(cached == n_prompt - 1 for _, cached in once)
    assert [ids for ids, _ in naive] == [ids for ids, _ in once]


async def test_a_kept_sessions_turns_carry_their_pin_and_admission_holds_new_sessions(model: str) -> None:
    """Issue 40 over SGLang's tokenizer-manager wire: a turn with ``keep_kv_s`` reaches the scheduler with
    the pin (``custom_params``, read by engines/sglang/pins.py where SGLang caches it), tokens unchanged;
    the engine's session book admits a new session only when the kept ones leave room."""
    from rollout_sdk.engines.sglang import pins
    from rollout_sdk.protocol import SessionHint

    async with engine(model, session_admission=0.5) as e:
        assert e.sessions is not None
        e.sessions.budget_tokens = 400  # the stand-in reports no pool: size it by hand
        assert e._path is not None
        sent: list[dict] = []
        submit = e._path.submit

        def spy(sid: str, ids: list[int], sampling: dict, **kw: object) -> object:
            sent.append(dict(sampling))
            return submit(sid, ids, sampling, **kw)

        e._path.submit = spy  # type: ignore[method-assign]
        prompt = [7 + j % 50 for j in range(200)]
        plain = await e.generate(GenerateRequest(rid="p", input_ids=prompt, sampling=SamplingParams(max_new_tokens=5)))
        kept = await e.generate(
            GenerateRequest(
                rid="k", input_ids=prompt, session_id="s1", keep_kv_s=30.0, sampling=SamplingParams(max_new_tokens=5)
            )
        )
        assert kept.output_ids == plain.output_ids  # a pin changes what is cached, never the tokens
        assert "custom_params" not in sent[0]
        assert sent[1]["custom_params"][pins.KEY][0] == "s1"
        assert e.sessions.holds("s1")
        second = asyncio.create_task(
            e.generate(
                GenerateRequest(
                    rid="k2",
                    input_ids=prompt,
                    session_id="s2",
                    keep_kv_s=30.0,
                    sampling=SamplingParams(max_new_tokens=5),
                )
            )
        )
        deadline = time.monotonic() + 60
        while e.sessions.waiting != 1:  # s1 keeps 205 tokens: s2's 205 do not fit in 400 as well
            assert time.monotonic() < deadline, "s2 never waited for room"
            await asyncio.sleep(0.005)
        e.session_hints([SessionHint(session_id="s1", ended=True)])
        assert (await asyncio.wait_for(second, 60)).output_ids == plain.output_ids
        assert e.sessions.holds("s2") and not e.sessions.holds("s1")


async def test_the_prefix_cache_is_keyed_by_weight_version_and_keep_continues_on_its_kv(model: str) -> None:
    """Issue 41 on SGLang's request path.  A later request never reuses KV cached under older weights, with
    no flush; a request held across an update goes on under its old key (``keep``: it takes all of its
    sequence but the last token from the cache, nothing re-prefilled) or under the new one (``reprefill``:
    all of it computed again); the tokens and their version and KV-version runs are exact either way."""
    prompt = [50 + (7 * j) % 91 for j in range(120)]
    vocab = _vocab(model)
    async with engine(model, step_s=0.001) as e:
        v0 = e.weight_version
        a = await e.generate(req("ns-a", prompt, 4))
        b = await e.generate(req("ns-b", prompt, 4))
        assert (a.cached_tokens, b.cached_tokens) == (0, len(prompt) - 1)
        await e.set_weight_version(v0 + 1)  # no flush: the cached prompt is v0's
        c = await e.generate(req("ns-c", prompt, 4))
        d = await e.generate(req("ns-d", prompt, 4))
        assert (c.cached_tokens, d.cached_tokens) == (0, len(prompt) - 1)

        for inflight in ("keep", "reprefill"):
            v = e.weight_version
            p = [3, 1, 4, 1, 5, 9, 2, 6, len(inflight)]
            task = asyncio.create_task(e.generate(req(f"held-{inflight}", p, 3000)))
            await _until(lambda rid=f"held-{inflight}": started(e, rid))
            before = e.reprefilled_tokens
            async with e._control._quiesced():  # the update's own path, minus SGLang's weight RPC
                await e._control._finish_update(v + 1, False, inflight)  # type: ignore[arg-type]
            out = await task
            assert out.output_ids == expected(p, 3000, vocab)
            (v_a, n_a), (v_b, n_b) = out.version_segments
            assert (v_a, v_b, n_a + n_b) == (v, v + 1, 3000)
            if inflight == "keep":
                assert out.kv_version_segments == [(v, 3000)] and out.mixed_kv_tokens == n_b
                assert e.reprefilled_tokens == before
            else:
                assert out.kv_version_segments == [] and out.mixed_kv_tokens == 0
                assert e.reprefilled_tokens == before + len(p) + n_a - 1
        # new requests after either update: nothing from older weights
        late = await e.generate(req("ns-late", prompt, 4))
        assert late.cached_tokens == 0


def _check_tokens(prompt: list[int], out: object, vocab: int, w0: int) -> None:
    """Every token of ``out`` is the one the stand-in samples from its state with the weights its version run
    names (the stand-in's weights: the updates it received; version ``w0`` is weights 0): an off-by-one
    split point fails here (a token sampled by other weights differs)."""
    ids = out.output_ids  # type: ignore[attr-defined]
    weights = [v - w0 for v, n in out.version_segments for _ in range(n)]  # type: ignore[attr-defined]
    assert len(weights) == len(ids)
    h = standin_seed(prompt)
    for i, (tok, w) in enumerate(zip(ids, weights, strict=True)):
        want, h = standin_next(h, vocab, w)
        assert tok == want, f"token {i} was not sampled by weights {w}: {out.version_segments}"  # type: ignore[attr-defined]


async def _send_weights(e: SglangEngine) -> None:
    """SGLang's own weight call, as the IPC update makes it (the stand-in bumps its weights)."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

    ok, text = await e._tm.update_weights_from_tensor(
        UpdateWeightsFromTensorReqInput(serialized_named_tensors=[b""], flush_cache=False, abort_all_requests=False),
        None,
    )
    assert ok, text


@pytest.mark.parametrize("inplace", [True, False], ids=["scheduler-patched", "plain-scheduler"])
async def test_keep_goes_on_in_place_and_every_token_names_its_weights(model: str, inplace: bool) -> None:
    """Issue 41: ``keep`` pauses SGLang in place where the scheduler has our patch (inplace.py): the two
    running requests stay in its batch (no abort, no resubmission, nothing prefilled again) and switch
    weights at the recorded token; the one still queued inside SGLang is checkpointed and starts on the new
    weights.  Without the patch the same update checkpoints all three.  Either way each token is the one
    its reported weights sample (checked token by token against the stand-in's sampler)."""
    vocab = _vocab(model)
    async with engine(model, step_s=0.001, max_running=2, inplace=inplace, decode_window=None) as e:
        assert e._control.inplace is inplace
        v = e.weight_version
        prompts = {f"ip-{k}": [7, 7, k, 3, 1 + k] for k in range(3)}
        tasks = {rid: asyncio.create_task(e.generate(req(rid, p, 2500))) for rid, p in prompts.items()}
        await _until(lambda: started(e, "ip-0") and started(e, "ip-1"))
        assert not started(e, "ip-2")  # max_running=2: queued inside SGLang
        sent, before = e._path.sent, e.reprefilled_tokens  # type: ignore[union-attr]

        await e._control._update(lambda: _send_weights(e), v + 1, False, "keep")
        outs = {rid: await t for rid, t in tasks.items()}

        for rid, out in outs.items():
            _check_tokens(prompts[rid], out, vocab, v)
            assert len(out.output_ids) == 2500 and out.weight_version == v + 1
        for rid in ("ip-0", "ip-1"):  # ran across the update: split, their KV of the old weights
            (v_a, n_a), (v_b, n_b) = outs[rid].version_segments
            assert (v_a, v_b) == (v, v + 1) and n_a > 0 and n_b > 0
            assert outs[rid].kv_version_segments == [(v, 2500)] and outs[rid].mixed_kv_tokens == n_b
        # queued: no KV yet, so it starts on the new weights (only a cache hit would make its KV older)
        assert outs["ip-2"].version_segments == [(v + 1, 2500)]
        assert e.reprefilled_tokens == before  # keep: nothing computed again
        # in place, only the queued one went to SGLang again; without the patch all three did
        assert e._path.sent - sent == (1 if inplace else 3)  # type: ignore[union-attr]


async def test_keep_charges_a_retracted_request_to_sglang_not_to_the_update(
    model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 41: a request SGLang retracted for KV memory (back in its queue with tokens, no KV) when a
    ``keep`` update comes cannot stay in place: it is checkpointed and continued from its tokens (exact, each
    token naming its weights), and its prefill again is counted as the retraction's cost
    (``retraction_reprefilled_tokens``), not as tokens the update re-prefilled (``reprefilled_tokens``)."""
    vocab = _vocab(model)
    # a pool of 1,000 tokens: both start, then the newer is retracted at ~500 tokens each and waits for the
    # older one's 4,000 tokens (the last running request is never retracted); every token streamed, so its
    # continuation is as long as it was and cannot come back before the older one ends
    monkeypatch.setenv("SGLANG_FORCE_STREAM_INTERVAL", "1")
    async with engine(model, step_s=0.001, kv_tokens=1000, decode_window=None) as e:
        v = e.weight_version
        prompts = {"long": [5, 1, 2, 3, 4], "retracted": [6, 1, 2, 3, 4]}
        tasks = {
            rid: asyncio.create_task(e.generate(req(rid, p, 4_000 if rid == "long" else 2_000)))
            for rid, p in prompts.items()
        }

        async def retracted() -> bool:
            states = await e._tm.get_internal_state()
            return bool(states[0]["standin_retracted"])

        await _until_async(retracted)
        before = e.reprefilled_tokens
        await e._control._update(lambda: _send_weights(e), v + 1, False, "keep")
        assert (e._control.retracted, e._control.kept_in_place) == (1, 1)
        outs = {rid: await t for rid, t in tasks.items()}

        for rid, out in outs.items():
            _check_tokens(prompts[rid], out, vocab, v)
            assert out.weight_version == v + 1 and out.finish_reason == "length"
        (v_a, n_a), (v_b, n_b) = outs["retracted"].version_segments
        assert (v_a, v_b) == (v, v + 1) and n_a > 0 and n_a + n_b == 2_000
        assert outs["retracted"].kv_version_segments == []  # prefilled again on the new weights
        assert e.reprefilled_tokens == before  # nothing charged to the update
        assert e.retraction_reprefilled_tokens == len(prompts["retracted"]) + n_a - 1


async def test_updates_sent_together_run_one_after_the_other_and_each_split_is_exact(model: str) -> None:
    """Control calls run concurrently on a server: two ``keep`` updates and a ``reprefill`` one sent at once
    are applied one at a time, in order (none resumes SGLang or opens the gate while another loads), and a
    request that runs across them reports every switch where it happened."""
    vocab = _vocab(model)
    async with engine(model, step_s=0.001, decode_window=None) as e:
        v = e.weight_version
        prompts = {f"multi-{k}": [9, k, 4, 4, 2 + k] for k in range(4)}
        tasks = {rid: asyncio.create_task(e.generate(req(rid, p, 4000))) for rid, p in prompts.items()}
        await _until(lambda: all(started(e, rid) for rid in prompts))
        modes = ("keep", "reprefill", "keep")
        await asyncio.gather(
            *(e._control._update(lambda: _send_weights(e), v + 1 + k, False, m) for k, m in enumerate(modes))
        )
        assert e.weight_version == v + 3
        for rid, t in tasks.items():
            out = await t
            _check_tokens(prompts[rid], out, vocab, v)
            versions = [ver for ver, _ in out.version_segments]
            # in order, from the first weights to the last; a middle version shows only where the request
            # sampled under it (on a loaded machine the next update can come before the scheduler's next step),
            # and _check_tokens proved every token's version
            assert versions[0] == v and versions[-1] == v + 3, out.version_segments
            assert versions == sorted(set(versions)), out.version_segments


@pytest.mark.parametrize("warmup", [True, False])
async def test_the_warm_up_runs_before_serving_and_leaves_nothing_behind(model: str, warmup: bool) -> None:
    """``warmup`` (the default) sends the SDK's request kinds once at start (SGLang compiles kernels on a
    path's first run); what it ran is gone before the first request: its prompt is not in the prefix cache
    (flushed) and the prefill-once counter is untouched."""
    from rollout_sdk.engines.sglang.engine import warmup_prompt

    prompt = warmup_prompt(_vocab(model), 64)  # the tiny model's context is 4,096: the warm-up sends 64
    async with engine(model, warmup=warmup) as e:
        assert (e.warmup_s is not None) is warmup
        assert e.prefill_once_tokens == 0
        out = await e.generate(
            GenerateRequest(rid="after", input_ids=prompt, sampling=SamplingParams(max_new_tokens=2))
        )
        assert out.cached_tokens == 0
        again = await e.generate(
            GenerateRequest(rid="again", input_ids=prompt, sampling=SamplingParams(max_new_tokens=2))
        )
        assert again.cached_tokens == len(prompt) - 1  # the cache works: 0 above was the flush
