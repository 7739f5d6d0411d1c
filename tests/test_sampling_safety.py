"""Sampling that cannot fail (#15 item 1): every value SamplingParams accepts is safe in every engine, and
every value with no meaning is refused with a typed error naming the field.

Property-based (hypothesis) over the whole accepted space, against the sampler, the CPU engine on the
tiny model, the fake engine and the validators (client-side ``SamplingParams`` and the server's decoder
plus ``check_against_limits``), with the values that killed the CPU engine before pinned as examples.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rollout_sdk import RolloutClient
from rollout_sdk.engines._sampling import RowSampling, sample
from rollout_sdk.engines.base import Engine
from rollout_sdk.engines.cpu import CpuEngine, CpuEngineConfig
from rollout_sdk.engines.fake import FakeEngine, FakeEngineConfig
from rollout_sdk.errors import InvalidRequestError
from rollout_sdk.protocol import (
    GREEDY_TEMPERATURE,
    EngineLimits,
    GenerateRequest,
    SamplingParams,
    check_against_limits,
    decode_client_message,
    encode,
)

T = TypeVar("T")

# -- strategies ------------------------------------------------------------------------------------

#: floats the way a clumsy user or a fuzzer sends them: tiny, huge, subnormal, signed zero, NaN, inf
any_float = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 1e-45, 1e-40, 1e-6, 1e-5, 1.0, 1e300]),
)
tiny = st.floats(min_value=0.0, max_value=1e-3)

#: accepted temperatures, weighted towards the edges that overflow float32
temperatures = st.one_of(
    st.floats(min_value=0.0, max_value=1e300, allow_nan=False, allow_infinity=False),
    tiny,
    st.sampled_from([0.0, 5e-324, 1e-40, 1e-38, GREEDY_TEMPERATURE, 1e-4, 1.0, 1e6, 1e300]),
)
penalties = st.one_of(
    st.floats(min_value=5e-324, max_value=1e300),
    st.floats(min_value=5e-324, max_value=1e-3),
    st.sampled_from([5e-324, 1e-300, 1e-40, 1e-6, 0.5, 1.0, 2.0, 1e6, 1e300]),
)


def accepted_sampling(vocab: int, *, max_new: int = 4) -> st.SearchStrategy[SamplingParams]:
    """Any SamplingParams the validators accept, for an engine with ``vocab`` tokens."""

    @st.composite
    def build(draw: st.DrawFn) -> SamplingParams:
        max_new_tokens = draw(st.integers(1, max_new))
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            min_new_tokens=draw(st.integers(0, max_new_tokens)),
            temperature=draw(temperatures),
            top_p=draw(st.one_of(st.floats(min_value=5e-324, max_value=1.0), st.sampled_from([1e-300, 0.5, 1.0]))),
            top_k=draw(st.one_of(st.sampled_from([-1, 0, 1, 2, vocab]), st.integers(-1, vocab))),
            min_p=draw(st.one_of(st.floats(min_value=0.0, max_value=1.0), st.sampled_from([0.0, 1.0]))),
            repetition_penalty=draw(penalties),
            frequency_penalty=draw(st.floats(min_value=-2.0, max_value=2.0)),
            presence_penalty=draw(st.floats(min_value=-2.0, max_value=2.0)),
            stop_token_ids=draw(st.lists(st.integers(0, vocab - 1), max_size=8)),
            ignore_eos=draw(st.booleans()),
            seed=draw(st.one_of(st.none(), st.integers(0, 2**63 - 1))),
        )

    return build()


# -- the sampler -----------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-38, 1e-7])
@pytest.mark.parametrize(("top_k", "top_p", "min_p"), [(-1, 1.0, 0.0), (5, 1.0, 0.0), (-1, 0.9, 0.0), (3, 0.5, 0.1)])
def test_tiny_temperatures_stay_in_vocabulary_with_finite_logprobs(
    temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    """The reported killer: logits / 1e-40 overflow float32; with top-k/top-p the draw left the vocabulary."""
    vocab = 3000
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(0)) * 4
    rows = [RowSampling(temperature, top_k, top_p, min_p, u / 8) for u in range(8)]
    toks, lps = sample(logits.clone(), rows)
    assert ((toks >= 0) & (toks < vocab)).all()
    assert torch.isfinite(lps).all()
    assert toks.tolist() == logits.argmax(dim=-1).tolist()  # below the threshold: greedy


@settings(max_examples=300, deadline=None)
@given(
    vocab=st.sampled_from([2, 7, 1024, 1025, 3000]),
    temperature=temperatures,
    top_k=st.integers(-1, 3000),
    top_p=st.floats(min_value=5e-324, max_value=1.0),
    min_p=st.floats(min_value=0.0, max_value=1.0),
    u=st.floats(min_value=0.0, max_value=1.0, exclude_max=True),
    scale=st.sampled_from([1e-30, 1.0, 30.0, 1e30, 3e38]),
    poison=st.sampled_from(["none", "neg_inf_row", "nan_some", "pos_inf_some", "all_nan", "one_left"]),
)
def test_sampler_never_leaves_the_vocabulary(
    vocab: int, temperature: float, top_k: int, top_p: float, min_p: float, u: float, scale: float, poison: str
) -> None:
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(3, vocab, generator=g) * scale).float()
    if poison == "neg_inf_row":
        logits[1] = float("-inf")
    elif poison == "nan_some":
        logits[:, : max(1, vocab // 3)] = float("nan")
    elif poison == "pos_inf_some":
        logits[:, : max(1, vocab // 5)] = float("inf")
    elif poison == "all_nan":
        logits[:] = float("nan")
    elif poison == "one_left":
        logits[:, 1:] = float("-inf")
    only_first = poison == "one_left" and bool(torch.isfinite(logits[:, 0]).all())
    rows = [RowSampling(temperature, top_k, top_p, min_p, u) for _ in range(3)]
    toks, lps = sample(logits, rows)
    assert ((toks >= 0) & (toks < vocab)).all(), toks
    assert torch.isfinite(lps).all() and (lps <= 1e-6).all(), lps
    if only_first:  # the one possible token is drawn, whatever the filters
        assert toks.tolist() == [0, 0, 0]


# -- the validators --------------------------------------------------------------------------------

FIELDS = {
    "max_new_tokens": st.integers(-5, 5000),
    "min_new_tokens": st.integers(-5, 5000),
    "temperature": any_float,
    "top_p": any_float,
    "top_k": st.integers(-5, 10**6),
    "min_p": any_float,
    "repetition_penalty": any_float,
    "frequency_penalty": any_float,
    "presence_penalty": any_float,
    "stop_token_ids": st.lists(st.integers(-3, 10**6), max_size=4),
    "seed": st.one_of(st.none(), st.integers(-3, 2**63 - 1)),
}


@settings(max_examples=400, deadline=None)
@given(st.fixed_dictionaries({}, optional=FIELDS))
@example({"temperature": math.inf})
@example({"temperature": math.nan})
@example({"repetition_penalty": math.inf})
@example({"repetition_penalty": math.nan})
@example({"frequency_penalty": math.inf})
@example({"top_p": math.nan})
def test_validators_agree_and_name_the_field(kwargs: dict[str, Any]) -> None:
    """Client side (building the struct) and server side (decoding the wire) accept the same values, and a
    refusal is an InvalidRequestError naming the field; accepted values are finite where they are floats."""
    raw = {"type": "generate", "input_ids": [1, 2], "rid": "r", "sampling": kwargs}
    try:
        client_side: SamplingParams | None = SamplingParams(**kwargs)
        client_err = None
    except InvalidRequestError as exc:
        client_side, client_err = None, exc
    try:
        decoded = decode_client_message(msgspec.msgpack.encode(raw))
        server_err = None
    except InvalidRequestError as exc:
        decoded, server_err = None, exc
    if client_side is not None:
        assert isinstance(decoded, GenerateRequest) and decoded.sampling == client_side
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            assert math.isfinite(getattr(client_side, name)), name
    else:
        assert client_err is not None and server_err is not None
        assert client_err.field.startswith("sampling."), client_err.field
        assert client_err.field.split(".")[1].split("[")[0] in kwargs
        assert server_err.field == client_err.field


LIMITS = EngineLimits(vocab_size=16, max_context=4096, eos_token_ids=[0])


def test_top_k_beyond_the_vocabulary_is_refused_by_field() -> None:
    check_against_limits(GenerateRequest(input_ids=[1], sampling=SamplingParams(top_k=16)), LIMITS)
    with pytest.raises(InvalidRequestError) as info:
        check_against_limits(GenerateRequest(input_ids=[1], sampling=SamplingParams(top_k=17)), LIMITS)
    assert info.value.field == "sampling.top_k" and info.value.value == 17


@pytest.mark.parametrize(
    ("stops", "ignore_eos", "refused"),
    [
        (list(range(1, 16)), False, True),  # with EOS (0) every token stops
        (list(range(1, 16)), True, False),  # EOS ignored: token 0 is left
        (list(range(16)), True, True),
        (list(range(2, 16)), False, False),
    ],
)
def test_stop_ids_that_leave_nothing_to_sample_are_refused(stops: list[int], ignore_eos: bool, refused: bool) -> None:
    sp = SamplingParams(min_new_tokens=3, max_new_tokens=5, stop_token_ids=stops, ignore_eos=ignore_eos)
    req = GenerateRequest(input_ids=[1], sampling=sp)
    if not refused:
        check_against_limits(req, LIMITS)
        return
    with pytest.raises(InvalidRequestError) as info:
        check_against_limits(req, LIMITS)
    assert info.value.field == "sampling.stop_token_ids"
    # without min_new_tokens the same stops are meaningful (stop at once)
    check_against_limits(GenerateRequest(input_ids=[1], sampling=msgspec.structs.replace(sp, min_new_tokens=0)), LIMITS)


async def test_server_refuses_nothing_to_sample_by_field_and_keeps_serving(fake_servers) -> None:
    (server,) = await fake_servers(1, FakeEngineConfig(vocab_size=16, eos_token_ids=(0,)))
    async with RolloutClient(servers=[server.address]) as client:
        bad = SamplingParams(min_new_tokens=2, max_new_tokens=4, stop_token_ids=list(range(1, 16)))
        with pytest.raises(InvalidRequestError) as info:
            await client.generate(GenerateRequest(input_ids=[3], sampling=bad))
        assert info.value.field == "sampling.stop_token_ids"
        ok = await client.generate(GenerateRequest(input_ids=[3], sampling=SamplingParams(max_new_tokens=4)))
        assert len(ok.output_ids) == 4
    assert server.engine.dead is None


# -- the engines -----------------------------------------------------------------------------------


class LoopThread:
    """An event loop on a thread of its own, so a synchronous hypothesis test can drive an async engine."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def cpu_engine(tiny_model: Path) -> Iterator[tuple[LoopThread, CpuEngine]]:
    lt = LoopThread()
    engine = CpuEngine(CpuEngineConfig(model_path=str(tiny_model), max_running=8))
    lt.run(engine.start())
    yield lt, engine
    lt.run(engine.close())
    lt.close()


