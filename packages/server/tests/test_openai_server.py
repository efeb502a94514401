"""The OpenAI-compatible API of a real ``engine serve``, through the official client."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest

from engine.testing.server import RemoteServer

GREEDY: dict[str, Any] = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.client()


# -- completions and chat -------------------------------------------------------------------


def test_completion(client: openai.OpenAI, server: RemoteServer) -> None:
    result = client.completions.create(model=server.model, prompt="Hello", max_tokens=8,
                                       **GREEDY)
    assert result.object == "text_completion" and result.model == "tiny"
    (choice,) = result.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    count = httpx.post(server.url_for("tokenize"), headers=server.headers,
                       json={"prompt": "Hello"}).json()["count"]
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (count, 8)
    assert result.usage.total_tokens == count + 8


def test_completion_token_ids_and_several_prompts(client: openai.OpenAI,
                                                  server: RemoteServer) -> None:
    ids = httpx.post(server.url_for("tokenize"), headers=server.headers,
                     json={"prompt": "Hello"}).json()["tokens"]
    by_text = client.completions.create(model=server.model, prompt="Hello", max_tokens=6,
                                        **GREEDY)
    by_ids = client.completions.create(model=server.model, prompt=ids, max_tokens=6, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    both = client.completions.create(model=server.model, prompt=["Hello", "abc"], n=2,
                                     max_tokens=4, **GREEDY)
    assert [c.index for c in sorted(both.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    assert both.usage is not None and both.usage.completion_tokens == 16


def test_chat(client: openai.OpenAI, server: RemoteServer) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    result = client.chat.completions.create(model=server.model, messages=messages,
                                            max_completion_tokens=5, **GREEDY)
    assert result.object == "chat.completion"
    (choice,) = result.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    rendered = "<|system|>Be brief.\n<|user|>Hi\n<|assistant|>"
    count = httpx.post(server.url_for("tokenize"), headers=server.headers,
                       json={"prompt": rendered}).json()["count"]
    chat_count = httpx.post(server.url_for("tokenize"), headers=server.headers, json={
        "messages": messages, "add_special_tokens": False}).json()["count"]
    assert result.usage is not None
    assert result.usage.prompt_tokens == count == chat_count
    assert result.usage.completion_tokens == 5


def _stream_text(chunks: list[Any], chat: bool) -> dict[int, tuple[str, str | None]]:
    """Per choice index: the concatenated text and the finish reason, checking that the
    finish reason comes only on each choice's last chunk."""
    texts: dict[int, str] = {}
    finished: dict[int, str | None] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            assert choice.index not in finished, "a chunk after the finish_reason"
            piece = (choice.delta.content or "") if chat else choice.text
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert set(finished) == set(texts)
    return {i: (texts[i], finished[i]) for i in texts}


@pytest.mark.parametrize("n", [1, 3])
def test_completion_streaming_equals_non_streaming(client: openai.OpenAI,
                                                   server: RemoteServer, n: int) -> None:
    args = {"model": server.model, "prompt": "The quick brown fox", "max_tokens": 12, "n": n,
            **GREEDY}
    full = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True, **args))
    streamed = _stream_text(chunks, chat=False)
    assert streamed == {c.index: (c.text, c.finish_reason) for c in full.choices}
    assert sorted(streamed) == list(range(n))
    assert all(chunk.usage is None for chunk in chunks)


@pytest.mark.parametrize("n", [1, 3])
def test_chat_streaming_equals_non_streaming(client: openai.OpenAI, server: RemoteServer,
                                             n: int) -> None:
    args = {"model": server.model, "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 10, "n": n, **GREEDY}
    full = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **args))
    *content, last = chunks
    assert last.choices == [] and last.usage == full.usage
    assert all(chunk.usage is None for chunk in content)
    first_roles = {c.choices[0].index: c.choices[0].delta.role for c in reversed(content)}
    assert set(first_roles.values()) == {"assistant"}
    streamed = _stream_text(content, chat=True)
    assert streamed == {c.index: (c.message.content, c.finish_reason) for c in full.choices}


