"""engine-kernels on a CUDA GPU: every kernel checked and timed, then the engine end to end.

    .venv/bin/python benchmarks/kernels_gpu.py                      # everything (~10 min)
    .venv/bin/python benchmarks/kernels_gpu.py --skip-e2e           # the kernel table only
    .venv/bin/python benchmarks/kernels_gpu.py --models 100m --batch-sizes 1

Part 1, kernels (bfloat16): each Triton kernel is checked against its torch reference on
the shapes it is timed on, then timed (CUDA events, median of ``--iters``) beside a torch
baseline computing the same thing:

* paged attention (the ``triton`` backend through the SDK: KV write + attention) against
  the built-in ``torch`` backend on the same cache, for a decode batch and a prefill batch;
* ``rms_norm`` (+ residual), ``rotary_embedding``, ``silu_and_mul`` against the SDK's
  ``forward_native``;
* the ``int8_w8a8`` GEMM against ``F.linear`` on the bfloat16 weight (decode and prefill M).

Part 2, end to end: the engine (``LLM``, ``--load-format dummy``: random weights, no
checkpoint to write; decode steps replay CUDA graphs unless ``--enforce-eager``) on the
~100M random Llama of ``benchmarks/throughput.py`` and on a ~1.2B one shaped like Llama 3.2
1B, decoding ``--output-len`` tokens after a
``--input-len`` prompt, at each batch size. Decode tokens/s is measured as the difference
of two runs (``output_len`` tokens and one token), so prefill is left out. Beside it:
the memory roofline, ``batch / (weight bytes / bandwidth)`` with the bandwidth measured
here (a device copy), i.e. every weight read once per step (KV reads ignored), and
``transformers`` ``generate`` on the same GPU and model (random init, same dtype).

Without CUDA it exits at once with status 1, saying so.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: ~1.2B parameters, the shape of Llama 3.2 1B (tied embeddings).
LLAMA_1B = {
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=50, help="timed calls per kernel")
    parser.add_argument("--skip-kernels", action="store_true", help="only the end-to-end part")
    parser.add_argument("--skip-e2e", action="store_true", help="only the kernel table")
    parser.add_argument("--models", default="100m,1b", help="comma list of 100m, 1b")
    parser.add_argument("--batch-sizes", default="1,64", help="comma list")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="the engine without CUDA graphs (every step eager)")
    parser.add_argument("--in-process", action="store_true",
                        help="EngineCore in the benchmark's process (default: its own)")
    return parser


def require_cuda() -> None:
    if not torch.cuda.is_available():
        built = torch.backends.cuda.is_built()  # type: ignore[no-untyped-call]
        reason = "no NVIDIA GPU or driver is visible" if built else "this torch is a CPU build"
        sys.exit(f"kernels_gpu.py needs a CUDA GPU: torch.cuda.is_available() is False "
                 f"({reason}). The kernels are checked without one by "
                 f"`pytest packages/engine-kernels` (Triton's interpreter).")


# -- timing ----------------------------------------------------------------------------


def cuda_ms(fn: Callable[[], object], iters: int) -> float:
    """Median milliseconds of ``fn`` over ``iters`` calls (after three warm-up calls)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device memory bandwidth in bytes/s: a 1 GiB device-to-device copy reads and writes."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_ms(lambda: dst.copy_(src), 10)
    return 2 * src.numel() / (ms / 1e3)


@dataclass
class KernelRow:
    name: str
    shape: str
    max_error: float
    tolerance: float
    triton_ms: float
    torch_ms: float
    baseline: str

    @property
    def ok(self) -> bool:
        return self.max_error <= self.tolerance


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).abs().max())


# -- part 1: kernels -------------------------------------------------------------------