@pytest.fixture(scope="module")
def fake_engine() -> Iterator[tuple[LoopThread, FakeEngine]]:
    lt = LoopThread()
    engine = FakeEngine(FakeEngineConfig(vocab_size=64, step_base_s=0.0005))
    lt.run(engine.start())
    yield lt, engine
    lt.run(engine.close())
    lt.close()


_counter = iter(range(10**9))


def _check_result(engine: Engine, lt: LoopThread, sp: SamplingParams, prompt: list[int], *, bans: bool = True) -> None:
    vocab = engine.limits.vocab_size
    req = GenerateRequest(input_ids=prompt, sampling=sp, rid=f"p{next(_counter)}")
    check_against_limits(req, engine.limits)  # what the server does first
    r = lt.run(engine.generate(req))
    assert engine.dead is None
    assert r.finish_reason in ("stop", "length")
    assert 1 <= len(r.output_ids) <= sp.max_new_tokens
    assert all(0 <= t < vocab for t in r.output_ids), r.output_ids
    assert r.logprobs is not None and len(r.logprobs) == len(r.output_ids)
    assert all(math.isfinite(lp) and lp <= 1e-4 for lp in r.logprobs), r.logprobs
    if bans:  # a sampling engine never samples a stop id before min_new_tokens (the fake replays its script)
        stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(engine.limits.eos_token_ids))
        assert not stops & set(r.output_ids[: sp.min_new_tokens])


