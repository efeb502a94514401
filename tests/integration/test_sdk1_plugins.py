"""The frozen SDK 1.0 plugins (``engine-test-plugin-sdk1``) against today's SDK and engine.

``packages/testing-fixtures/plugins/sdk1`` was written once against engine-plugin-sdk
1.0.0 and is never edited. Every test here proves that one of its plugins is still
*reached* (its counter in ``engine_test_plugin_sdk1.counters.CALLS`` moves, or its effect
shows) and still *selective* (runs and requests that do not select it are untouched). A
failure means a later SDK or engine broke a 1.0 plugin: fix the SDK or the engine, or
the change needs a major version. Never "fix" the plugin.

The groups the engine cannot select yet are loaded through the engine's catalog and
driven through their SDK contracts directly. The IO processor is driven both ways: through
its contract, and through ``POST /pooling`` and ``LLM.encode``.

SDK deprecation warnings are shown, not raised: a feature deprecated in a later 1.x keeps
working until 2.0, so a 1.0 plugin that uses it must still pass (every other warning is
still an error).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pydantic
import pytest
import torch
import torch.nn.functional as F

from engine.core import LLM
from engine.core.messages import CollectiveRpcError
from engine.core.plugins import Allowlist, PluginCatalog
from engine.sdk import (
    CachedRequestData,
    GenerationResult,
    IOProcessorContext,
    KVConnectorContext,
    KVConnectorRole,
    LayerInfo,
    LinearKernelConfig,
    NewRequestData,
    PlatformInfo,
    PluginError,
    RequestStatus,
    SamplingParams,
    SchedulerOutput,
    ValidationError,
)
from engine.sdk import groups as sdk_groups
from engine.sdk.ops import RMSNormOp
from engine.sdk.quantization import check_quantization_support
from engine.testing.contracts import (
    check_kv_connector,
    check_logits_processor,
    check_scheduler,
)
from engine.testing.engine import assert_kv_pool_full
from engine.testing.server import running_server
from engine.testing.test_plugins import PLUGINS_SOURCE, env_with_plugins, run_engine_cli

pytestmark = pytest.mark.filterwarnings("default::engine.sdk.deprecation.SDKDeprecationWarning")

DIST = "engine-test-plugin-sdk1"
SDK1_SOURCE = PLUGINS_SOURCE / "sdk1"

#: sha256 over every file of plugins/sdk1 (see ``_tree_sha256``). It never changes.
FROZEN_SHA256 = "ce3c77bc73b3293c5cd882b0aee5ded4de5c6139a988196328dd0804cfba8a34"

#: Every entry of the distribution, by group.
ENTRIES = {
    sdk_groups.GENERAL_PLUGINS: "sdk1_register",
    sdk_groups.PLATFORMS: "sdk1_cpu",
    sdk_groups.MODELS: "Sdk1LlamaForCausalLM",
    sdk_groups.ATTENTION_BACKENDS: "sdk1_paged",
    sdk_groups.QUANTIZATION: "sdk1_int8",
    sdk_groups.LINEAR_KERNELS: "sdk1_matmul",
    sdk_groups.CUSTOM_OPS: "rms_norm",
    sdk_groups.KV_CONNECTORS: "sdk1_store",
    sdk_groups.SCHEDULERS: "sdk1_fcfs",
    sdk_groups.SCHEDULING_POLICIES: "sdk1_shortest_first",
    sdk_groups.LOGITS_PROCESSORS: "sdk1_no_repeat",
    sdk_groups.WORKER_EXTENSIONS: "sdk1_inspect",
    sdk_groups.STAT_LOGGERS: "sdk1_totals",
    sdk_groups.ENDPOINTS: "sdk1_status",
    sdk_groups.IO_PROCESSORS: "sdk1_batch",
}

#: Three prompts: short, longer than two 16-token blocks, and one greedy decoding repeats.
PROMPTS = ([7, 11, 13, 17, 19, 23], list(range(30, 70)), [5] * 20)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _llm(checkpoint: Path, **kwargs: Any) -> LLM:
    """An in-process engine on ``checkpoint`` that allows the sdk1 distribution."""
    kwargs.setdefault("plugins", DIST)
    kwargs.setdefault("num_kv_blocks", 128)
    return LLM(str(checkpoint), dtype=kwargs.pop("dtype", "float32"), in_process=True,
               **kwargs)


def _greedy(llm: LLM, prompts: Sequence[Sequence[int]] = PROMPTS,
            params: SamplingParams | Sequence[SamplingParams] = GREEDY) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                           use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@contextmanager
def _calls() -> Iterator[Counter[str]]:
    """What the sdk1 plugins counted inside the block (filled in at its end)."""
    from engine_test_plugin_sdk1.counters import CALLS

    before = Counter(CALLS)
    diff: Counter[str] = Counter()
    yield diff
    diff.update({key: value - before[key] for key, value in CALLS.items()
                 if value != before[key]})


def _catalog() -> PluginCatalog:
    return PluginCatalog.discover(Allowlist.from_env(DIST))


@pytest.fixture(scope="session")
def reference(tiny_llama: Path) -> list[list[int]]:
    """Greedy tokens of ``PROMPTS`` with built-ins only (no plugin allowed)."""
    with _llm(tiny_llama, plugins="none") as llm:
        return _greedy(llm)


# -- the distribution as a whole ------------------------------------------------------------


def _tree_sha256(root: Path) -> str:
    """sha256 over (relative path, sha256 of content) of every file, sorted by path."""
    digest = hashlib.sha256()
    files = [p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    for path in sorted(files, key=lambda p: p.relative_to(root).as_posix()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def test_frozen_sources_are_unchanged() -> None:
    assert _tree_sha256(SDK1_SOURCE) == FROZEN_SHA256, (
        f"the files of {SDK1_SOURCE} changed. They are FROZEN: written once against "
        f"engine-plugin-sdk 1.0.0 and never edited, so that CI proves every later 1.x SDK "
        f"and engine still runs a 1.0 plugin unchanged. Restore them. If a test of "
        f"{DIST} fails, fix the SDK or the engine (or the change needs SDK 2.0), never the "
        f"plugin (see {SDK1_SOURCE / 'README.md'})")


def test_plugins_check_reports_every_entry_ok(sdk1_plugin_dir: Path) -> None:
    # --plugins keeps other distributions (e.g. engine-kernels' ops) out of the check.
    result = run_engine_cli(["plugins", "check", DIST, "--plugins", DIST, "--json"],
                            sdk1_plugin_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(result.stdout)
    assert {r["group"]: r["name"] for r in rows} == ENTRIES and len(rows) == len(ENTRIES)
    assert set(ENTRIES) == set(sdk_groups.GROUPS), "one plugin per entry-point group"
    for row in rows:
        assert row["ok"] and row["error"] is None, row
        assert (row["distribution"], row["version"]) == (DIST, "1.0.0")


def test_endpoint_is_opt_in_and_everything_else_is_allowed(sdk1: Path) -> None:
    unset = PluginCatalog.discover(Allowlist.from_env(None))
    decisions = {e.group: unset.decision(e) for e in unset.entries if e.distribution == DIST}
    assert set(decisions) == set(ENTRIES)
    assert not decisions[sdk_groups.ENDPOINTS].allowed
    assert "opt-in" in decisions[sdk_groups.ENDPOINTS].reason
    assert all(d.allowed for g, d in decisions.items() if g != sdk_groups.ENDPOINTS)
    assert ENTRIES[sdk_groups.ENDPOINTS] in _catalog().names(sdk_groups.ENDPOINTS)


# -- seams the engine selects ---------------------------------------------------------------


def test_general_plugin_runs_once_per_process(tiny_llama: Path, sdk1: Path) -> None:
    import os

    from engine_test_plugin_sdk1 import general
    from engine_test_plugin_sdk1.counters import CALLS

    none = PluginCatalog.discover(Allowlist.from_env("none"))
    assert ENTRIES[sdk_groups.GENERAL_PLUGINS] not in none.names(sdk_groups.GENERAL_PLUGINS)
    with _calls() as calls:
        none.run_general_plugins()
    assert calls["sdk1_register.call"] == 0  # not allowed: not called
    with _llm(tiny_llama):
        pass
    with _llm(tiny_llama):  # a second engine in the same process: not called again
        pass
    assert CALLS["sdk1_register.call"] == 1
    assert os.environ[general.ENV_MARKER] == str(os.getpid())
    assert general.REGISTRY == {"sdk1": DIST}


def test_attention_backend(tiny_llama: Path, sdk1: Path, reference: list[list[int]]) -> None:
    with _calls() as calls, _llm(tiny_llama, attention_backend="sdk1_paged", plugin_options={
            "sdk1_paged": {"upcast": False}}) as llm:
        assert _greedy(llm) == reference
        worker = llm.llm_engine.core.worker
        assert worker.built.backend.name == "sdk1_paged"
        impls = [layer.impl for layer in worker.built.factory.attention_layers.values()]
        assert impls and all(impl.upcast is False for impl in impls)  # the option arrived
        assert_kv_pool_full(llm)
    assert calls["sdk1_paged.supports"] >= 1 and calls["sdk1_paged.build"] > 0
    assert calls["sdk1_paged.forward"] == 2 * calls["sdk1_paged.build"]  # 2 layers per step
    with _calls() as calls, _llm(tiny_llama) as llm:  # allowed, not selected
        assert _greedy(llm) == reference
        assert llm.llm_engine.core.worker.built.backend.name == "torch"
    assert calls["sdk1_paged.forward"] == 0 and calls["sdk1_paged.build"] == 0


def test_linear_kernel_only_when_forced(tiny_llama: Path, sdk1: Path,
                                        reference: list[list[int]]) -> None:
    with _calls() as calls, _llm(tiny_llama, linear_kernel="sdk1_matmul") as llm:
        assert _greedy(llm) == reference
        assert_kv_pool_full(llm)
    layers = calls["sdk1_matmul.process_weights_after_loading"]
    assert layers == 9  # 2 x (qkv, o, gate_up, down) + lm_head
    assert calls["sdk1_matmul.apply"] > 0 and calls["sdk1_matmul.apply"] % layers == 0
    with _calls() as calls, _llm(tiny_llama) as llm:  # priority -10: never chosen unforced
        assert _greedy(llm) == reference
    assert calls["sdk1_matmul.apply"] == 0
    kernel_cls = _catalog().load(sdk_groups.LINEAR_KERNELS, "sdk1_matmul")
    config = LinearKernelConfig(scheme="unquantized", weight_dtype="float32",
                                act_dtype="float32", input_size=8, output_size=5, has_bias=True)
    assert kernel_cls.can_implement(config).ok
    assert not kernel_cls.can_implement(LinearKernelConfig(
        scheme="int8_w8a8", weight_dtype="int8", act_dtype="float32", input_size=8,
        output_size=5)).ok
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(5, 8), requires_grad=False)
    kernel = kernel_cls(config)
    kernel.process_weights_after_loading(layer)
    x, bias = torch.randn(3, 8), torch.randn(5)
    torch.testing.assert_close(kernel.apply(layer, x, bias), F.linear(x, layer.weight, bias))


def test_custom_op_replaces_rms_norm_exactly(tiny_llama: Path, sdk1: Path,
                                             reference: list[list[int]]) -> None:
    with _calls() as calls, _llm(tiny_llama) as llm:  # every allowed custom op is used
        assert _greedy(llm) == reference
        model = llm.llm_engine.core.worker.built.model
        assert type(model.norm).__name__ == "Sdk1RMSNorm"
    assert calls["rms_norm.call"] > 0
    with _calls() as calls, _llm(tiny_llama, plugins="none") as llm:
        assert type(llm.llm_engine.core.worker.built.model.norm) is RMSNormOp
        assert _greedy(llm) == reference
    assert calls["rms_norm.call"] == 0
    op_cls = _catalog().load(sdk_groups.CUSTOM_OPS, "rms_norm")
    for dtype in (torch.float32, torch.bfloat16):
        reference_op, op = RMSNormOp(64, 1e-5, dtype=dtype), op_cls(64, 1e-5, dtype=dtype,
                                                                     dispatch_key="cpu")
        with torch.no_grad():
            for o in (reference_op, op):
                o.weight.copy_(torch.linspace(0.5, 1.5, 64))
        x, residual = torch.randn(4, 64, dtype=dtype), torch.randn(4, 64, dtype=dtype)
        x_copy, residual_copy = x.clone(), residual.clone()
        with _calls() as calls:
            got_y, got_residual = op(x, residual)
            got_plain = op(x)
        assert calls["rms_norm.call"] == 2
        want_y, want_residual = reference_op(x.clone(), residual.clone())
        assert torch.equal(got_y, want_y) and torch.equal(got_residual, want_residual)
        assert torch.equal(got_plain, reference_op(x.clone()))
        assert torch.equal(x, x_copy) and torch.equal(residual, residual_copy)
    with _calls() as calls:
        op_cls(64, dispatch_key="native")(torch.randn(2, 64))  # the inherited reference
    assert calls["rms_norm.call"] == 0


def test_scheduler(tiny_llama: Path, sdk1: Path, reference: list[list[int]]) -> None:
    # 6 blocks of 16 tokens for three 52-token sequences: preemption by recompute.
    with _calls() as calls, _llm(tiny_llama, scheduler="sdk1_fcfs", num_kv_blocks=6,
                                 max_model_len=64) as llm:
        assert type(llm.llm_engine.core.scheduler).__name__ == "Sdk1FCFSScheduler"
        assert _greedy(llm) == reference
        assert_kv_pool_full(llm)
    assert calls["sdk1_fcfs.schedule"] > 0 and calls["sdk1_fcfs.preempt"] > 0
    with _calls() as calls, _llm(tiny_llama) as llm:
        assert type(llm.llm_engine.core.scheduler).__name__ != "Sdk1FCFSScheduler"
        assert _greedy(llm) == reference
    assert calls["sdk1_fcfs.schedule"] == 0
    report = check_scheduler(_catalog().load(sdk_groups.SCHEDULERS, "sdk1_fcfs"))
    assert report.num_preempted > 0 and report.num_partial_chunks > 0


def _finish_order(llm: LLM, prompts: dict[str, list[int]]) -> list[str]:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    finished: list[str] = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert_kv_pool_full(llm)
    return finished


def test_scheduling_policy(tiny_llama: Path, sdk1: Path) -> None:
    prompts = {"long": list(range(10, 40)), "short": [3, 4], "medium": list(range(50, 60))}
    options = {"sdk1_shortest_first": {"max_running": 1}}  # one at a time, by its option
    with _calls() as calls, _llm(tiny_llama, max_num_seqs=4, plugin_options=options,
                                 scheduling_policy="sdk1_shortest_first") as llm:
        assert _finish_order(llm, prompts) == ["short", "medium", "long"]
    assert calls["sdk1_shortest_first.sort_key"] >= 3
    assert calls["sdk1_shortest_first.can_admit"] >= 3
    with _calls() as calls, _llm(tiny_llama, max_num_seqs=1) as llm:  # fcfs
        assert _finish_order(llm, prompts) == ["long", "short", "medium"]
    assert calls["sdk1_shortest_first.sort_key"] == 0


def test_logits_processor_applies_only_to_requests_that_ask(
        tiny_llama: Path, sdk1: Path, reference: list[list[int]]) -> None:
    window = GREEDY.max_tokens
    assert len(set(reference[2])) < len(reference[2]), "pick a prompt whose greedy repeats"
    asking = GREEDY.replace(extra_args={"sdk1_no_repeat": window})
    with _calls() as calls, _llm(tiny_llama) as llm:
        mixed = _greedy(llm, [PROMPTS[2], PROMPTS[2], PROMPTS[0]], [asking, GREEDY, GREEDY])
        assert len(set(mixed[0])) == len(mixed[0])  # no token repeated in the window
        assert mixed[1:] == [reference[2], reference[0]]  # the others are untouched
        for bad in ("x", 0, 5000):
            with pytest.raises(ValidationError) as info:  # validate_params, front end
                _greedy(llm, [PROMPTS[0]], GREEDY.replace(extra_args={"sdk1_no_repeat": bad}))
            assert info.value.param == "extra_args.sdk1_no_repeat"
        assert_kv_pool_full(llm)
    assert calls["sdk1_no_repeat.apply"] > 0 and calls["sdk1_no_repeat.rows_changed"] > 0
    cls = _catalog().load(sdk_groups.LOGITS_PROCESSORS, "sdk1_no_repeat")

    def make_params(rng: Any) -> SamplingParams:
        if rng.random() < 0.4:
            return SamplingParams()
        return SamplingParams(extra_args={"sdk1_no_repeat": rng.randint(1, 6)})

    def slot_free(params: SamplingParams, prompt_ids: Any, output_ids: Sequence[int],
                  row: torch.Tensor) -> torch.Tensor:
        size = (params.extra_args or {}).get("sdk1_no_repeat")
        for token in output_ids[-size:] if size else ():
            row[token] = float("-inf")
        return row

    report = check_logits_processor(cls, make_params, reference=slot_free, steps=600)
    assert report.num_rows_changed > 0


def test_model_plugin_serves_its_architecture(tiny_llama: Path, sdk1: Path, tmp_path: Path,
                                              reference: list[list[int]]) -> None:
    checkpoint = tmp_path / "sdk1-llama"
    shutil.copytree(tiny_llama, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    config["architectures"] = ["Sdk1LlamaForCausalLM"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    with _calls() as calls, _llm(checkpoint) as llm:
        model = llm.llm_engine.core.worker.built.model
        assert type(model).__name__ == "Sdk1LlamaForCausalLM"
        assert len(model.loaded_names) == 21  # every tensor of the checkpoint
        assert _greedy(llm) == reference  # the same weights: the same tokens as built-in Llama
        assert_kv_pool_full(llm)
    assert calls["Sdk1LlamaForCausalLM.load_weights"] == 1
    assert calls["Sdk1LlamaForCausalLM.forward"] > 0
    with _calls() as calls, _llm(tiny_llama) as llm:  # a checkpoint naming LlamaForCausalLM
        assert type(llm.llm_engine.core.worker.built.model).__name__ == "LlamaForCausalLM"
    assert calls["Sdk1LlamaForCausalLM.forward"] == 0
    with pytest.raises(PluginError, match="Sdk1LlamaForCausalLM"):  # only the plugin has it
        _llm(checkpoint, plugins="none")


def test_platform_claims_the_host_only_when_enabled(
        tiny_llama: Path, sdk1: Path, reference: list[list[int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    with _calls() as calls, _llm(tiny_llama) as llm:
        assert llm.llm_engine.setup.platform.name == "cpu"
    assert calls["sdk1_cpu.detect"] >= 1 and calls["sdk1_cpu.check_and_update_config"] == 0
    monkeypatch.setenv("ENGINE_TEST_SDK1_PLATFORM", "1")
    with _calls() as calls, _llm(tiny_llama, dtype="auto") as llm:
        setup = llm.llm_engine.setup
        assert setup.platform.name == "sdk1_cpu"
        assert setup.block_size == 32  # check_and_update_config rounded 16 up
        assert setup.dtype is torch.float32
        assert llm.llm_engine.core.worker.built.backend.name == "sdk1_paged"  # its default
        assert setup.enforce_eager is True  # check_and_update_config set it: applied
        assert _greedy(llm) == reference
        assert_kv_pool_full(llm)
    assert calls["sdk1_cpu.is_available"] >= 1 and calls["sdk1_paged.forward"] > 0
    assert calls["sdk1_cpu.default_attention_backend"] >= 1


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


def test_custom_ops_flag_turns_the_replacement_off(tiny_llama: Path, sdk1: Path,
                                                   reference: list[list[int]]) -> None:
    for items in (("-rms_norm",), ("none",)):
        with _calls() as calls, _llm(tiny_llama, custom_ops=items) as llm:
            assert type(llm.llm_engine.core.worker.built.model.norm) is RMSNormOp
            assert _greedy(llm) == reference
        assert calls["rms_norm.call"] == 0
    with _calls() as calls, _llm(tiny_llama, custom_ops=("none", "+rms_norm")) as llm:
        assert type(llm.llm_engine.core.worker.built.model.norm).__name__ == "Sdk1RMSNorm"
        assert _greedy(llm) == reference
    assert calls["rms_norm.call"] > 0


def test_plugins_list_shows_each_op_implementation(sdk1_plugin_dir: Path) -> None:
    listed = run_engine_cli(["plugins", "list", "--plugins", DIST], sdk1_plugin_dir)
    assert listed.returncode == 0, listed.stderr
    assert ("  rms_norm                     engine_test_plugin_sdk1.ops:Sdk1RMSNorm "
            f"({DIST} 1.0.0)  [default: an allowed replacement is used]") in listed.stdout
    assert ("  silu_and_mul                 built-in engine.sdk.ops:SiluAndMulOp  [no "
            "replacement is installed]") in listed.stdout
    off = run_engine_cli(["plugins", "list", "--plugins", DIST, "--custom-ops=-rms_norm",
                          "--json"], sdk1_plugin_dir)
    assert off.returncode == 0, off.stderr
    [row] = [r for r in json.loads(off.stdout) if r["group"] == sdk_groups.CUSTOM_OPS]
    assert (row["name"], row["used"], row["used_reason"]) == (
        "rms_norm", False, "--custom-ops: -rms_norm")
    bad = run_engine_cli(["plugins", "list", "--plugins", DIST, "--custom-ops", "+rms"],
                         sdk1_plugin_dir)
    assert bad.returncode == 2 and "rms_norm, rotary_embedding, silu_and_mul" in bad.stderr


def test_stat_logger_under_llm(tiny_llama: Path, sdk1: Path) -> None:
    from engine_test_plugin_sdk1.stats import TOTALS

    before = json.loads(json.dumps(TOTALS))
    with _calls() as calls, _llm(tiny_llama, plugin_options={
            "sdk1_totals": {"keep_recent": 5}}) as llm:
        assert "sdk1_totals" in llm.llm_engine.stat_loggers.loggers
        _greedy(llm)
    assert TOTALS["generation_tokens"] - before["generation_tokens"] == 3 * GREEDY.max_tokens
    assert TOTALS["finished"]["length"] - before["finished"].get("length", 0) == 3
    assert TOTALS["engines"][-1]["num_kv_blocks"] == 128  # log_engine_initialized
    assert calls["sdk1_totals.record"] > 0  # and the default shutdown() ran at the end
    before = json.loads(json.dumps(TOTALS))
    with _llm(tiny_llama, plugins="none") as llm:
        _greedy(llm)
    assert TOTALS == before


def test_io_processor_through_llm_encode(tiny_llama: Path, sdk1: Path) -> None:
    options = {"sdk1_batch": {"prefix": "Q: ", "max_items": 3}}
    with _calls() as calls, _llm(tiny_llama, io_processor="sdk1_batch",
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
    with _calls() as calls, _llm(tiny_llama) as llm:  # allowed, not selected: not reached
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


def test_quantization_through_the_engine(tiny_llama: Path, sdk1: Path, tmp_path: Path,
                                         reference: list[list[int]]) -> None:
    with _calls() as calls, _llm(tiny_llama, quantization="sdk1_int8") as llm:
        got = _greedy(llm)
        setup = llm.llm_engine.setup
        model = llm.llm_engine.core.worker.model
        assert setup.quantization is not None and setup.quantization.name == "sdk1_int8"
        qkv = model.layers[0].self_attn.qkv_proj
        assert qkv.weight.dtype == torch.int8 and qkv.weight_scale.shape == (128,)
        assert model.lm_head.weight.dtype == torch.float32  # kind lm_head: left unquantized
        assert_kv_pool_full(llm)
    assert [t[:6] for t in got] == [t[:6] for t in reference]  # int8 rows: close, not equal
    layers = 8  # 2 x (qkv, o, gate_up, down)
    assert calls["sdk1_int8.from_config"] >= 1
    assert calls["sdk1_int8.create_weights"] == calls[
        "sdk1_int8.process_weights_after_loading"] == layers
    assert calls["sdk1_int8.apply"] > 0 and calls["sdk1_int8.apply"] % layers == 0
    # Selected by the checkpoint: config.json's quantization_config, then its own file.
    checkpoint = shutil.copytree(tiny_llama, tmp_path / "quantized")
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "sdk1_int8",
                                     "modules_to_not_convert": ["o_proj"]}
    (checkpoint / "config.json").write_text(json.dumps(config))
    with _calls() as calls, _llm(checkpoint) as llm:
        layer = llm.llm_engine.core.worker.model.layers[1]
        assert layer.self_attn.o_proj.weight.dtype == torch.float32  # its setting arrived
        assert layer.mlp.down_proj.weight.dtype == torch.int8
    assert calls["sdk1_int8.create_weights"] == layers - 2
    del config["quantization_config"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    (checkpoint / "sdk1_quant.json").write_text(json.dumps({"quant_method": "sdk1_int8"}))
    with _calls() as calls, _llm(checkpoint) as llm:
        assert llm.llm_engine.setup.quantization.origin == "sdk1_quant.json"  # type: ignore[union-attr]
    assert calls["sdk1_int8.create_weights"] == layers
    with _calls() as calls, _llm(tiny_llama) as llm:  # allowed, not selected
        assert llm.llm_engine.setup.quantization is None
        assert _greedy(llm) == reference
    assert not any(key.startswith("sdk1_int8.") for key in calls)


# -- seams the engine does not select yet: driven through their SDK contracts ---------------


def test_quantization_stores_int8_and_applies(sdk1: Path) -> None:
    from engine.core.attention import TorchAttentionBackend
    from engine.core.model_executor.layers import LayerFactory

    cls = _catalog().load(sdk_groups.QUANTIZATION, "sdk1_int8")
    assert check_quantization_support(cls, PlatformInfo("cpu", "cpu"), "float32").ok
    no_dtype = check_quantization_support(cls, PlatformInfo("cpu", "cpu"), "float16")
    assert not no_dtype.ok and "float32, bfloat16" in no_dtype.reason
    assert "found npu" in check_quantization_support(cls, PlatformInfo("npu", "npu"),
                                                     "float32").reason
    with pytest.raises(ValidationError) as info:
        cls.from_config({"modules_to_not_convert": "o_proj"})
    assert info.value.param == "modules_to_not_convert"
    config = cls.from_config({"quant_method": "sdk1_int8", "modules_to_not_convert": ["o_proj"]})
    embedding = LayerInfo(prefix="model.embed_tokens", kind="embedding", input_size=512,
                          output_size=64, input_size_per_partition=512,
                          output_partition_sizes=(64,), params_dtype="float32")
    assert config.get_quant_method(embedding, embedding.prefix) is None
    factory = LayerFactory(dtype=torch.float32, block_size=16,
                           attention_backend=TorchAttentionBackend, quant_config=config)
    skipped = factory.linear("model.layers.0.self_attn.o_proj", 64, (64,))
    assert skipped.weight.dtype == torch.float32  # modules_to_not_convert
    layer = factory.linear("model.layers.0.self_attn.qkv_proj", 64, (64, 32, 32), bias=True)
    torch.manual_seed(0)
    shards = [torch.randn(n, 64) for n in (64, 32, 32)]
    for shard, tensor in enumerate(shards):
        layer.load_weight("weight", tensor, shard)
    bias = torch.randn(128)
    layer.load_weight("bias", bias, None)
    layer.process_weights_after_loading()
    assert layer.weight.dtype == torch.int8 and tuple(layer.weight.shape) == (128, 64)
    assert layer.weight_scale.dtype == torch.float32 and tuple(layer.weight_scale.shape) == (128,)
    weight = torch.cat(shards)
    scale = weight.abs().amax(1) / 127
    dequantized = torch.round(weight / scale[:, None]).clamp(-127, 127) * scale[:, None]
    x = torch.randn(5, 64)
    out = layer(x)
    torch.testing.assert_close(out, F.linear(x, dequantized, bias))
    exact = F.linear(x, weight, bias)  # int8 with per-row scales: within ~1% of it
    assert float((out - exact).norm() / exact.norm()) < 0.02


_NO_PARAMS = SamplingParams()


@dataclass(frozen=True)
class _View:
    """A request as the scheduler shows it (satisfies ``engine.sdk.RequestView``)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    num_computed_tokens: int = 0
    output_token_ids: tuple[int, ...] = ()
    sampling_params: SamplingParams = _NO_PARAMS
    priority: int = 0
    arrival_time: float = 0.0
    status: RequestStatus = RequestStatus.WAITING

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


