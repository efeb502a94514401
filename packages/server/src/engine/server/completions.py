"""``POST /v1/completions``: text (or token-id) prompts in, completions out.

A request with several prompts runs them concurrently; its choices are numbered
``prompt_index * n + choice_index``, as OpenAI numbers them. ``echo`` prepends the prompt
(and, with ``logprobs``, the prompt tokens' logprobs, the first being null).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from engine.core.client.request_stream import RequestStream
from engine.core.frontend.input_processor import PromptType
from engine.core.outputs import CompletionOutput, LogprobsStep, RequestOutput
from engine.core.tokenizer import Tokenizer
from engine.sdk.errors import ValidationError
from engine.server.logprobs import append_completion_logprobs
from engine.server.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from engine.server.request_log import log_request
from engine.server.sampling import completion_params
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

router = APIRouter()


def prompts_of(prompt: str | list[str] | list[int] | list[list[int]]) -> list[PromptType]:
    """The request's prompts, each a text or a list of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ValidationError("prompt must not be empty", param="prompt")
    if all(isinstance(item, int) for item in prompt):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


def usage_of(outputs: Sequence[RequestOutput]) -> UsageInfo:
    """Prompt tokens once per prompt, completion tokens over every choice."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion)


@dataclass
class _Echo:
    """Builds a choice's text and logprobs, with the prompt first when ``echo`` is set."""

    tokenizer: Tokenizer
    echo: bool
    num_logprobs: int | None
    text_offsets: dict[tuple[int, int], int] = field(default_factory=dict)

    def prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.tokenizer.decode(output.prompt_token_ids, skip_special_tokens=False)

    def start(self, key: tuple[int, int], output: RequestOutput
              ) -> tuple[str, CompletionLogProbs | None]:
        """The echoed prefix of a choice (empty without ``echo``) and its logprobs."""
        logprobs = None if self.num_logprobs is None else CompletionLogProbs()
        prefix = self.prompt_text(output) if self.echo else ""
        if self.echo and logprobs is not None:
            steps = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
            texts = [self.tokenizer.decode([t], skip_special_tokens=False)
                     for t in output.prompt_token_ids]
            append_completion_logprobs(logprobs, steps, self.num_logprobs or 0, texts)
        self.text_offsets[key] = len(prefix)
        return prefix, logprobs

    def add(self, key: tuple[int, int], logprobs: CompletionLogProbs | None,
            steps: Sequence[LogprobsStep] | None) -> CompletionLogProbs | None:
        """Append generated tokens' logprobs, continuing the choice's text offsets."""
        if self.num_logprobs is None:
            return None
        logprobs = logprobs or CompletionLogProbs()
        self.text_offsets[key] = append_completion_logprobs(
            logprobs, steps or [], self.num_logprobs, text_offset=self.text_offsets.get(key, 0))
        return logprobs


def _choice(index: int, text: str, logprobs: CompletionLogProbs | None,
            completion: CompletionOutput, prompt_token_ids: list[int] | None,
            ) -> CompletionChoice:
    return CompletionChoice(index=index, text=text, logprobs=logprobs,
                            finish_reason=completion.finish_reason,
                            stop_reason=completion.stop_reason,
                            prompt_token_ids=prompt_token_ids,
                            token_ids=None if prompt_token_ids is None else completion.token_ids)


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    """OpenAI's completions API (see the module docstring)."""
    state = server_state(request)
    model = state.check_model(body.model)
    setup = state.engine.setup
    params = with_structured_outputs(completion_params(body, setup.generation_defaults), body,
                                     setup.config.structured_outputs_backend)
    response_id, created = random_id("cmpl"), int(time.time())
    log_request(state.args, response_id, body.prompt, params)
    streams = await start_requests(state.engine, response_id, prompts_of(body.prompt),
                                   params, priority=body.priority)
    echo = _Echo(state.engine.tokenizer, body.echo, body.logprobs)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return SSEResponse(_stream(streams, echo, response_id, created, model, params.n,
                                   include_usage, body.return_token_ids),
                           on_close=lambda: close_all(streams))
    try:
        outputs = await cancel_on_disconnect(request, collect_final(streams))
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        close_all(streams)
    choices = []
    for prompt_index, output in enumerate(outputs):
        for completion in output.outputs:
            key = (prompt_index, completion.index)
            prefix, logprobs = echo.start(key, output)
            logprobs = echo.add(key, logprobs, completion.logprobs)
            choices.append(_choice(
                prompt_index * params.n + completion.index, prefix + completion.text, logprobs,
                completion, output.prompt_token_ids if body.return_token_ids else None))
    response = CompletionResponse(id=response_id, created=created, model=model,
                                  choices=choices, usage=usage_of(outputs))
    return JSONResponse(response.model_dump())


async def _stream(streams: list[RequestStream], echo: _Echo, response_id: str, created: int,
                  model: str, n: int, include_usage: bool, return_token_ids: bool,
                  ) -> AsyncIterator[str]:
    cursors: dict[tuple[int, int], ChoiceCursor] = {}
    finals: dict[int, RequestOutput] = {}
    frames = ChunkFrames(CompletionResponse(id=response_id, created=created, model=model,
                                            choices=[]))
    try:
        async for prompt_index, output in merge_streams(streams):
            finals[prompt_index] = output
            for completion in output.outputs:
                key = (prompt_index, completion.index)
                started = key in cursors
                if not started and not completion.token_ids and not completion.finished:
                    continue  # prefill only (e.g. prompt logprobs so far): wait for a token
                cursor = cursors.setdefault(key, ChoiceCursor())
                prefix, logprobs = echo.start(key, output) if not started else ("", None)
                delta = cursor.advance(completion)
                if delta is None and not prefix:
                    continue
                text = prefix + (delta.text if delta else "")
                logprobs = echo.add(key, logprobs, delta.logprobs if delta else None)
                choice = CompletionChoice(
                    index=prompt_index * n + completion.index, text=text, logprobs=logprobs,
                    finish_reason=delta.finish_reason if delta else None,
                    stop_reason=delta.stop_reason if delta and delta.finish_reason else None,
                    prompt_token_ids=(output.prompt_token_ids
                                      if return_token_ids and not started else None),
                    token_ids=(delta.token_ids if delta else []) if return_token_ids else None)
                yield frames.frame(choice)
        if include_usage:
            yield sse_frame(CompletionResponse(
                id=response_id, created=created, model=model, choices=[],
                usage=usage_of([finals[i] for i in sorted(finals)])))
    except Exception as exc:  # noqa: BLE001 - reported to the client as an error frame
        yield error_frame(exc)
    yield DONE_FRAME
