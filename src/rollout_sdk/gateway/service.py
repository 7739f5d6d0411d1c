"""One OpenAI call served as exact tokens: render, match the session, generate, parse, record.

::

    handler (event loop)                        tokenizer thread (one)
    ────────────────────                        ──────────────────────
    check fields, normalise messages
    match the session (hash lookups, no await)
    render / glue of the new messages ──────▶  (only past OFFLOAD_CHARS characters: a thread hop costs
    ◀────────────── context ids ────────────    more than a small render under the GIL; bench/gateway.py)
    n x client.generate (session affinity; an aborted generation — a trainer's pause — is continued
                         from its tokens, up to max_resumes times)
    decode, stop strings, reasoning split,
    tool-call parser ───────────────────────▶  (same rule)
    record the turns (no await), answer

The tokenizer is only ever called with its default truncation and padding, so the loop thread and the
tokenizer thread never change its state under each other.  Model output ids are never decoded and
re-encoded into the history: a later turn appends the template's glue after the exact ids the engine
returned.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from .._aio import first_exception
from ..agents import ChatTemplate, ParsedTurn, TemplateError, ToolCallParser, ToolCallRecord, Turn, get_parser
from ..agents.chat import message_images
from ..agents.parsers import ReasoningParser, get_reasoning_parser, split_reasoning
from ..protocol import GenerateRequest, GenerateResult, Lifecycle, SamplingParams
from ..rollouts.continuation import Continuation
from ..rollouts.seeds import sample_seed
from .bodies import CharCaps, PromptLimits
from .config import GatewayConfig
from .errors import GatewayError, bad_request, unsupported
from .sampling import RequestOptions, parse_options
from .sessions import Node, Session, extend_key, prefix_keys
from .tools import assistant_reply, canonical, parse_tool_choice, template_messages, template_tools

__all__ = [
    "Choice",
    "Outcome",
    "TurnService",
    "keeps_call_content",
    "keeps_reasoning",
    "max_token_chars",
    "vocab_bounds",
]

T = TypeVar("T")
_TEMPLATES = 64
#: work on more characters than this leaves the event loop for the tokenizer thread
OFFLOAD_CHARS = 16_384
#: a text longer than this many characters per token of room is first tokenized only that far (a prompt
#: that can fit averages ~3-5; a longer text that fits tokenizes unusually well and is then encoded whole)
PROBE_CHARS_PER_TOKEN = 8
#: tokens a prefix may have beyond the room before it is refused (its cut can split one pre-token)
PROBE_SLACK_TOKENS = 64
#: the prefix is tokenized in pieces of about this many characters (the tokenizer's memory: a few MB)
PROBE_PIECE_CHARS = 32_768


@dataclass(frozen=True, kw_only=True)
class Choice:
    index: int
    node: Node
    #: chat: the assistant message (OpenAI shape); completions: None
    message: dict[str, Any] | None
    text: str
    finish_reason: str
    #: (token text, logprob) per output token, when the request asked for logprobs
    logprobs: list[tuple[str, float]] | None
    #: the reasoning the reasoning parser split off the model's text (None: none, or no parser)
    reasoning: str | None = None
    #: the stop string that ended the turn, if one did
    matched_stop: str | None = None


@dataclass(frozen=True, kw_only=True)
class Outcome:
    id: str
    created: int
    model: str
    session: str
    choices: list[Choice]
    prompt_tokens: int
    completion_tokens: int
    options: RequestOptions


@dataclass(frozen=True)
class _Decoded:
    ids: list[int]
    cut: int
    text: str
    content: str
    parsed: ParsedTurn | None
    token_texts: list[str] | None
    reasoning: str | None
    matched_stop: str | None


class TurnService:
    """Serves chat and text completions for sessions, against a :class:`~rollout_sdk.RolloutClient`."""

    def __init__(
        self,
        client: Any,
        tokenizer: Any,
        *,
        model: str,
        config: GatewayConfig,
        max_token_chars: int | None = None,
        char_caps: CharCaps | None = None,
        call_content: bool = False,
        reasoning: bool = False,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.model = model
        self.config = config
        self._parser: ToolCallParser = get_parser(config.parser)
        self._parsers: collections.OrderedDict[str, ToolCallParser] = collections.OrderedDict()
        self._reasoning: ReasoningParser = get_reasoning_parser(config.reasoning_parser)
        self._templates: OrderedDict[str, ChatTemplate] = OrderedDict()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-tokenizer")
        self._eos = _eos_ids(tokenizer)
        #: the most characters one token of this tokenizer stands for (None: unknown, no character bound)
        self.max_token_chars = max_token_chars
        #: what bounds a text's tokens from its characters' counts (None: unknown)
        self.char_caps = char_caps
        #: the chat template renders an assistant's content beside its tool calls (:func:`keeps_call_content`)
        self.call_content = call_content
        #: the chat template renders an assistant's text before ``</think>`` (:func:`keeps_reasoning`)
        self.reasoning = reasoning

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _cpu(self, fn: Callable[[], T], size: int) -> T:
        """Run tokenizer / template work: inline when small (a thread hop costs more than ~0.5 ms of work
        under the GIL: bench/gateway.py), on the tokenizer thread when ``size`` (characters) is large."""
        if size < OFFLOAD_CHARS:
            return fn()
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    # -- shared pieces -----------------------------------------------------------------------------

    def _options(self, session: Session, body: dict[str, Any], *, chat: bool) -> RequestOptions:
        model = body.get("model")
        if model is None:
            raise bad_request("model", "model is required", "missing_required_parameter")
        if model != self.model:
            raise GatewayError(
                404,
                f"the model {model!r} does not exist; this gateway serves {self.model!r}",
                param="model",
                code="model_not_found",
            )
        opts = parse_options(body, chat=chat, max_n=self.config.max_n, stop_token_ids=self._single_token_stops)
        return session.sampling.apply(opts) if session.sampling is not None else opts

    def _single_token_stops(self, stops: Sequence[str]) -> list[int]:
        out = []
        for s in stops:
            ids = self.tokenizer.encode(s, add_special_tokens=False)
            if len(ids) == 1:
                out.append(int(ids[0]))
        return out

    def _parser_for(self, tools: list[dict[str, Any]] | None) -> ToolCallParser:
        """The tool-call parser for a request's tools: formats whose values are untyped text (qwen3_coder)
        read each value as its parameter's declared type, as the tool agent's parser does.  Cached per
        tool set, like the templates."""
        if not tools:
            return self._parser
        key = canonical({"tools": tools})
        parser = self._parsers.get(key)
        if parser is None:
            parser = self._parsers[key] = get_parser(self.config.parser, tools=tools)
            while len(self._parsers) > _TEMPLATES:
                self._parsers.popitem(last=False)
        else:
            self._parsers.move_to_end(key)
        return parser

    def _template(self, tools: list[dict[str, Any]] | None) -> ChatTemplate:
        key = canonical({"tools": tools})
        tmpl = self._templates.get(key)
        if tmpl is None:
            tmpl = ChatTemplate(self.tokenizer, tools=tools, strategy=self.config.template_strategy)
            self._templates[key] = tmpl
            while len(self._templates) > _TEMPLATES:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(key)
        return tmpl

    def _context(self) -> int:
        return min((i.limits.max_context for i in self.client.server_info()), default=1 << 30)

    def prompt_limits(self) -> PromptLimits:
        """The most any prompt can hold here (whatever a call's ``max_tokens``): what a body is weighed
        against before it is decoded (:mod:`.bodies`)."""
        tokens = max(self._context() - 1, 0)
        b = self.max_token_chars
        return PromptLimits(
            tokens=tokens,
            chars=None if b is None else tokens * b,
            probe_chars=tokens * PROBE_CHARS_PER_TOKEN,
            char_caps=self.char_caps,
            call_content=self.call_content,
            reasoning=self.reasoning,
        )

    async def probe(self, texts: list[str], param: str) -> None:
        """The prefix probe (:meth:`_probe`) on the first characters of a body not yet decoded
        (:class:`~.bodies.Probe`), against the room of any call (the context less one token)."""
        room = max(self._context() - 1, 0)
        tok = self.tokenizer
        await self._cpu(
            lambda: self._probe(texts, room, lambda t: list(tok.encode(t, add_special_tokens=False)), param),
            sum(len(t) for t in texts),
        )

    def _prompt_room(self, opts: RequestOptions) -> int:
        """The most prompt tokens a call with these options can have (what :meth:`_fit` accepts)."""
        return self._context() - max(opts.max_tokens or 1, 1)

    def _too_long(self, param: str, what: str) -> GatewayError:
        context = self._context()
        return GatewayError(
            400,
            f"this model's context is {context} tokens; {what}",
            param=param,
            code="context_length_exceeded",
        )

    def _check_chars(self, chars: int, room: int, param: str) -> None:
        """Refuse, before any tokenizing, text that cannot fit: a token stands for at most
        ``max_token_chars`` characters, so ``chars`` characters are at least ``chars / max_token_chars``
        tokens.  O(1): the caller counts characters it already holds."""
        b = self.max_token_chars
        if b is not None and chars > max(room, 0) * b:
            raise self._too_long(
                param,
                f"the text holds {chars} characters, at least {-(-chars // b)} tokens ({b} characters a token at most)",
            )

    def _encode_bounded(self, text: str, room: int, encode: Callable[[str], list[int]], param: str) -> list[int]:
        """``encode(text)``, unless it cannot fit in ``room`` tokens: refused by its length in characters,
        or by tokenizing only a prefix (:meth:`_probe`) whose tokens alone already overflow.  So the work
        on a text that cannot fit is bounded by the context, not by the text.  Runs on the tokenizer
        thread for large texts."""
        self._check_chars(len(text), room, param)
        self._probe([text], room, encode, param)
        return encode(text)

    def _probe(self, texts: Sequence[str], room: int, encode: Callable[[str], list[int]], param: str) -> None:
        """Refuse ``texts`` (the parts of one prompt, in order) when their first ``PROBE_CHARS_PER_TOKEN x
        room`` characters alone are more than ``room`` tokens.  Nothing is tokenized when they are shorter
        than that (a prompt that can fit averages ~3-5 characters a token).  The prefix is tokenized in
        pieces cut before a space (where pre-tokenizers split anyway), so the tokenizer's memory is a
        piece's, and counting stops as soon as the room is clearly exceeded; each piece may add a token or
        two at its edges (a split pre-token, special tokens): a slack per piece covers it."""
        probe = max(room, 0) * PROBE_CHARS_PER_TOKEN
        if sum(len(t) for t in texts) <= probe + PROBE_SLACK_TOKENS:
            return
        left = probe
        n = pieces = 0
        for text in texts:
            pos, stop = 0, min(len(text), left)
            while pos < stop and n <= room + PROBE_SLACK_TOKENS + 4 * pieces:
                end = min(pos + PROBE_PIECE_CHARS, stop)
                cut = text.rfind(" ", pos + 1, end) if end < stop else -1
                end = cut if cut > pos else end
                n += len(encode(text[pos:end]))
                pos, pieces = end, pieces + 1
            left -= pos
            if left <= 0 or n > room + PROBE_SLACK_TOKENS + 4 * pieces:
                break
        if n > room + PROBE_SLACK_TOKENS + 4 * pieces:
            raise self._too_long(param, f"the first {probe - left} characters alone are {n} tokens, the room is {room}")

    def _check_messages(self, messages: list[dict[str, Any]], room: int) -> None:
        """The context refusal on the messages' own text, before they are hashed or rendered (each of those
        copies the text): by characters, then by a bounded prefix (:meth:`_probe`).  The rendered prompt
        holds every system / user / tool text verbatim between the template's special tokens, so its
        tokens are at least theirs."""
        texts = _kept_texts(messages)
        self._check_chars(sum(len(t) for t in texts), room, "messages")
        tok = self.tokenizer
        self._probe(texts, room, lambda t: list(tok.encode(t, add_special_tokens=False)), "messages")

    def _fit(self, prompt_len: int, opts: RequestOptions) -> SamplingParams:
        context = self._context()
        room = context - prompt_len
        if room < 1 or (opts.max_tokens is not None and opts.max_tokens > room):
            asked = f" plus {opts.max_tokens} tokens to generate" if opts.max_tokens else ""
            raise GatewayError(
                400,
                f"this model's context is {context} tokens; the prompt has {prompt_len}{asked}",
                param="messages",
                code="context_length_exceeded",
            )
        max_new = opts.max_tokens or min(self.config.default_max_tokens, room)
        if opts.max_tokens_cap is not None:  # the session's limit: clamped, never refused
            max_new = min(max_new, opts.max_tokens_cap)
        sp = opts.sampling
        return msgspec.structs.replace(sp, max_new_tokens=max_new, min_new_tokens=min(sp.min_new_tokens, max_new))

    async def _generate(
        self,
        session: Session,
        prompt: list[int],
        sampling: SamplingParams,
        k: int,
        turn: int,
        images: list[bytes] | None = None,
    ) -> tuple[GenerateResult, list[Lifecycle]]:
        # choice k of the turn at depth `turn`: the SDK's one seed function, as generate_many / ToolAgent
        if sampling.seed is not None and (k or turn):
            sampling = msgspec.structs.replace(sampling, seed=sample_seed(sampling.seed, member=k, turn=turn))
        req = GenerateRequest(
            input_ids=prompt,
            sampling=sampling,
            session_id=session.id,
            images=images or [],
            keep_kv_s=self.config.keep_kv_s,  # the agent calls again after its tools: keep the session's KV
        )
        cont = Continuation(req)
        lifecycles: list[Lifecycle] = []
        for _ in range(self.config.max_resumes + 1):
            result = await self.client.generate(cont.next_request(), timeout=self.config.request_timeout_s)
            if result.lifecycle is not None:
                lifecycles.append(result.lifecycle)
            cont.add(result)
            if cont.done:
                break
        if not cont.done:
            raise GatewayError(
                503, "the generation was aborted (engines paused or shutting down)", type="server_error", code="aborted"
            )
        return cont.result(), lifecycles

    async def _generate_n(
        self,
        session: Session,
        prompt: list[int],
        sampling: SamplingParams,
        n: int,
        turn: int,
        images: list[bytes] | None = None,
    ) -> list[tuple[GenerateResult, list[Lifecycle]]]:
        session.in_flight += 1
        session.last_used = time.monotonic()
        try:
            if n == 1:
                return [await self._generate(session, prompt, sampling, 0, turn, images)]
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._generate(session, prompt, sampling, k, turn, images)) for k in range(n)]
            return [t.result() for t in tasks]
        except BaseExceptionGroup as eg:
            raise first_exception(eg) from None
        finally:
            session.in_flight -= 1
            session.last_used = time.monotonic()

    async def _run_choices(
        self,
        session: Session,
        prompt: list[int],
        opts: RequestOptions,
        parser: ToolCallParser | None,
        turn: int,
        images: list[bytes] | None = None,
        *,
        chat: bool,
    ) -> tuple[list[tuple[GenerateResult, list[Lifecycle]]], list[_Decoded], float]:
        """Generate the ``n`` choices of one call and decode them (off the loop when large); returns the
        results with their engine calls' lifecycles, their decodings and the seconds generation took.
        Refuses a session closed meanwhile."""
        sampling = self._fit(len(prompt), opts)
        t0 = time.perf_counter()
        results = await self._generate_n(session, prompt, sampling, opts.n, turn, images)
        elapsed = time.perf_counter() - t0
        decoded = await self._cpu(
            lambda: [self._decode(r, opts.stop, parser, opts.logprobs, chat) for r, _ in results],
            4 * sum(len(r.output_ids) for r, _ in results),
        )
        session.check_open()
        return results, decoded, elapsed

    def _decode(
        self, result: GenerateResult, stops: Sequence[str], parser: ToolCallParser | None, logprobs: bool, chat: bool
    ) -> _Decoded:
        """Runs on the tokenizer thread."""
        tok = self.tokenizer
        ids = list(result.output_ids)
        text = tok.decode(ids, skip_special_tokens=False)
        cut = len(ids)
        matched: str | None = None
        body_ids = ids[:-1] if ids and result.finish_reason == "stop" and ids[-1] in self._eos else ids
        content = tok.decode(body_ids, skip_special_tokens=False) if len(body_ids) != len(ids) else text
        if stops:
            found = [(content.find(s), s) for s in stops if s in content]
            if found:
                pos, stop = min(found)
                matched = stop
                cut = _first_covering(tok, ids, pos + len(stop))
                ids = ids[:cut]
                text = tok.decode(ids, skip_special_tokens=False)
                content = content[:pos]
        # the reasoning is split off the text the agent sees; the recorded tokens stay the model's, exact
        # (think tags inside a tool call's arguments are the call's text, never reasoning)
        reasoning, content = (
            split_reasoning(self._reasoning, parser or self._parser, content) if chat else (None, content)
        )
        parsed = parser.parse(content) if parser is not None else None
        texts = [tok.decode([t], skip_special_tokens=False) for t in ids] if logprobs else None
        return _Decoded(ids, cut, text, content, parsed, texts, reasoning, matched)

    def _outcome(
        self, session: Session, opts: RequestOptions, prompt_len: int, choices: list[Choice], rid: str
    ) -> Outcome:
        return Outcome(
            id=rid,
            created=int(time.time()),
            model=self.model,
            session=session.id,
            choices=choices,
            prompt_tokens=prompt_len,
            completion_tokens=sum(len(c.node.result.output_ids) for c in choices),
            options=opts,
        )

    # -- chat --------------------------------------------------------------------------------------

    async def chat(self, session: Session, body: dict[str, Any], *, id_prefix: str = "chatcmpl-") -> Outcome:
        """One chat call (also what the Responses and Messages adapters translate their calls into)."""
        opts = self._options(session, body, chat=True)
        tools = template_tools(body.get("tools"))
        parse = parse_tool_choice(body.get("tool_choice"), tools)
        messages = template_messages(body.get("messages"), max_messages=self.config.max_messages)
        session.check_open()
        room = self._prompt_room(opts)
        await self._cpu(lambda: self._check_messages(messages, room), _chars(messages))
        keys = prefix_keys("chat\x00" + canonical({"tools": tools}), (canonical(m) for m in messages))
        parent, covered = session.match(keys)
        template = self._template(tools)
        new = messages[covered:]

        def render() -> tuple[list[int], bool]:
            if parent is None:
                text, rewrites, base = template.render(messages, add_generation_prompt=True), False, 0
            else:
                (text, rewrites), base = template.glue(parent.messages, new, parent.text), parent.num_ids
            return self._encode_bounded(text, room - base, template.encode, "messages"), rewrites

        try:
            context, rewrites = await self._cpu(render, _chars(parent.messages if parent else []) + _chars(messages))
        except TemplateError as exc:
            raise bad_request("messages", f"the chat template cannot extend this conversation: {exc}") from None
        except Exception as exc:  # jinja's own errors (e.g. a template that forbids this role order)
            if type(exc).__module__.startswith("jinja2"):
                raise bad_request("messages", f"the chat template refused these messages: {exc}") from None
            raise
        prompt = (parent.ids() if parent is not None else []) + context
        depth = 0 if parent is None else parent.depth + 1
        parser = self._parser_for(tools) if parse else None
        results, decoded, elapsed = await self._run_choices(
            session, prompt, opts, parser, depth, message_images(messages), chat=True
        )
        rid = _response_id(id_prefix)
        choices = []
        base = len(prompt) - len(context)
        for k, ((result, lifecycles), dec) in enumerate(zip(results, decoded, strict=True)):
            kept = _cut(result, dec.cut)
            if result.input_ids is not None:  # images: record the context as the engine expanded it
                context = result.input_ids[base:]
            call_ids = session.new_call_ids(dec.parsed.calls if dec.parsed else [], parser)
            wire, tmpl, errors = assistant_reply(dec.parsed, dec.content, call_ids)
            calls = dec.parsed.calls if dec.parsed else []
            turn = _served_turn(
                kept,
                elapsed,
                tool_calls=[ToolCallRecord(name=c.name, arguments=c.arguments, ok=True) for c in calls],
                parse_errors=errors,
            )
            after = [*messages, tmpl]
            node = Node(
                uid=len(session.nodes),
                parent=parent,
                context_ids=context,
                result=kept,
                text=dec.text,
                key=extend_key(keys[-1], canonical(tmpl)),
                messages=after,
                turn=turn,
                lifecycles=lifecycles,
                response_id=rid,
            )
            session.add(node)
            session.template_rewrites = session.template_rewrites or rewrites
            if dec.reasoning is not None:
                wire["reasoning_content"] = dec.reasoning
            finish = (
                "tool_calls" if wire.get("tool_calls") else ("length" if kept.finish_reason == "length" else "stop")
            )
            lps = _token_logprobs(dec, kept)
            choices.append(
                Choice(
                    index=k,
                    node=node,
                    message=wire,
                    text=dec.content,
                    finish_reason=finish,
                    logprobs=lps,
                    reasoning=dec.reasoning,
                    matched_stop=dec.matched_stop,
                )
            )
        return self._outcome(session, opts, len(prompt), choices, rid)

    # -- text completions --------------------------------------------------------------------------

    async def complete(self, session: Session, body: dict[str, Any]) -> Outcome:
        opts = self._options(session, body, chat=False)
        prompt_in = body.get("prompt")
        if isinstance(prompt_in, list) and len(prompt_in) == 1 and isinstance(prompt_in[0], str | list):
            prompt_in = prompt_in[0]
        if prompt_in is None:
            raise bad_request("prompt", "prompt is required", "missing_required_parameter")
        session.check_open()
        room = self._prompt_room(opts)
        text_prompt = isinstance(prompt_in, str)
        if text_prompt:
            if not prompt_in:
                raise bad_request("prompt", "prompt must not be empty")
            self._check_chars(len(prompt_in), room, "prompt")
            parent = session.match_text(prompt_in)
            base = 0 if parent is None else parent.num_ids

            def encode() -> list[int]:
                tok = self.tokenizer
                if parent is None:
                    text, special = prompt_in, True
                else:
                    text, special = prompt_in[len(parent.text) :], False
                return self._encode_bounded(
                    text, room - base, lambda t: list(tok.encode(t, add_special_tokens=special)), "prompt"
                )

            context = await self._cpu(encode, len(prompt_in))
            prompt = (parent.ids() if parent is not None else []) + context
        elif (
            isinstance(prompt_in, list)
            and prompt_in
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_in)
        ):
            if len(prompt_in) > room:
                raise self._too_long("prompt", f"the prompt has {len(prompt_in)} tokens")
            prompt = list(prompt_in)
            parent = session.match_ids(prompt)
            context = prompt[parent.num_ids :] if parent is not None else prompt
        else:
            raise unsupported("prompt", "prompt must be one string or one non-empty list of token ids (no batches)")
        if not context:
            raise bad_request("prompt", "the prompt adds nothing after the text already served")
        depth = 0 if parent is None else parent.depth + 1
        results, decoded, elapsed = await self._run_choices(session, prompt, opts, None, depth, chat=False)
        prefix_text = prompt_in if isinstance(prompt_in, str) else ""
        rid = _response_id("cmpl-")
        choices = []
        for k, ((result, lifecycles), dec) in enumerate(zip(results, decoded, strict=True)):
            kept = _cut(result, dec.cut)
            turn = _served_turn(kept, elapsed)
            node = Node(
                uid=len(session.nodes),
                parent=parent,
                context_ids=context,
                result=kept,
                # only a text prompt that continues prompt + the model's whole text reuses these ids
                text=prefix_text + dec.text if text_prompt else "\x00ids",
                key=f"completion:{uuid.uuid4().hex}",
                messages=[],
                turn=turn,
                lifecycles=lifecycles,
                response_id=rid,
            )
            session.add(node)
            finish = "length" if kept.finish_reason == "length" else "stop"
            lps = _token_logprobs(dec, kept)
            choices.append(
                Choice(index=k, node=node, message=None, text=dec.content, finish_reason=finish, logprobs=lps)
            )
        return self._outcome(session, opts, len(prompt), choices, rid)


def _response_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def _kept_texts(messages: list[dict[str, Any]]) -> list[str]:
    """The messages' text that every chat template renders as given: system, user and tool content (a
    template may drop parts of assistant turns, e.g. earlier reasoning, so those do not count)."""
    out: list[str] = []
    for m in messages:
        if m["role"] == "assistant":
            continue
        content = m.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out.extend(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return out


def vocab_bounds(tokenizer: Any) -> tuple[int | None, CharCaps | None]:
    """:func:`max_token_chars` and the :class:`~.bodies.CharCaps` of ``tokenizer``'s vocabulary, from one
    read of it (at a gateway's open)."""
    vocab = _vocab(tokenizer)
    if vocab is None:
        return None, None
    return max((len(t) for t in vocab), default=0) or None, CharCaps(vocab)


_MARKS = ("m1q7zx", "m2q7zx")


def keeps_call_content(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s chat template renders an assistant message's content beside its tool calls,
    at an earlier turn and at the latest (Qwen's and Hermes' do; Llama 3.1's does not): only then is such
    content counted before a body is decoded.  Probed once at open by rendering a small conversation, as
    :class:`~rollout_sdk.agents.ChatTemplate` probes how a template writes arguments."""
    call = {"type": "function", "id": "c1", "function": {"name": "f", "arguments": {}}}
    return _renders_both(tokenizer, lambda mark: {"role": "assistant", "content": mark, "tool_calls": [call]})


def keeps_reasoning(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s chat template renders what an assistant's content holds before ``</think>``,
    at an earlier turn and at the latest (Qwen2.5's does; Qwen3's and DeepSeek-R1's drop earlier
    reasoning): only then is an assistant's text counted whole, else from its last ``think`` on."""
    return _renders_both(tokenizer, lambda mark: {"role": "assistant", "content": mark + "</think>ok"})


def _renders_both(tokenizer: Any, assistant: Callable[[str], dict[str, Any]]) -> bool:
    """Whether both marks appear when the template renders ``assistant(mark)`` as an earlier turn and as
    the latest, each followed by a tool result (a message with calls needs one) or a user message."""
    first, latest = _MARKS
    convo: list[dict[str, Any]] = [
        {"role": "user", "content": "u"},
        assistant(first),
        {"role": "tool", "tool_call_id": "c1", "content": "r"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "v"},
        assistant(latest),
        {"role": "tool", "tool_call_id": "c1", "content": "r"},
    ]
    try:
        text = ChatTemplate(tokenizer).render(convo, add_generation_prompt=True)
    except Exception:  # any template error (no template, jinja, a role order it forbids): not known to keep it
        return False
    return first in text and latest in text


def max_token_chars(tokenizer: Any) -> int | None:
    """The longest token's string in ``tokenizer``'s vocabulary (added tokens included): at least as many
    characters as that token stands for in any text (a byte-level token's string has one character per
    byte).  None when the tokenizer has no vocabulary to read."""
    vocab = _vocab(tokenizer)
    return None if vocab is None else max((len(t) for t in vocab), default=0) or None


def _vocab(tokenizer: Any) -> Any:
    """The tokenizer's token strings (a dict's keys), or None when it has no vocabulary to read."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    try:
        return get_vocab()
    except (NotImplementedError, AttributeError):
        return None


def _chars(messages: list[dict[str, Any]]) -> int:
    return sum(len(m.get("content") or "") + 64 for m in messages)


def _eos_ids(tokenizer: Any) -> set[int]:
    ids = {tokenizer.eos_token_id} if getattr(tokenizer, "eos_token_id", None) is not None else set()
    for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        tid = tokenizer.convert_tokens_to_ids(name) if hasattr(tokenizer, "convert_tokens_to_ids") else None
        if isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None) and tid >= 0:
            ids.add(tid)
    return ids


def _first_covering(tok: Any, ids: list[int], chars: int) -> int:
    """The fewest leading tokens whose text is at least ``chars`` characters (binary search)."""
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tok.decode(ids[:mid], skip_special_tokens=False)) >= chars:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _served_turn(
    kept: GenerateResult,
    elapsed: float,
    *,
    tool_calls: list[ToolCallRecord] | None = None,
    parse_errors: list[str] | None = None,
) -> Turn:
    """The record of one served turn: what the engine returned for it (after any cut) and how long it took."""
    return Turn(
        index=0,
        model_tokens=len(kept.output_ids),
        finish_reason=kept.finish_reason,
        weight_version=kept.weight_version,
        generate_s=elapsed,
        tool_calls=tool_calls or [],
        parse_errors=parse_errors or [],
    )


def _token_logprobs(dec: _Decoded, kept: GenerateResult) -> list[tuple[str, float]] | None:
    """(token text, logprob) per kept output token, when the request asked for logprobs."""
    return list(zip(dec.token_texts, kept.logprobs or [], strict=False)) if dec.token_texts is not None else None


def _cut(result: GenerateResult, k: int) -> GenerateResult:
    """The first ``k`` tokens of ``result``, as a stop there would have returned them (``result`` itself
    when it has no more than ``k``)."""
    if k >= len(result.output_ids):
        return result
    segments: list[tuple[int, int]] = []
    left = k
    for version, n in result.version_segments or [(result.weight_version, len(result.output_ids))]:
        if left <= 0:
            break
        segments.append((version, min(n, left)))
        left -= n
    return msgspec.structs.replace(
        result,
        output_ids=list(result.output_ids[:k]),
        logprobs=None if result.logprobs is None else list(result.logprobs[:k]),
        version_segments=segments,
        finish_reason="stop",
        matched_stop=None,
    )
