"""Every system of ``peers.py`` kept off AMX on a Sapphire Rapids (``--isa no-amx``).

The issue's ratios are asked for on each CPU kind the team meets; one is AVX-512 with
avx512_bf16 but no AMX (Zen 4). On an AMX machine this gives each system what it would
run there:

* the engine: its C++ kernels built for ``-march=cooperlake`` (AVX-512 with avx512_bf16
  and VNNI, no AMX, no avx512_fp16; ``ENGINE_CPU_KERNELS_MARCH``), oneDNN at
  ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``; ``--dtype auto`` is bfloat16 there too;
* vLLM and transformers: the same oneDNN limit, and torch reporting no AMX
  (``no_amx_site/sitecustomize.py``), so vLLM takes its non-AMX attention and linear
  paths;
* llama.cpp: its native build as it is (its AMX code serves quantized types only; the
  benchmark's bf16 GGUF runs its avx512_bf16 path either way).

What this cannot change: the core runs the code at its own speed (a Zen 4 splits 512-bit
vectors in two; its memory differs). Only the ratios of one run mean anything.
"""

from __future__ import annotations

from pathlib import Path

from isa_avx2 import restrict

HERE = Path(__file__).resolve().parent
#: The variables that keep oneDNN and the engine's kernels off AMX.
ISA_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "ENGINE_CPU_KERNELS_MARCH": "cooperlake"}


def apply(peers_dir: Path) -> dict[str, str]:
    """Restrict this process (before torch loads) and return the peers' environment."""
    return restrict(ISA_ENV, HERE / "no_amx_site", peers_dir)