def test_n3_choices(client: openai.OpenAI, server: RemoteServer) -> None:
    result = client.completions.create(model=server.model, prompt="abc", n=3, max_tokens=6,
                                       temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in result.choices) == [0, 1, 2]
    assert result.usage is not None and result.usage.completion_tokens == 18
    assert len({c.text for c in result.choices}) > 1  # seeds seed, seed+1, seed+2
    chat = client.chat.completions.create(model=server.model, n=3, max_tokens=4,
                                          messages=[{"role": "user", "content": "x"}])
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]


def test_seeded_sampling_is_reproducible(client: openai.OpenAI, server: RemoteServer) -> None:
    args = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 8,
            "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    first = client.completions.create(seed=1234, **args).choices[0].text
    again = client.completions.create(seed=1234, **args).choices[0].text
    other = {client.completions.create(seed=s, **args).choices[0].text for s in (1, 2)}
    assert first == again
    assert len(other | {first}) > 1


def test_completion_logprobs_shape(client: openai.OpenAI, server: RemoteServer) -> None:
    result = client.completions.create(model=server.model, prompt="Hello", max_tokens=5,
                                       logprobs=3, **GREEDY)
    logprobs = result.choices[0].logprobs
    assert logprobs is not None
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == 5
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    # Top 3 plus the sampled token, keyed by text (distinct ids may decode alike).
    assert all(1 <= len(top) <= 4 for top in logprobs.top_logprobs)
    pairs = zip(logprobs.tokens, logprobs.top_logprobs, strict=True)
    assert all(token in top for token, top in pairs)
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    echoed = client.completions.create(model=server.model, prompt="Hello", max_tokens=3,
                                       logprobs=1, echo=True, **GREEDY)
    choice = echoed.choices[0]
    assert choice.text.startswith("Hello") and choice.logprobs is not None
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert len(choice.logprobs.tokens) == 5 + 3
    assert "".join(choice.logprobs.tokens[:5]) == "Hello"


def test_chat_logprobs_shape(client: openai.OpenAI, server: RemoteServer) -> None:
    result = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        logprobs=True, top_logprobs=2, **GREEDY)
    content = result.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert item.logprob <= 0 and isinstance(item.bytes, list)
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
    # Greedy: the sampled token is the most likely one.
    assert all(item.logprob == item.top_logprobs[0].logprob for item in content)
    plain = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        logprobs=True, **GREEDY)
    assert all(item.top_logprobs == [] for item in plain.choices[0].logprobs.content)


def test_stop_string(client: openai.OpenAI, server: RemoteServer) -> None:
    args = {"model": server.model, "prompt": "Hello", "max_tokens": 16, **GREEDY}
    text = client.completions.create(**args).choices[0].text
    stop = next(c for c in text[1:] if c.isascii() and c.isprintable())
    expected = text[:text.index(stop)]
    result = client.completions.create(stop=[stop], **args).choices[0]
    assert (result.text, result.finish_reason) == (expected, "stop")
    assert result.model_extra["stop_reason"] == stop
    chunks = list(client.completions.create(stop=stop, stream=True, **args))
    assert _stream_text(chunks, chat=False) == {0: (expected, "stop")}


# -- the other endpoints --------------------------------------------------------------------


def test_models_version_health(client: openai.OpenAI, server: RemoteServer) -> None:
    (model,) = client.models.list().data
    assert model.id == "tiny" and model.model_extra["max_model_len"] == 256
    assert httpx.get(server.url_for("version"), headers=server.headers).json()["version"] == "0.1.0"
    assert httpx.get(server.url_for("health")).status_code == 200


