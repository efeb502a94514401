"""Layers of one model with different attention specs: groups, per-group metadata, fallback."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from engine.core.attention import TorchAttentionBackend
from engine.core.attention.layer_groups import (
    GroupedMetadata,
    GroupedMetadataBuilder,
    group_layers,
    make_builder,
)
from engine.core.model_executor.layers import LayerFactory
from engine.core.model_executor.models.llama import Qwen2ForCausalLM
from engine.kernels.cpu.attention import CpuAttentionBackend
from engine.sdk.attention import AttentionSpec, CommonAttentionMetadata
from engine.sdk.capture import CaptureContext, GraphKind
from engine.sdk.errors import UnsupportedError
from engine.sdk.model import ModelContext
from engine.sdk.support import Support
from engine.testing.model_checks import ModelChecks
from engine.testing.models import build_tiny_checkpoint

BLOCK = 4
WINDOW = 3


@dataclass
class WindowPerLayer(LayerFactory):
    """A factory giving each layer the window its ``layer_types`` entry says (as Qwen2's
    ``layer_types`` in transformers): the engine's Qwen2 gives every layer the config's."""

    layer_types: tuple[str, ...] = ()

    def attention(self, prefix: str, **kwargs: Any) -> Any:  # type: ignore[override]
        index = int(prefix.split(".")[2])  # model.layers.N.self_attn.attn
        if self.layer_types[index] != "sliding_attention":
            kwargs["sliding_window"] = None
        return super().attention(prefix, **kwargs)


def build(tmp_path: Path, backend: Any, layer_types: list[str]) -> tuple[Any, Any, LayerFactory]:
    from transformers import AutoModelForCausalLM

    path = build_tiny_checkpoint(tmp_path / "qwen2", "qwen2", use_sliding_window=True,
                                 sliding_window=WINDOW, max_window_layers=0,
                                 layer_types=layer_types)  # two layers
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.config.layer_types == layer_types
    factory = WindowPerLayer(dtype=torch.float32, block_size=BLOCK, attention_backend=backend,
                             layer_types=tuple(layer_types))
    model = Qwen2ForCausalLM(ModelContext(hf_config=hf.config, layers=factory))
    model.load_weights(hf.state_dict().items())
    return hf, model, factory


class Steps:
    """Steps of several requests over one paged cache, metadata from the engine's builder."""

    def __init__(self, model: Any, factory: LayerFactory, backend: Any) -> None:
        self.model = model
        layers = factory.attention_layers
        spec = next(iter(layers.values())).impl.params.spec
        shape = backend.get_kv_cache_shape(128, BLOCK, spec.num_kv_heads, spec.head_size)
        for layer in layers.values():
            layer.kv_cache = torch.zeros(shape)
        self.builder = make_builder(backend, {n: a.impl.params.spec for n, a in layers.items()},
                                    device="cpu", max_num_reqs=8, max_num_batched_tokens=512,
                                    max_model_len=256)
        self.next_block = 1
        self.blocks: list[list[int]] = []

    def run(self, tokens: list[list[int]], cached: list[int]) -> tuple[torch.Tensor, list[int]]:
        """One step: request i adds ``tokens[i]`` after ``cached[i]`` cached tokens."""
        while len(self.blocks) < len(tokens):
            self.blocks.append([])
        slots, positions, starts = [], [], [0]
        for i, (new, done) in enumerate(zip(tokens, cached, strict=True)):
            total = done + len(new)
            while len(self.blocks[i]) * BLOCK < total:
                self.blocks[i].append(self.next_block)
                self.next_block += 1
            slots += [self.blocks[i][p // BLOCK] * BLOCK + p % BLOCK for p in range(done, total)]
            positions += list(range(done, total))
            starts.append(starts[-1] + len(new))
        width = max(len(b) for b in self.blocks[:len(tokens)])
        table = [b + [0] * (width - len(b)) for b in self.blocks[:len(tokens)]]
        qsl = torch.tensor(starts, dtype=torch.int32)
        seq_lens = torch.tensor([d + len(t) for d, t in zip(cached, tokens, strict=True)],
                                dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_lens,
            seq_lens_cpu=seq_lens, block_table=torch.tensor(table, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64), num_reqs=len(tokens),
            num_actual_tokens=starts[-1], max_query_len=max(len(t) for t in tokens),
            max_seq_len=int(seq_lens.max()))
        ids = torch.tensor([t for new in tokens for t in new])
        with torch.inference_mode():
            hidden = self.model(ids, torch.tensor(positions), self.builder.build(common))
            return self.model.compute_logits(hidden), starts


LAYER_TYPES = [["full_attention", "sliding_attention"], ["sliding_attention", "full_attention"]]


@pytest.mark.parametrize("backend", [TorchAttentionBackend, CpuAttentionBackend],
                         ids=lambda b: b.name)
@pytest.mark.parametrize("layer_types", LAYER_TYPES, ids=["full_first", "sliding_first"])
def test_alternating_windows_match_transformers(backend: Any, layer_types: list[str],
                                                tmp_path: Path) -> None:
    hf, model, factory = build(tmp_path, backend, layer_types)
    steps = Steps(model, factory, backend)
    assert isinstance(steps.builder, GroupedMetadataBuilder)
    assert [b.ctx.spec.sliding_window for b in steps.builder.builders] == [
        WINDOW if layer_types[0] == "sliding_attention" else None,
        None if layer_types[0] == "sliding_attention" else WINDOW]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 17, 1, 9)]
    logits, starts = steps.run(prompts, [0] * len(prompts))
    # Then two decode steps, and one with a chunk and decodes mixed.
    sequences = [list(p) for p in prompts]
    for step in range(3):
        new = [torch.randint(3, 500, (1,), generator=gen).tolist() for _ in prompts]
        if step == 2:
            new[1] = torch.randint(3, 500, (6,), generator=gen).tolist()
        cached = [len(s) for s in sequences]
        logits_step, starts_step = steps.run(new, cached)
        for i, tokens in enumerate(new):
            sequences[i] += tokens
        with torch.inference_mode():
            for i, seq in enumerate(sequences):
                expected = hf(torch.tensor([seq])).logits[0, cached[i]:]
                got = logits_step[starts_step[i]:starts_step[i + 1]]
                torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            expected = hf(torch.tensor([prompt])).logits[0]
            torch.testing.assert_close(logits[starts[i]:starts[i + 1]], expected,
                                       atol=1e-4, rtol=1e-4)


