"""The measured linear-kernel choice: buckets, the decision rule, timing, the disk record."""

from __future__ import annotations

import json
import logging
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F

from engine.core.kernel_choice import selection, store
from engine.core.kernel_choice.buckets import RowBucket, bucket_index, row_buckets, upper_bounds
from engine.core.kernel_choice.plan import KernelPlan, choose
from engine.core.kernel_choice.row_dispatch import RowDispatchKernel
from engine.core.kernel_choice.timing import Timing, time_kernels
from engine.core.model_executor.linear_kernels import TorchLinearKernel
from engine.kernels.cpu.linear import CpuLinearKernel
from engine.kernels.cpu.native import native_kernels
from engine.sdk.linear_kernel import LinearKernel, LinearKernelConfig
from engine.sdk.platform import PlatformInfo
from engine.sdk.support import Support

CPU = PlatformInfo("cpu", "cpu")
#: Big enough to be measured (``MIN_MEASURED_WEIGHTS``), small enough to be quick.
CONFIG = LinearKernelConfig(scheme="unquantized", weight_dtype="float32",
                            act_dtype="float32", input_size=512, output_size=512)
BUCKETS = row_buckets(64)


class _Linear(LinearKernel):
    name: ClassVar[str] = ""
    calls: ClassVar[list[int]]

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        return Support.yes()

    @classmethod
    def can_implement(cls, config: LinearKernelConfig) -> Support:
        return Support.yes()

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight, bias)


class FastPlugin(_Linear):
    """A third party's kernel ranked last by priority, as fast as F.linear."""

    name = "fast_plugin"
    priority = -5


class SlowBuiltin(_Linear):
    """Ranked first, but does the product many times over."""

    name = "slow_builtin"
    priority = 500

    def apply(self, layer, x, bias=None):
        for _ in range(10):
            out = F.linear(x, layer.weight, bias)
        return out


class Raises(_Linear):
    name = "raises"

    def apply(self, layer, x, bias=None):
        raise ZeroDivisionError("boom")


class Wrong(_Linear):
    name = "wrong"

    def apply(self, layer, x, bias=None):
        return torch.zeros(x.shape[0], layer.weight.shape[0], dtype=x.dtype)


class Replaces(_Linear):
    """Replaces the layer's weight (allowed), so it cannot share a layer."""

    name = "replaces"

    def process_weights_after_loading(self, layer):
        layer.weight = torch.nn.Parameter(layer.weight.detach().clone(), requires_grad=False)


def _timing(name: str, *seconds: float, keeps: bool = True, recordable: bool = False,
            ) -> Timing:
    return Timing(name, seconds, (1.0,) * len(seconds), keeps, recordable)


def test_buckets_cover_every_row_count_up_to_the_budget():
    buckets = row_buckets(512)
    assert [b.describe() for b in buckets] == ["1 row", "2-4 rows", "5-64 rows", "65+ rows"]
    assert buckets[-1].rows == 512
    uppers = upper_bounds(buckets)
    assert [bucket_index(uppers, n) for n in (1, 2, 4, 5, 64, 65, 4096)] == [0, 1, 1, 2, 2,
                                                                             3, 3]
    assert row_buckets(3) == (RowBucket(1, 1, 1), RowBucket(2, None, 3))
    assert row_buckets(1) == (RowBucket(1, None, 1),)


def test_the_kernel_fastest_in_most_buckets_runs_all_but_those_another_wins_clearly():
    buckets = row_buckets(512)
    plan = choose([_timing("a", 1.0, 1.0, 1.0, 1.0), _timing("b", 2.0, 2.0, 0.5, 1.05)],
                  buckets, ["a", "b"])
    assert plan.kernels == ("a", "a", "b", "a")  # b within the margin at 65+: a stays
    assert plan.names == ("a", "b") and plan.kernel_for(32) == "b"
    assert plan.kernel_for(1000) == "a"
    # a kernel that changes the layer's parameters cannot share it: the main one runs all
    alone = choose([_timing("a", 1.0, 1.0, 1.0, 1.0),
                    _timing("b", 2.0, 2.0, 0.5, 2.0, keeps=False)], buckets, ["a", "b"])
    assert alone.kernels == ("a",) * 4
    # equal times: priority order decides
    tie = choose([_timing("b", 1.0, 1.0), _timing("a", 1.0, 1.0)], row_buckets(3), ["a", "b"])
    assert tie.kernels == ("a", "a")


