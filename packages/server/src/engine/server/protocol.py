r"""Request bodies of the OpenAI-compatible API (pydantic), with vLLM's extra fields.

Every model forbids unknown fields (a typo is a 400 naming the field, never silently
ignored) and is strict about types (``"0.5"`` is not a temperature). OpenAI fields the
engine cannot honour are declared so that they get a precise message: they are accepted
only at their neutral value (see ``UNSUPPORTED`` in :mod:`engine.server.sampling`).

Ranges (``temperature >= 0``, ``top_p`` in (0, 1], ...) are checked by
``engine.sdk.SamplingParams``, so the HTTP API and ``LLM`` accept exactly the same values;
what the wire to EngineCore can carry (``seed`` in int64, ``top_k`` in int32, ...) by
:mod:`engine.core.frontend.wire_limits`. Here, for every body: numbers are finite (JSON's
``NaN``/``Infinity`` and ``1e999`` are refused), every string is valid Unicode (no lone
UTF-16 surrogate such as ``"\ud800"``: the tokenizer and the wire cannot carry it), and
``chat_template_kwargs`` may not set the chat template call's own arguments.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
)
from pydantic_core import PydanticCustomError

from engine.core.frontend.wire_limits import describe_surrogate, lone_surrogate_at

#: Most completions per prompt a request may ask for.
MAX_N = 128
#: Most top logprobs per token (completions ``logprobs``, chat ``top_logprobs``).
MAX_LOGPROBS = 20

#: A completions prompt: text, texts, token ids, or lists of token ids.
Prompt = Union[str, list[str], list[int], list[list[int]]]


#: Types of JSON values that hold no text: a list of only these is skipped in one C call.
_SCALARS = frozenset({int, float, bool, type(None)})


def surrogate_in(value: Any) -> str | None:
    """Why ``value`` (a field's value, walked through lists and dicts) is not valid Unicode.

    None when every string in it, dict keys included, is valid. Iterative (nesting as deep
    as the JSON parser allows cannot overflow the stack), breadth first (the first bad
    string is reported), and a list of numbers (token ids) costs one pass in C.
    """
    queue: deque[tuple[tuple[Any, ...], Any]] = deque([((), value)])
    while queue:
        path, item = queue.popleft()
        if isinstance(item, str):
            index = lone_surrogate_at(item)
            if index is not None:
                where = f"the text at {_dotted(path)}" if path else "the text"
                return f"{where} {describe_surrogate(item, index)}"
        elif isinstance(item, Mapping):
            for key, child in item.items():
                if isinstance(key, str) and (index := lone_surrogate_at(key)) is not None:
                    where = f"a key of {_dotted(path)}" if path else "a key"
                    return f"{where} {describe_surrogate(key, index)}"
                if type(child) not in _SCALARS:
                    queue.append(((*path, key), child))
        elif isinstance(item, (list, tuple)) and not set(map(type, item)) <= _SCALARS:
            queue.extend(((*path, i), child) for i, child in enumerate(item)
                         if type(child) not in _SCALARS)
    return None


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in path)


class OpenAIModel(BaseModel):
    """Base of request bodies: unknown fields forbidden, strict types, valid values.

    Numbers must be finite and every string valid Unicode (see the module docstring).
    """

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        if isinstance(value, BaseModel):
            return value  # a nested body checks its own fields
        problem = surrogate_in(value)
        if problem is not None:
            raise PydanticCustomError("invalid_unicode", problem)
        return value


#: What ``Tokenizer.apply_chat_template`` (engine-core), transformers'
#: ``apply_chat_template`` and its ``render_jinja_template`` take as their own arguments or
#: pass to the template themselves: a ``chat_template_kwargs`` key may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "self", "messages", "conversation", "conversations", "add_generation_prompt", "tools",
    "documents", "chat_template", "continue_final_message", "tokenize",
    "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def _check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    clash = sorted(set(kwargs or ()) & RESERVED_TEMPLATE_KWARGS)
    if clash:
        names = ", ".join(repr(name) for name in clash)
        raise PydanticCustomError(
            "reserved_template_kwargs",
            f"{names} cannot be set here: the server passes "
            f"{'it' if len(clash) == 1 else 'them'} to the chat template call itself "
            f"(messages and add_generation_prompt are fields of the request). Keys are "
            f"template variables (e.g. enable_thinking), any but: "
            f"{', '.join(sorted(RESERVED_TEMPLATE_KWARGS))}")
    return kwargs


#: ``chat_template_kwargs``: extra template variables, none of them reserved.
TemplateKwargs = Annotated[dict[str, Any] | None, AfterValidator(_check_template_kwargs)]


class StreamOptions(OpenAIModel):
    """``stream_options``: with ``include_usage`` a last chunk carries the usage."""

    include_usage: bool = False


class SamplingRequest(OpenAIModel):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(None, description="a served model name; default: the first")
    n: int = Field(1, description="completions to generate")
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="accepted and ignored (no per-user state)")
    # vLLM's extra sampling fields.
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    extra_args: dict[str, Any] | None = Field(None, description="parameters for plugins")
    vllm_xargs: dict[str, Any] | None = Field(None, description="alias of extra_args")
    priority: int = 0
    return_token_ids: bool = Field(False, description="add token ids to the choices")
    # Structured outputs (engine.server.structured_outputs): one of these at most.
    response_format: Any = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    # OpenAI fields this engine cannot honour (400 unless neutral).
    service_tier: Any = None
    store: Any = None
    metadata: Any = None


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``."""

    prompt: Prompt
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: Any = None
    suffix: Any = None


class ChatMessage(OpenAIModel):
    """One message of a conversation; ``content`` is text or a list of text parts."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: Any = None
    tool_call_id: Any = None
    function_call: Any = None
    refusal: Any = None


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: TemplateKwargs = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None


class TokenizeCompletionRequest(OpenAIModel):
    """``POST /tokenize`` with text."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIModel):
    """``POST /tokenize`` with a conversation (rendered with the chat template)."""

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: TemplateKwargs = None


def _tokenize_kind(body: Any) -> str:
    """Which ``/tokenize`` body this is: one with ``messages`` is a conversation."""
    has_messages = (isinstance(body, Mapping) and "messages" in body) or isinstance(
        body, TokenizeChatRequest)
    return "TokenizeChatRequest" if has_messages else "TokenizeCompletionRequest"


#: ``POST /tokenize``: a text, or a conversation when the body has ``messages`` (errors
#: then name that form's fields only, not both forms').
TokenizeRequest = Annotated[
    Union[Annotated[TokenizeCompletionRequest, Tag("TokenizeCompletionRequest")],
          Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")]],
    Discriminator(_tokenize_kind),
]


class DetokenizeRequest(OpenAIModel):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


# -- responses ------------------------------------------------------------------------------


class UsageInfo(BaseModel):
    """Token counts of a response."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(BaseModel):
    """The completions API's logprobs: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One choice of a completion (or of a streamed chunk)."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    """A completion, or one chunk of a streamed one (same object type, as OpenAI's)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogProb(BaseModel):
    """One alternative token in the chat API's logprobs."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProb(TopLogProb):
    """The sampled token and the top alternatives at one position."""

    top_logprobs: list[TopLogProb] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    """The chat API's logprobs."""

    content: list[ChatLogProb] | None = None


class FunctionCall(BaseModel):
    """The function a tool call invokes; ``arguments`` is JSON text."""

    name: str
    arguments: str


class ToolCallItem(BaseModel):
    """One tool call of the assistant's reply."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    """The assistant's reply (``tool_calls``: ``[]`` when it calls none, as vLLM answers)."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallItem] = Field(default_factory=list)


class DeltaFunctionCall(BaseModel):
    """A streamed piece of a call: the name once, then fragments of the arguments."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed piece of tool call ``index`` (``id`` and ``type`` on its first piece)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    """A streamed piece of the reply."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatChunkChoice(BaseModel):
    """One choice of a streamed chat chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    """A chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    """One chunk of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