def test_one_group_is_the_backends_own_builder_and_metadata() -> None:
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=8, dtype="float32",
                         kv_cache_dtype="float32", block_size=BLOCK)
    builder = make_builder(TorchAttentionBackend, {"a": spec, "b": spec}, device="cpu",
                           max_num_reqs=4, max_num_batched_tokens=64, max_model_len=64)
    assert type(builder) is TorchAttentionBackend.get_builder_cls()
    assert builder.ctx.layer_names == ("a", "b")


def test_groups_keep_model_order_and_each_layer_gets_its_groups_metadata() -> None:
    base = dict(num_heads=4, num_kv_heads=2, head_size=8, dtype="float32",
                kv_cache_dtype="float32", block_size=BLOCK)
    wide, narrow = AttentionSpec(**base), AttentionSpec(**base, sliding_window=2)  # type: ignore[arg-type]
    specs = {"l0": narrow, "l1": wide, "l2": narrow, "l3": wide}
    assert group_layers(specs) == [(narrow, ("l0", "l2")), (wide, ("l1", "l3"))]
    metadata = GroupedMetadata(["narrow", "wide"], {"l0": 0, "l2": 0, "l1": 1, "l3": 1})
    assert [metadata.for_layer(n) for n in specs] == ["narrow", "wide", "narrow", "wide"]
    with pytest.raises(KeyError, match="'l9' is in no attention group"):
        metadata.for_layer("l9")


def test_cpu_groups_give_the_step_graph_every_groups_buffers() -> None:
    base = dict(num_heads=4, num_kv_heads=2, head_size=8, dtype="float32",
                kv_cache_dtype="float32", block_size=BLOCK)
    specs = {"l0": AttentionSpec(**base, sliding_window=2), "l1": AttentionSpec(**base)}  # type: ignore[arg-type]
    builder = make_builder(CpuAttentionBackend, specs, device="cpu", max_num_reqs=4,
                           max_num_batched_tokens=64, max_model_len=64)
    ctx = CaptureContext(kind=GraphKind.CPU_STEP_GRAPH, max_tokens=16, max_reqs=4,
                         max_blocks_per_req=4)
    graph = builder.graph_metadata(ctx)
    assert graph is not None and len(graph.tensors()) == 8
    qsl = torch.tensor([0, 3, 4], dtype=torch.int32)
    seq_lens = torch.tensor([3, 6], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_lens, seq_lens_cpu=seq_lens,
        block_table=torch.tensor([[1, 0], [2, 3]], dtype=torch.int32),
        slot_mapping=torch.tensor([4, 5, 6, 13]), num_reqs=2, num_actual_tokens=4,
        max_query_len=3, max_seq_len=6)
    graph.fill(common)
    view, built = graph.view(4), builder.build(common)
    for name in specs:
        assert torch.equal(view.for_layer(name).positions, built.for_layer(name).positions)
    # A group whose builder has no graph metadata: none for the model (it runs eagerly).
    torch_builder = make_builder(TorchAttentionBackend, specs, device="cpu", max_num_reqs=4,
                                 max_num_batched_tokens=64, max_model_len=64)
    assert torch_builder.graph_metadata(ctx) is None


