"""A plugin that raises at run time fails only the requests it served (DESIGN §4.2).

``engine-test-plugin-faults`` raises on demand: a per-request logits processor (one
request fails, the batch goes on), a batch-level one (every request of the step fails,
unless it narrows the failure with ``RowsFailedError``) and a custom op (the forward pass
fails: every request of the step). Each failed request ends with ``finish_reason ==
"error"`` and an error naming the plugin, its group and distribution; the others get the
tokens they get without any fault, every KV block is back in the pool, and the engine
serves the next requests.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.core import LLM, SamplingParams
from engine.core.outputs import RequestOutput
from engine.core.plugin_faults import ForwardAttribution
from engine.core.plugins import PluginEntry
from engine.testing.engine import assert_kv_pool_full
from engine.testing.test_plugins import put_on_path

DIST = "engine-test-plugin-faults"
WHERE = rf"\(group engine\.{{group}}, distribution {DIST} 0\.1\.0\)"
PROMPTS = ([5, 6, 7, 8, 9] * 4, [11, 12, 13] * 5, [20, 21] * 7)


def identity(plugin: str, group: str) -> str:
    return rf"plugin '{plugin}' " + WHERE.format(group=group)


@pytest.fixture
def faults(fault_plugins_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return put_on_path(fault_plugins_dir, monkeypatch)


@pytest.fixture(scope="module")
def llm(fault_plugins_dir: Path, tiny_llama: Path) -> Iterator[LLM]:
    with pytest.MonkeyPatch.context() as mp:
        put_on_path(fault_plugins_dir, mp)
        with LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, in_process=True,
                 plugins=DIST) as engine:
            yield engine


def params(**extra: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                          extra_args=extra or None)


def run(llm: LLM, *extras: dict[str, Any]) -> list[RequestOutput]:
    """One batch: prompt i with ``extras[i]`` (plain params for the rest)."""
    requests = [{"prompt_token_ids": list(p)} for p in PROMPTS]
    all_params = [params(**(extras[i] if i < len(extras) else {})) for i in range(len(PROMPTS))]
    return llm.generate(requests, all_params, use_tqdm=False)


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in run(llm)]


def check(outputs: list[RequestOutput], reference: list[list[int]], failed: list[int],
          message: str, llm: LLM) -> None:
    """``failed`` ended with ``message``; the others equal ``reference``; the pool is full."""
    for index, output in enumerate(outputs):
        completion = output.outputs[0]
        if index in failed:
            assert completion.finish_reason == "error", index
            assert completion.error is not None
            assert re.fullmatch(message, completion.error.message), completion.error.message
        else:
            assert (completion.finish_reason, completion.error) == ("length", None), index
            assert list(completion.token_ids) == reference[index], index
    assert_kv_pool_full(llm)
    assert [list(o.outputs[0].token_ids) for o in run(llm)] == reference  # it serves on


def test_a_per_request_function_that_raises_fails_that_request_only(
        llm: LLM, reference: list[list[int]], caplog: pytest.LogCaptureFixture) -> None:
    from engine_test_plugin_faults import CALLS

    before = CALLS["test_fault_request.apply"]
    with caplog.at_level(logging.ERROR, logger="engine.core"):
        outputs = run(llm, {"fault": "none"}, {"fault": "apply"})
    check(outputs, reference, [1], identity("test_fault_request", "logits_processors")
          + ": apply\\(\\) raised ZeroDivisionError: test_fault_request divided by zero "
            "\\(for this request only\\)", llm)
    assert CALLS["test_fault_request.apply"] - before >= 5 + 1  # request 0 used it throughout
    logged = [r for r in caplog.records if "test_fault_request" in r.getMessage()]
    assert len(logged) == 1 and "failing 1 request(s)" in logged[0].getMessage()


def test_a_request_the_processor_refuses_in_update_state_fails_alone(
        llm: LLM, reference: list[list[int]]) -> None:
    outputs = run(llm, {}, {}, {"fault": "update_state"})
    check(outputs, reference, [2], identity("test_fault_request", "logits_processors")
          + ": update_state\\(\\) raised RuntimeError: test_fault_request refused this "
            "request \\(for this request only\\)", llm)


def test_a_batch_processor_that_raises_fails_every_request_of_the_step(
        llm: LLM, reference: list[list[int]]) -> None:
    outputs = run(llm, {}, {"fault_batch": "raise"})
    check(outputs, reference, [0, 1, 2], identity("test_fault_batch", "logits_processors")
          + ": apply\\(\\) raised RuntimeError: test_fault_batch broke the batch", llm)


def test_a_batch_processor_can_narrow_its_failure_to_rows(
        llm: LLM, reference: list[list[int]]) -> None:
    outputs = run(llm, {"fault_batch": "rows"})
    check(outputs, reference, [0], identity("test_fault_batch", "logits_processors")
          + ": apply\\(\\) raised test_fault_batch failed this row \\(for this request "
            "only\\)", llm)


def test_a_custom_op_that_raises_fails_the_step_not_the_engine(
        llm: LLM, reference: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    from engine_test_plugin_faults import CALLS

    call = CALLS["rms_norm.forward"] + 3  # inside the next forward pass
    monkeypatch.setenv("ENGINE_TEST_FAULT_OP_CALL", str(call))
    outputs = run(llm)
    check(outputs, reference, [0, 1, 2], identity("rms_norm", "custom_ops")
          + f": forward raised RuntimeError: rms_norm failed on call {call}", llm)


def test_a_kernel_that_raises_is_named_from_its_traceback(
        faults: Path, tiny_llama: Path, reference: list[list[int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from engine_test_plugin_faults import CALLS

    with LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, in_process=True,
             plugins=DIST, linear_kernel="test_fault_matmul") as engine:
        call = CALLS["test_fault_matmul.apply"] + 5
        monkeypatch.setenv("ENGINE_TEST_FAULT_KERNEL_CALL", str(call))
        outputs = run(engine)
        check(outputs, reference, [0, 1, 2], identity("test_fault_matmul", "linear_kernels")
              + f": raised RuntimeError: test_fault_matmul failed on call {call} in the "
                "forward pass", engine)


def test_requests_that_do_not_use_the_plugins_are_untouched(
        faults: Path, tiny_llama: Path, reference: list[list[int]]) -> None:
    with LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, in_process=True,
             plugins="none") as plain:
        assert [list(o.outputs[0].token_ids) for o in run(plain)] == reference


def test_the_failure_crosses_the_worker_process_boundary(
        faults: Path, tiny_llama: Path, reference: list[list[int]]) -> None:
    with LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, plugins=DIST,
             in_process=True, distributed_executor_backend="mp") as engine:
        outputs = run(engine, {}, {"fault": "apply"})
        check(outputs, reference, [1], identity("test_fault_request", "logits_processors")
              + ": apply\\(\\) raised ZeroDivisionError: .*", engine)


def test_the_docs_rows_failed_example_fails_only_its_row(
        tmp_path: Path, tiny_llama: Path, reference: list[list[int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/plugins/logits-processors.md, "When the plugin fails at run time"."""
    from engine.testing.docs import code_block

    (tmp_path / "rows_failed.py").write_text(code_block("logits-processors.md",
                                                        "# rows_failed.py"))
    monkeypatch.syspath_prepend(str(tmp_path))
    with LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, in_process=True,
             plugins="none", logits_processors=["rows_failed:CapLogits"]) as engine:
        outputs = run(engine, {"cap": 1e9}, {"cap": -1})
        check(outputs, reference, [1], r"plugin 'rows_failed:CapLogits' \(group "
              r"engine\.logits_processors, .*\): apply\(\) raised cap must be > 0, got -1 "
              r"\(for this request only\)", engine)