def test_a_kernel_the_step_graph_records_is_never_displaced_by_one_it_cannot():
    """One unrecordable product keeps every step out of the graph: it may not win a layer
    or a bucket from a recordable kernel; recordable kernels still compete by time."""
    buckets = row_buckets(512)
    eager = _timing("eager", 0.5, 0.5, 0.5, 0.5)
    graph = _timing("graph", 1.0, 1.0, 1.0, 1.0, recordable=True)
    plan = choose([eager, graph], buckets, ["eager", "graph"])
    assert plan.kernels == ("graph",) * 4
    other = _timing("other", 2.0, 2.0, 0.5, 2.0, recordable=True)
    plan = choose([eager, graph, other], buckets, ["eager", "graph", "other"])
    assert plan.kernels == ("graph", "graph", "other", "graph")
    assert KernelPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    # nothing recordable: time alone decides
    assert choose([eager, _timing("b", 1.0, 1.0, 1.0, 1.0)], buckets,
                  ["b", "eager"]).kernels == ("eager",) * 4


def test_a_kernel_the_graph_records_is_timed_replayed_from_a_graph():
    native = native_kernels()
    if native is None or torch.float32 not in native.packed_matmul_dtypes:
        pytest.skip("the float32 panels are built for AVX-512 CPUs only")
    timings, failed = time_kernels([TorchLinearKernel, CpuLinearKernel], CONFIG, BUCKETS,
                                   CPU, step_graph=True)
    assert failed == {} and {t.name: t.recordable for t in timings} == {"torch": False,
                                                                         "cpu": True}
    timings, _ = time_kernels([CpuLinearKernel], CONFIG, BUCKETS, CPU, step_graph=False)
    assert not timings[0].recordable  # --enforce-eager: timed as it is called


class SeesModes(_Linear):
    name = "sees_modes"
    enabled: ClassVar[list[bool]] = []

    def apply(self, layer, x, bias=None):
        self.enabled.append(torch._C._is_torch_function_enabled())
        return super().apply(layer, x, bias)


def test_kernels_are_timed_without_the_model_builders_device_mode():
    """The worker measures inside ``with torch.device(...)``; steps run without it."""
    SeesModes.enabled.clear()
    with torch.device("cpu"):
        time_kernels([SeesModes], CONFIG, BUCKETS)
    assert SeesModes.enabled and not any(SeesModes.enabled)