class _LayerTypes:
    """``ctx.layers`` of :class:`PerLayerQwen2`: the engine's factory, each layer's window
    from ``layer_types``."""

    def __init__(self, factory: Any, layer_types: list[str], sinks: bool = False) -> None:
        self._factory = factory
        self._layer_types = layer_types
        self._sinks = sinks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._factory, name)

    def attention(self, prefix: str, **kwargs: Any) -> Any:
        if self._layer_types[int(prefix.split(".")[2])] != "sliding_attention":
            kwargs["sliding_window"] = None
            kwargs["logits_soft_cap"] = FULL_LAYER_CAP
        return self._factory.attention(prefix, sinks=self._sinks, **kwargs)


#: The soft cap of :class:`PerLayerQwen2`'s full-attention layers: so large that it changes
#: no score measurably (transformers' Qwen2 has none), yet a spec field to answer.
FULL_LAYER_CAP = 1e5


class PerLayerQwen2(Qwen2ForCausalLM):
    """Qwen2 with transformers' per-layer ``layer_types`` (sliding or full attention)."""

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__(replace(ctx, layers=_LayerTypes(ctx.layers, ctx.hf_config.layer_types)))


class SinkQwen2(Qwen2ForCausalLM):
    """:class:`PerLayerQwen2` with attention sinks, set after loading (Qwen2 has none)."""

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__(replace(ctx, layers=_LayerTypes(ctx.layers, ctx.hf_config.layer_types,
                                                         sinks=True)))

    def load_weights(self, weights: Any) -> set[str]:
        loaded = super().load_weights(weights)
        heads = self.config.num_attention_heads
        for i, layer in enumerate(self.layers):
            layer.self_attn.attn.load_weight("sinks", torch.linspace(-1.0, 2.0 + i, heads))
        return loaded


@pytest.fixture(scope="module")
def per_layer_checks(tmp_path_factory: pytest.TempPathFactory) -> ModelChecks:
    layer_types = ["sliding_attention", "full_attention"]
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen2-layers", "qwen2",
                                 use_sliding_window=True, sliding_window=5,
                                 max_window_layers=0, layer_types=layer_types)
    checks = ModelChecks(path, PerLayerQwen2)
    checks.options["model_impl"] = checks.by_path
    return checks


def test_the_engine_serves_layers_of_two_windows(per_layer_checks: ModelChecks) -> None:
    """Through the engine (worker, cpu backend, one builder per group): transformers' logits
    and tokens, also in chunks and from the prefix cache; bfloat16 as a step graph."""
    model = per_layer_checks.logits_and_greedy_tokens()
    specs = [layer.self_attn.attn.impl.params.spec for layer in model.layers]
    assert [(s.sliding_window, s.logits_soft_cap) for s in specs] == [(5, None),
                                                                      (None, FULL_LAYER_CAP)]
    with per_layer_checks.llm() as llm:
        builder = llm.llm_engine.core.worker.model_runner.builder
        assert isinstance(builder, GroupedMetadataBuilder)
        assert [b.ctx.layer_names for b in builder.builders] == [
            ("model.layers.0.self_attn.attn",), ("model.layers.1.self_attn.attn",)]
    per_layer_checks.chunked_prefill()
    per_layer_checks.prefix_cache()
    per_layer_checks.bfloat16_step_graph()


