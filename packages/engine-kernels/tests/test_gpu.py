"""On a real GPU: the engine serves with the package's kernels and gives the torch path's tokens.

Marked ``gpu``: skipped without CUDA (see conftest.py). Elsewhere in this package the same
kernels run on CUDA tensors when a GPU is present, and in Triton's interpreter otherwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.kernels.attention import TritonAttentionBackend
from engine.testing.contracts import check_attention_backend

pytestmark = pytest.mark.gpu


def test_the_backend_conforms_in_bfloat16_on_the_gpu() -> None:
    report = check_attention_backend(TritonAttentionBackend, device="cuda", dtype="bfloat16")
    assert not report.skipped, report.skipped


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_the_engine_on_cuda_matches_the_torch_backend(tiny_llama_checkpoint: Path,
                                                      quantization: str | None) -> None:
    from engine.core import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 40))}, {"prompt_token_ids": [5, 9, 7]}]
    tokens = {}
    for backend, custom_ops in (("triton", ()), ("torch", ("none",))):
        with LLM(str(tiny_llama_checkpoint), dtype="float32", in_process=True,
                 num_kv_blocks=64, attention_backend=backend, custom_ops=custom_ops,
                 quantization=quantization) as llm:
            assert llm.llm_engine.setup.platform.name == "cuda"
            outputs = llm.generate(prompts, params, use_tqdm=False)
            tokens[backend] = [list(o.outputs[0].token_ids) for o in outputs]
    assert tokens["triton"] == tokens["torch"]
