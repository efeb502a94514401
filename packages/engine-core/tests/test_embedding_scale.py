"""The embedding layer's output scale (``LayerFactory.embedding(..., scale=...)``).

Gemma multiplies its embeddings by ``sqrt(hidden_size)`` rounded to the model dtype
(transformers: ``embeds * torch.tensor(normalizer, dtype=embeds.dtype)``). The layer does
the same after its lookup, bit for bit, in float32, bfloat16 and float16; the table (and so
a tied LM head) stays as stored. The CPU step graph records the product (``scale_rows``)
and its replay gives the eager rows for any token count; any other product (by a tensor,
or of anything but a lookup's rows) is still refused naming the op. A scale
that is not a finite number is refused when the layer is built; a quantized table scales
what its method looks up.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine.core.model_executor.layers.embedding import QuantizedVocabEmbedding, VocabEmbedding
from engine.core.model_executor.models.llama import LlamaForCausalLM
from engine.core.native.graph import KernelGraph, NotCapturable, record
from engine.core.native.runtime import graph_runtime
from engine.kernels.cpu.native import native_kernels
from engine.sdk.groups import MODELS
from engine.sdk.model import ModelContext
from engine.sdk.quantization import LayerInfo, QuantizeMethod
from engine.testing.test_plugins import entry_installer

RUNTIME = graph_runtime()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: sqrt(3072) (Gemma 2 2B's width): 55.4256..., 55.5 in bfloat16, 55.4375 in float16.
SCALE = 3072**0.5


def table(dtype: torch.dtype, scale: float | None = SCALE) -> VocabEmbedding:
    torch.manual_seed(0)
    layer = VocabEmbedding(97, 40, dtype, "model.embed_tokens", scale=scale)
    layer.load_weight("weight", torch.randn(97, 40) * torch.logspace(-3, 1, 40), None)
    return layer


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_are_transformers_product_and_the_table_stays_unscaled(dtype: torch.dtype) -> None:
    layer = table(dtype)
    stored = layer.weight.clone()
    ids = torch.tensor([3, 96, 0, 3, 41])
    normalizer = torch.tensor(SCALE, dtype=dtype)  # transformers' Gemma
    expected = F.embedding(ids, stored) * normalizer
    assert layer.scale == normalizer.item()
    assert torch.equal(bits(layer(ids)), bits(expected))
    assert torch.equal(layer.weight, stored)
    assert torch.equal(bits(table(dtype, None)(ids)), bits(F.embedding(ids, stored)))


@pytest.mark.skipif(RUNTIME is None, reason="the step graph runtime cannot be built here")
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_step_graph_records_the_scale_and_replays_the_eager_rows(dtype: torch.dtype
                                                                     ) -> None:
    assert RUNTIME is not None
    layer = table(dtype)
    ids = torch.randint(0, 97, (16,))

    def forward(rows: int) -> torch.Tensor:
        out: torch.Tensor = layer(ids[:rows])
        return out

    graph = KernelGraph.from_recordings(RUNTIME, [
        record(RUNTIME, forward, n, [layer.weight, ids]) for n in (16, 2, 3)])
    assert graph.names == ["gather_rows", "scale_rows"]
    for rows in (1, 7, 16):
        assert torch.equal(bits(graph.run(rows)), bits(forward(rows)))


@pytest.mark.skipif(RUNTIME is None, reason="the step graph runtime cannot be built here")
def test_products_a_graph_cannot_replay_are_refused_naming_the_op() -> None:
    assert RUNTIME is not None
    weight, factors = torch.randn(8, 4), torch.full((4,), 2.0)
    ids = torch.arange(4)

    def by_tensor(rows: int) -> torch.Tensor:
        return F.embedding(ids[:rows], weight) * factors

    def of_the_weights(rows: int) -> torch.Tensor:
        return F.embedding(ids[:rows], weight * 2.0)

    def of_other_rows(rows: int) -> torch.Tensor:
        return F.embedding(ids[:rows], weight)[:, 1:] * 2.0  # a view: not the lookup

    for forward in (by_tensor, of_the_weights, of_other_rows):
        with pytest.raises(NotCapturable, match=r"runs the torch op aten\.mul"):
            record(RUNTIME, forward, 4, [weight, ids, factors])


@pytest.mark.parametrize("scale", [math.inf, math.nan, "8", True])
def test_a_scale_that_is_not_a_finite_number_is_refused(scale: Any) -> None:
    with pytest.raises(ValueError, match=r"model\.embed_tokens: the embedding's scale must be "
                                         r"a finite number or None, got"):
        VocabEmbedding(8, 4, torch.float32, "model.embed_tokens", scale=scale)


class _Doubled(QuantizeMethod):
    """A stand-in method: a float table whose lookup returns twice the rows."""

    def create_weights(self, layer: torch.nn.Module, info: LayerInfo) -> None:
        layer.register_parameter("weight", torch.nn.Parameter(
            torch.zeros(info.input_size_per_partition, info.output_size,
                        dtype=torch.bfloat16), requires_grad=False))

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.embedding(x, layer.weight) * 2  # type: ignore[arg-type]


def test_a_quantized_table_scales_what_its_method_looks_up() -> None:
    info = LayerInfo(prefix="model.embed_tokens", kind="embedding", input_size=8,
                     output_size=4, input_size_per_partition=8, output_partition_sizes=(4,),
                     params_dtype="bfloat16")
    layer = QuantizedVocabEmbedding(info, _Doubled(), scale=SCALE)
    rows = torch.randn(8, 4)
    layer.load_weight("weight", rows, None)
    ids = torch.tensor([1, 7, 1])
    expected = F.embedding(ids, rows.bfloat16()) * 2 * torch.tensor(SCALE, dtype=torch.bfloat16)
    assert layer.scale == 55.5
    assert torch.equal(layer(ids), expected)
    assert torch.equal(layer.weight, rows.bfloat16())  # stored unscaled


class ScaledEmbeddingLlama(LlamaForCausalLM):
    """A plugin's Llama whose embedding multiplies its rows by 3 (``scale=3.0``)."""

    def __init__(self, ctx: ModelContext, prefix: str = "") -> None:
        super().__init__(ctx, prefix)
        assert ctx.layers is not None
        config = ctx.hf_config
        self.embed_tokens = ctx.layers.embedding("model.embed_tokens", config.vocab_size,
                                                 config.hidden_size, scale=3.0)