class Catalog:
    """The one method ForwardAttribution reads, over the given entries."""

    def __init__(self, *entries: PluginEntry) -> None:
        self.entries = entries

    def allowed(self, group: str) -> list[PluginEntry]:
        return [e for e in self.entries if e.group == group]


def raised_in(module: str) -> BaseException:
    """An exception whose innermost frame is in a module named ``module``."""
    namespace: dict[str, Any] = {"__name__": module}
    exec("def fail():\n    raise RuntimeError('x')", namespace)
    try:
        namespace["fail"]()
    except RuntimeError as exc:
        return exc
    raise AssertionError("unreachable")


def test_a_frame_is_named_by_its_own_package_never_by_the_shared_engine_namespace() -> None:
    """``engine`` is a namespace package: an engine bug in ``engine.core`` names no plugin
    even with a plugin installed under ``engine.kernels``; that plugin's other modules do."""
    kernels = PluginEntry(group="engine.linear_kernels", name="fast",
                          value="engine.kernels.fast_linear:FastKernel",
                          distribution="engine-kernels", version="1.0")
    acme = PluginEntry(group="engine.custom_ops", name="rms_norm",
                       value="acme_plugins.ops.norm:RMSNorm", distribution="acme", version="1")
    attribution = ForwardAttribution(Catalog(kernels, acme))  # type: ignore[arg-type]
    assert attribution.plugin_of(raised_in("engine.core.worker.model_runner")) is None
    assert attribution.plugin_of(raised_in("engine.sdk.linear")) is None
    assert attribution.plugin_of(raised_in("engine.kernels.helpers")) is kernels
    assert attribution.plugin_of(raised_in("engine.kernels.fast_linear")) is kernels
    assert attribution.plugin_of(raised_in("acme_plugins.util")) is acme
    assert attribution.plugin_of(raised_in("torch.nn.functional")) is None
