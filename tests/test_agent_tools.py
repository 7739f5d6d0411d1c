"""Tools: schemas from type hints, precise argument errors, and an executor that never breaks a rollout."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import enum
import threading
import time
from typing import Annotated, Any, Literal, NotRequired, Optional, TypedDict

import msgspec
import pytest

from rollout_sdk.agents.parsers import ToolCall
from rollout_sdk.agents.tools import (
    TOOL_ERROR_KINDS,
    Tool,
    ToolArgumentError,
    ToolRegistry,
    ToolResult,
    tool,
)
from rollout_sdk.errors import ConfigError

# Types used in annotations live at module level so that string annotations resolve.


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Point(msgspec.Struct):
    x: int
    y: float = 0.0


class Renamed(msgspec.Struct, rename="camel"):
    max_items: int


@dataclasses.dataclass
class Box:
    lo: Point
    label: str = "box"
    tags: list[str] = dataclasses.field(default_factory=list)


class Options(TypedDict):
    deep: bool
    level: NotRequired[int]


class Node(msgspec.Struct):
    children: list[Node]


class Tagged(msgspec.Struct, tag=True):
    x: int


def params(fn: Any) -> dict[str, Any]:
    """The ``parameters`` schema of ``fn`` made into a tool."""
    return tool(fn).parameters


def obj(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def call(tool_name: str, call_id: str = "call_0", /, **arguments: Any) -> ToolCall:
    return ToolCall(name=tool_name, arguments=arguments, id=call_id)


# -- schema derivation ----------------------------------------------------------------------------


def test_scalar_types() -> None:
    def f(s: str, i: int, x: float, b: bool, n: None) -> None: ...

    assert params(f) == obj(
        {
            "s": {"type": "string"},
            "i": {"type": "integer"},
            "x": {"type": "number"},
            "b": {"type": "boolean"},
            "n": {"type": "null"},
        },
        ["s", "i", "x", "b", "n"],
    )


def test_container_types() -> None:
    def f(
        xs: list[int],
        pair: tuple[int, str],
        many: tuple[float, ...],
        scores: dict[str, float],
        anything: list,  # type: ignore[type-arg]
        mapping: dict,  # type: ignore[type-arg]
        nested: list[dict[str, list[bool]]],
        value: Any,
    ) -> None: ...

    assert params(f) == obj(
        {
            "xs": {"type": "array", "items": {"type": "integer"}},
            "pair": {
                "type": "array",
                "prefixItems": [{"type": "integer"}, {"type": "string"}],
                "minItems": 2,
                "maxItems": 2,
            },
            "many": {"type": "array", "items": {"type": "number"}},
            "scores": {"type": "object", "additionalProperties": {"type": "number"}},
            "anything": {"type": "array"},
            "mapping": {"type": "object"},
            "nested": {
                "type": "array",
                "items": {"type": "object", "additionalProperties": {"type": "array", "items": {"type": "boolean"}}},
            },
            "value": {},
        },
        ["xs", "pair", "many", "scores", "anything", "mapping", "nested", "value"],
    )


def test_enums_and_literals() -> None:
    def f(color: Color, level: Level, mode: Literal["fast", "slow"], mixed: Literal[1, "one", None]) -> None: ...

    assert params(f) == obj(
        {
            "color": {"type": "string", "enum": ["red", "green"]},
            "level": {"type": "integer", "enum": [1, 2]},
            "mode": {"type": "string", "enum": ["fast", "slow"]},
            "mixed": {"enum": [1, "one", None]},
        },
        ["color", "level", "mode", "mixed"],
    )


def test_optional_is_required_without_default_and_optional_with_one() -> None:
    def f(a: int | None, b: Optional[str] = None, c: int | str = 3, d: Color = Color.GREEN) -> None:  # noqa: UP045
        ...

    assert params(f) == obj(
        {
            "a": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "b": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
            "c": {"anyOf": [{"type": "integer"}, {"type": "string"}], "default": 3},
            "d": {"type": "string", "enum": ["red", "green"], "default": "green"},
        },
        ["a"],
    )


def test_nested_struct_dataclass_and_typeddict() -> None:
    def f(box: Box, options: Options, renamed: Renamed, maybe: Point | None = None) -> None: ...

    point = obj({"x": {"type": "integer"}, "y": {"type": "number", "default": 0.0}}, ["x"])
    assert params(f) == obj(
        {
            "box": obj(
                {
                    "lo": point,
                    "label": {"type": "string", "default": "box"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                ["lo"],
            ),
            "options": obj({"deep": {"type": "boolean"}, "level": {"type": "integer"}}, ["deep"]),
            "renamed": obj({"maxItems": {"type": "integer"}}, ["maxItems"]),
            "maybe": {"anyOf": [point, {"type": "null"}], "default": None},
        },
        ["box", "options", "renamed"],
    )


def test_docstring_gives_descriptions() -> None:
    def search(query: str, limit: int = 5, *, exact: bool = False) -> list[str]:
        """Search the web
        for pages.

        Longer explanation that is not part of the description.

        Args:
            query (str): What to look for,
                in plain words.
            limit: At most this many results.

        Returns:
            The page titles.
        """
        return []

    t = tool(search)
    assert t.description == "Search the web for pages."
    assert t.parameters == obj(
        {
            "query": {"description": "What to look for, in plain words.", "type": "string"},
            "limit": {"description": "At most this many results.", "type": "integer", "default": 5},
            "exact": {"type": "boolean", "default": False},
        },
        ["query"],
    )


def test_annotated_descriptions_and_overrides() -> None:
    @tool(name="lookup", description="Look a word up.")
    def f(word: Annotated[str, "The word."], lang: Annotated[str, msgspec.Meta(description="ISO code.")] = "en") -> str:
        """Ignored because a description is given."""
        return word

    assert f.name == "lookup"
    assert f.description == "Look a word up."
    assert f.parameters["properties"] == {
        "word": {"description": "The word.", "type": "string"},
        "lang": {"description": "ISO code.", "type": "string", "default": "en"},
    }


def test_no_docstring_and_no_parameters() -> None:
    def now() -> str:
        return "noon"

    t = tool(now)
    assert (t.name, t.description, t.parameters) == ("now", "", obj({}, []))


def test_schema_is_openai_format_and_a_copy() -> None:
    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    schema = add.schema()
    assert schema == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": obj({"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"]),
        },
    }
    schema["function"]["parameters"]["properties"].clear()
    assert add.parameters["properties"]  # the tool's own schema is untouched
    assert add.fn(2, 3) == 5  # the function stays callable
    assert isinstance(add, Tool)
    assert (add.timeout_s, add.max_concurrency, add.is_async) == (30.0, None, False)


def test_decorator_options() -> None:
    @tool(timeout_s=2, max_concurrency=3)
    async def fetch(url: str) -> str:
        return url

    assert (fetch.name, fetch.timeout_s, fetch.max_concurrency, fetch.is_async) == ("fetch", 2.0, 3, True)
    assert tool(timeout_s=None)(fetch.fn).timeout_s is None


def test_bound_methods_can_be_tools() -> None:
    class Counter:
        def __init__(self) -> None:
            self.total = 0

        def bump(self, by: int = 1) -> int:
            """Bump the counter."""
            self.total += by
            return self.total

    t = tool(Counter().bump)
    assert t.parameters == obj({"by": {"type": "integer", "default": 1}}, [])


# -- decoration-time errors -----------------------------------------------------------------------


def test_var_args_are_rejected() -> None:
    def f(*args: int) -> None: ...

    def g(a: int, **kwargs: int) -> None: ...

    with pytest.raises(TypeError, match=r"tool 'f': parameter \*args is not allowed"):
        tool(f)
    with pytest.raises(TypeError, match=r"tool 'g': parameter \*\*kwargs is not allowed"):
        tool(g)


def test_positional_only_and_unannotated_parameters_are_rejected() -> None:
    def f(a: int, /) -> None: ...

    def g(a) -> None: ...  # type: ignore[no-untyped-def]

    with pytest.raises(TypeError, match=r"tool 'f': parameter 'a' is positional-only"):
        tool(f)
    with pytest.raises(TypeError, match=r"tool 'g': parameter 'a' has no type annotation"):
        tool(g)


@pytest.mark.parametrize(
    ("annotation", "pattern"),
    [
        (datetime.datetime, r"parameter 'p': unsupported type annotation datetime\.datetime"),
        (set[int], r"parameter 'p': unsupported type annotation set\[int\]"),
        (dict[int, str], r"parameter 'p': dict keys must be str \(JSON object keys\) in dict\[int, str\]"),
        (list[bytes], r"parameter 'p' \(at 'p\[\]'\): unsupported type annotation bytes"),
        (Node, r"parameter 'p' \(at 'p\.children\[\]'\): recursive type .*Node"),
        (Tagged, r"parameter 'p': array_like or tagged Structs are not supported"),
        (Literal[b"x"], r"parameter 'p': unsupported type annotation typing\.Literal\[b'x'\]: Literal may only"),
    ],
)
def test_unsupported_annotations_fail_at_decoration(annotation: Any, pattern: str) -> None:
    def f(p: int) -> None: ...

    f.__annotations__ = {"p": annotation, "return": None}
    with pytest.raises(TypeError, match=rf"tool 'f': {pattern}"):
        tool(f)


def test_unsupported_annotations_list_what_is_supported() -> None:
    def f(when: datetime.date) -> None: ...

    with pytest.raises(TypeError, match=r"supported: str, int, float, bool, None, Any, list\[T\]"):
        tool(f)


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"name": "has space"}, r"name='has space': a tool name must be 1-64 characters"),
        ({"name": "x" * 65}, r"a tool name must be 1-64 characters"),
        ({"timeout_s": 0}, r"timeout_s=0: must be a positive number"),
        ({"timeout_s": float("inf")}, r"timeout_s=inf: must be a positive number"),
        ({"max_concurrency": 0}, r"max_concurrency=0: must be a positive integer"),
        ({"max_concurrency": True}, r"max_concurrency=True: must be a positive integer"),
    ],
)
def test_bad_options(options: dict[str, Any], pattern: str) -> None:
    def f() -> None: ...

    with pytest.raises(ConfigError, match=pattern):
        tool(**options)(f)


# -- argument validation --------------------------------------------------------------------------


@tool
def rich(
    n: int,
    ratio: float = 1.0,
    flag: bool = False,
    color: Color = Color.RED,
    mode: Literal["a", "b"] = "a",
    pair: tuple[int, str] = (0, ""),
    xs: list[int] | None = None,
    box: Box | None = None,
    options: Options | None = None,
    scores: dict[str, float] | None = None,
    maybe: int | None = None,
) -> str:
    """Take many kinds of arguments."""
    return "ok"


@pytest.mark.parametrize(
    ("arguments", "problem"),
    [
        ({}, "missing required argument 'n'"),
        ({"n": 1, "m": 2}, "unexpected argument 'm' (accepted: 'n', 'ratio', 'flag', 'color', 'mode', 'pair', "),
        ({"n": "three"}, "argument 'n' must be an integer, got \"three\""),
        ({"n": True}, "argument 'n' must be an integer, got true"),
        ({"n": 1.5}, "argument 'n' must be an integer, got 1.5"),
        ({"n": 2.0}, "argument 'n' must be an integer, got 2.0"),
        ({"n": None}, "argument 'n' must be an integer, got null"),
        ({"n": 1, "ratio": "1"}, "argument 'ratio' must be a number, got \"1\""),
        ({"n": 1, "ratio": False}, "argument 'ratio' must be a number, got false"),
        ({"n": 1, "flag": 1}, "argument 'flag' must be a boolean, got 1"),
        ({"n": 1, "color": "blue"}, 'argument \'color\' must be one of "red", "green", got "blue"'),
        ({"n": 1, "mode": "A"}, 'argument \'mode\' must be one of "a", "b", got "A"'),
        ({"n": 1, "pair": [1]}, "argument 'pair' must be an array of 2 items, got 1: [1]"),
        ({"n": 1, "pair": [1, 2]}, "argument 'pair[1]' must be a string, got 2"),
        ({"n": 1, "pair": "1,a"}, "argument 'pair' must be an array, got \"1,a\""),
        ({"n": 1, "xs": [1, "2", 3]}, "argument 'xs[1]' must be an integer, got \"2\""),
        ({"n": 1, "xs": {"a": 1}}, "argument 'xs' must be an array or null, got {\"a\": 1}"),
        ({"n": 1, "box": {}}, "argument 'box' is missing required field 'lo'"),
        ({"n": 1, "box": {"lo": {"x": "1"}}}, "argument 'box.lo.x' must be an integer, got \"1\""),
        ({"n": 1, "box": {"lo": {"x": 1}, "tags": ["a", 2]}}, "argument 'box.tags[1]' must be a string, got 2"),
        (
            {"n": 1, "box": {"lo": {"x": 1, "z": 0}}},
            "argument 'box.lo' has unexpected field 'z' (accepted: 'x', 'y')",
        ),
        ({"n": 1, "options": {"deep": "yes"}}, "argument 'options.deep' must be a boolean, got \"yes\""),
        ({"n": 1, "scores": {"a": 1, "b c": "x"}}, 'argument \'scores["b c"]\' must be a number, got "x"'),
        ({"n": 1, "scores": {"ok": None}}, "argument 'scores.ok' must be a number, got null"),
        ({"n": 1, "maybe": "1"}, "argument 'maybe' must be an integer or null, got \"1\""),
    ],
)
def test_validation_messages(arguments: dict[str, Any], problem: str) -> None:
    with pytest.raises(ToolArgumentError) as info:
        rich.validate(arguments)
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith(problem)
    assert str(info.value) == f"invalid arguments for tool 'rich': {info.value.problems[0]}"
    assert info.value.tool_name == "rich"


def test_every_problem_is_reported() -> None:
    with pytest.raises(ToolArgumentError) as info:
        rich.validate({"ratio": "x", "flag": None, "zzz": 1})
    assert info.value.problems == [
        "missing required argument 'n'",
        "unexpected argument 'zzz' (accepted: 'n', 'ratio', 'flag', 'color', 'mode', 'pair', 'xs', 'box', "
        "'options', 'scores', 'maybe')",
        "argument 'ratio' must be a number, got \"x\"",
        "argument 'flag' must be a boolean, got null",
    ]


def test_arguments_must_be_an_object() -> None:
    with pytest.raises(ToolArgumentError, match=r"arguments must be a JSON object, got \[1, 2\]"):
        rich.validate([1, 2])  # type: ignore[arg-type]


def test_unexpected_argument_for_a_tool_without_parameters() -> None:
    @tool
    def now() -> str:
        return "noon"

    with pytest.raises(ToolArgumentError, match=r"unexpected argument 'x' \(it takes none\)"):
        now.validate({"x": 1})


def test_long_values_are_shortened() -> None:
    with pytest.raises(ToolArgumentError) as info:
        rich.validate({"n": "x" * 500})
    assert info.value.problems == ["argument 'n' must be an integer, got \"" + "x" * 76 + "..."]


def test_valid_arguments_are_converted_to_annotated_types() -> None:
    kwargs = rich.validate(
        {
            "n": 1,
            "ratio": 2,  # an int is a valid number
            "color": "green",
            "pair": [3, "c"],
            "box": {"lo": {"x": 1}, "tags": ["t"]},
            "options": {"deep": True},
            "maybe": None,
        }
    )
    assert kwargs == {
        "n": 1,
        "ratio": 2.0,
        "color": Color.GREEN,
        "pair": (3, "c"),
        "box": Box(lo=Point(x=1), tags=["t"]),
        "options": {"deep": True},
        "maybe": None,
    }
    assert isinstance(kwargs["ratio"], float)


def test_msgspec_constraints_are_reported_with_their_path() -> None:
    @tool
    def f(
        n: Annotated[int, msgspec.Meta(ge=0)], xs: list[Annotated[int, msgspec.Meta(le=9)]] | None = None
    ) -> None: ...

    with pytest.raises(ToolArgumentError) as info:
        f.validate({"n": -1, "xs": [1, 10]})
    assert info.value.problems == [
        "argument 'n' is invalid: Expected `int` >= 0, got -1",
        "argument 'xs[1]' is invalid: Expected `int` <= 9",
    ]


# -- registry -------------------------------------------------------------------------------------


def test_register_get_names_and_schemas() -> None:
    registry = ToolRegistry()

    @registry.register
    def first(a: int) -> int:
        """First tool."""
        return a

    def second_fn(b: str) -> str:
        return b

    second = registry.register(tool(name="second_tool")(second_fn))
    assert isinstance(first, Tool)
    assert registry.names == ["first", "second_tool"]
    assert registry.get("first") is first
    assert registry.get("second_tool") is second
    assert registry.get("missing") is None
    assert "first" in registry and "missing" not in registry
    assert len(registry) == 2
    assert [s["function"]["name"] for s in registry.schemas()] == ["first", "second_tool"]
    with pytest.raises(ConfigError, match=r"name='first': a tool with this name is already registered"):
        registry.register(first)


def test_registry_from_an_iterable() -> None:
    def a() -> None: ...

    registry = ToolRegistry([a, tool(name="b")(a)])
    assert registry.names == ["a", "b"]


async def test_execute_async_and_sync_tools() -> None:
    registry = ToolRegistry()

    @registry.register
    async def add(a: int, b: int) -> int:
        return a + b

    @registry.register
    def greet(name: str) -> str:
        return f"hello {name}"

    result = await registry.execute(call("add", "call_7", a=2, b=3))
    assert result == ToolResult(call_id="call_7", name="add", content="5", ok=True, latency_s=result.latency_s)
    assert result.error_kind is None and result.latency_s >= 0
    assert (await registry.execute(call("greet", name="wörld"))).content == "hello wörld"


async def test_results_are_json_encoded_and_strings_are_kept() -> None:
    class Opaque:
        def __str__(self) -> str:
            return "<opaque>"

    values: dict[str, Any] = {
        "text": 'plain "text"\n',
        "data": {"a": [1, 2.5, None, True], "é": "ü"},
        "struct": Point(x=1, y=2.0),
        "enum": Color.RED,
        "none": None,
        "opaque": {"o": Opaque()},
    }
    registry = ToolRegistry()

    @registry.register
    def give(key: str) -> Any:
        return values[key]

    contents = {key: (await registry.execute(call("give", key=key))).content for key in values}
    assert contents == {
        "text": 'plain "text"\n',
        "data": '{"a":[1,2.5,null,true],"é":"ü"}',
        "struct": '{"x":1,"y":2.0}',
        "enum": '"red"',
        "none": "null",
        "opaque": '{"o":"<opaque>"}',
    }


async def test_tool_receives_converted_arguments() -> None:
    seen: list[Any] = []
    registry = ToolRegistry()

    @registry.register
    async def paint(color: Color, box: Box) -> str:
        seen.extend([color, box])
        return "done"

    result = await registry.execute(call("paint", color="green", box={"lo": {"x": 3}}))
    assert result.ok
    assert seen == [Color.GREEN, Box(lo=Point(x=3))]


async def test_unknown_tool_lists_the_available_names() -> None:
    def search(q: str) -> str:
        return q

    def calc(e: str) -> str:
        return e

    registry = ToolRegistry([search, calc])
    result = await registry.execute(call("serach", "call_3", q="x"))
    assert result == ToolResult(
        call_id="call_3",
        name="serach",
        content="unknown tool 'serach'; available tools: 'search', 'calc'",
        ok=False,
        error_kind="unknown_tool",
        latency_s=result.latency_s,
    )
    empty = await ToolRegistry().execute(call("x"))
    assert empty.content == "unknown tool 'x'; no tools are available"
    # the name is checked before the arguments (no schema to check them against): unknown_tool wins
    both = await registry.execute(call("serach", "call_4", nope=[1], q=3))
    assert both.error_kind == "unknown_tool" and both.content.startswith("unknown tool 'serach'")


async def test_bad_arguments_become_an_error_result() -> None:
    registry = ToolRegistry([rich])
    result = await registry.execute(call("rich", n="three"))
    assert (result.ok, result.error_kind) == (False, "bad_arguments")
    assert result.content == "invalid arguments for tool 'rich': argument 'n' must be an integer, got \"three\""


async def test_tool_raising_becomes_an_error_result() -> None:
    registry = ToolRegistry()

    @registry.register
    async def boom(x: int) -> None:
        raise ValueError(f"bad x {x}")

    @registry.register
    def silent() -> None:
        raise RuntimeError

    @registry.register
    async def own_timeout() -> None:
        raise TimeoutError("upstream API timed out")

    result = await registry.execute(call("boom", x=3))
    assert (result.ok, result.error_kind, result.content) == (
        False,
        "raised",
        "tool 'boom' failed: ValueError: bad x 3",
    )
    assert (await registry.execute(call("silent"))).content == "tool 'silent' failed: RuntimeError"
    own = await registry.execute(call("own_timeout"))
    assert (own.error_kind, own.content) == (
        "raised",
        "tool 'own_timeout' failed: TimeoutError: upstream API timed out",
    )


async def test_tool_raising_cancelled_error_itself_is_an_error_not_a_cancellation() -> None:
    registry = ToolRegistry()

    @registry.register
    async def waits_on_cancelled_future() -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.cancel()
        await future

    result = await registry.execute(call("waits_on_cancelled_future"))
    assert (result.error_kind, result.content) == ("raised", "tool 'waits_on_cancelled_future' failed: CancelledError")


async def test_unencodable_result_is_an_error_result() -> None:
    registry = ToolRegistry()

    class Unprintable:
        def __str__(self) -> str:
            raise ValueError("no text form")

    @registry.register
    def odd() -> Any:
        return [Unprintable()]

    result = await registry.execute(call("odd"))
    assert (result.error_kind, result.content) == (
        "raised",
        "tool 'odd' returned a value that cannot be encoded as JSON: no text form",
    )


async def test_async_tool_is_cancelled_at_its_timeout() -> None:
    cancelled = asyncio.Event()
    registry = ToolRegistry()

    @registry.register
    @tool(timeout_s=0.1)
    async def slow() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "late"

    start = time.perf_counter()
    result = await registry.execute(call("slow"))
    elapsed = time.perf_counter() - start
    assert elapsed >= 0.09  # never early; how late depends on the machine, so no upper bound
    assert (result.ok, result.error_kind, result.content) == (False, "timeout", "tool 'slow' timed out after 0.1 s")
    assert cancelled.is_set()
    assert result.latency_s >= 0.09


async def test_sync_tool_is_abandoned_at_its_timeout() -> None:
    release = threading.Event()
    registry = ToolRegistry()

    @registry.register
    @tool(timeout_s=0.1)
    def stuck() -> str:
        release.wait(5)
        return "late"

    try:
        result = await registry.execute(call("stuck"))  # had the timeout not worked: "late", after 5 s
    finally:
        release.set()  # let the abandoned thread finish so the loop shuts down promptly
    assert (result.error_kind, result.content) == ("timeout", "tool 'stuck' timed out after 0.1 s")


async def test_sync_tool_does_not_block_the_event_loop() -> None:
    """A condition, not tick counting: the tool blocks until a coroutine on the loop has run while the tool
    was running, which is only possible if the tool runs off the loop."""
    registry = ToolRegistry()
    tool_started = threading.Event()
    loop_ran = threading.Event()

    @registry.register
    def sleepy() -> str:
        tool_started.set()
        return "rested" if loop_ran.wait(timeout=60) else "the event loop was blocked"

    async def on_the_loop() -> None:
        while not tool_started.is_set():
            await asyncio.sleep(0.001)
        loop_ran.set()

    beside = asyncio.create_task(on_the_loop())
    result = await registry.execute(call("sleepy"))
    beside.cancel()
    assert result.content == "rested"


async def test_max_concurrency_is_honoured() -> None:
    """Calls park on the cap, not on time: each tool holds until released, and the test releases only once the
    calls beyond the cap wait at it (so a third could have started if the cap leaked)."""
    active = 0
    peak = 0
    release = asyncio.Event()
    registry = ToolRegistry()

    async def hold(i: int) -> int:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await release.wait()
        active -= 1
        return i

    registry.register(tool(name="limited", max_concurrency=2)(hold))
    registry.register(tool(name="unlimited")(hold))

    async def until(cond, what: str) -> None:  # type: ignore[no-untyped-def]
        try:
            async with asyncio.timeout(60):
                while not cond():
                    await asyncio.sleep(0.001)
        except TimeoutError:
            raise AssertionError(f"never happened: {what}") from None

    calls = asyncio.gather(*(registry.execute(call("limited", f"call_{i}", i=i)) for i in range(7)))
    waiters = lambda: len(registry._semaphores["limited"][1]._waiters or ())  # noqa: E731
    await until(lambda: active == 2 and "limited" in registry._semaphores and waiters() == 5, "5 wait at the cap")
    assert peak == 2
    release.set()
    results = await calls
    assert [r.content for r in results] == [str(i) for i in range(7)]
    assert peak == 2
    peak = 0
    release.clear()
    calls = asyncio.gather(*(registry.execute(call("unlimited", i=i)) for i in range(5)))
    await until(lambda: active == 5, "all 5 run at once")  # no cap: every call runs together
    release.set()
    await calls
    assert peak == 5


def test_max_concurrency_works_across_event_loops() -> None:
    registry = ToolRegistry()

    @registry.register
    @tool(max_concurrency=1)
    async def one(i: int) -> int:
        await asyncio.sleep(0.001)
        return i

    async def burst() -> list[str]:
        results = await asyncio.gather(*(registry.execute(call("one", i=i)) for i in range(3)))
        return [r.content for r in results]

    assert asyncio.run(burst()) == ["0", "1", "2"]
    assert asyncio.run(burst()) == ["0", "1", "2"]


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_cancelling_execute_propagates(kind: str) -> None:
    started = threading.Event()
    release = threading.Event()
    cleaned_up = asyncio.Event()
    registry = ToolRegistry()

    async def forever_async() -> None:
        started.set()
        try:
            await asyncio.sleep(10)
        finally:
            cleaned_up.set()

    def forever_sync() -> None:
        started.set()
        release.wait(5)

    registry.register(tool(name="forever")(forever_async if kind == "async" else forever_sync))
    task = asyncio.create_task(registry.execute(call("forever")))
    while not started.is_set():
        await asyncio.sleep(0.005)
    task.cancel()
    try:
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        release.set()
    if kind == "async":
        assert cleaned_up.is_set()
    stats = registry.stats()
    assert (stats["cancelled"], stats["calls"], stats["tools"]["forever"]["cancelled"]) == (1, 1, 1)


async def test_stats_count_calls_errors_and_timeouts() -> None:
    registry = ToolRegistry()

    @registry.register
    def ok(x: int) -> int:
        return x

    @registry.register
    async def fails() -> None:
        raise KeyError("k")

    @registry.register
    @tool(timeout_s=0.02)
    async def hangs() -> None:
        await asyncio.sleep(5)

    for c in [
        call("ok", x=1),
        call("ok", x=2),
        call("ok", x="bad"),
        call("fails"),
        call("hangs"),
        call("hangs"),
        call("nope"),
    ]:
        await registry.execute(c)
    stats = registry.stats()
    assert set(TOOL_ERROR_KINDS) == set(stats["errors"])
    assert {k: v for k, v in stats.items() if k not in ("tools", "latency_s_total")} == {
        "calls": 7,
        "ok": 2,
        "errors": {"unknown_tool": 1, "bad_arguments": 1, "raised": 1, "timeout": 2},
        "timeouts": 2,
        "cancelled": 0,
    }
    assert stats["latency_s_total"] >= 0.04
    assert stats["tools"]["ok"]["calls"] == 3
    assert stats["tools"]["ok"]["ok"] == 2
    assert stats["tools"]["ok"]["errors"]["bad_arguments"] == 1
    assert stats["tools"]["fails"]["errors"]["raised"] == 1
    assert (stats["tools"]["hangs"]["timeouts"], stats["tools"]["hangs"]["errors"]["timeout"]) == (2, 2)
    assert stats["tools"]["hangs"]["latency_s_total"] >= 0.04
    registry.reset_stats()
    assert registry.stats()["calls"] == 0
    assert registry.stats()["tools"]["ok"]["calls"] == 0
