"""Request fields, typed: what each field of a request may be, said once as msgspec structs.

msgspec's typed conversion does the field-by-field work (types, ranges, lengths, unknown fields) that
was hand-written before; :func:`convert` is the one place its :class:`msgspec.ValidationError` becomes
the gateway's 400, naming the field as the rest of the gateway does (``$.stop[0]`` -> ``stop[0]``)::

    Object contains unknown field `x`        -> unsupported_parameter     param: the field
    Object missing required field `x`        -> missing_required_parameter
    Expected `int | null`, got `str`         -> invalid_type
    Expected `int` >= 1, of length <= 16 ... -> invalid_value

What a type cannot say (a value the engines cannot honour, ``n`` against the gateway's own ``max_n``,
OpenAI's temperature range, worded as OpenAI words it) stays in the modules that use these types.  The
structs convert the JSON *already decoded* (strict: no string-to-number coercion, a bool is not an
int); bodies are weighed before that (:mod:`.bodies`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from ..protocol import MAX_STOP_TOKEN_IDS
from .errors import GatewayError, bad_request, unsupported

__all__ = [
    "AckRequest",
    "ChatRequest",
    "CompletionRequest",
    "FinishRequest",
    "RewardRequest",
    "SessionRequest",
    "SessionSamplingFields",
    "TurnReward",
    "convert",
]

T = TypeVar("T")

MAX_STOP = 16
MAX_STOP_CHARS = 512

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Stop = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_CHARS)]
Stops = Annotated[list[Stop], msgspec.Meta(max_length=MAX_STOP)]


class _Sampling(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The fields every completion API shares: sampling, and fields that change nothing the model sees."""

    model: Any = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: PositiveInt | None = None
    stop: Stop | Stops | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    user: Any = None
    metadata: Any = None
    store: Any = None
    logit_bias: Any = None
    service_tier: Any = None
    # SGLang / vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: Annotated[list[int], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None


class ChatRequest(_Sampling, kw_only=True):
    """``POST /v1/chat/completions`` (also what Responses and Messages calls are translated into)."""

    messages: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: Any = None
    modalities: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    safety_identifier: Any = None
    # hints to OpenAI's own models: the chat template is rendered without them (docs/gateway.md)
    reasoning_effort: Any = None
    verbosity: Any = None
    prediction: Any = None


class CompletionRequest(_Sampling, kw_only=True):
    """``POST /v1/completions``."""

    prompt: Any = None
    logprobs: int | None = None
    echo: bool | None = None
    suffix: Any = None
    best_of: Any = None


class SessionSamplingFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """What a trainer may fix per session (``POST /v1/sessions {"sampling": {...}}``)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    max_tokens: int | None = None


class SessionRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/sessions``; other fields are ignored."""

    id: str | None = None
    metadata: dict[str, Any] | None = None
    sampling: Any = None


class TurnReward(msgspec.Struct, kw_only=True):
    reward: float
    turn: int | None = None
    response_id: str | None = None


class RewardRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/sessions/{id}/reward``; ``turn_rewards`` is bounded by the caller before it is converted."""

    reward: float | None = None
    finish: bool = True
    turn_rewards: list[Any] | None = None


class FinishRequest(msgspec.Struct, kw_only=True):
    reward: float | None = None


class AckRequest(msgspec.Struct, kw_only=True):
    ids: list[str]


# -- text parts (OpenAI chat and Responses) -------------------------------------------------------------


class InputText(msgspec.Struct, tag_field="type", tag="input_text"):
    text: str


class OutputText(msgspec.Struct, tag_field="type", tag="output_text"):
    text: str


class PlainText(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class Refusal(msgspec.Struct, tag_field="type", tag="refusal"):
    refusal: str


TextPart = InputText | OutputText | PlainText | Refusal


# -- OpenAI chat (``POST /v1/chat/completions``): messages and tools ------------------------------------

MAX_TOOLS = 256


class ToolSpec(msgspec.Struct):
    name: Annotated[str, msgspec.Meta(min_length=1)]
    description: Any = None
    parameters: dict[str, Any] | None = None


class ChatTool(msgspec.Struct):
    type: Literal["function"]
    function: ToolSpec


ChatTools = Annotated[list[ChatTool], msgspec.Meta(max_length=MAX_TOOLS)]


class ToolCallFunction(msgspec.Struct):
    name: str
    #: a JSON object, or a string holding one (OpenAI's format); decoded by the caller
    arguments: Any = msgspec.field(default_factory=dict)


class ToolCall(msgspec.Struct):
    function: ToolCallFunction
    id: Any = None


class ImageUrlPart(msgspec.Struct, tag_field="type", tag="image_url"):
    #: ``{"url": "data:image/...;base64,..."}`` or the URL itself; checked by the caller (nothing fetched)
    image_url: Any = None


class ChatMessage(msgspec.Struct):
    """One chat message; fields a template does not render (``refusal``, ``audio`` ...) are ignored."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[PlainText | InputText | OutputText | ImageUrlPart] | None = None
    #: only an assistant message's are read (converted as ``list[ToolCall]`` then)
    tool_calls: Any = None
    tool_call_id: Any = None
    name: Any = None


# -- Anthropic Messages (``POST /v1/messages``) ----------------------------------------------------------


class TextBlock(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any] | None = None


class ToolResultBlock(msgspec.Struct, tag_field="type", tag="tool_result"):
    tool_use_id: str
    content: str | list[TextBlock] | None = None