def attention_rows(iters: int) -> list[KernelRow]:
    from engine.core.attention import TorchAttentionBackend
    from engine.kernels.attention import TritonAttentionBackend
    from engine.kernels.attention.reference import paged_attention_reference
    from engine.sdk.attention import (
        AttentionContext,
        AttentionImplParams,
        AttentionSpec,
        CommonAttentionMetadata,
    )

    rows = []
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16",
                         kv_cache_dtype="bfloat16", block_size=16)
    for label, query_len, seq_len, num_reqs in (("decode", 1, 1024, 64),
                                                ("prefill", 512, 512, 4)):
        blocks_per_req = seq_len // spec.block_size
        num_blocks = num_reqs * blocks_per_req + 1
        table = (torch.randperm(num_blocks - 1) + 1).view(num_reqs, blocks_per_req)
        table = table.to(torch.int32).cuda()
        positions = torch.arange(seq_len - query_len, seq_len, device="cuda")
        slots = (table.long()[:, positions // spec.block_size] * spec.block_size
                 + positions % spec.block_size).view(-1)
        starts = torch.arange(num_reqs + 1, dtype=torch.int32) * query_len
        lens = torch.full((num_reqs,), seq_len, dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=starts.cuda(), query_start_loc_cpu=starts, seq_lens=lens.cuda(),
            seq_lens_cpu=lens, block_table=table, slot_mapping=slots, num_reqs=num_reqs,
            num_actual_tokens=num_reqs * query_len, max_query_len=query_len,
            max_seq_len=seq_len)
        tokens = num_reqs * query_len
        q = torch.randn(tokens, 32, 128, dtype=torch.bfloat16, device="cuda")
        k, v = torch.randn(2, tokens, 8, 128, dtype=torch.bfloat16, device="cuda")
        timed = {}
        outputs = {}
        ctx = AttentionContext(plugin_name="bench", spec=spec, layer_names=("l",),
                               device="cuda", max_num_reqs=num_reqs,
                               max_num_batched_tokens=tokens, max_model_len=seq_len)
        for backend in (TritonAttentionBackend, TorchAttentionBackend):
            cache = torch.randn(backend.get_kv_cache_shape(num_blocks, 16, 8, 128),
                                dtype=torch.bfloat16, device="cuda")
            impl = backend.get_impl_cls()(AttentionImplParams(spec=spec, layer_name="l",
                                                              scale=128 ** -0.5))
            metadata = backend.get_builder_cls()(ctx).build(common)
            out = torch.empty_like(q)

            def step(impl: Any = impl, cache: torch.Tensor = cache, metadata: Any = metadata,
                     out: torch.Tensor = out, qkv: tuple[torch.Tensor, ...] = (q, k, v)
                     ) -> None:
                impl.forward(*qkv, cache, metadata, out)

            timed[backend.name] = cuda_ms(step, iters)
            outputs[backend.name] = (out, cache)
        out, cache = outputs["triton"]
        batch = TritonAttentionBackend.get_builder_cls()(ctx).build(common)
        expected = paged_attention_reference(q, cache[0], cache[1], batch, scale=128 ** -0.5,
                                             sliding_window=None)
        rows.append(KernelRow(f"paged attention, {label}",
                              f"{num_reqs} x {query_len} q / {seq_len} ctx, 32/8 x 128",
                              max_error(out, expected), 2e-2, timed["triton"], timed["torch"],
                              "torch backend"))
    return rows


def op_rows(iters: int) -> list[KernelRow]:
    from engine.kernels.ops import RMSNorm, RotaryEmbedding, SiluAndMul
    from engine.sdk.ops import RotaryEmbeddingOp

    rows = []
    bf16 = {"dtype": torch.bfloat16, "device": "cuda"}
    norm = RMSNorm(2048, dtype=torch.bfloat16, dispatch_key="cuda").cuda()
    x, residual = torch.randn(2, 4096, 2048, **bf16)
    y, new_residual = norm(x.clone(), residual.clone())
    ref_y, ref_residual = norm.forward_native(x, residual)
    rows.append(KernelRow(
        "rms_norm + residual", "4096 x 2048", max(max_error(y, ref_y),
                                                  max_error(new_residual, ref_residual)),
        3e-2, cuda_ms(lambda: norm(x, residual.clone()), iters),
        cuda_ms(lambda: norm.forward_native(x, residual), iters), "forward_native"))
    cache = RotaryEmbeddingOp.default_cos_sin_cache(128, 8192).cuda()
    rope = RotaryEmbedding(128, 128, cache, True, dispatch_key="cuda")
    positions = torch.randint(0, 8192, (4096,), device="cuda")
    q, k = torch.randn(4096, 32, 128, **bf16), torch.randn(4096, 8, 128, **bf16)
    got, ref = rope(positions, q.clone(), k.clone()), rope.forward_native(positions, q, k)
    rows.append(KernelRow(
        "rotary_embedding (neox)", "4096 x (32+8) x 128",
        max(max_error(got[0], ref[0]), max_error(got[1], ref[1])), 3e-2,
        cuda_ms(lambda: rope(positions, q, k), iters),
        cuda_ms(lambda: rope.forward_native(positions, q, k), iters), "forward_native"))
    silu = SiluAndMul(dispatch_key="cuda")
    gate_up = torch.randn(4096, 2 * 8192, **bf16)
    rows.append(KernelRow(
        "silu_and_mul", "4096 x 2*8192", max_error(silu(gate_up), silu.forward_native(gate_up)),
        3e-2, cuda_ms(lambda: silu(gate_up), iters),
        cuda_ms(lambda: silu.forward_native(gate_up), iters), "forward_native"))
    return rows


def int8_rows(iters: int) -> list[KernelRow]:
    import torch.nn.functional as F

    from engine.kernels.linear.int8_kernels import w8a8_linear
    from engine.kernels.linear.reference import w8a8_linear_reference

    rows = []
    weight = torch.randn(2048, 2048, device="cuda")
    scale = weight.abs().amax(dim=-1) / 127
    q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    dense = (q.float() * scale[:, None]).to(torch.bfloat16)
    for m in (1, 64, 2048):
        x = torch.randn(m, 2048, dtype=torch.bfloat16, device="cuda")
        out = w8a8_linear(x, q, scale, None)
        expected = w8a8_linear_reference(x.cpu(), q.cpu(), scale.cpu(), None)
        rel = max_error(out.cpu(), expected) / float(expected.float().abs().max())
        rows.append(KernelRow("int8_w8a8 GEMM", f"{m} x 2048 -> 2048", rel, 1e-2,
                              cuda_ms(lambda x=x: w8a8_linear(x, q, scale, None), iters),
                              cuda_ms(lambda x=x: F.linear(x, dense), iters), "bf16 F.linear"))
    return rows


def print_kernels(rows: Sequence[KernelRow]) -> None:
    print(f"\n{'kernel':<26} {'shape':<34} {'max err':>9} {'ok':>3} {'triton ms':>10} "
          f"{'baseline ms':>12} {'speed-up':>9}  baseline")
    for r in rows:
        print(f"{r.name:<26} {r.shape:<34} {r.max_error:9.2e} {'yes' if r.ok else 'NO':>3} "
              f"{r.triton_ms:10.4f} {r.torch_ms:12.4f} {r.torch_ms / r.triton_ms:9.2f}  "
              f"{r.baseline}")


# -- part 2: end to end ----------------------------------------------------------------


def model_config(name: str) -> dict[str, Any]:
    from engine.testing.models import BENCH_LLAMA_100M

    return {"100m": BENCH_LLAMA_100M, "1b": LLAMA_1B}[name]


def write_config(path: Path, config: dict[str, Any]) -> Path:
    """A checkpoint directory without weights (``--load-format dummy`` reads only this)."""
    from transformers import LlamaConfig

    from engine.testing.models import _write_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    LlamaConfig(**config, architectures=["LlamaForCausalLM"]).save_pretrained(path)
    _write_tokenizer(path, config["vocab_size"])
    return path


def weight_bytes(config: dict[str, Any]) -> int:
    """Bytes a decode step reads: every weight once (the LM head, not the embedding rows)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**config), dtype=torch.bfloat16)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not config.get("tie_word_embeddings", False):
        embed = model.get_input_embeddings().weight
        total -= embed.numel() * embed.element_size()
    return int(total)


def engine_decode_tps(path: Path, batch: int, args: argparse.Namespace) -> float:
    from engine.core import LLM, SamplingParams

    prompts = torch.randint(3, 250, (batch, args.input_len)).tolist()
    with LLM(str(path), load_format="dummy", dtype="bfloat16", max_num_seqs=batch,
             max_model_len=args.input_len + args.output_len + 16,
             in_process=args.in_process, enforce_eager=args.enforce_eager) as llm:
        def run(tokens: int) -> float:
            params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return time.perf_counter() - start

        run(4)  # warm-up: kernels compiled, caches touched
        return batch * (args.output_len - 1) / (run(args.output_len) - run(1))


def transformers_decode_tps(config: dict[str, Any], batch: int,
                            args: argparse.Namespace) -> float:
    from transformers import AutoModelForCausalLM, LlamaConfig

    model: Any = AutoModelForCausalLM.from_config(LlamaConfig(**config), dtype=torch.bfloat16)
    model = model.cuda().eval()
    ids = torch.randint(3, 250, (batch, args.input_len), device="cuda")
    kwargs = {"attention_mask": torch.ones_like(ids), "do_sample": False,
              "eos_token_id": None, "pad_token_id": 0}

    def run(tokens: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    with torch.inference_mode():
        run(4)
        return batch * (args.output_len - 1) / (run(args.output_len) - run(1))


def end_to_end(args: argparse.Namespace) -> None:
    bandwidth = copy_bandwidth()
    print(f"\nend to end: {args.input_len}-token prompts, {args.output_len} new tokens, "
          f"greedy, bfloat16; decode tokens/s = difference of an {args.output_len}-token and "
          f"a 1-token run; measured copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print(f"{'model':<6} {'batch':>5} {'weights GB':>10} {'roofline tok/s':>15} "
          f"{'engine tok/s':>13} {'% roofline':>10} {'transformers':>13} {'engine/hf':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            config = model_config(name)
            path = write_config(Path(tmp) / name, config)
            nbytes = weight_bytes(config)
            for batch in (int(b) for b in args.batch_sizes.split(",")):
                roofline = batch * bandwidth / nbytes
                ours = engine_decode_tps(path, batch, args)
                hf = None if args.skip_transformers else transformers_decode_tps(config, batch,
                                                                                 args)
                torch.cuda.empty_cache()  # the transformers model is gone: its memory too
                hf_text = "-" if hf is None else f"{hf:.1f}"
                ratio = "-" if hf is None else f"{ours / hf:.2f}"
                print(f"{name:<6} {batch:>5} {nbytes / 1e9:10.2f} {roofline:15.1f} "
                      f"{ours:13.1f} {100 * ours / roofline:9.1f}% {hf_text:>13} {ratio:>9}",
                      flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    require_cuda()
    import triton

    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()} (capability "
          f"{'.'.join(map(str, torch.cuda.get_device_capability()))}), torch "
          f"{torch.__version__}, triton {triton.__version__}")
    if not args.skip_kernels:
        rows = [*attention_rows(args.iters), *op_rows(args.iters), *int8_rows(args.iters)]
        print_kernels(rows)
        if not all(r.ok for r in rows):
            sys.exit("a kernel differs from its reference beyond its tolerance (ok = NO)")
    if not args.skip_e2e:
        end_to_end(args)


if __name__ == "__main__":
    main()