def test_tokenize_detokenize_round_trip(server: RemoteServer) -> None:
    text = "The quick brown fox jumps."
    tokens = httpx.post(server.url_for("tokenize"), headers=server.headers, json={
        "model": "tiny", "prompt": text, "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"])
    assert tokens["max_model_len"] == 256
    back = httpx.post(server.url_for("detokenize"), headers=server.headers,
                      json={"tokens": tokens["tokens"]}).json()
    assert back == {"prompt": text}
    bad = httpx.post(server.url_for("detokenize"), headers=server.headers, json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def _metric(server: RemoteServer, name: str, **labels: str) -> float:
    text = httpx.get(server.url_for("metrics"), headers=server.headers).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_metrics_names(server: RemoteServer, client: openai.OpenAI) -> None:
    client.completions.create(model=server.model, prompt="Hi", max_tokens=3, **GREEDY)
    text = httpx.get(server.url_for("metrics"), headers=server.headers).text
    for name in ("engine:num_requests_running", "engine:num_requests_waiting",
                 "engine:kv_cache_usage_perc", "engine:prefix_cache_queries_total",
                 "engine:prefix_cache_hits_total", "engine:external_prefix_cache_queries_total",
                 "engine:external_prefix_cache_hits_total", "engine:prompt_tokens_total",
                 "engine:generation_tokens_total", "engine:time_to_first_token_seconds_bucket",
                 "engine:inter_token_latency_seconds_bucket",
                 "engine:e2e_request_latency_seconds_bucket", "engine:request_success_total"):
        assert f"\n{name}{{" in text, name
    assert _metric(server, "engine:request_success_total", finished_reason="length") >= 1
    assert _metric(server, "engine:generation_tokens_total") >= 3


# -- concurrency and disconnects ------------------------------------------------------------


async def test_32_concurrent_streams(server: RemoteServer) -> None:
    client = server.async_client()

    async def one(i: int) -> tuple[str, int]:
        stream = await client.completions.create(
            model=server.model, prompt=f"request {i}", max_tokens=16, stream=True,
            stream_options={"include_usage": True}, **GREEDY)
        text, usage = "", 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return text, usage

    results = await asyncio.gather(*(one(i) for i in range(32)))
    assert [usage for _, usage in results] == [16] * 32
    await client.close()


async def _wait_idle(server: RemoteServer) -> None:
    for _ in range(100):
        if (_metric(server, "engine:kv_cache_usage_perc") == 0
                and _metric(server, "engine:num_requests_running") == 0):
            return
        await asyncio.sleep(0.1)
    raise AssertionError("KV cache not freed: "
                         + httpx.get(server.url_for("metrics"), headers=server.headers).text)


async def test_disconnects_free_kv_blocks(server: RemoteServer) -> None:
    aborted_before = _metric(server, "engine:request_success_total", finished_reason="abort")
    body = {"model": server.model, "prompt": "Hello", "max_tokens": 200, "stream": True,
            "temperature": 0.0, "ignore_eos": True}
    async with httpx.AsyncClient(headers=server.headers, timeout=30) as http:

        async def read_two_frames_and_leave() -> None:
            async with http.stream("POST", server.url_for("v1/completions"), json=body) as resp:
                assert resp.status_code == 200
                frames = 0
                async for line in resp.aiter_lines():
                    frames += line.startswith("data: ")
                    if frames == 2:
                        return

        await asyncio.gather(*(read_two_frames_and_leave() for _ in range(4)))
        await _wait_idle(server)
        # A non-streaming client that gives up once its request runs.
        waiting = asyncio.create_task(http.post(
            server.url_for("v1/completions"), json={**body, "stream": False, "max_tokens": 240}))
        while _metric(server, "engine:num_requests_running") == 0:
            assert not waiting.done(), waiting.result().text
            await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
    await _wait_idle(server)
    aborted = _metric(server, "engine:request_success_total", finished_reason="abort")
    assert aborted - aborted_before == 5


# -- errors ---------------------------------------------------------------------------------


def _post(server: RemoteServer, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    headers = {**server.headers, **kwargs.pop("headers", {})}
    if isinstance(body, str):
        return httpx.post(server.url_for(path), content=body, timeout=30,
                          headers={"content-type": "application/json", **headers})
    return httpx.post(server.url_for(path), json=body, headers=headers, timeout=30)


def _error(response: httpx.Response, status: int, param: str | None = None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert error["message"]
    return str(error["message"])


COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@pytest.mark.parametrize(("path", "body", "param", "words"), [
    ("v1/completions", '{"prompt": "Hello",', None, "malformed JSON"),
    ("v1/completions", {**COMPLETION, "temperature": "hot"}, "temperature", "valid number"),
    ("v1/completions", {**COMPLETION, "n": 1.5}, "n", "valid integer"),
    ("v1/completions", {"model": "tiny"}, "prompt", "required"),
    ("v1/completions", {**COMPLETION, "temperature": -1}, "temperature", ">= 0"),
    ("v1/completions", {**COMPLETION, "top_p": 2}, "top_p", "(0, 1]"),
    ("v1/completions", {**COMPLETION, "max_tokens": 0}, "max_tokens", ">= 1"),
    ("v1/completions", {**COMPLETION, "colour": "red"}, "colour", "unknown field"),
    ("v1/completions", {**COMPLETION, "logprobs": 21}, "logprobs", "[0, 20]"),
    ("v1/completions", {**COMPLETION, "best_of": 3}, "best_of", "not supported"),
    ("v1/completions", {**COMPLETION, "suffix": "end"}, "suffix", "not supported"),
    ("v1/completions", {**COMPLETION, "max_tokens": 1000}, "max_tokens", "context length"),
    ("v1/completions", {**COMPLETION, "prompt": "x" * 300}, "prompt", "context length"),
    ("v1/completions", {**COMPLETION, "prompt": [10**6]}, "prompt", "out of range"),
    ("v1/completions", {**COMPLETION, "logit_bias": {"a": 1}}, "logit_bias", "token ids"),
    ("v1/completions", {**COMPLETION, "stream_options": {"include_usage": True}},
     "stream_options", "stream: true"),
    ("v1/completions", {**COMPLETION, "priority": 3}, "priority", "scheduling-policy"),
    ("v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools.0.function",
     "must be an object with a name"),
    ("v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {
        "name": "f"}}]}, "tool_choice", "--enable-auto-tool-choice"),
    ("v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}},
     "response_format", "must be one of text, json_object, json_schema"),
    ("v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs", "logprobs: true"),
    ("v1/chat/completions", {**CHAT, "max_completion_tokens": 1000},
     "max_completion_tokens", "max_completion_tokens"),
    ("v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages.0.content.0",
     "not supported"),
    ("v1/chat/completions", {**CHAT, "messages": []}, "messages", "at least one"),
])
def test_bad_requests_are_400(server: RemoteServer, path: str, body: Any, param: str | None,
                              words: str) -> None:
    response = _post(server, path, body)
    message = _error(response, 400, param)
    assert words in message
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_bad_request_through_the_openai_client(client: openai.OpenAI,
                                               server: RemoteServer) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.model, prompt="Hi", max_tokens=4,
                                  temperature=-0.5)
    assert info.value.status_code == 400 and info.value.param == "temperature"


def test_missing_or_wrong_api_key_is_401(server: RemoteServer) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(server.url_for("v1/completions"), json=COMPLETION,
                              headers=headers)
        assert _error(response, 401)
        assert response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    assert httpx.get(server.url_for("health")).status_code == 200  # not under /v1


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-17", prompt="Hi", max_tokens=2)
    assert info.value.code == "model_not_found"
    assert "gpt-17" in info.value.message and "tiny" in info.value.message


def test_unknown_route_is_404_and_endpoint_plugins_are_opt_in(server: RemoteServer) -> None:
    _error(httpx.get(server.url_for("test-echo/hello"), headers=server.headers), 404)


def test_stream_error_frames_are_json(server: RemoteServer) -> None:
    # A request that fails validation never starts a stream: it is a plain 400.
    response = _post(server, "v1/completions", {**COMPLETION, "stream": True, "top_k": -5})
    _error(response, 400, "top_k")
    assert json.loads(response.text)["error"]["type"] == "invalid_request_error"