KILLERS = [
    SamplingParams(temperature=1e-40, max_new_tokens=3),
    SamplingParams(temperature=5e-324, top_k=5, top_p=0.9, max_new_tokens=3),
    SamplingParams(temperature=1e-38, top_p=0.5, min_p=0.2, max_new_tokens=3),
    SamplingParams(repetition_penalty=1e-300, max_new_tokens=3),
    SamplingParams(repetition_penalty=5e-324, temperature=1e-30, top_k=3, max_new_tokens=3),
    SamplingParams(repetition_penalty=1e300, max_new_tokens=3),
    SamplingParams(temperature=1e300, max_new_tokens=3),
]


@pytest.mark.parametrize("sp", KILLERS, ids=lambda sp: repr(msgspec.to_builtins(sp)))
def test_cpu_engine_survives_the_reported_killers(cpu_engine: tuple[LoopThread, CpuEngine], sp: SamplingParams) -> None:
    lt, engine = cpu_engine
    _check_result(engine, lt, sp, [151644, 872, 198, 1000, 2000])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_cpu_engine_accepts_everything_the_validators_accept(
    cpu_engine: tuple[LoopThread, CpuEngine], data: st.DataObject
) -> None:
    lt, engine = cpu_engine
    vocab = engine.limits.vocab_size
    sp = data.draw(accepted_sampling(vocab, max_new=3))
    prompt = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6))
    _check_result(engine, lt, sp, prompt)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fake_engine_accepts_everything_the_validators_accept(
    fake_engine: tuple[LoopThread, FakeEngine], data: st.DataObject
) -> None:
    lt, engine = fake_engine
    vocab = engine.limits.vocab_size
    sp = data.draw(accepted_sampling(vocab, max_new=6))
    prompt = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6))
    if sp.min_new_tokens and len(set(sp.stop_token_ids) | ({0} if not sp.ignore_eos else set())) >= vocab:
        return  # a small vocabulary: stop ids may leave nothing to sample (refused, tested above)
    _check_result(engine, lt, sp, prompt, bans=False)


def test_wire_roundtrip_of_killers_is_accepted() -> None:
    for sp in KILLERS:
        msg = decode_client_message(encode(GenerateRequest(input_ids=[1], sampling=sp, rid="x")))
        assert isinstance(msg, GenerateRequest) and msg.sampling == sp


def test_sglang_gets_the_same_safe_values() -> None:
    """SGLang samples greedily only below 1e-6: our threshold and penalty clamp apply there too."""
    from rollout_sdk.engines.sglang import SglangEngineConfig
    from rollout_sdk.engines.sglang.translate import sampling_params

    cfg = SglangEngineConfig(model_path="/nonexistent")
    tiny = sampling_params(SamplingParams(temperature=5e-6, repetition_penalty=1e-300, top_k=0), cfg)
    assert (tiny["temperature"], tiny["repetition_penalty"], tiny["top_k"]) == (0.0, 1e-6, -1)
    huge = sampling_params(SamplingParams(temperature=0.7, repetition_penalty=1e300), cfg)
    assert (huge["temperature"], huge["repetition_penalty"]) == (0.7, 1e6)
