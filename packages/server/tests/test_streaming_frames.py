"""The SSE frames of streamed chunks, and the event loop ``engine serve`` runs on."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from engine.server.api_server import run_event_loop
from engine.server.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
)
from engine.server.streaming import ChunkFrames, sse_frame

# Quotes, a backslash, a newline, non-ASCII text and the envelope's own marker inside
# strings: nothing a model name or generated text holds may move the cut.
MODEL = 'odd "choices":[] model\\name'
TEXTS = ["plain", ' "quoted" \\ and\nnewline', "caf\u00e9 \u2603 \U0001f600", '"choices":[]', ""]


@pytest.mark.parametrize("text", TEXTS)
def test_completion_frames_equal_the_whole_chunk(text: str) -> None:
    frames = ChunkFrames(CompletionResponse(id="cmpl-1", created=7, model=MODEL, choices=[]))
    choice = CompletionChoice(index=3, text=text, finish_reason="length", token_ids=[1, 2])
    whole = CompletionResponse(id="cmpl-1", created=7, model=MODEL, choices=[choice])
    assert frames.frame(choice) == sse_frame(whole)
    payload = json.loads(frames.frame(choice).removeprefix("data: "))
    assert payload["choices"][0]["text"] == text and payload["model"] == MODEL


@pytest.mark.parametrize("text", TEXTS)
def test_chat_frames_equal_the_whole_chunk(text: str) -> None:
    frames = ChunkFrames(ChatCompletionChunk(id="chatcmpl-1", created=7, model=MODEL,
                                             choices=[]))
    choice = ChatChunkChoice(index=0, delta=DeltaMessage(content=text))
    whole = ChatCompletionChunk(id="chatcmpl-1", created=7, model=MODEL, choices=[choice])
    assert frames.frame(choice) == sse_frame(whole)


def test_an_envelope_with_choices_is_refused() -> None:
    choice = CompletionChoice(index=0, text="x")
    with pytest.raises(ValueError, match="exactly one empty choices list"):
        ChunkFrames(CompletionResponse(id="c", created=1, model="m", choices=[choice]))


async def _loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop does not support Windows")
def test_serve_runs_on_uvloop() -> None:
    assert run_event_loop(_loop_module()).startswith("uvloop")


def test_serve_runs_on_asyncio_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    assert run_event_loop(_loop_module()).startswith("asyncio")
