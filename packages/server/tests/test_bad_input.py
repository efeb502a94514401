"""Bad input never gets a 5xx, and never costs the client its connection.

Against one real ``engine serve`` (EngineCore in its own process, behind gRPC) with the
test plugins ``engine-test-plugin-good`` (its logits processor reads
``extra_args["ban_token"]``) and ``engine-test-plugin-io`` (``POST /pooling``), and a chat
template that uses a template variable, ``greeting``. Every class of value the sampler or
the wire cannot carry was a 500 ``internal_error`` before (and a 500 made uvicorn drop the
keep-alive connection): each row of :data:`BAD` is one such value, now a 400
``invalid_request_error`` whose ``param`` names the field and whose message says what is
allowed. All rows go through one ``httpx.Client``, and the connection it opened first is
the one it still uses at the end.

The last test runs uvicorn on an app with the server's error handling and a bug in a route
and in a middleware: the 500 is JSON, logged once with its traceback, and the next request
on the same connection is served.
"""

from __future__ import annotations

import inspect
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.core.tokenizer import Tokenizer
from engine.server.errors import install_error_handlers
from engine.server.protocol import RESERVED_TEMPLATE_KWARGS
from engine.testing.server import RemoteServer, free_port, running_server
from engine.testing.test_plugins import env_with_plugins

#: The tiny checkpoint's template, plus one template variable.
TEMPLATE = ("{% if greeting is defined %}{{ greeting + '! ' }}{% endif %}"
            "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def server(tiny_llama_checkpoint: Path, test_plugins_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    args = ["--plugins", "engine-test-plugin-good,engine-test-plugin-io",
            "--io-processor", "test_io_prompts", "--chat-template", str(template)]
    with running_server(tiny_llama_checkpoint, args, served_model_name="tiny",
                        env=env_with_plugins(test_plugins_dir)) as remote:
        yield remote


CMPL, CHAT, TOK = "v1/completions", "v1/chat/completions", "tokenize"
_MSG = '"messages": [{"role": "user", "content": "Hi"}]'
_SURROGATE = "lone UTF-16 surrogate"


def _chat_kwargs(kwargs: str) -> str:
    return f'{{{_MSG}, "max_tokens": 1, "chat_template_kwargs": {kwargs}}}'