def _step(request: _View, block_ids: tuple[int, ...], num_computed_tokens: int,
          num_tokens: int) -> SchedulerOutput:
    """A step that sends ``request`` as new and computes ``num_tokens`` more of it."""
    new = NewRequestData(request.request_id, request.prompt_token_ids, SamplingParams(),
                         block_ids, num_computed_tokens=num_computed_tokens)
    return SchedulerOutput((new,), CachedRequestData(), {request.request_id: num_tokens},
                           num_tokens)


def test_kv_connector_sides_exchange_metadata(sdk1: Path) -> None:
    cls = _catalog().load(sdk_groups.KV_CONNECTORS, "sdk1_store")
    layers = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")

    def context(role: KVConnectorRole) -> KVConnectorContext:
        return KVConnectorContext(plugin_name="sdk1_store", role=role, engine_id="e1",
                                  block_size=4, num_blocks=10, num_layers=2, layer_names=layers,
                                  num_kv_heads=2, head_size=8, kv_cache_dtype="float32")

    scheduler = cls.scheduler_cls(context(KVConnectorRole.SCHEDULER))
    worker = cls.worker_cls(context(KVConnectorRole.WORKER))
    caches = {name: torch.randn(2, 10, 4, 2, 8) for name in layers}  # block index: dim 1
    worker.register_kv_caches(caches)

    def run_step(meta: Any) -> None:  # the worker's part of one step, after the wire
        decoded = cls.metadata_cls.from_bytes(meta.to_bytes())
        assert decoded == meta
        worker.start_load_kv(decoded)
        for name in layers:
            worker.wait_for_layer_load(name)
            worker.save_kv_layer(name, caches[name], None)
        worker.wait_for_save()
        assert worker.get_finished(set()) == (set(), set())

    first = _View("first", tuple(range(100, 110)))  # 2 full blocks + 2 tokens
    assert scheduler.get_num_new_matched_tokens(first, 0) == (0, False)
    scheduler.update_state_after_alloc(first, [3, 5, 7], 0)
    meta = scheduler.build_connector_meta(_step(first, (3, 5, 7), 0, 10))
    assert list(meta.saves) == [3, 5] and meta.loads == {}
    first_keys = list(meta.saves.values())
    wire = json.loads(meta.to_bytes())  # the SDK's default wire format: JSON, bytes as text
    assert list(wire["saves"]) == ["3", "5"] and all(isinstance(k, str) for k in
                                                     wire["saves"].values())
    run_step(meta)
    assert scheduler.request_finished(first, [3, 5, 7]) == (
        False, {"sdk1_stored_blocks": 2, "engine_id": "e1"})
    saved = {name: cache[:, [3, 5]].clone() for name, cache in caches.items()}

    second = _View("second", (*range(100, 108), 1, 2, 3, 4, 5))  # same 2 blocks
    assert scheduler.get_num_new_matched_tokens(second, 0) == (8, False)
    assert scheduler.get_num_new_matched_tokens(second, 0) == (8, False)  # no side effects
    assert scheduler.get_num_new_matched_tokens(second, 4) == (4, False)
    scheduler.update_state_after_alloc(second, [2, 4, 6, 8], 8)
    meta = scheduler.build_connector_meta(_step(second, (2, 4, 6, 8), 8, 5))
    assert meta.loads == dict(zip((2, 4), first_keys, strict=True))
    assert list(meta.saves) == [6]  # its third block is new
    for cache in caches.values():
        cache[:, [2, 4]] = 0.0
    run_step(meta)
    for name, cache in caches.items():  # the stored blocks arrived in the new block ids
        assert torch.equal(cache[:, [2, 4]], saved[name])
    assert worker.steps_seen == [1, 2]
    empty = scheduler.build_connector_meta(_step(second, (2, 4, 6, 8), 13, 1))
    assert empty.loads == {} and empty.saves == {}  # per-step state was reset
    chunked = _View("chunked", tuple(range(200, 212)))  # 3 blocks, 5 tokens computed now
    scheduler.update_state_after_alloc(chunked, [1, 9], 0)
    meta = scheduler.build_connector_meta(_step(chunked, (1, 9), 0, 5))
    assert list(meta.saves) == [1]  # only the block whose KV is computed
    with pytest.raises(pydantic.ValidationError):  # a malformed payload fails loudly
        cls.metadata_cls.from_bytes(b'{"loads": {"0": "AA=="}}')  # block 0: the null block