def test_a_layer_the_default_backend_refuses_moves_the_model_to_torch(
        per_layer_checks: ModelChecks, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """The cpu backend as if it predated logits_soft_cap: the engine's gate refuses it the
    capped layer; by default torch serves the model (logged), named it is an error."""
    monkeypatch.setattr(CpuAttentionBackend, "answered_spec_fields", frozenset())
    with caplog.at_level(logging.WARNING), per_layer_checks.llm() as llm:
        built = llm.llm_engine.core.worker.built
        assert built.backend is TorchAttentionBackend
        assert all(type(layer.self_attn.attn.impl) is TorchAttentionBackend.get_impl_cls()
                   for layer in built.model.layers)
        assert per_layer_checks.run(llm) == per_layer_checks.hf_tokens
    assert ("backend 'cpu' (the engine's choice: no --attention-backend) cannot serve layer "
            "'model.layers.1.self_attn.attn'") in caplog.text
    with pytest.raises(UnsupportedError) as err:
        per_layer_checks.llm(attention_backend="cpu")
    text = str(err.value)
    assert "attention layer 'model.layers.1.self_attn.attn'" in text
    assert "attention backend 'cpu' cannot serve it" in text
    assert "logits_soft_cap=100000.0 not supported" in text


def test_sinks_through_the_engine_cpu_step_graph_eager_and_torch_agree(
        per_layer_checks: ModelChecks) -> None:
    """Sinks the model loads reach the cpu kernel, also through a recorded step graph: its
    tokens are the eager pass's (bfloat16) and the torch backend's (float32)."""
    from engine.kernels.cpu.native import native_kernels

    checks = ModelChecks(per_layer_checks.checkpoint, SinkQwen2)
    checks.options["model_impl"] = checks.by_path
    with checks.llm() as llm:  # float32, cpu backend
        model = checks.model_of(llm)
        assert llm.llm_engine.core.worker.built.backend is CpuAttentionBackend
        assert torch.equal(model.layers[1].self_attn.attn.impl.params.sinks,
                           torch.linspace(-1.0, 3.0, 4))
        cpu_tokens = checks.run(llm)
    with checks.llm(attention_backend="torch") as llm:
        assert checks.run(llm) == cpu_tokens
    assert cpu_tokens != per_layer_checks.hf_tokens  # the sinks change the model
    native = native_kernels()
    if native is None or torch.bfloat16 not in native.packed_matmul_dtypes:
        pytest.skip("no packed bfloat16 product in this build: no step graph")
    options = {"dtype": "bfloat16", "block_size": 16, "num_kv_blocks": 32,
               "max_num_batched_tokens": 64}
    with checks.llm(**options) as llm:
        assert llm.llm_engine.core.worker.model_runner.step_graph is not None
        graph_tokens = checks.run(llm)
    with checks.llm(enforce_eager=True, **options) as llm:
        assert checks.run(llm) == graph_tokens


class NoCapBackend(TorchAttentionBackend):
    """A backend that cannot cap logits (as a platform default that is not the reference)."""

    name: ClassVar[str] = "no_cap"

    @classmethod
    def supports(cls, spec: AttentionSpec) -> Support:
        if spec.logits_soft_cap is not None:
            return Support.no("no soft cap here")
        return super().supports(spec)


class NoCapImpl(TorchAttentionBackend.get_impl_cls()):  # type: ignore[misc]
    pass


NoCapBackend.get_impl_cls = classmethod(lambda cls: NoCapImpl)  # type: ignore[method-assign]


def _layers(factory: LayerFactory) -> None:
    for i, cap in enumerate((None, 30.0, None)):
        factory.attention(f"model.layers.{i}.self_attn.attn", num_heads=4, num_kv_heads=2,
                          head_size=8, scale=0.35, logits_soft_cap=cap)


def test_a_refused_layer_moves_the_model_to_the_fallback(caplog) -> None:
    factory = LayerFactory(dtype=torch.float32, block_size=BLOCK, attention_backend=NoCapBackend,
                           fallback_backend=(TorchAttentionBackend,
                                             TorchAttentionBackend.Options()))
    with caplog.at_level(logging.WARNING):
        _layers(factory)
    assert factory.attention_backend is TorchAttentionBackend
    impls = [layer.impl for layer in factory.attention_layers.values()]
    assert [type(i) for i in impls] == [TorchAttentionBackend.get_impl_cls()] * 3
    assert impls[1].params.spec.logits_soft_cap == 30.0
    assert ("'no_cap' (the engine's choice: no --attention-backend) cannot serve layer "
            "'model.layers.1.self_attn.attn'") in caplog.text
    assert "no soft cap here" in caplog.text


def test_a_refused_layer_without_fallback_names_layer_backend_and_reason() -> None:
    factory = LayerFactory(dtype=torch.float32, block_size=BLOCK, attention_backend=NoCapBackend)
    with pytest.raises(UnsupportedError) as err:
        _layers(factory)
    text = str(err.value)
    assert "attention layer 'model.layers.1.self_attn.attn'" in text
    assert "logits_soft_cap=30.0" in text and "- no_cap: no soft cap here" in text


def test_a_fallback_refusing_a_layer_too_says_both() -> None:
    factory = LayerFactory(dtype=torch.float32, block_size=BLOCK, attention_backend=NoCapBackend,
                           fallback_backend=(NoCapBackend, NoCapBackend.Options()))
    with pytest.raises(UnsupportedError, match="no_cap: no soft cap here"):
        _layers(factory)
    legacy: Any = type("Legacy", (TorchAttentionBackend,),
                       {"name": "legacy", "answered_spec_fields": frozenset()})
    factory = LayerFactory(dtype=torch.float32, block_size=BLOCK, attention_backend=NoCapBackend,
                           fallback_backend=(legacy, legacy.Options()))
    with pytest.raises(UnsupportedError) as err:
        _layers(factory)
    assert "the fallback 'legacy' cannot serve layer 'model.layers.1.self_attn.attn'" in str(
        err.value)