#: (route, JSON body as sent, the 400's param, a piece of its message). Raw JSON text, so
#: that NaN, Infinity, 1e999 and lone "\\ud800" escapes reach the server as a client sends
#: them.
BAD: list[tuple[str, str, str | None, str]] = [
    # 64-bit seeds, also for seed + i (choice i of n)
    (CMPL, '{"prompt": "Hi", "max_tokens": 1, "seed": 9223372036854775808}', "seed",
     "[-2^63, 9223372036854775807]"),
    (CMPL, '{"prompt": "Hi", "max_tokens": 1, "seed": -9223372036854775809}', "seed",
     "64-bit integer"),
    (CMPL, '{"prompt": "Hi", "max_tokens": 1, "n": 3, "seed": 9223372036854775806}', "seed",
     "[-2^63, 9223372036854775805] with n=3"),
    (CHAT, f'{{{_MSG}, "max_tokens": 1, "seed": 18446744073709551615}}', "seed", "64-bit"),
    # 32-bit integers
    (CMPL, '{"prompt": "Hi", "max_tokens": 1, "top_k": 2147483648}', "top_k",
     "[0, 2147483647]"),
    (CHAT, f'{{{_MSG}, "max_tokens": 1, "top_k": 9223372036854775808}}', "top_k",
     "[0, 2147483647]"),
    # numbers that are not finite
    (CMPL, '{"prompt": "Hi", "max_tokens": 1, "temperature": Infinity}', "temperature",
     "finite number"),
    (CMPL, '{"prompt": "Hi", "max_tokens": 1, "repetition_penalty": 1e999}',
     "repetition_penalty", "finite number"),
    (CHAT, f'{{{_MSG}, "max_tokens": 1, "top_p": NaN}}', "top_p", "finite number"),
    (CMPL, '{"prompt": "Hi", "max_tokens": 1, "logit_bias": {"5": NaN}}', "logit_bias.5",
     "finite number"),
    # logit_bias keys are decimal token ids
    (CMPL, '{"prompt": "Hi", "max_tokens": 1, "logit_bias": {"1_0": 1}}', "logit_bias",
     "decimal strings"),
    (CMPL, '{"prompt": "Hi", "max_tokens": 1, "logit_bias": {"%s": 1}}' % ("9" * 5000),
     "logit_bias", "5000 digits"),
    # lone surrogates, wherever text goes
    (CMPL, '{"prompt": "ab\\ud800", "max_tokens": 1}', "prompt", "(U+D800) at character 2"),
    (CMPL, '{"prompt": ["fine", "\\udfff"], "max_tokens": 1}', "prompt", "the text at 1"),
    (CMPL, '{"prompt": "Hi", "max_tokens": 1, "stop": ["a", "\\ud800"]}', "stop", _SURROGATE),
    (CMPL, '{"prompt": "Hi", "max_tokens": 1, "model": "\\ud800"}', "model", _SURROGATE),
    (CMPL, '{"prompt": "Hi", "max_tokens": 1, "user": "\\ud800"}', "user", _SURROGATE),
    (CMPL, '{"prompt": "Hi", "max_tokens": 1, "vllm_xargs": {"ban_token": "\\ud800"}}',
     "vllm_xargs", "the text at ban_token"),
    (CMPL, '{"prompt": "Hi", "max_tokens": 1, "extra_args": {"\\ud800": 1}}', "extra_args",
     "a key holds"),
    (CHAT, '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}',
     "messages.0.content", _SURROGATE),
    (CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udbff"}]}],'
     ' "max_tokens": 1}', "messages.0.content", "the text at 0.text"),
    (CHAT, '{"messages": [{"role": "user", "content": "x", "name": "\\ud800"}]}',
     "messages.0.name", _SURROGATE),
    (CHAT, f'{{{_MSG}, "max_tokens": 1, "stop": "\\ud800"}}', "stop", _SURROGATE),
    (CHAT, _chat_kwargs('{"greeting": "\\ud800"}'), "chat_template_kwargs", _SURROGATE),
    (TOK, '{"prompt": "\\ud800"}', "prompt", _SURROGATE),
    (TOK, '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content",
     _SURROGATE),
    ("detokenize", '{"tokens": [1], "model": "\\ud800"}', "model", _SURROGATE),
    ("pooling", '{"prompts": ["\\ud800"]}', None, "the text at prompts.0"),
    # chat_template_kwargs that would collide with the template call's own arguments
    *[(CHAT, _chat_kwargs(f'{{"{name}": 1}}'), "chat_template_kwargs",
       f"'{name}' cannot be set here")
      for name in ("messages", "add_generation_prompt", "tokenize", "chat_template", "tools",
                   "documents", "conversation", "return_dict", "continue_final_message")],
    (TOK, f'{{{_MSG}, "chat_template_kwargs": {{"messages": []}}}}', "chat_template_kwargs",
     "'messages' cannot be set here"),
    # a template variable of a type the template cannot use
    (CHAT, _chat_kwargs('{"greeting": 5}'), "messages", "chat template error: TypeError"),
    # extra_args keys no loaded logits processor reads
    (CMPL, '{"prompt": "Hi", "max_tokens": 1, "vllm_xargs": {"ban_tokens": [3]}}',
     "extra_args.ban_tokens", "the keys they take: 'ban_token'"),
    (CHAT, f'{{{_MSG}, "max_tokens": 1, "extra_args": {{"ban_token": 3, "strength": 1}}}}',
     "extra_args.strength", "'strength' is not taken by any plugin this engine uses"),
    # bodies that are not a JSON object
    (CMPL, '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", None, "nested too deeply"),
    (CMPL, '{"prompt": "Hi", "seed": ' + "9" * 5000 + "}", None,
     "the request body could not be parsed"),
    (CMPL, "", None, "the request body is required"),
]


def _post(client: httpx.Client, route: str, body: str | bytes) -> httpx.Response:
    return client.post(route, content=body, headers={"Content-Type": "application/json"})


def _local_port(response: httpx.Response) -> int:
    port: int = response.extensions["network_stream"].get_extra_info("client_addr")[1]
    return port


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        yield http


def test_bad_input_is_a_400_naming_the_field(client: httpx.Client) -> None:
    first = client.get("/health")
    failures = []
    for route, body, param, message in BAD:
        response = _post(client, f"/{route}", body)
        error = response.json().get("error") if response.content else None
        if (response.status_code != 400 or error is None
                or error["type"] != "invalid_request_error" or error["param"] != param
                or message not in error["message"]):
            failures.append(f"POST /{route} {body[:100]!r}: {response.status_code} "
                            f"{response.text[:400]}")
    assert not failures, "\n".join(failures)
    # Every answer kept the connection open: the last request went over the first one.
    assert _local_port(client.get("/health")) == _local_port(first)


def test_a_body_with_another_content_type_is_a_400(client: httpx.Client) -> None:
    response = client.post("/v1/completions", content=b'{"prompt": "Hi"}',
                           headers={"Content-Type": "text/plain"})
    assert response.status_code == 400
    assert "Content-Type: application/json" in response.json()["error"]["message"]
    response = _post(client, "/v1/completions", b'{"prompt": "\xff"}')
    assert response.status_code == 400 and "UTF-8" in response.json()["error"]["message"]


#: Values at the edge of what the wire carries, and text that only looks suspicious.
EDGES: list[tuple[str, dict[str, Any]]] = [
    (CMPL, {"prompt": "Hi", "seed": 2**63 - 1}),
    (CMPL, {"prompt": "Hi", "n": 3, "seed": 2**63 - 3}),
    (CMPL, {"prompt": "Hi", "seed": -(2**63), "top_k": 2**31 - 1}),
    (CMPL, {"prompt": "Hi \U0001f600 caf\u00e9", "stop": ["\U0001f600"],
            "logit_bias": {"7": 1.5}, "vllm_xargs": {"ban_token": 3}}),
    (CHAT, {"messages": [{"role": "user", "content": "Hi \U0001f600"}],
            "chat_template_kwargs": {"greeting": "Hello", "enable_thinking": False}}),
]


@pytest.mark.parametrize(("route", "body"), EDGES, ids=[str(i) for i in range(len(EDGES))])
def test_the_edges_are_served(client: httpx.Client, route: str, body: dict[str, Any]) -> None:
    response = client.post(f"/{route}", json={"max_tokens": 1, **body})
    assert response.status_code == 200, response.text


def test_a_template_variable_reaches_the_template(client: httpx.Client) -> None:
    plain = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})
    greeted = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}],
                                             "chat_template_kwargs": {"greeting": "Hey"}})
    assert plain.status_code == greeted.status_code == 200
    assert greeted.json()["count"] == plain.json()["count"] + len("Hey! ")


