"""The gateway under attack (issue 36): bounded work per request, no 5xx from any input, no session from
a failed call, at-least-once export, connection and read bounds, and the bind rule.  Every wait is on a
condition (a connection closed, a count reached), never a sleep followed by a check."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import openai
import pytest
import yarl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_sdk import RolloutClient
from rollout_sdk.engines.fake import FakeEngine, FakeEngineConfig
from rollout_sdk.errors import ConfigError
from rollout_sdk.gateway import Gateway, GatewayConfig, SessionRecord
from rollout_sdk.server import EngineServer, ServerConfig
from test_gateway import QWEN, Script, gateway_on, wait_for

IM_END = 151645


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> Any:
    from rollout_sdk.models import load_tokenizer

    return load_tokenizer(str(tiny_model))


def root(gw: Gateway) -> str:
    return f"http://127.0.0.1:{gw.port}"


# -- item 7: the bind rule ---------------------------------------------------------------------------


def test_a_gateway_beyond_loopback_needs_an_admin_key() -> None:
    for host in ("0.0.0.0", "::", "10.1.2.3", ""):
        with pytest.raises(ConfigError, match="admin key"):
            GatewayConfig(host=host)
    GatewayConfig(host="0.0.0.0", admin_key="k")  # with a key: allowed
    GatewayConfig(host="localhost")
    GatewayConfig(host="::1")
    with pytest.raises(ConfigError, match="admin_key"):
        GatewayConfig(admin_key="  ")


def test_cli_gateway_on_every_interface_without_a_key_refuses_in_one_line(sdk_home: Path) -> None:
    env = dict(os.environ, ROLLOUT_SDK_HOME=str(sdk_home))
    proc = subprocess.run(
        [sys.executable, "-m", "rollout_sdk", "gateway", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "admin" in lines[0] and "0.0.0.0" in lines[0], proc.stderr
    assert "READY" not in proc.stdout


# -- item 11: smaller holes ---------------------------------------------------------------------------


async def test_small_holes_are_closed(fake_servers, tok) -> None:
    async with gateway_on(fake_servers, tok, Script(tok, ["x"]), max_turns_per_session=8) as (gw, _):
        async with aiohttp.ClientSession() as http:
            # /v1/messages without max_tokens: 400 as Anthropic answers (an error of type invalid_request_error)
            body = {"model": gw.model_name, "messages": [{"role": "user", "content": "hi"}]}
            async with http.post(f"{root(gw)}/v1/messages", json=body, headers={"x-api-key": "k1"}) as r:
                err = await r.json()
                assert r.status == 400 and err["type"] == "error"
                assert err["error"]["param"] == "max_tokens" and err["error"]["type"] == "invalid_request_error"
            assert "k1" not in gw.store.sessions  # and the failed call opened nothing
            # turn_rewards longer than a session can have turns
            s = gw.session()
            many = {"turn_rewards": [{"turn": 0, "reward": 1.0}] * 200_000}
            async with http.post(f"{root(gw)}/v1/sessions/{s.id}/reward", json=many) as r:
                err = (await r.json())["error"]
                assert r.status == 400 and err["param"] == "turn_rewards" and err["code"] == "too_many_items"
            # session ids the session endpoints cannot address: refused, by path and by key
            for path in ("/s/%2E%2E/v1/chat/completions", "/s/%2E/v1/chat/completions"):
                chat = {"model": gw.model_name, "messages": [{"role": "user", "content": "hi"}]}
                async with http.post(yarl.URL(root(gw) + path, encoded=True), json=chat) as r:
                    assert r.status == 400 and (await r.json())["error"]["code"] == "bad_session", path
            async with http.post(
                f"{root(gw)}/v1/chat/completions", json=chat, headers={"Authorization": "Bearer .."}
            ) as r:
                assert r.status == 400 and (await r.json())["error"]["code"] == "bad_session"
            async with http.post(f"{root(gw)}/v1/sessions", json={"id": ".."}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "session"
            # the stream past max_export_streams: a 429 with a code
            streams = [await http.get(f"{root(gw)}/v1/trajectories/stream") for _ in range(16)]
            await wait_for(lambda: gw.export_streams == 16)
            async with http.get(f"{root(gw)}/v1/trajectories/stream") as r:
                assert r.status == 429 and (await r.json())["error"]["code"] == "too_many_streams"
            for resp in streams:
                resp.close()
            await wait_for(lambda: gw.export_streams == 0)


# -- item 3: a failed call opens nothing; the trainer always has room ----------------------------------


async def test_junk_keys_open_nothing_and_cannot_starve_the_trainer(fake_servers, tok) -> None:
    async with gateway_on(fake_servers, tok, Script(tok, ["x"]), max_sessions=20) as (gw, _):
        assert gw.store.max_auto_sessions == 18  # 90%: the rest is the trainer's
        async with aiohttp.ClientSession() as http:
            bad = {"model": gw.model_name, "messages": "not a list"}
            for k in range(450):  # every call a 400, each with a fresh key
                async with http.post(
                    f"{root(gw)}/v1/chat/completions", json=bad, headers={"Authorization": f"Bearer junk{k}"}
                ) as r:
                    assert r.status == 400
            assert gw.store.sessions == {} and gw.store.num_auto == 0
            # a call that ends any other way (cancelled, say) before its session served a turn: the same
            seen = []

            async def cancelled_call() -> None:
                with gw.store.call("cancelled", create=True) as session:
                    seen.append(session.auto and "cancelled" in gw.store.sessions)
                    await asyncio.Event().wait()

            task = asyncio.create_task(cancelled_call())
            await wait_for(lambda: bool(seen))
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert seen == [True]
            assert gw.store.sessions == {} and gw.store.num_auto == 0
            # junk keys with *valid* calls fill the auto sessions' share, and no more
            good = {"model": gw.model_name, "messages": [{"role": "user", "content": "hi"}]}
            codes = []
            for k in range(25):
                async with http.post(
                    f"{root(gw)}/v1/chat/completions", json=good, headers={"Authorization": f"Bearer flood{k}"}
                ) as r:
                    codes.append(r.status if r.status == 200 else (await r.json())["error"]["code"])
            assert codes == [200] * 18 + ["too_many_auto_sessions"] * 7
            # the trainer's own sessions still open, and serve
            async with http.post(f"{root(gw)}/v1/sessions", json={}) as r:
                assert r.status == 201
                sid = (await r.json())["id"]
            h = gw.session()
            async with http.post(
                f"{root(gw)}/v1/chat/completions", json=good, headers={"Authorization": f"Bearer {sid}"}
            ) as r:
                assert r.status == 200
            assert len(gw.store.sessions) == 20 and h.id in gw.store.sessions


# -- item 4: at-least-once export --------------------------------------------------------------------------


async def _finished_sessions(gw: Gateway, n: int) -> list[str]:
    oa = openai.AsyncOpenAI(base_url=gw.url, api_key="x", max_retries=0)
    ids = []
    for _ in range(n):
        h = gw.session()
        await oa.with_options(api_key=h.api_key).chat.completions.create(
            model=gw.model_name, messages=[{"role": "user", "content": h.id}]
        )
        gw.finish(h.id)
        ids.append(h.id)
    await oa.close()
    return ids


async def _read_records(http: aiohttp.ClientSession, url: str) -> list[str]:
    async with http.get(url) as r:
        return [msgspec.json.decode(line, type=SessionRecord).session async for line in r.content if line.strip()]


async def test_a_consumer_that_vanishes_loses_nothing_for_the_next(fake_servers, tok) -> None:
    async with gateway_on(fake_servers, tok, Script(tok, ["x"])) as (gw, _):
        ids = await _finished_sessions(gw, 20)
        async with aiohttp.ClientSession() as http:
            # connects, gets the records written into its socket, reads nothing, goes away
            r = await http.get(f"{root(gw)}/v1/trajectories/stream")
            await wait_for(lambda: len(gw._unacked) == 20)  # all 20 sent to it
            r.close()
            await wait_for(lambda: gw.export_streams == 0)
            assert gw.exported_sessions == 0 and gw._unacked == {}  # given back at once, not lost
            assert gw.redelivered_sessions == 20 and b"rollout_gateway_export_redelivered_total 20.0" in gw.metrics()[0]
            got = await _read_records(http, f"{root(gw)}/v1/trajectories/stream?limit=20")
            assert sorted(got) == sorted(ids)
            async with http.post(f"{root(gw)}/v1/trajectories/ack", json={"ids": [*got, "nope"]}) as r:
                answer = await r.json()
            assert sorted(answer["acknowledged"]) == sorted(ids) and answer["unknown"] == ["nope"]
            assert gw.exported_sessions == 20 and gw.store.sessions == {}
            async with http.post(f"{root(gw)}/v1/trajectories/ack", json={"ids": got[:1]}) as r:
                assert (await r.json())["already_acknowledged"] == got[:1]  # idempotent
            async with http.post(f"{root(gw)}/v1/trajectories/ack", json={"ids": "x"}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "ids"


async def test_a_record_never_acknowledged_is_sent_again(fake_servers, tok) -> None:
    async with gateway_on(fake_servers, tok, Script(tok, ["x"]), export_ack_timeout_s=0.2) as (gw, _):
        ids = await _finished_sessions(gw, 3)
        async with aiohttp.ClientSession() as http:
            # a consumer that reads (limit=2, window=2) and never acknowledges: after the ack timeout its
            # records go back to the queue, and the next consumer gets all three (read at most once here:
            # nothing of it is leased, so no timeout can move a record while it reads)
            first = await _read_records(http, f"{root(gw)}/v1/trajectories/stream?limit=2&window=2")
            assert len(first) == 2
            await wait_for(lambda: gw.redelivered_sessions == 2 and gw.store.finished.qsize() == 3)
            again = await _read_records(http, f"{root(gw)}/v1/trajectories/stream?limit=3&ack=false")
            assert sorted(again) == sorted(ids)


async def test_the_window_bounds_a_stream_and_ack_false_exports_at_once(fake_servers, tok) -> None:
    # the default ack timeout (60 s): no record goes back to the queue while the test looks at it
    async with gateway_on(fake_servers, tok, Script(tok, ["x"])) as (gw, _):
        ids = await _finished_sessions(gw, 3)
        async with aiohttp.ClientSession() as http:
            # a stream holds at most `window` unacknowledged records, then takes no more
            async with http.get(f"{root(gw)}/v1/trajectories/stream?window=1") as r:
                line = await r.content.readline()
                sid = msgspec.json.decode(line, type=SessionRecord).session
                assert gw._unacked.keys() == {sid}
                async with http.post(f"{root(gw)}/v1/trajectories/ack", json={"ids": [sid]}) as a:
                    assert (await a.json())["acknowledged"] == [sid]
                line = await r.content.readline()  # room again: the next record comes
                assert msgspec.json.decode(line, type=SessionRecord).session in set(ids) - {sid}
            # at most once, asked for: a record leaves when written
            n = gw.exported_sessions
            await wait_for(lambda: gw.store.finished.qsize() >= 1)
            assert len(await _read_records(http, f"{root(gw)}/v1/trajectories/stream?limit=1&ack=false")) == 1
            assert gw.exported_sessions == n + 1


# -- item 5: no input gives a 5xx ------------------------------------------------------------------------

ROUTES = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/responses"),
    ("POST", "/v1/messages"),
    ("POST", "/s/fuzz/v1/chat/completions"),
    ("POST", "/s/fuzz/v1/responses"),
    ("POST", "/s/fuzz/v1/messages"),
    ("POST", "/s/fuzz/v1/completions"),
    ("POST", "/v1/sessions"),
    ("POST", "/v1/sessions/fuzz/reward"),
    ("POST", "/v1/sessions/fuzz/finish"),
    ("POST", "/v1/trajectories/ack"),
]


class _ThreadGateway:
    """A gateway on its own event loop in a thread, so a synchronous hypothesis test can drive it over
    real HTTP (hypothesis runs examples synchronously)."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.stop: asyncio.Event | None = None
        self.gw: Gateway | None = None
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._main(),), daemon=True)

    async def _main(self) -> None:
        self.stop = asyncio.Event()
        server = EngineServer(FakeEngine(QWEN, responder=Script(self.tok, ["x"])), ServerConfig(server_id="fuzz"))  # type: ignore[arg-type]
        async with server, RolloutClient(servers=[server.address]) as client:
            async with Gateway(client, tokenizer=self.tok) as gw:
                self.gw = gw
                self.ready.set()
                await self.stop.wait()

    def __enter__(self) -> _ThreadGateway:
        self.thread.start()
        assert self.ready.wait(120)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.stop is not None
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(120)
        self.loop.close()

    def request(self, method: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        assert self.gw is not None
        conn = http.client.HTTPConnection("127.0.0.1", self.gw.port, timeout=60)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read() or b"null")
        finally:
            conn.close()