class ThinkingBlock(msgspec.Struct, tag_field="type", tag="thinking"):
    pass


class RedactedThinkingBlock(msgspec.Struct, tag_field="type", tag="redacted_thinking"):
    pass


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock


class AnthropicMessage(msgspec.Struct):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(msgspec.Struct):
    """A client tool (``type`` absent or ``custom``); server tools (``bash_...``, ``web_search_...``) run
    on Anthropic's side and cannot run here."""

    name: Any = None
    description: Any = None
    input_schema: Any = None
    type: Literal["custom"] | None = None


class MessagesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /v1/messages``: the mapped fields typed here or by the chat call they become."""

    model: Any = None
    messages: Annotated[list[AnthropicMessage], msgspec.Meta(min_length=1)] | None = None
    system: str | list[TextBlock] | None = None
    max_tokens: Any = None
    tools: list[AnthropicTool] | None = None
    tool_choice: Any = None
    temperature: Any = None
    top_p: Any = None
    top_k: Any = None
    stop_sequences: Any = None
    stream: Any = None
    # accepted, change nothing the model sees
    metadata: Any = None
    thinking: Any = None
    service_tier: Any = None
    cache_control: Any = None
    output_config: dict[str, Any] | None = None
    container: Any = None
    diagnostics: Any = None
    inference_geo: Any = None
    speed: Any = None
    user_profile_id: Any = None
    workspace_id: Any = None


# -- OpenAI Responses (``POST /v1/responses``) ----------------------------------------------------------


class MessageItem(msgspec.Struct, tag_field="type", tag="message"):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart] | None = None


class FunctionCallItem(msgspec.Struct, tag_field="type", tag="function_call"):
    name: str
    call_id: str
    arguments: Any = None


class FunctionCallOutputItem(msgspec.Struct, tag_field="type", tag="function_call_output"):
    call_id: str
    output: str | list[TextPart] | None = None


class ReasoningItem(msgspec.Struct, tag_field="type", tag="reasoning"):
    pass


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /v1/responses``: the mapped fields typed here or by the chat call they become; ``input``
    items are converted on their own (an item with a ``role`` and no ``type`` is a message)."""

    model: Any = None
    input: str | list[Any] | None = None
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    temperature: Any = None
    top_p: Any = None
    max_output_tokens: Any = None
    stream: Any = None
    previous_response_id: str | None = None
    include: list[Any] | None = None
    metadata: dict[str, Any] | None = None
    # SGLang / vLLM-style extensions, as in chat
    seed: Any = None
    stop: Any = None
    top_k: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    frequency_penalty: Any = None
    presence_penalty: Any = None
    min_tokens: Any = None
    # change nothing the model sees: accepted (those the chat call checks are passed on to it)
    store: Any = None
    user: Any = None
    parallel_tool_calls: Any = None
    truncation: Any = None
    text: Any = None
    reasoning: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    safety_identifier: Any = None
    service_tier: Any = None
    stream_options: Any = None
    top_logprobs: Any = None
    background: Any = None
    background_options: Any = None
    context_management: Any = None
    #: a limit on built-in (hosted) tool calls: this gateway has none, so it is always kept
    max_tool_calls: Any = None


def convert(value: Any, kind: type[T], *, where: str = "") -> T:
    """``value`` (decoded JSON) as ``kind``, or a 400 naming the field (``where``: the field ``value`` is,
    prefixed to every name)."""
    try:
        return msgspec.convert(value, kind, strict=True)
    except msgspec.ValidationError as exc:
        raise field_error(str(exc), where) from None


_MESSAGE = re.compile(r"^(?P<what>.*?)(?: - at (?:`key` in )?`\$(?P<path>[^`]*)`)?$", re.DOTALL)
_PART_TYPE = re.compile(r"(?:content|system|output)\[\d+\]\.type$")
_NAMED = re.compile(r"^Object (?P<kind>contains unknown|missing required) field `(?P<name>[^`]*)`$")


def field_error(message: str, where: str = "") -> GatewayError:
    """The 400 for one of msgspec's validation messages (see the module's docstring).  A ``type`` that
    is not one of a union's (``Invalid value``) or a ``Literal``'s is an unsupported kind of thing; an
    error about a content part's or block's ``type`` names the part (``messages[0].content[1]``)."""
    match = _MESSAGE.match(message)
    what, path = (match["what"], match["path"] or "") if match else (message, "")
    param = _join(where, path.removeprefix("."))
    named = _NAMED.match(what)
    if named is not None:
        param = _join(param, named["name"])
        if named["kind"] == "contains unknown":
            return unsupported(param, f"unsupported field {named['name']!r}: this gateway does not implement it")
        if not _PART_TYPE.search(param):
            return bad_request(param, f"{param} is required", "missing_required_parameter")
    part = _PART_TYPE.search(param)
    if part is not None:
        param = param.removesuffix(".type")
    if what.startswith("Invalid value") or (what.startswith("Invalid enum value") and param.endswith(".type")):
        return unsupported(param, f"{param}: {what.replace('Invalid value', 'unsupported type')}")
    if part is not None:
        return unsupported(param, f"{param}: {what}")
    code = "invalid_type" if ", got `" in what else "invalid_value"
    return bad_request(param or None, f"{param or 'the value'}: {what}", code)


def _join(head: str, tail: str) -> str:
    if not head or not tail or tail.startswith("["):
        return head + tail
    return f"{head}.{tail}"
