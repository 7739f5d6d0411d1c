"""Mistyped arguments get the SDK's own one-line error naming the argument and the type it wants, where
they are passed (issue 37): SamplingParams, every config a user builds, RolloutClient(...), generate(...),
generate_many(...), ToolAgent(...).  Property-based: any value of any type either is accepted or refused
with InvalidRequestError / ConfigError naming the field; nothing else escapes."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_sdk import RolloutClient, SamplingParams
from rollout_sdk.agents import AgentConfig, ToolAgent
from rollout_sdk.client import ClientConfig
from rollout_sdk.client.client import _check_call_args
from rollout_sdk.client.scheduler import SchedulerConfig
from rollout_sdk.demos.generate import DemoConfig
from rollout_sdk.demos.grpo import GrpoConfig
from rollout_sdk.engines.cpu import CpuEngineConfig
from rollout_sdk.errors import ConfigError, InvalidRequestError
from rollout_sdk.server import ServerConfig

#: any value a clumsy user might pass
ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=4),
    st.lists(st.one_of(st.integers(-5, 200_000), st.text(max_size=3), st.floats()), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def _refused(make: Any, error: Any) -> Any:
    """The ``error`` that ``make()`` raised, or None; any other exception escapes (and fails the test)."""
    try:
        make()
    except error as exc:
        return exc
    return None


# -- the examples of the issue, one line each --------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"temperature": "hot"}, "sampling.temperature='hot': must be a number (got str)"),
        ({"seed": "1"}, "sampling.seed='1': must be an int or None (got str)"),
        ({"stop_token_ids": 151645}, "sampling.stop_token_ids=151645: must be a list of int token ids"),
        ({"max_new_tokens": 16.5}, "sampling.max_new_tokens=16.5: must be an int (got float)"),
        ({"stop_token_ids": [1, "2"]}, "sampling.stop_token_ids[1]='2': must be an int token id"),
        ({"ignore_eos": "yes"}, "sampling.ignore_eos='yes': must be a bool"),
        ({"top_k": True}, "sampling.top_k=True: must be an int (got bool)"),
    ],
)
def test_sampling_params_name_the_mistyped_field(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert says in str(info.value)
    assert len(str(info.value).splitlines()) == 1


def test_right_types_still_pass_and_an_int_is_a_number() -> None:
    sp = SamplingParams(temperature=1, top_p=1, max_new_tokens=4, stop_token_ids=(1, 2), seed=0)
    assert sp.temperature == 1 and sp.stop_token_ids == (1, 2)


SAMPLING_FIELDS = [f for f in SamplingParams.__struct_fields__]


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(SAMPLING_FIELDS), value=ANY)
def test_any_value_of_any_sampling_field_is_accepted_or_named(field: str, value: Any) -> None:
    exc = _refused(lambda: SamplingParams(**{field: value}), InvalidRequestError)
    assert exc is None or exc.field.startswith(f"sampling.{field}"), (exc, field)


# -- configs -----------------------------------------------------------------------------------------

#: deprecated config fields and the field they stand for
DEPRECATED_NAMES = {"samples": "group_size", "group": "group_size"}
CONFIGS = [ClientConfig, SchedulerConfig, CpuEngineConfig, ServerConfig, AgentConfig, DemoConfig, GrpoConfig]


def _scalar_fields(cls: type) -> list[str]:
    hints = typing.get_type_hints(cls)
    scalars = (int, float, str, bool, int | None, float | None, str | None, bool | None)
    return [f.name for f in dataclasses.fields(cls) if hints[f.name] in scalars]


@pytest.mark.filterwarnings("ignore:.*is deprecated:DeprecationWarning")
@settings(max_examples=400, deadline=None)
@given(data=st.data(), cls=st.sampled_from(CONFIGS), value=ANY)
def test_any_value_of_any_config_field_is_accepted_or_named(data: st.DataObject, cls: type, value: Any) -> None:
    field = data.draw(st.sampled_from(_scalar_fields(cls)))
    if cls is ServerConfig and field == "host" and isinstance(value, str):
        value = "127.0.0.1"  # a non-loopback host needs a job secret: another check, not a type
    exc = _refused(lambda: cls(**{field: value}), ConfigError)
    named = DEPRECATED_NAMES.get(field, field)  # a deprecated spelling is checked under its new name
    assert exc is None or any(exc.field.startswith(n) or n in str(exc) for n in (field, named)), (exc, field)


def test_a_sampling_dict_in_an_agent_config_says_how_to_build_one() -> None:
    with pytest.raises(ConfigError, match=r"sampling=.*must be a SamplingParams \(got dict\); SamplingParams\(\*\*d\)"):
        AgentConfig(sampling={"max_new_tokens": 4})  # type: ignore[arg-type]


# -- calls -------------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(["sampling", "session_id", "timeout", "retries"]),
    value=ANY,
)
def test_any_value_of_a_call_argument_is_accepted_or_named(name: str, value: Any) -> None:
    """What generate(...) / generate_many(...) check before anything is sent."""
    exc = _refused(lambda: _check_call_args(**{"sampling": None, name: value}), InvalidRequestError)
    assert exc is None or exc.field == name


async def test_generate_and_generate_many_refuse_mistyped_arguments_before_sending(fake_servers) -> None:
    (server,) = await fake_servers(1)
    async with RolloutClient(servers=[server.address]) as client:
        with pytest.raises(InvalidRequestError, match=r"sampling=.*must be a SamplingParams \(got dict\)"):
            await client.generate([1, 2], sampling={"max_new_tokens": 4})  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match=r"input_ids\[1\]='x'"):
            await client.generate([1, "x"])  # type: ignore[list-item]
        with pytest.raises(InvalidRequestError, match=r"timeout='5'"):
            await client.generate([1, 2], timeout="5")  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match=r"session_id=7"):
            await client.generate([1, 2], session_id=7)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match=r"group_size='4'"):
            client.generate_many([[1, 2]], group_size="4")  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match=r"is one prompt"):
            client.generate_many([1, 2, 3])  # type: ignore[list-item]
        with pytest.raises(InvalidRequestError, match=r"sampling=.*got dict"):
            client.generate_many([[1, 2]], sampling={"max_new_tokens": 4})  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match=r"concurrency=0"):
            client.generate_many([[1, 2]], concurrency=0)
        # nothing was sent: the server saw no request
        assert server.stats().completed == 0
        r = await client.generate([1, 2], sampling=SamplingParams(max_new_tokens=2))  # and it still works
        assert len(r.output_ids) == 2


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"engine": {"model_path": "x"}}, "engine=.*must be a CpuEngineConfig"),
        ({"config": {"retries": 2}}, "config=.*must be a ClientConfig"),
        ({"servers": ["127.0.0.1:5555"]}, "tcp://host:port"),
        ({"retries": "2"}, "retries='2': must be an int"),
        ({"heartbeat_timeout_s": "10"}, "heartbeat_timeout_s='10': must be a number"),
        ({"max_in_flight_per_server": 1.5}, "max_in_flight_per_server=1.5: must be an int"),
    ],
)
def test_rolloutclient_refuses_mistyped_options_at_construction(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        RolloutClient(**kwargs)


class _Tok:
    def apply_chat_template(self, *a: Any, **k: Any) -> Any:  # pragma: no cover - never called
        raise AssertionError


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("/models/tool",), "tokenizer='/models/tool': must be a tokenizer object"),
        ((_Tok(), [print]), "tools=.*ToolRegistry\\(\\[...\\]\\) builds one"),
        ((_Tok(), None, {"max_turns": 2}), "config=.*must be an AgentConfig"),
    ],
)
def test_toolagent_refuses_mistyped_arguments(args: tuple[Any, ...], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        ToolAgent(*args)