@pytest.fixture(scope="module")
def thread_gateway(tok: Any) -> Iterator[_ThreadGateway]:
    with _ThreadGateway(tok) as tg:
        yield tg


def _nested(depth: int) -> bytes:
    return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize("depth", [100, 1000, 100_000])
def test_deep_and_invalid_json_is_a_400_on_every_route(thread_gateway: _ThreadGateway, depth: int) -> None:
    for method, path in ROUTES:
        status, body = thread_gateway.request(method, path, _nested(depth))
        assert status == 400 and body["error"]["code"] == "nested_too_deep", (path, body)
        if depth == 100:
            assert body["error"]["param"].startswith("messages[0]"), body  # names the field
        status, body = thread_gateway.request(method, path, b'{"reward": ')
        assert status == 400 and body["error"]["code"] == "invalid_json", (path, body)
    status, body = thread_gateway.request("GET", "/health", b"")
    assert status == 200


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
_FIELDS = [
    "model",
    "messages",
    "prompt",
    "input",
    "max_tokens",
    "max_output_tokens",
    "n",
    "stop",
    "temperature",
    "tools",
    "tool_choice",
    "stream",
    "reward",
    "turn_rewards",
    "metadata",
    "sampling",
    "id",
    "ids",
    "system",
    "logprobs",
    "seed",
    "previous_response_id",
]


