"""The frozen SDK 1.0 plugins of the front end: stat loggers, endpoints, IO processors.

Each is driven under ``LLM``/``AsyncLLM`` and on a real server (``engine serve``), and the
IO processor through its contract too. See ``test_sdk1_distribution.py`` for what these
tests prove and why the plugin is never edited.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from engine.sdk import (
    GenerationResult,
    IOProcessorContext,
    SamplingParams,
    ValidationError,
)
from engine.sdk import groups as sdk_groups
from engine.testing.sdk1 import (
    DIST,
    GREEDY,
    counting,
    greedy,
    sdk1_catalog,
    sdk1_llm,
)
from engine.testing.server import running_server
from engine.testing.test_plugins import env_with_plugins

pytestmark = pytest.mark.filterwarnings("default::engine.sdk.deprecation.SDKDeprecationWarning")


async def test_stat_logger_receives_every_step(tiny_llama: Path, sdk1: Path) -> None:
    from engine_test_plugin_sdk1.stats import RECENT, TOTALS

    from engine.core.client.async_llm import AsyncLLM, in_process_client
    from engine.core.config import EngineConfig

    async def run(plugins: str) -> AsyncLLM:
        config = EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=64,
                              plugins=plugins, plugin_options={} if plugins == "none" else {
                                  "sdk1_totals": {"keep_recent": 2}})
        llm = AsyncLLM(config, log_stats_interval=0, client=in_process_client)
        await llm.start()
        try:
            for request_id in ("a", "b", "c"):
                async for _ in llm.generate(request_id, "Hello", SamplingParams(
                        temperature=0, max_tokens=4, ignore_eos=True)):
                    pass
        finally:
            await llm.shutdown()
        return llm

    before = json.loads(json.dumps(TOTALS))
    llm = await run(DIST)
    assert "sdk1_totals" in llm.stat_loggers.loggers
    assert TOTALS["generation_tokens"] - before["generation_tokens"] == 12
    assert TOTALS["finished"]["length"] - before["finished"].get("length", 0) == 3
    assert TOTALS["engines"][-1]["num_kv_blocks"] == 64  # log_engine_initialized
    assert [r[0] for r in RECENT] == ["b", "c"]  # the keep_recent option arrived
    before = json.loads(json.dumps(TOTALS))
    llm = await run("none")
    assert "sdk1_totals" not in llm.stat_loggers.loggers
    assert TOTALS == before


def test_stat_logger_under_llm(tiny_llama: Path, sdk1: Path) -> None:
    from engine_test_plugin_sdk1.stats import TOTALS

    before = json.loads(json.dumps(TOTALS))
    with counting() as calls, sdk1_llm(tiny_llama, plugin_options={
            "sdk1_totals": {"keep_recent": 5}}) as llm:
        assert "sdk1_totals" in llm.llm_engine.stat_loggers.loggers
        greedy(llm)
    assert TOTALS["generation_tokens"] - before["generation_tokens"] == 3 * GREEDY.max_tokens
    assert TOTALS["finished"]["length"] - before["finished"].get("length", 0) == 3
    assert TOTALS["engines"][-1]["num_kv_blocks"] == 128  # log_engine_initialized
    assert calls["sdk1_totals.record"] > 0  # and the default shutdown() ran at the end
    before = json.loads(json.dumps(TOTALS))
    with sdk1_llm(tiny_llama, plugins="none") as llm:
        greedy(llm)
    assert TOTALS == before


def test_endpoint_on_a_real_server(tiny_llama: Path, sdk1_plugin_dir: Path) -> None:
    with running_server(tiny_llama, ["--in-process", "--plugins", DIST],
                        served_model_name="tiny", env=env_with_plugins(sdk1_plugin_dir)
                        ) as server:
        status = httpx.get(server.url_for("sdk1/status"))
        assert status.status_code == 200 and status.json()["ready"] is True
        assert status.json()["sdk_version"].startswith("1.")
        assert "endpoint plugin 'sdk1_status'" in server.log()
        client = server.client()
        for extra in ({}, {"extra_args": {"sdk1_no_repeat": 6}}):
            result = client.completions.create(model="tiny", prompt="Hello", max_tokens=6,
                                               temperature=0, extra_body=extra)
            assert result.choices[0].finish_reason == "length"
        bad = httpx.post(server.url_for("v1/completions"), json={
            "model": "tiny", "prompt": "Hello", "max_tokens": 2,
            "vllm_xargs": {"sdk1_no_repeat": "x"}})
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "extra_args.sdk1_no_repeat"
        stats = httpx.get(server.url_for("sdk1/stats")).json()  # the stat logger, served
        assert stats["generation_tokens"] == 12 and stats["finished"] == {"length": 2}
        assert stats["engines"][0]["num_kv_blocks"] == 128
        # Built-in routes are untouched.
        assert httpx.get(server.url_for("health")).status_code == 200
        assert client.models.list().data[0].id == "tiny"


def test_io_processor_through_llm_encode(tiny_llama: Path, sdk1: Path) -> None:
    options = {"sdk1_batch": {"prefix": "Q: ", "max_items": 3}}
    with counting() as calls, sdk1_llm(tiny_llama, io_processor="sdk1_batch",
                                 plugin_options=options) as llm:
        body = llm.encode({"items": ["Hello", [7, 11, 13]]},
                          SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        expected = llm.generate(["Q: Hello", {"prompt_token_ids": [7, 11, 13]}],
                                SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                                use_tqdm=False)
        with pytest.raises(ValidationError) as info:
            llm.encode({"items": ["a", "b", "c", "d"]})  # the max_items option arrived
        assert info.value.param == "items"
    assert body["request_id"].startswith("encode-")
    assert [(o["index"], o["text"], o["num_tokens"], o["finish_reason"])
            for o in body["outputs"]] == [(i, e.outputs[0].text, 4, "length")
                                          for i, e in enumerate(expected)]
    assert calls["sdk1_batch.parse_request"] == 2 and calls["sdk1_batch.post_process"] == 1
    with counting() as calls, sdk1_llm(tiny_llama) as llm:  # allowed, not selected: not reached
        with pytest.raises(ValidationError, match="installed: sdk1_batch"):
            llm.encode({"items": ["Hello"]})
    assert not [key for key in calls if key.startswith("sdk1_batch")]


def test_io_processor_on_a_real_server(tiny_llama: Path, sdk1_plugin_dir: Path) -> None:
    with running_server(tiny_llama, ["--in-process", "--plugins", DIST, "--io-processor",
                                     "sdk1_batch", "--plugin-option", "sdk1_batch.max_items=2"],
                        served_model_name="tiny", env=env_with_plugins(sdk1_plugin_dir)
                        ) as server:
        response = httpx.post(server.url_for("pooling"), json={"items": ["Hello", [7, 11]]},
                              timeout=60)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["request_id"].startswith("pool-")
        assert [o["index"] for o in body["outputs"]] == [0, 1]
        assert all(1 <= o["num_tokens"] <= 16 for o in body["outputs"])  # vLLM's defaults
        bad = httpx.post(server.url_for("pooling"), json={"items": ["a", "b", "c"]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "items"
        bad = httpx.post(server.url_for("pooling"), json={"items": ["a", [1, -2]]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "items[1]"
        # The other routes are untouched.
        result = server.client().completions.create(model="tiny", prompt="Hello",
                                                    max_tokens=3, temperature=0)
        assert result.choices[0].finish_reason in ("length", "stop")


def test_io_processor_round_trip_through_the_engine(tiny_llama: Path, sdk1: Path) -> None:
    cls = sdk1_catalog().load(sdk_groups.IO_PROCESSORS, "sdk1_batch")
    with sdk1_llm(tiny_llama) as llm:
        proc = cls(IOProcessorContext(
            plugin_name="sdk1_batch", options=cls.Options(prefix="Q: ", max_items=3),
            process="frontend", model=str(tiny_llama),
            max_model_len=llm.llm_engine.setup.max_model_len))
        request = proc.parse_request({"items": ["Hello", [7, 11, 13]]})
        prompts = proc.pre_process(request, request_id="io-1")
        assert [(p.text, p.token_ids) for p in prompts] == [("Q: Hello", None),
                                                           (None, (7, 11, 13))]
        inputs = [p.text if p.text is not None else {"prompt_token_ids": list(p.token_ids)}
                  for p in prompts]
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        outputs = llm.generate(inputs, params, use_tqdm=False)
        results = [GenerationResult(f"io-1-{i}", o.outputs[0].text,
                                    tuple(o.outputs[0].token_ids), o.outputs[0].finish_reason)
                   for i, o in enumerate(outputs)]
        body = proc.post_process(results, request_id="io-1")
        assert json.loads(json.dumps(body)) == body
        assert body["request_id"] == "io-1"
        assert [(o["index"], o["num_tokens"], o["finish_reason"]) for o in body["outputs"]] == [
            (0, 4, "length"), (1, 4, "length")]
        assert body["outputs"][0]["text"] == outputs[0].outputs[0].text
        for bad, param in (({}, "items"), ({"items": []}, "items"), ({"items": [""]}, "items[0]"),
                           ({"items": ["a", [1, -2]]}, "items[1]"),
                           ({"items": ["a", "b", "c", "d"]}, "items"),
                           ({"items": [[1] * 300]}, "items[0]")):
            with pytest.raises(ValidationError) as info:
                proc.parse_request(bad)
            assert info.value.param == param