def test_kv_connector_through_the_engine(tiny_llama: Path, sdk1: Path,
                                        reference: list[list[int]]) -> None:
    # Selected with kv_connector="sdk1_store": both sides run inside a real engine, and
    # the blocks it stored come back as cached tokens once the prefix cache is dropped.
    prompts = [{"prompt_token_ids": list(p)} for p in PROMPTS]
    with _calls() as calls, _llm(tiny_llama, kv_connector="sdk1_store") as llm:
        assert _greedy(llm) == reference
        assert llm.llm_engine.core.reset_prefix_cache()
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == reference
        assert [o.num_cached_tokens for o in outputs] == [0, 32, 16]  # its full blocks
        assert_kv_pool_full(llm)
    assert calls["sdk1_store.register_kv_caches"] == 1
    assert calls["sdk1_store.request_finished"] == 2 * len(PROMPTS)
    steps = calls["sdk1_store.build_connector_meta"]
    assert steps > 0 and calls["sdk1_store.start_load_kv"] == steps
    assert calls["sdk1_store.wait_for_save"] == steps
    assert calls["sdk1_store.save_kv_layer"] == calls["sdk1_store.wait_for_layer_load"] > 0
    assert calls["sdk1_store.update_state_after_alloc"] == 2 * len(PROMPTS)
    with _calls() as calls, _llm(tiny_llama) as llm:  # allowed, not selected: never called
        assert _greedy(llm) == reference
    assert not any(key.startswith("sdk1_store.") for key in calls)
    report = check_kv_connector(_catalog().load(sdk_groups.KV_CONNECTORS, "sdk1_store"))
    assert report.num_external_tokens > 0


