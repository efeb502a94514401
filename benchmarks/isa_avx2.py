"""Every system of ``peers.py`` restricted to AVX2 on an AVX-512 machine (``--isa avx2``).

The development machines differ: some have AVX-512 with avx512_bf16, some only AVX2, and
the issue's ratios are asked for on both. On an AVX-512 machine this gives each system what
it would run on a CPU with AVX2 and FMA only:

* the engine: its C++ kernels built for ``-march=haswell`` (``ENGINE_CPU_KERNELS_MARCH``),
  torch's ATen kernels at ``ATEN_CPU_CAPABILITY=avx2``, oneDNN at
  ``ONEDNN_MAX_CPU_ISA=AVX2``, MKL at ``MKL_ENABLE_INSTRUCTIONS=AVX2``, and ``--dtype auto``
  resolved as on such a CPU (float32: no native bfloat16);
* llama.cpp: built a second time with ``GGML_NATIVE=OFF`` and AVX2/FMA/F16C only (into
  ``build-avx2`` beside setup.sh's build; ~5 minutes the first time), run through
  ``bench.sh`` from a peers directory of links whose llama.cpp is that build;
* vLLM and transformers: the same torch/oneDNN/MKL variables, and torch reporting no
  AVX-512 (``avx2_site/sitecustomize.py``), so vLLM loads its AVX2 kernels
  (``vllm._C_AVX2``), as it does on such a CPU.

What this cannot change: the core executes the AVX2 code at its own speed. A Zen 4 runs
512-bit vectors as two 256-bit halves, so its AVX2 peak equals its AVX-512 peak; an
AVX2-only CPU differs in absolute speed. Only the ratios of one run mean anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: The variables that keep torch, oneDNN, MKL and the engine's kernels to AVX2.
ISA_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
           "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ENGINE_CPU_KERNELS_MARCH": "haswell"}
#: Where setup.sh unpacks llama.cpp, under the peers directory.
LLAMA_CPP_SRC = Path("src/llama_cpp_python-0.3.36/vendor/llama.cpp")
#: The llama.cpp tools bench.sh runs.
TOOLS = ("llama-server", "llama-batched-bench")
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON",
               "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON",
               "-DGGML_AVX512=OFF", "-DGGML_AVX512_BF16=OFF", "-DGGML_AVX512_VNNI=OFF",
               "-DGGML_AVX_VNNI=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
#: ``--dtype auto`` as the engine resolves it on a CPU without native bfloat16.
AUTO_DTYPE = "float32"
#: What bench.sh reads from its peers directory (``$ENGINE_PEERS``), linked unchanged.
SHARED = ("venv-vllm", "venv-hf", "gguf", "llama-100m", "tiny-llama")


def build_llama_cpp(peers_home: Path) -> Path:
    """llama.cpp's two tools built for AVX2 (once); the directory they are in."""
    source = peers_home / LLAMA_CPP_SRC
    build = source / "build-avx2"
    tools = build / "bin"
    if not all((tools / t).exists() for t in TOOLS):
        if not source.is_dir():
            raise SystemExit(f"{source} does not exist: run ../shared/peers/setup.sh first")
        log = peers_home / "log_cmake_avx2.txt"
        print(f"building llama.cpp for AVX2 into {build} (log: {log}) ...", flush=True)
        with log.open("w") as out:
            subprocess.run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS],
                           stdout=out, stderr=subprocess.STDOUT, check=True)
            subprocess.run(["cmake", "--build", str(build), f"-j{os.cpu_count() or 1}",
                            "--target", *TOOLS],
                           stdout=out, stderr=subprocess.STDOUT, check=True)
    return tools


def peers_home(peers_home: Path) -> Path:
    """A peers directory for bench.sh: links to ``peers_home``'s parts, llama.cpp for AVX2."""
    tools = build_llama_cpp(peers_home)
    home = peers_home / "isa-avx2"
    bin_link = home / LLAMA_CPP_SRC / "build" / "bin"
    bin_link.parent.mkdir(parents=True, exist_ok=True)
    for name, target in [(home / n, peers_home / n) for n in SHARED] + [(bin_link, tools)]:
        if name.is_symlink() or name.exists():
            name.unlink()
        name.symlink_to(target)
    return home


def apply(peers_dir: Path) -> dict[str, str]:
    """Restrict this process (before torch loads) and return the peers' environment."""
    return restrict(ISA_ENV, HERE / "avx2_site", peers_home(peers_dir))


def restrict(isa_env: dict[str, str], site: Path, peers_dir: Path) -> dict[str, str]:
    """``isa_env`` in this process (before torch loads); the peers' environment: the same,
    ``site`` first on their ``PYTHONPATH`` (its ``sitecustomize``), ``peers_dir`` theirs."""
    if "torch" in sys.modules:
        raise RuntimeError("an instruction-set limit must be applied before torch is imported")
    os.environ.update(isa_env)
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "ENGINE_PEERS": str(peers_dir),
            "PYTHONPATH": str(site) if not path else f"{site}{os.pathsep}{path}"}


def engine_dtype(dtype: str) -> str:
    """The engine's ``--dtype`` under the restriction: ``auto`` as such a CPU resolves it."""
    return AUTO_DTYPE if dtype == "auto" else dtype