def _tokens(path: Path, **options: Any) -> tuple[list[list[int]], Any]:
    from engine.core import LLM, SamplingParams

    prompts = [[5 + i for i in range(n)] for n in (3, 40, 17, 1)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(path), dtype="float32", num_kv_blocks=64, in_process=True,
             max_num_batched_tokens=64, **options) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                               use_tqdm=False)
        graph = llm.llm_engine.core.worker.model_runner.step_graph
        return [list(o.outputs[0].token_ids) for o in outputs], graph


def test_a_model_whose_embedding_scales_is_recorded_with_the_eager_tokens(
        monkeypatch: pytest.MonkeyPatch, tiny_llama: Path) -> None:
    native = native_kernels()
    if RUNTIME is None or native is None or torch.float32 not in native.packed_matmul_dtypes:
        pytest.skip("no step graph for the tiny Llama here (the packed float32 product is "
                    "built for AVX-512 CPUs only)")
    unscaled, _ = _tokens(tiny_llama, enforce_eager=True)
    entry_installer(monkeypatch, "acme-plugins", "0.1.0")(MODELS, "LlamaForCausalLM",
                                                          ScaledEmbeddingLlama)
    eager, _ = _tokens(tiny_llama, enforce_eager=True)
    recorded, graph = _tokens(tiny_llama)
    assert graph is not None
    assert graph.graph.names[:2] == ["gather_rows", "scale_rows"]
    assert recorded == eager != unscaled