def test_worker_extension_through_collective_rpc(tiny_llama: Path, sdk1: Path) -> None:
    with _calls() as calls, _llm(tiny_llama, worker_extensions=["sdk1_inspect"]) as llm:
        worker = llm.llm_engine.core.worker  # uni: the worker runs in this process
        [memory] = llm.collective_rpc("sdk1_memory")
        assert memory == {
            "rank": 0, "world_size": 1, "device": "cpu",
            "parameter_bytes": sum(p.numel() * 4 for p in worker.model.parameters()),
            "kv_cache_bytes": sum(t.numel() * 4 for t in worker.kv_caches.values()),
            "kv_cache_layers": sorted(worker.kv_caches)}
        assert llm.collective_rpc("sdk1_weights_changed") == [False]
        with torch.no_grad():
            worker.model.norm.weight.add_(1.0)
        assert llm.collective_rpc("sdk1_weights_changed") == [True]
    assert calls["sdk1_inspect.init"] == 1 and calls["sdk1_inspect.destroy"] == 1
    assert calls["sdk1_inspect.memory"] == 1
    with _llm(tiny_llama, worker_extensions=["sdk1_inspect"], tensor_parallel_size=2) as llm:
        memories = llm.collective_rpc("sdk1_memory")  # two worker processes
        assert [(m["rank"], m["world_size"]) for m in memories] == [(0, 2), (1, 2)]
        fingerprints = llm.collective_rpc("sdk1_fingerprint", timeout=30)
        assert fingerprints[0]["sha256"] != fingerprints[1]["sha256"]  # each rank's shard
        assert llm.collective_rpc("sdk1_weights_changed") == [False, False]
    with _llm(tiny_llama) as llm:  # allowed, not selected: not reachable
        with pytest.raises(CollectiveRpcError, match="no worker extension defines"):
            llm.collective_rpc("sdk1_memory")


def test_io_processor_round_trip_through_the_engine(tiny_llama: Path, sdk1: Path) -> None:
    cls = _catalog().load(sdk_groups.IO_PROCESSORS, "sdk1_batch")
    with _llm(tiny_llama) as llm:
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
