"""``POST /v1/chat/completions``: a conversation in, the assistant's reply out.

The conversation is rendered with the tokenizer's chat template (or ``--chat-template``).
Content may be a string or a list of ``{"type": "text", "text": ...}`` parts; other part
types (images, audio) are refused: the engine serves text-only models. The ``developer``
role is passed to the template as ``system``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from engine.core.client.request_stream import RequestStream
from engine.core.frontend.input_processor import InputProcessor, PromptType
from engine.core.outputs import RequestOutput
from engine.core.tokenizer import Tokenizer
from engine.sdk.errors import ValidationError
from engine.sdk.sampling_params import SamplingParams
from engine.sdk.tool_parser import StreamDelta
from engine.server.logprobs import chat_logprobs
from engine.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCallItem,
    UsageInfo,
)
from engine.server.request_log import log_request
from engine.server.sampling import chat_params, chat_renames
from engine.server.state import random_id, server_state
from engine.server.streaming import (
    DONE_FRAME,
    ChoiceCursor,
    ChunkFrames,
    ClientDisconnected,
    SSEResponse,
    cancel_on_disconnect,
    close_all,
    collect_final,
    error_frame,
    merge_streams,
    sse_frame,
    start_requests,
)
from engine.server.structured_outputs import with_structured_outputs
from engine.server.tool_messages import tool_fields
from engine.server.tool_stream import ChoiceTools
from engine.server.tools import ToolPlan, new_call_id, plan_tools

router = APIRouter()

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
          "tool": "tool"}


def _unsupported(param: str, what: str) -> ValidationError:
    return ValidationError(f"{param}: {what}", param=param)


def conversation_of(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Plain ``{"role", "content"[, "name"]}`` dicts for the chat template.

    Raises:
        ValidationError: an unsupported role, content part or message field, naming it.
    """
    if not messages:
        raise ValidationError("messages must hold at least one message", param="messages")
    conversation = []
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if message.role not in _ROLES:
            raise _unsupported(f"{where}.role", f"role {message.role!r} is not supported; use "
                               f"one of {', '.join(_ROLES)}")
        if message.function_call is not None:
            raise _unsupported(f"{where}.function_call", "the deprecated function_call is not "
                               "supported; send tool_calls")
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _unsupported(f"{where}.content.{j}", f"content part type "
                                       f"{part.get('type')!r} is not supported; only "
                                       f"{{\"type\": \"text\", \"text\": ...}} parts (this "
                                       f"engine serves text-only models)")
                texts.append(part["text"])
            content = "\n".join(texts)
        entry: dict[str, Any] = {"role": _ROLES[message.role], "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        entry.update(tool_fields(message, where))
        conversation.append(entry)
    return conversation


def render_chat(tokenizer: Tokenizer, messages: Sequence[ChatMessage], *,
                add_generation_prompt: bool, template_kwargs: Mapping[str, Any] | None,
                tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The conversation rendered with the chat template (with ``tools``, if given)."""
    return tokenizer.apply_chat_template(conversation_of(messages), add_generation_prompt,
                                         tools=tools, **dict(template_kwargs or {}))


def chat_prompt(processor: InputProcessor, messages: Sequence[ChatMessage], *,
                add_generation_prompt: bool,
                template_kwargs: Mapping[str, Any] | None,
                tools: Sequence[Mapping[str, Any]] | None = None) -> PromptType:
    """The rendered conversation as a prompt (text and its token ids).

    Raises:
        ValidationError: the template refused the conversation, or the rendered text cannot
            fit the context (refused before it is tokenized; ``param`` ``messages``).
    """
    text = render_chat(processor.tokenizer, messages,
                       add_generation_prompt=add_generation_prompt,
                       template_kwargs=template_kwargs, tools=tools)
    ids = processor.encode_text(text, add_special_tokens=False, param="messages")
    return {"prompt": text, "prompt_token_ids": list(ids)}


def _usage(output: RequestOutput) -> UsageInfo:
    prompt = len(output.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in output.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion)


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    """OpenAI's chat completions API (see the module docstring)."""
    state = server_state(request)
    model = state.check_model(body.model)
    engine = state.engine
    plan = plan_tools(body, auto_enabled=state.tool_parser is not None)
    params = chat_sampling(body, plan, engine.setup)
    # Rendering and tokenizing a long conversation takes a while: off the event loop.
    prompt = await engine.tokenizer_pool.run(
        chat_prompt, engine.input_processor, body.messages,
        add_generation_prompt=body.add_generation_prompt,
        template_kwargs=body.chat_template_kwargs, tools=plan.tools)
    response_id, created = random_id("chatcmpl"), int(time.time())
    log_request(state.args, response_id, prompt, params)
    streams = await start_requests(engine, response_id, [prompt], params,
                                   priority=body.priority, rename=chat_renames(body))
    num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        tools = [ChoiceTools(plan, state.tool_parser) for _ in range(params.n)
                 ] if plan.parses else None
        return SSEResponse(_stream(streams[0], response_id, created, model, params.n,
                                   num_logprobs, include_usage, body.return_token_ids, tools),
                           on_close=lambda: close_all(streams))
    try:
        (output,) = await cancel_on_disconnect(request, collect_final(streams))
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        close_all(streams)
    choices = []
    for c in output.outputs:
        message, finish_reason = ChatResponseMessage(content=c.text), c.finish_reason
        if plan.parses:
            reader = ChoiceTools(plan, state.tool_parser)
            found = reader.final(c.text)
            message = ChatResponseMessage(content=found.content, tool_calls=[
                ToolCallItem(id=call.id or new_call_id(),
                             function=FunctionCall(name=call.name, arguments=call.arguments))
                for call in found.tool_calls])
            finish_reason = tool_finish_reason(plan, reader, finish_reason)
        choices.append(ChatChoice(
            index=c.index, message=message,
            logprobs=None if num_logprobs is None else chat_logprobs(c.logprobs or [],
                                                                     num_logprobs),
            finish_reason=finish_reason, stop_reason=c.stop_reason,
            token_ids=c.token_ids if body.return_token_ids else None))
    response = ChatCompletionResponse(
        id=response_id, created=created, model=model, choices=choices, usage=_usage(output),
        prompt_token_ids=output.prompt_token_ids if body.return_token_ids else None)
    return JSONResponse(response.model_dump())


def chat_sampling(body: ChatCompletionRequest, plan: ToolPlan, setup: Any) -> SamplingParams:
    """The request's sampling params, with its output constraint (format or tool choice).

    Raises:
        ValidationError: a bad value, or both a response format and a tool choice that
            constrains the output.
    """
    params = with_structured_outputs(chat_params(body, setup.generation_defaults), body,
                                     setup.config.structured_outputs_backend)
    if plan.constraint is None:
        return params
    if params.structured_outputs is not None:
        raise ValidationError(f"tool_choice {plan.choice!r} constrains the output to a tool "
                              f"call; it cannot be combined with response_format, "
                              f"structured_outputs or guided_*", param="tool_choice")
    return params.replace(structured_outputs=plan.constraint)


def tool_finish_reason(plan: ToolPlan, reader: ChoiceTools, reason: str | None) -> str | None:
    """``"tool_calls"`` for a choice that ended by calling tools (auto or required)."""
    if reason == "stop" and reader.called and plan.choice in ("auto", "required"):
        return "tool_calls"
    return reason


def _delta_message(delta: StreamDelta) -> DeltaMessage:
    calls = [DeltaToolCall(
        index=call.index, id=call.id, type="function" if call.id else None,
        function=DeltaFunctionCall(name=call.name, arguments=call.arguments))
        for call in delta.tool_calls]
    return DeltaMessage(content=delta.content, tool_calls=calls or None)


async def _stream(stream: RequestStream, response_id: str, created: int, model: str, n: int,
                  num_logprobs: int | None, include_usage: bool, return_token_ids: bool,
                  tools: list[ChoiceTools] | None = None) -> AsyncIterator[str]:
    chunk = ChunkFrames(ChatCompletionChunk(id=response_id, created=created, model=model,
                                            choices=[])).frame

    try:
        for index in range(n):
            yield chunk(ChatChunkChoice(index=index,
                                        delta=DeltaMessage(role="assistant", content="")))
        cursors = [ChoiceCursor() for _ in range(n)]
        final = stream.output
        async for _, output in merge_streams([stream]):
            final = output
            for completion in output.outputs:
                delta = cursors[completion.index].advance(completion)
                if delta is None:
                    continue
                logprobs = None if num_logprobs is None else chat_logprobs(
                    delta.logprobs or [], num_logprobs)
                message = DeltaMessage(content=delta.text) if delta.text else DeltaMessage()
                finish_reason = delta.finish_reason
                if tools is not None:
                    reader = tools[delta.index]
                    piece = reader.advance(delta.text, finished=finish_reason is not None)
                    if finish_reason is not None:
                        finish_reason = tool_finish_reason(reader.plan, reader, finish_reason)
                    message = _delta_message(piece) if piece is not None else DeltaMessage()
                    if piece is None and finish_reason is None and not logprobs:
                        continue
                yield chunk(ChatChunkChoice(
                    index=delta.index, delta=message,
                    logprobs=logprobs, finish_reason=finish_reason,
                    stop_reason=delta.stop_reason if delta.finish_reason else None,
                    token_ids=delta.token_ids if return_token_ids else None))
        if include_usage:
            yield sse_frame(ChatCompletionChunk(id=response_id, created=created, model=model,
                                                choices=[], usage=_usage(final)))
    except Exception as exc:  # noqa: BLE001 - reported to the client as an error frame
        yield error_frame(exc)
    yield DONE_FRAME