def test_a_choice_made_under_instruction_limits_is_kept_apart(monkeypatch):
    """A build for an older CPU (``-march=haswell``) or torch/oneDNN held to AVX2 measures
    other kernels: their records must not be read without those limits, nor the reverse."""
    for name in ("ENGINE_CPU_KERNELS_MARCH", *selection.ISA_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    assert "isa" not in selection.machine_key()
    monkeypatch.setenv("ENGINE_CPU_KERNELS_MARCH", "haswell")
    assert selection.machine_key()["isa"] == {"march": "haswell"}
    monkeypatch.delenv("ENGINE_CPU_KERNELS_MARCH")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert selection.machine_key()["isa"] == {"march": "native", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def test_a_plan_describes_its_times_and_round_trips_through_json():
    plan = choose([_timing("a", 1e-5, 2e-5), _timing("b", 3e-5, 1e-5)], row_buckets(3),
                  ["a", "b"], {"c": "ZeroDivisionError: boom"})
    assert plan.describe() == "a for 1 row (10.0 µs; b 30.0); b for 2+ rows (10.0 µs; a 20.0)"
    assert KernelPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    with pytest.raises(ValueError, match="one kernel per bucket"):
        KernelPlan.from_json({**plan.to_json(), "kernels": ["a"]})


def test_timing_leaves_out_a_kernel_that_raises_or_multiplies_wrong_and_names_why():
    timings, failed = time_kernels([TorchLinearKernel, Raises, Wrong, Replaces], CONFIG,
                                   BUCKETS)
    assert [t.name for t in timings] == ["torch", "replaces"]
    assert failed["raises"] == "ZeroDivisionError: boom"
    assert "differs from F.linear's" in failed["wrong"]
    keeps = {t.name: t.keeps_layer for t in timings}
    assert keeps == {"torch": True, "replaces": False}
    assert all(len(t.seconds) == len(BUCKETS) and min(t.seconds) > 0 for t in timings)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    return tmp_path / store.SUBDIR


def _selector(*kernels: type[LinearKernel], step_tokens: int = 64,
              disabled: tuple[str, ...] = ()) -> selection.MeasuredSelector:
    return selection.MeasuredSelector(kernels, CPU, disabled=disabled,
                                      step_tokens=step_tokens,
                                      versions={"fast_plugin": "acme 1.0"})


def test_a_faster_third_party_kernel_wins_over_priority_and_the_choice_is_kept(
        cache, monkeypatch, caplog):
    monkeypatch.setattr(selection, "STEADY_SPREAD", float("inf"))  # kept, however busy
    with caplog.at_level(logging.INFO, logger=selection.__name__):
        assert _selector(SlowBuiltin, FastPlugin)(CONFIG) is FastPlugin
    assert "linear kernel for scheme=unquantized" in caplog.text
    assert "fast_plugin for 1 row" in caplog.text and "measured in" in caplog.text
    [record] = store.stored()
    assert record.path.parent == cache and record.plan.names == ("fast_plugin",)
    assert record.key["kernels"][0][:3] == ["slow_builtin",
                                            f"{__name__}:SlowBuiltin", ""]

    def no_timing(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(selection, "time_kernels", no_timing)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=selection.__name__):
        assert _selector(SlowBuiltin, FastPlugin)(CONFIG) is FastPlugin  # from disk
    assert f"kept in {record.path}" in caplog.text
    # another token budget (other buckets), another candidate set: measured again
    with pytest.raises(AssertionError, match="measured again"):
        _selector(SlowBuiltin, FastPlugin, step_tokens=8)(CONFIG)
    with pytest.raises(AssertionError, match="measured again"):
        _selector(SlowBuiltin, FastPlugin, TorchLinearKernel)(CONFIG)
    assert store.clear() == 1 and store.stored() == []


def test_what_is_not_measured_keeps_the_priority_order(cache, monkeypatch):
    monkeypatch.setattr(selection, "time_kernels", lambda *a: pytest.fail("measured"))
    small = LinearKernelConfig(scheme="unquantized", weight_dtype="float32",
                               act_dtype="float32", input_size=64, output_size=64)
    quantized = LinearKernelConfig(scheme="int8_w8a8", weight_dtype="int8",
                                   act_dtype="float32", input_size=512, output_size=512)
    for config in (small, quantized):
        assert _selector(SlowBuiltin, FastPlugin)(config) is SlowBuiltin
    assert _selector(SlowBuiltin, FastPlugin, disabled=("slow_builtin",))(CONFIG) is FastPlugin
    assert selection.make_selector("priority", [FastPlugin], CPU, forced=None, disabled=(),
                                   step_tokens=64, versions={}) is None
    assert selection.make_selector("measured", [FastPlugin], CPU, forced="fast_plugin",
                                   disabled=(), step_tokens=64, versions={}) is None


def test_a_choice_timed_on_a_busy_machine_is_measured_again_a_few_times(
        cache, monkeypatch, caplog):
    n = len(BUCKETS)
    unsteady = [Timing("slow_builtin", (2.0,) * n, (3.0,) * n, True),
                Timing("fast_plugin", (1.0,) * n, (1.0,) * n, True)]
    measured = []
    monkeypatch.setattr(selection, "time_kernels",
                        lambda *a, **k: measured.append(1) or (unsteady, {}))
    for attempt in range(1, selection.MAX_ATTEMPTS + 2):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=selection.__name__):
            assert _selector(SlowBuiltin, FastPlugin)(CONFIG) is FastPlugin
        [record] = store.stored()
        if attempt <= selection.MAX_ATTEMPTS:
            assert len(measured) == attempt and record.attempts == attempt
            assert "the machine is busy" in caplog.text and not record.steady
            last = attempt == selection.MAX_ATTEMPTS
            assert ("kept after 3 tries: `engine kernels clear` measures again" in caplog.text
                    ) is last
        else:  # used from disk from then on
            assert len(measured) == selection.MAX_ATTEMPTS
            assert "measured in" not in caplog.text and "kept in" in caplog.text


def test_a_kernel_left_out_is_named_with_its_distribution(cache, monkeypatch, caplog):
    monkeypatch.setattr(selection, "time_kernels", lambda *a, **k: (
        [_timing("slow_builtin", *(1.0,) * len(BUCKETS))], {"fast_plugin": "ValueError: no"}))
    with caplog.at_level(logging.WARNING, logger=selection.__name__):
        assert _selector(SlowBuiltin, FastPlugin)(CONFIG) is SlowBuiltin
    assert ("linear kernel fast_plugin (acme 1.0) left out of the measured choice for "
            "scheme=unquantized") in caplog.text and "ValueError: no" in caplog.text


class _Recording(_Linear):
    def apply(self, layer, x, bias=None):
        type(self).calls.append(x.shape[0])
        return super().apply(layer, x, bias)


class Small(_Recording):
    name = "small"
    calls: ClassVar[list[int]] = []


class Large(_Recording):
    name = "large"
    calls: ClassVar[list[int]] = []


def test_a_layer_whose_buckets_chose_two_kernels_runs_each_step_on_its_rows_kernel():
    plan = KernelPlan(row_buckets(512), ("small", "small", "large", "large"))
    cls = RowDispatchKernel.of(plan, {"small": Small, "large": Large, "other": FastPlugin})
    assert cls.name == "small+large" and set(cls.classes) == {"small", "large"}
    kernel = cls(CONFIG)
    layer = torch.nn.Linear(512, 512, bias=False)
    kernel.process_weights_after_loading(layer)
    for rows in (1, 4, 5, 100):
        x = torch.randn(rows, 512)
        torch.testing.assert_close(kernel.apply(layer, x), F.linear(x, layer.weight))
    assert Small.calls == [1, 4] and Large.calls == [5, 100]


def test_the_engine_measures_each_layer_shape_once_and_generates_the_same_tokens(
        tiny_llama, cache, monkeypatch, caplog):
    from engine.core import LLM, SamplingParams
    from engine.core.model_executor.layers.linear import UnquantizedLinearMethod

    monkeypatch.setattr(selection, "MIN_MEASURED_WEIGHTS", 0)  # the tiny model's too
    monkeypatch.setattr(selection, "STEADY_SPREAD", float("inf"))
    common = {"dtype": "float32", "num_kv_blocks": 64, "in_process": True}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": [4, 8, 15, 16, 23, 42]}
    with caplog.at_level(logging.INFO, logger=selection.__name__):
        measured = LLM(str(tiny_llama), **common)
    decisions = [r.getMessage() for r in caplog.records if r.name == selection.__name__]
    model = measured.llm_engine.core.worker.built.model
    configs = {m.quant_method.kernel.config for m in model.modules()
               if isinstance(getattr(m, "quant_method", None), UnquantizedLinearMethod)}
    assert len(decisions) == len(configs) == len(store.stored()) >= 3
    assert all("(measured in" in message for message in decisions)
    priority = LLM(str(tiny_llama), kernel_selection="priority", **common)
    tokens = [llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
              for llm in (measured, priority)]
    assert tokens[0] == tokens[1]


class Clips(_Linear):
    """Changes the weight's values in place: it cannot share a layer either."""

    name = "clips"

    def process_weights_after_loading(self, layer):
        with torch.no_grad():
            layer.weight.clamp_(-0.01, 0.01)


def test_a_kernel_changing_the_weight_in_place_does_not_share_a_layer():
    timings, failed = time_kernels([Clips, TorchLinearKernel], CONFIG, row_buckets(1))
    assert not failed
    assert {t.name: t.keeps_layer for t in timings} == {"clips": False, "torch": True}


def test_a_layer_run_by_two_kernels_is_not_recorded_by_a_graph_replaying_both_sizes():
    from engine.sdk.capture import CaptureContext, GraphKind

    plan = KernelPlan(row_buckets(512), ("small", "small", "large", "large"))
    kernel = RowDispatchKernel.of(plan, {"small": Small, "large": Large})(CONFIG)
    answer = kernel.capture_support(CaptureContext(kind=GraphKind.CPU_STEP_GRAPH,
                                                   max_tokens=512))
    assert not answer.ok and "small for 1 row; small for 2-4 rows; large for 5-64 rows" in (
        answer.reason)
    small_steps = CaptureContext(kind=GraphKind.CPU_STEP_GRAPH, max_tokens=4)
    assert kernel.capture_support(small_steps) == Small(CONFIG).capture_support(small_steps)
