"""``--max-request-bytes`` and work off the event loop, against a real ``engine serve``.

A body over the limit is a 413 naming the limit, whether it declares its length or streams
in chunks, and the connection keeps working; an unauthenticated one is a 401 before its
body is read. While a large (under the limit) text is tokenized, ``/health`` answers within
1 s. A large prompt or conversation that cannot fit the context is refused before it is
tokenized (``InputProcessor.encode_text``; the spy below shows the tokenizer is not called).
The server runs with a small limit so the large bodies stay fast.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.core.frontend.input_processor import InputProcessor
from engine.core.frontend.tokenizer_pool import TokenizerPool
from engine.core.messages import EngineDeadError
from engine.core.model_loader import resolve_model
from engine.core.tokenizer import load_tokenizer
from engine.sdk.errors import ValidationError
from engine.server.chat import chat_prompt
from engine.server.cli._main import build_parser
from engine.server.limits import DEFAULT_MAX_REQUEST_BYTES
from engine.server.protocol import ChatMessage
from engine.testing.server import RemoteServer, running_server

LIMIT = 800_000
KEY = "limits-key"
#: Under the limit; a second or more to tokenize with the test checkpoint's byte-level BPE.
LARGE_TEXT = "All work and no play. " * (700_000 // 22)


@pytest.fixture(scope="module")
def server(tiny_llama_checkpoint: Path) -> Iterator[RemoteServer]:
    env = dict(os.environ, ENGINE_PLUGINS="none")
    # --in-process starts faster, and shares the GIL with EngineCore's thread: the harder
    # case for /health staying responsive.
    args = ["--in-process", "--max-request-bytes", str(LIMIT), "--public-path", "/metrics"]
    with running_server(tiny_llama_checkpoint, args, served_model_name="tiny", api_key=KEY,
                        env=env) as remote:
        yield remote


def _too_large(response: httpx.Response) -> str:
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["code"] == "request_too_large"
    assert f"at most {LIMIT} bytes" in error["message"]
    assert "--max-request-bytes" in error["message"]
    message: str = error["message"]
    return message


@pytest.mark.parametrize("route", ["v1/completions", "v1/chat/completions", "tokenize",
                                   "detokenize", "no/such/route"])
def test_declared_body_over_the_limit_is_413_and_the_connection_keeps_working(
        server: RemoteServer, route: str) -> None:
    body = {"model": "tiny", "prompt": "x" * LIMIT}
    with httpx.Client(headers=server.headers, timeout=30) as client:
        response = client.post(server.url_for(route), json=body)
        size = len(response.request.content)
        assert f"the request body is {size} bytes" in _too_large(response)  # as declared
        after = client.post(server.url_for("tokenize"), json={"model": "tiny", "prompt": "ok"})
        assert after.status_code == 200 and after.json()["count"] >= 2


def test_chunked_body_over_the_limit_is_413(server: RemoteServer) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(2 * LIMIT // 65536):
            yield b"y" * 65536
        yield b'"}'

    headers = {**server.headers, "Content-Type": "application/json"}
    with httpx.Client(headers=headers, timeout=30) as client:
        response = client.post(server.url_for("v1/completions"), content=chunks())
        assert response.request.headers.get("transfer-encoding") == "chunked"
        assert "larger than the limit" in _too_large(response)
        assert client.get(server.url_for("health")).status_code == 200


def test_unauthenticated_large_body_is_401_not_read(server: RemoteServer) -> None:
    response = httpx.post(server.url_for("tokenize"), json={"prompt": "z" * 2 * LIMIT},
                          timeout=30)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_health_answers_within_1s_while_a_large_text_is_tokenized(
        server: RemoteServer) -> None:
    latencies: list[float] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool, httpx.Client(timeout=30) as probe:
        large = pool.submit(httpx.post, server.url_for("tokenize"),
                            json={"model": "tiny", "prompt": LARGE_TEXT},
                            headers=server.headers, timeout=120)
        while not large.done():
            start = time.monotonic()
            assert probe.get(server.url_for("health")).status_code == 200
            latencies.append(time.monotonic() - start)
        response = large.result()
    assert response.status_code == 200, response.text
    assert response.json()["count"] >= len(LARGE_TEXT) // 4
    assert len(latencies) >= 3, "the probes did not overlap the large request"
    assert max(latencies) < 1.0, f"/health took {max(latencies):.2f} s"


LARGE_REQUESTS = [
    ("v1/completions", {"model": "tiny", "prompt": LARGE_TEXT, "max_tokens": 1}, "prompt"),
    ("v1/chat/completions", {"model": "tiny", "max_tokens": 1,
                             "messages": [{"role": "user", "content": LARGE_TEXT}]}, "messages"),
]


@pytest.mark.parametrize(("route", "body", "param"), LARGE_REQUESTS,
                         ids=[r for r, _, _ in LARGE_REQUESTS])
def test_a_large_prompt_that_cannot_fit_is_refused_by_its_length(
        server: RemoteServer, route: str, body: dict[str, Any], param: str) -> None:
    response = httpx.post(server.url_for(route), json=body, headers=server.headers, timeout=120)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["message"].startswith("the prompt has at least ")
    assert "maximum context length is 256, which leaves no room" in error["message"]


def test_chat_refuses_a_conversation_that_cannot_fit_before_tokenizing_it(
        tiny_llama_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = load_tokenizer(resolve_model(str(tiny_llama_checkpoint)))
    processor = InputProcessor(tokenizer, max_model_len=256, vocab_size=512,
                               extra_args_plugins={})
    calls: list[str] = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, **kw: calls.append(text) or encode(
        text, **kw))
    huge = [ChatMessage(role="user", content="x" * 20_000_000)]
    with pytest.raises(ValidationError, match="the prompt has at least") as info:
        chat_prompt(processor, huge, add_generation_prompt=True, template_kwargs=None)
    assert info.value.param == "messages"
    assert calls == []
    prompt = chat_prompt(processor, [ChatMessage(role="user", content="Hi")],
                         add_generation_prompt=True, template_kwargs=None)
    assert isinstance(prompt, dict) and prompt["prompt_token_ids"]
    assert calls == [prompt["prompt"]]


def test_public_path_flag_opens_a_route(server: RemoteServer) -> None:
    assert httpx.get(server.url_for("metrics")).status_code == 200  # --public-path /metrics
    assert httpx.post(server.url_for("tokenize"), json={"prompt": "a"}).status_code == 401


def test_max_request_bytes_flag() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).max_request_bytes == DEFAULT_MAX_REQUEST_BYTES
    assert DEFAULT_MAX_REQUEST_BYTES == 32 * 2**20
    assert parser.parse_args(["serve", "--max-request-bytes", "1024"]).max_request_bytes == 1024


@pytest.mark.parametrize("value", ["0", "-5", "32MiB", "1e6"])
def test_max_request_bytes_flag_refuses_what_is_not_a_byte_count(
        value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-request-bytes", value])
    assert "a whole number of bytes, at least 1" in capsys.readouterr().err


async def test_tokenizer_pool_runs_off_the_loop_and_hands_back_errors() -> None:
    def refuse() -> None:
        raise ValidationError("no", param="prompt")

    pool = TokenizerPool(2)
    assert await pool.run(threading.get_ident) != threading.get_ident()
    assert await pool.run(sorted, [3, 1, 2], reverse=True) == [3, 2, 1]
    with pytest.raises(ValidationError, match="no"):
        await pool.run(refuse)
    pool.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        await pool.run(int)