@st.composite
def _bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["object", "raw", "any"]))
    if kind == "raw":
        return draw(st.binary(max_size=64))
    if kind == "any":
        return json.dumps(draw(_json)).encode()
    body = draw(st.dictionaries(st.sampled_from(_FIELDS), _json, max_size=5))
    if draw(st.booleans()):
        body["model"] = "tiny"  # the served model's name in this gateway (see the fixture) half the time
    if draw(st.booleans()):
        body["messages"] = draw(
            st.lists(
                st.fixed_dictionaries(
                    {"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]), "content": _json}
                ),
                max_size=3,
            )
        )
    return json.dumps(body).encode()


#: 400s about the whole body or the session, not one field
_NOT_A_FIELD = {"invalid_json", "nested_too_deep", "too_many_turns"}


@settings(
    max_examples=int(os.environ.get("ROLLOUT_SDK_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)
@given(route=st.sampled_from(ROUTES), body=_bodies())
def test_fuzz_every_route_answers_a_typed_4xx_or_success(
    thread_gateway: _ThreadGateway, route: tuple[str, str], body: bytes
) -> None:
    gw = thread_gateway.gw
    assert gw is not None
    body = body.replace(b'"tiny"', json.dumps(gw.model_name).encode())
    method, path = route
    status, answer = thread_gateway.request(method, path, body, {"Authorization": "Bearer fuzz-key"})
    assert status < 500, (path, body, answer)
    if status >= 400:
        err = answer["error"]
        assert isinstance(err["message"], str) and err["message"] and err["type"] and err["code"], answer
        if status == 400 and err["code"] not in _NOT_A_FIELD:
            assert err["param"] is not None, answer  # a bad field is named
    status, _ = thread_gateway.request("GET", "/health", b"")
    assert status == 200  # and it keeps serving


# -- item 6: slow clients -----------------------------------------------------------------------------------


async def _until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection (EOF)."""
    return await reader.read()


async def test_slow_heads_and_bodies_are_closed_and_connections_are_bounded(fake_servers, tok) -> None:
    options = {"header_timeout_s": 0.5, "body_timeout_s": 0.5, "max_connections": 6}
    async with gateway_on(fake_servers, tok, Script(tok, ["x"]), **options) as (gw, _):
        server = gw._runner.server
        # a request head that never completes: closed by the server (EOF), with nothing answered
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        await writer.drain()
        assert await asyncio.wait_for(_until_closed(reader), 60) == b""
        writer.close()
        await writer.wait_closed()  # closed before the loop ends: no "unclosed transport" at exit
        # a body sent a byte at a time, never finished: 408 body_timeout, then closed
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\nAuthorization: Bearer slow\r\n\r\n{"
        )
        await writer.drain()
        answer = await asyncio.wait_for(_until_closed(reader), 60)
        assert answer.startswith(b"HTTP/1.1 408") and b'"body_timeout"' in answer
        writer.close()
        await writer.wait_closed()
        assert "slow" not in gw.store.sessions
        await wait_for(lambda: len(server.connections) == 0)
        # connections beyond max_connections: 503 too_many_connections at once, the others stay served
        held = []
        for k in range(6):
            held.append(await asyncio.open_connection("127.0.0.1", gw.port))
            await wait_for(lambda k=k: len(server.connections) == k + 1)
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        answer = await asyncio.wait_for(_until_closed(reader), 60)
        assert answer.startswith(b"HTTP/1.1 503") and b'"too_many_connections"' in answer
        writer.close()
        await writer.wait_closed()
        assert b"rollout_gateway_connections_refused_total 1.0" in gw.metrics()[0]
        for _, w in held:
            w.close()
        await asyncio.gather(*(w.wait_closed() for _, w in held))
        await wait_for(lambda: len(server.connections) == 0)
        async with aiohttp.ClientSession() as http, http.get(f"{root(gw)}/health") as r:
            assert r.status == 200


# -- item 2: a request that cannot fit is refused before work proportional to its size -------------------


class CountingTokenizer:
    """The real tokenizer, counting the characters every encode call was given."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.encoded: list[int] = []

    def encode(self, text: str, *args: Any, **kw: Any) -> Any:
        self.encoded.append(len(text))
        return self._tok.encode(text, *args, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


@contextlib.asynccontextmanager
async def _counting_gateway(fake_servers: Any, tok: Any, context: int) -> AsyncIterator[tuple[Gateway, Any]]:
    counting = CountingTokenizer(tok)
    servers = await fake_servers(1, FakeEngineConfig(eos_token_ids=(IM_END,), max_context=context))
    async with RolloutClient(servers=[s.address for s in servers]) as client, Gateway(client, tokenizer=counting) as gw:
        yield gw, counting


async def test_a_call_that_cannot_fit_is_refused_before_it_is_tokenized_whole(fake_servers, tok) -> None:
    context = 4096
    async with _counting_gateway(fake_servers, tok, context) as (gw, counting):
        assert gw._service is not None and gw._service.max_token_chars == 128  # Qwen2's longest token
        big = "word " * 1_000_000  # 5M characters: over context * 128 -> refused by its length alone
        medium = "word " * 100_000  # 500k characters: within it -> refused after a bounded prefix
        oa = openai.AsyncOpenAI(base_url=gw.url, api_key="k", max_retries=0)
        async with aiohttp.ClientSession() as http:
            for text in (big, medium):
                counting.encoded.clear()
                calls = [
                    ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
                    ("/v1/responses", {"input": text}),
                    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": text}]}),
                    ("/v1/completions", {"prompt": text}),
                ]
                for path, body in calls:
                    async with http.post(
                        f"{root(gw)}{path}", json={"model": gw.model_name, **body}, headers={"x-api-key": "k"}
                    ) as r:
                        err = (await r.json())["error"]
                        assert r.status == 400 and err["code"] == "context_length_exceeded", (path, err)
                # nothing tokenized more than the probe's prefix (8 characters per token of room)
                assert max(counting.encoded, default=0) <= 8 * context, counting.encoded
                if text is big:
                    assert counting.encoded == []
            ids = {"model": gw.model_name, "prompt": [1] * (context + 1)}
            async with http.post(f"{root(gw)}/v1/completions", json=ids, headers={"x-api-key": "k"}) as r:
                assert r.status == 400 and (await r.json())["error"]["code"] == "context_length_exceeded"
        # a call that fits is served as before
        r2 = await oa.chat.completions.create(
            model=gw.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert r2.choices[0].message is not None
        await oa.close()
        assert gw.store.sessions.keys() == {"k"}  # the refused calls opened nothing


async def test_image_expansions_run_at_most_max_image_expansions_at_once(tiny_model: Path) -> None:
    """The CPU engine decodes and expands the images of at most ``max_image_expansions`` requests at once
    (each holds its decoded pixels meanwhile); the others wait, and a cancelled request's expansion keeps
    its slot until its thread is done."""
    import threading as th

    from rollout_sdk.engines.cpu import CpuEngine, CpuEngineConfig
    from rollout_sdk.models.vision import IMAGE_PAD_ID
    from rollout_sdk.protocol import EngineLimits, GenerateRequest, SamplingParams

    class Processor:
        def __init__(self) -> None:
            self.lock = th.Lock()
            self.running = self.peak = 0
            self.release = th.Event()

        def expand(self, ids: list[int], images: list[bytes]) -> Any:
            with self.lock:
                self.running += 1
                self.peak = max(self.peak, self.running)
            self.release.wait(60)
            with self.lock:
                self.running -= 1
            return type("V", (), {"input_ids": list(ids)})()

    engine = CpuEngine(CpuEngineConfig(model_path=str(tiny_model), max_image_expansions=2))
    proc = Processor()
    engine._runner.vision = proc
    engine._limits = EngineLimits(vocab_size=10, max_context=1 << 20, eos_token_ids=[])
    req = GenerateRequest(input_ids=[IMAGE_PAD_ID], sampling=SamplingParams(max_new_tokens=1), images=[b"x"])
    tasks = [asyncio.create_task(engine._expand_images(req)) for _ in range(6)]
    await wait_for(lambda: proc.running == 2)
    tasks[0].cancel()  # cancelled while expanding: its slot stays taken until its thread ends
    await asyncio.gather(tasks[0], return_exceptions=True)
    assert proc.running == 2 and engine._expansions.locked()
    proc.release.set()
    await asyncio.gather(*tasks[1:])
    # the cancelled request's thread may still be finishing: its slot is given back when it does
    await wait_for(lambda: proc.running == 0 and not engine._expansions.locked())
    assert proc.peak == 2


async def test_records_unacknowledged_when_the_gateway_closes_go_to_trajectories(fake_servers, tok) -> None:
    async with gateway_on(fake_servers, tok, Script(tok, ["x"])) as (gw, _):
        ids = await _finished_sessions(gw, 2)
        async with aiohttp.ClientSession() as http:
            assert sorted(await _read_records(http, f"{root(gw)}/v1/trajectories/stream?limit=2")) == sorted(ids)
        assert len(gw._unacked) == 2
    # closed: the streams are gone, so what they sent unacknowledged is handed to the in-process consumer
    assert sorted([t.id async for t in gw.trajectories()]) == sorted(ids)


async def test_chunked_bodies_are_read_and_bounded_too(fake_servers, tok) -> None:
    async with gateway_on(fake_servers, tok, Script(tok, ["x"]), max_body_bytes=4096) as (gw, _):

        async def chunks(parts: list[bytes]) -> AsyncIterator[bytes]:
            for p in parts:
                yield p

        body = json.dumps({"model": gw.model_name, "messages": [{"role": "user", "content": "hi"}]}).encode()
        headers = {"Content-Type": "application/json", "Authorization": "Bearer chunked"}
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"{root(gw)}/v1/chat/completions", data=chunks([body[:10], body[10:]]), headers=headers
            ) as r:
                assert r.status == 200 and "Content-Length" not in r.request_info.headers
            async with http.post(
                f"{root(gw)}/v1/chat/completions", data=chunks([b"[" + b" " * 3000] * 3), headers=headers
            ) as r:
                assert r.status == 413 and (await r.json())["error"]["code"] == "request_too_large"
            async with http.get(f"{root(gw)}/health") as r:
                assert r.status == 200
