"""The package reaches the engine only through its entry points, as a third party's would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import distribution
from pathlib import Path

from engine.core import LLM, SamplingParams
from engine.core.plugins import Allowlist, PluginCatalog
from engine.testing.test_plugins import run_engine_cli

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
DECLARED = {
    ("engine.attention_backends", "triton", "engine.kernels.attention:TritonAttentionBackend"),
    ("engine.linear_kernels", "int8_triton", "engine.kernels.linear:TritonInt8Kernel"),
    ("engine.custom_ops", "rms_norm", "engine.kernels.ops:RMSNorm"),
    ("engine.custom_ops", "rotary_embedding", "engine.kernels.ops:RotaryEmbedding"),
    ("engine.custom_ops", "silu_and_mul", "engine.kernels.ops:SiluAndMul"),
    ("engine.custom_ops", "gelu_and_mul", "engine.kernels.ops:GeluAndMul"),
    ("engine.custom_ops", "fused_moe", "engine.kernels.ops:FusedMoE"),
    ("engine.attention_backends", "cpu", "engine.kernels.cpu.attention:CpuAttentionBackend"),
    ("engine.linear_kernels", "cpu", "engine.kernels.cpu.linear:CpuLinearKernel"),
    ("engine.linear_kernels", "onednn", "engine.kernels.cpu.linear:OneDNNLinearKernel"),
    ("engine.linear_kernels", "gguf_dequant", "engine.kernels.gguf.kernels:GGUFDequantKernel"),
    ("engine.linear_kernels", "gguf_int4", "engine.kernels.gguf.kernels:GGUFInt4Kernel"),
    ("engine.quantization", "gguf", "engine.kernels.gguf.method:GGUFConfig"),
}


def test_the_pyproject_and_the_installed_metadata_declare_them() -> None:
    text = PYPROJECT.read_text()
    for group, name, value in DECLARED:
        assert f'[project.entry-points."{group}"]' in text and f'{name} = "{value}"' in text
    installed = {(e.group, e.name, e.value) for e in distribution("engine-kernels").entry_points}
    assert installed == DECLARED, (
        "the installed engine-kernels metadata is stale: pip install -e packages/engine-kernels")


def test_every_entry_loads_and_passes_its_groups_checks() -> None:
    catalog = PluginCatalog.discover(Allowlist.parse("engine-kernels"))
    for group, name, value in sorted(DECLARED):
        entry = catalog.resolve(group, name)
        assert (entry.distribution, entry.value) == ("engine-kernels", value)
        catalog.load(group, name)  # ABC, contract version, abstract methods, op contract


def test_engine_plugins_list_names_the_distribution(tmp_path: Path) -> None:
    result = run_engine_cli(["plugins", "list", "--json"], tmp_path)
    assert result.returncode == 0, result.stderr
    rows = {(r["group"], r["name"]): r for r in json.loads(result.stdout)
            if r.get("distribution") == "engine-kernels"}
    assert set(rows) == {(group, name) for group, name, _ in DECLARED}
    assert all(r["version"] == "0.1.0" for r in rows.values())


def test_the_engine_serves_with_the_triton_backend(tiny_llama_checkpoint: Path) -> None:
    """``--attention-backend triton`` in a real engine (on CPU tensors, in the interpreter),
    found by its entry-point name: prompts chunked under a 16-token budget (later chunks
    over a cached prefix), mixed with decodes, give the tokens of the built-in backend."""
    prompts = [{"prompt_token_ids": list(range(3, 30))}, {"prompt_token_ids": [7, 8, 9]},
               {"prompt_token_ids": list(range(3, 22))}]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for backend in ("triton", "torch"):
        with LLM(str(tiny_llama_checkpoint), dtype="float32", in_process=True,
                 num_kv_blocks=24, block_size=8, max_model_len=64, max_num_batched_tokens=16,
                 attention_backend=backend) as llm:
            assert llm.llm_engine.core.worker.built.backend.name == backend
            outputs = llm.generate(prompts, params, use_tqdm=False)
            tokens[backend] = [list(o.outputs[0].token_ids) for o in outputs]
    assert tokens["triton"] == tokens["torch"]


#: Run first in a fresh interpreter: ``import triton`` fails, and ``find_spec`` (what the
#: package asks before answering) finds no triton, as on a host where it is not installed.
WITHOUT_TRITON = """
import importlib.util
import sys

class NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError("No module named 'triton'")

sys.meta_path.insert(0, NoTriton())
_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name == "triton" else _find_spec(name, *a)
"""


def test_a_cpu_install_without_triton_loads_every_entry_and_says_why() -> None:
    """What a CPU-only ``pip install engine-server`` gets: the entries import and answer no,
    naming what to install; nothing imports triton."""
    code = WITHOUT_TRITON + """
from engine.core.plugins import Allowlist, PluginCatalog
from engine.sdk.attention import AttentionSpec
from engine.sdk.platform import PlatformInfo
catalog = PluginCatalog.discover(Allowlist.parse("engine-kernels"))
cuda = PlatformInfo(name="cuda", device_type="cuda", device_capability=(9, 0))
backend = catalog.load("engine.attention_backends", "triton")
print(backend.supports(AttentionSpec(num_heads=8, num_kv_heads=8, head_size=64,
                                     dtype="bfloat16", kv_cache_dtype="bfloat16",
                                     block_size=16, platform=cuda)).reason)
print(catalog.load("engine.linear_kernels", "int8_triton").is_supported(cuda).reason)
for op in ("rms_norm", "rotary_embedding", "silu_and_mul", "gelu_and_mul", "fused_moe"):
    catalog.load("engine.custom_ops", op)
print("triton" in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "TRITON_INTERPRET": "0"})
    assert result.returncode == 0, result.stderr
    hint = "triton is not installed (pip install 'engine-server[cuda]', or pip install triton)"
    assert result.stdout.splitlines() == [hint, hint, "False"]
