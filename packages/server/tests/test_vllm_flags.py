"""A ``vllm serve`` command line or YAML config runs unchanged against ``engine serve``.

Table-driven parser tests (no server): each vLLM flag and its YAML spelling parse into the
same namespace and ``EngineConfig``; then one real ``engine serve`` started from a vLLM-style
YAML file with dummy weights, another checkpoint's tokenizer, a generation config, a
logprobs cap and request logging; and the port-in-use error before any model loads.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from engine.core.config import EngineConfig
from engine.core.model_loader import GenerationDefaults
from engine.sdk.errors import ValidationError
from engine.server.cli._config_file import ConfigFileError
from engine.server.cli._engine_args import engine_config_from_args
from engine.server.cli._generate import sampling_params_of
from engine.server.cli._help import HelpFormatter
from engine.server.cli._logging_args import apply_uvicorn_log_level
from engine.server.cli._main import build_parser, main, parse_args
from engine.server.cli._port import check_can_bind
from engine.server.cli._serve import model_of
from engine.server.protocol import ChatCompletionRequest, CompletionRequest
from engine.server.request_log import log_request
from engine.server.sampling import chat_params, completion_params
from engine.server.state import ServerArgs
from engine.testing.server import RemoteServer, running_server

MODEL = "/models/llama"

# (flag spelling on the command line, the same in a YAML file, where it lands, value there)
CASES: list[tuple[list[str], dict[str, Any], str, str, Any]] = [
    (["--model", MODEL], {"model": MODEL}, "model", "model", MODEL),
    (["--tokenizer", "/tok"], {"tokenizer": "/tok"}, "config", "tokenizer", "/tok"),
    (["--load-format", "dummy"], {"load_format": "dummy"}, "config", "load_format", "dummy"),
    (["--generation-config", "vllm"], {"generation-config": "vllm"}, "config",
     "generation_config", "vllm"),
    (["--kv-cache-dtype", "float32"], {"kv_cache_dtype": "float32"}, "config",
     "kv_cache_dtype", "float32"),
    (["--enforce-eager"], {"enforce-eager": True}, "config", "enforce_eager", True),
    (["--max-logprobs", "5"], {"max_logprobs": 5}, "config", "max_logprobs", 5),
    (["--enable-log-requests"], {"enable-log-requests": True}, "args",
     "enable_log_requests", True),
    (["--disable-log-requests"], {"disable_log_requests": True}, "args",
     "enable_log_requests", False),
    (["--max-log-len", "10"], {"max-log-len": 10}, "args", "max_log_len", 10),
    (["--uvicorn-log-level", "warning"], {"uvicorn-log-level": "warning"}, "args",
     "uvicorn_log_level", "warning"),
    (["--log-level", "debug"], {"log-level": "DEBUG"}, "args", "log_level", "DEBUG"),
    (["--trust-remote-code"], {"trust-remote-code": True}, "config", "trust_remote_code", True),
    (["--dtype", "half"], {"dtype": "half"}, "config", "dtype", "float16"),
    (["--gpu-memory-utilization", "0.9"], {"gpu_memory_utilization": 0.9}, "config",
     "gpu_memory_utilization", 0.9),
    (["--served-model-name", "a", "b"], {"served-model-name": ["a", "b"]}, "args",
     "served_model_name", ["a", "b"]),
    (["--no-enable-prefix-caching"], {"enable_prefix_caching": False}, "config",
     "enable_prefix_caching", False),
    (["--disabled-kernels", "k1,k2"], {"disabled-kernels": ["k1", "k2"]}, "config",
     "disabled_kernels", ("k1", "k2")),
    (["--plugin-option", "p.k=1", "--plugin-option", "p.s=x"],
     {"plugin-option": {"p": {"k": 1, "s": "x"}}}, "config", "plugin_options",
     {"p": {"k": 1, "s": "x"}}),
    (["--kv-connector-option", "path=/kv"], {"kv-connector-option": {"path": "/kv"}},
     "config", "kv_connector_options", {"path": "/kv"}),
    (["--max-model-len", "64"], {"max-model-len": 64}, "config", "max_model_len", 64),
    (["--port", "8123"], {"port": 8123}, "args", "port", 8123),
    (["-tp", "2"], {"tensor-parallel-size": 2}, "config", "tensor_parallel_size", 2),
]


def _yaml(tmp_path: Path, mapping: dict[str, Any], name: str = "vllm.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(mapping))
    return str(path)


def _landed(args: argparse.Namespace, where: str, name: str) -> Any:
    if where == "model":
        return model_of(args)
    if where == "args":
        return getattr(args, name)
    return getattr(engine_config_from_args(args, model=model_of(args)), name)


@pytest.mark.parametrize(("cli", "mapping", "where", "name", "value"), CASES,
                         ids=[case[0][0] for case in CASES])
def test_flag_and_yaml_parse_into_the_same_config(tmp_path: Path, cli: list[str],
                                                  mapping: dict[str, Any], where: str,
                                                  name: str, value: Any) -> None:
    from_cli = parse_args(["serve", *cli])
    from_file = parse_args(["serve", "--config", _yaml(tmp_path, mapping)])
    assert vars(from_cli) == vars(from_file)
    assert _landed(from_cli, where, name) == value
    assert (engine_config_from_args(from_cli, model=model_of(from_cli))
            == engine_config_from_args(from_file, model=model_of(from_file)))


def test_the_command_line_wins_over_the_file(tmp_path: Path) -> None:
    config = _yaml(tmp_path, {"model": "/from/file", "port": 9001, "max-num-seqs": 8,
                              "dtype": "half"})
    args = parse_args(["serve", MODEL, "--config", config, "--max-num-seqs", "4"])
    assert (model_of(args), args.port) == (MODEL, 9001)
    engine = engine_config_from_args(args, model=model_of(args))
    assert (engine.max_num_seqs, engine.dtype) == (4, "float16")
    flag_first = parse_args(["serve", "--max_num_seqs=2", "--config", config])
    assert model_of(flag_first) == "/from/file"
    assert engine_config_from_args(flag_first).max_num_seqs == 2


def test_vllm_underscore_spellings_on_the_command_line() -> None:
    assert vars(parse_args(["serve", MODEL, "--max_model_len", "64", "--enforce_eager"])) == \
        vars(parse_args(["serve", MODEL, "--max-model-len", "64", "--enforce-eager"]))


def test_generate_reads_a_config_file_too(tmp_path: Path) -> None:
    config = _yaml(tmp_path, {"model": MODEL, "max-tokens": 3, "load-format": "dummy"})
    args = parse_args(["generate", "--prompt", "x", "--config", config])
    assert engine_config_from_args(args).load_format == "dummy"
    assert sampling_params_of(args).max_tokens == 3


@pytest.mark.parametrize(("mapping", "name", "words"), [
    ({"swap-space": 4}, "vllm.yaml", "'swap-space' is not an option of engine serve"),
    ({"enforce-eager": "yes"}, "vllm.yaml", "enforce-eager is a flag; give true or false"),
    ({"port": {"a": 1}}, "vllm.yaml", "port takes one value, not a mapping"),
    ({"config": "other.yaml"}, "vllm.yaml", "cannot name another"),
    ({"port": 1}, "vllm.json", "must be YAML (.yaml or .yml)"),
])
def test_bad_config_files_name_the_file_and_the_key(tmp_path: Path, mapping: dict[str, Any],
                                                    name: str, words: str) -> None:
    path = _yaml(tmp_path, mapping, name)
    with pytest.raises(ConfigFileError, match=re.escape(f"--config {path}")) as info:
        parse_args(["serve", "--config", path])
    assert words in str(info.value)


def test_unreadable_config_file_exits_2_with_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "nope.yaml")
    assert main(["serve", "--config", missing]) == 2
    assert capsys.readouterr().err == f"error: --config {missing}: cannot read it (No such " \
        f"file or directory)\n"
    with pytest.raises(ConfigFileError, match="more than once"):
        parse_args(["serve", "--config", missing, "--config", missing])


def test_model_given_twice_must_agree() -> None:
    assert model_of(parse_args(["serve", MODEL, "--model", MODEL])) == MODEL
    with pytest.raises(ValueError, match="give one of the two"):
        model_of(parse_args(["serve", MODEL, "--model", "/other"]))


@pytest.mark.parametrize(("flags", "words"), [
    (["--load-format", "pt"], "--load-format 'pt' would read PyTorch pickle files"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype 'fp8' would store keys and values in 8-bit"),
    (["--dtype", "double"], "--dtype 'double': Input should be 'auto', 'bfloat16'"),
    (["--gpu-memory-utilization", "2"], "--gpu-memory-utilization 2.0: Input should be less"),
])
def test_values_that_cannot_apply_say_why(flags: list[str], words: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValidationError, match=words):
        engine_config_from_args(parse_args(["serve", *flags]))
    thresholds = gc.get_threshold()
    assert main(["serve", MODEL, "--port", "0", *flags]) == 2  # before any engine starts
    assert capsys.readouterr().err.startswith(f"error: {words}")
    assert gc.get_threshold() == thresholds  # start-up's deferred collections undone


def _help_strings(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.Action, str]]:
    formatter = HelpFormatter(parser.prog)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _help_strings(sub)
        elif action.help and not isinstance(action, (argparse._HelpAction,
                                                     argparse._VersionAction)):
            text = formatter._get_help_string(action) or ""
            yield parser.prog, action, text % {"default": action.default}


def test_help_prints_each_default_once() -> None:
    engine_flags = {"--" + name.replace("_", "-") for name in EngineConfig.model_fields}
    checked = 0
    for prog, action, text in _help_strings(build_parser()):
        count = text.lower().count("default:")
        where = f"{prog} {action.option_strings or action.dest}: {text!r}"
        assert count <= 1, where
        shows = action.default not in (None, False, "", [], argparse.SUPPRESS)
        if shows or set(action.option_strings) & engine_flags:
            assert count == 1, where
            checked += 1
    assert checked > 40
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "(default: 256)" in help_text and "(default: None)" not in help_text  # --max-num-seqs


def test_uvicorn_log_level_sets_uvicorns_loggers() -> None:
    names = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")
    saved = {name: logging.getLogger(name).level for name in names}
    try:
        apply_uvicorn_log_level("warning")
        assert {logging.getLogger(n).level for n in names} == {logging.WARNING}
        apply_uvicorn_log_level("trace")
        assert logging.getLogger("uvicorn.access").level == 5
        before = logging.getLogger("uvicorn.error").level
        apply_uvicorn_log_level(None)  # unset: left to --log-level
        assert logging.getLogger("uvicorn.error").level == before
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


def test_generation_defaults_fill_what_a_request_leaves_unset() -> None:
    defaults = GenerationDefaults({"temperature": 0.6, "top_k": 20, "max_tokens": 7,
                                   "repetition_penalty": 1.2})
    unset = completion_params(CompletionRequest(prompt="x", max_tokens=None), defaults)
    assert (unset.temperature, unset.top_k, unset.max_tokens, unset.repetition_penalty) == \
        (0.6, 20, 7, 1.2)
    given = completion_params(CompletionRequest(prompt="x", temperature=0.0, top_k=0,
                                                max_tokens=3), defaults)
    assert (given.temperature, given.top_k, given.max_tokens) == (0.0, 0, 3)
    chat = chat_params(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]),
                       defaults)
    assert (chat.temperature, chat.max_tokens) == (0.6, 7)
    plain = chat_params(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]))
    assert (plain.temperature, plain.max_tokens) == (1.0, None)
    # engine generate: its flags, then the model's defaults, then its own (greedy, 64).
    args = parse_args(["generate", "--prompt", "x", "--top-k", "5"])
    from_model = sampling_params_of(args, defaults)
    assert (from_model.temperature, from_model.top_k, from_model.max_tokens) == (0.6, 5, 7)
    own = sampling_params_of(args)
    assert (own.temperature, own.max_tokens) == (0.0, 64)


def test_request_lines_only_when_enabled(caplog: pytest.LogCaptureFixture) -> None:
    from engine.sdk.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=3)
    with caplog.at_level(logging.INFO, logger="engine.server.requests"):
        log_request(ServerArgs(), "cmpl-a", "Hello", params)
        assert caplog.records == []
        log_request(ServerArgs(enable_log_requests=True, max_log_len=4), "cmpl-b",
                    ["Hello world", [5, 6, 7, 8, 9]], params)
    first, second = (r.getMessage() for r in caplog.records)
    assert first.startswith("Received request cmpl-b-0: prompt: 'Hell', params: SamplingParams(")
    assert second.startswith("Received request cmpl-b-1: prompt_token_ids: [5, 6, 7, 8],")
    assert "max_tokens=3" in first


def test_port_check_names_the_address_and_the_fix() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"127.0.0.1:{port}: the port is already in use") \
                as info:
            check_can_bind("127.0.0.1", port)
        assert "--port N" in str(info.value)
    check_can_bind("127.0.0.1", port)  # free again
    with pytest.raises(ValueError, match="not a TCP port"):
        check_can_bind("127.0.0.1", 70000)


def test_port_in_use_is_reported_before_the_model_loads(tiny_llama_checkpoint: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "engine.server.cli", "serve", str(tiny_llama_checkpoint),
             "--port", str(port)], capture_output=True, text=True, timeout=120)
        elapsed = time.monotonic() - start
    assert done.returncode == 2, done.stderr
    assert done.stderr.endswith(f"error: cannot serve on 127.0.0.1:{port}: the port is already "
                                f"in use (another server is listening there); stop it, or "
                                f"choose a free port with --port N\n"), done.stderr
    assert "model" not in done.stderr.lower() and "EngineCore" not in done.stderr
    assert elapsed < 60, elapsed  # generous: the interpreter's start-up, nothing loaded


# -- one real engine serve from a vLLM-style YAML config -------------------------------------

GENERATION = {"temperature": 0.0, "max_new_tokens": 5, "do_sample": False}


@pytest.fixture(scope="module")
def vllm_server(tiny_llama_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[RemoteServer]:
    """``engine serve --config vllm.yaml`` on a folder holding only config.json."""
    folder = tmp_path_factory.mktemp("vllm-style")
    model = folder / "model"
    model.mkdir()
    shutil.copy(tiny_llama_checkpoint / "config.json", model / "config.json")
    (folder / "generation").mkdir()
    (folder / "generation" / "generation_config.json").write_text(json.dumps(GENERATION))
    config = folder / "vllm.yaml"
    config.write_text(yaml.safe_dump({
        "load-format": "dummy", "tokenizer": str(tiny_llama_checkpoint),
        "generation-config": str(folder / "generation"), "max-logprobs": 3,
        "enable-log-requests": True, "max-log-len": 8, "trust-remote-code": True,
        "gpu-memory-utilization": 0.9, "enforce-eager": True, "kv-cache-dtype": "auto",
        "uvicorn-log-level": "warning", "served-model-name": ["dummy"],
    }))
    assert not list(model.glob("*.safetensors")) and not (model / "tokenizer.json").exists()
    with running_server(model, ["--config", str(config), "--log-level", "info"],
                        env={**os.environ, "ENGINE_PLUGINS": "none"}) as remote:
        remote.model = "dummy"
        yield remote


def _post(server: RemoteServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url_for(path), json={"model": server.model, **body}, timeout=60)


def test_dummy_weights_serve_without_a_weight_file(vllm_server: RemoteServer) -> None:
    models = httpx.get(vllm_server.url_for("v1/models"), timeout=10).json()["data"]
    assert [m["id"] for m in models] == ["dummy"]
    done = _post(vllm_server, "v1/completions", {"prompt": "Hello", "max_tokens": 4,
                                                 "ignore_eos": True})
    assert done.status_code == 200, done.text
    assert done.json()["usage"]["completion_tokens"] == 4


def test_generation_config_sets_the_default_max_tokens(vllm_server: RemoteServer) -> None:
    done = _post(vllm_server, "v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True})
    assert done.status_code == 200, done.text
    assert done.json()["usage"]["completion_tokens"] == GENERATION["max_new_tokens"]
    asked = _post(vllm_server, "v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True, "max_tokens": 2})
    assert asked.json()["usage"]["completion_tokens"] == 2


def test_max_logprobs_caps_requests(vllm_server: RemoteServer) -> None:
    ok = _post(vllm_server, "v1/completions", {"prompt": "Hi", "max_tokens": 1, "logprobs": 3})
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["logprobs"]["top_logprobs"][0]
    over = _post(vllm_server, "v1/completions", {"prompt": "Hi", "max_tokens": 1,
                                                 "logprobs": 4})
    assert over.status_code == 400, over.text
    error = over.json()["error"]
    assert error["param"] == "logprobs"
    assert "[0, 3]" in error["message"] and "--max-logprobs" in error["message"]
    chat = _post(vllm_server, "v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "logprobs": True,
        "top_logprobs": 4})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "top_logprobs"


def test_log_has_the_request_lines_and_the_notes(vllm_server: RemoteServer) -> None:
    done = _post(vllm_server, "v1/completions", {"prompt": "Tell me a story", "max_tokens": 2,
                                                 "temperature": 0.5})
    response_id = done.json()["id"]
    deadline = time.monotonic() + 10
    while f"Received request {response_id}-0" not in vllm_server.log() \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    log = vllm_server.log()
    line = next(x for x in log.splitlines() if f"Received request {response_id}-0" in x)
    assert "prompt: 'Tell me ', params: SamplingParams(" in line  # cut to --max-log-len 8
    assert "temperature=0.5" in line and "max_tokens=2" in line
    assert "--trust-remote-code: would let transformers run Python code" in log
    assert "--gpu-memory-utilization 0.9: would size the KV cache" in log
    assert "temperature=0.0, max_tokens=5 (from " in log
    assert "Uvicorn running on" not in log and '"POST /v1/completions' not in log