def test_the_reserved_names_cover_the_template_calls_arguments() -> None:
    from transformers import PreTrainedTokenizerBase
    from transformers.utils.chat_template_utils import render_jinja_template

    names = set()
    for fn in (Tokenizer.apply_chat_template, PreTrainedTokenizerBase.apply_chat_template,
               render_jinja_template):
        names |= {p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    names |= {"messages"}  # what render_jinja_template passes to the template itself
    assert names <= RESERVED_TEMPLATE_KWARGS, sorted(names - RESERVED_TEMPLATE_KWARGS)


# -- an unexpected exception -------------------------------------------------------------


@pytest.fixture(scope="module")
def buggy_server() -> Iterator[str]:
    """uvicorn serving an app with the server's error handling and a route with a bug."""
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/bug")
    async def bug() -> None:
        raise RuntimeError("a bug in a route")

    class BuggyMiddleware:  # added after the handlers, as the server's own middleware is
        def __init__(self, app: ASGIApp) -> None:
            self.app = app

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            if scope.get("path") == "/middleware-bug":
                raise KeyError("a bug in a middleware")
            await self.app(scope, receive, send)

    app.add_middleware(BuggyMiddleware)

    @app.get("/fine")
    async def fine() -> dict[str, bool]:
        return {"fine": True}

    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical",
                                       lifespan="off"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    uv.should_exit = True
    thread.join(10)


@pytest.mark.parametrize(("path", "message"), [
    ("/bug", "RuntimeError: a bug in a route"),
    ("/middleware-bug", "KeyError: 'a bug in a middleware'"),
])
def test_an_internal_error_is_json_and_keeps_the_connection(
        buggy_server: str, caplog: pytest.LogCaptureFixture, path: str, message: str) -> None:
    with httpx.Client(base_url=buggy_server, timeout=10) as http:
        first = http.get("/fine")
        with caplog.at_level("ERROR", logger="engine.server"):
            response = http.get(path)
        assert response.status_code == 500
        assert response.json()["error"] == {
            "message": f"internal server error: {message}", "type": "server_error",
            "param": None, "code": "internal_error"}
        assert caplog.text.count("internal error while serving a request") == 1
        assert "Traceback" in caplog.text and "a bug in a" in caplog.text
        after = http.get("/fine")
        assert after.status_code == 200 and json.loads(after.content) == {"fine": True}
        assert _local_port(after) == _local_port(first)
