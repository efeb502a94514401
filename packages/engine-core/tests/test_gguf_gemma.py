"""Gemma 2 and Gemma 3 from GGUF files, end to end, the embedding table quantized too.

Each tiny checkpoint (``engine.testing.models``, kinds ``gemma2`` / ``gemma3``: tied
embeddings, ``1 + weight`` norms, soft caps, sliding windows) is written as llama.cpp's
converter writes it (``engine.testing.gguf_writer``: norms stored as ``1 + w``), in F32 and
in Q8_0 (every matrix, ``token_embd`` included, as llama.cpp quantizes it). The engine
serves each file:

Keys llama.cpp's files do not hold are set as it assumes them (``OVERRIDES``).

* F32: transformers' logits on the checkpoint within 1e-4, its greedy tokens;
* Q8_0 dequantized at load, and with ``--quantization gguf`` (the table and every matrix
  kept as Q8_0 blocks, the tied LM head reading the table's blocks): transformers' on
  the checkpoint with every matrix rounded through Q8_0 (``round_trip_checkpoint``).

The quantized table works because Gemma's ``sqrt(hidden_size)`` is the embedding layer's
output scale (``layers.embedding(..., scale=...)``), not a product taken on the table when
it is loaded: the table stays as stored, blocks and all.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.core.model_executor.models.gemma2 import Gemma2ForCausalLM
from engine.core.model_executor.models.gemma3 import Gemma3ForCausalLM
from engine.testing.gguf_checks import gguf_checks, gguf_files

KINDS: dict[str, type] = {"gemma2": Gemma2ForCausalLM, "gemma3": Gemma3ForCausalLM}
#: What a GGUF file can state: llama.cpp scales queries by ``head_dim ** -0.5`` (but for
#: the 27B models) and its gemma3 graph makes every sixth layer global, keys it does not
#: write; the tiny checkpoints follow (``query_pre_attn_scalar`` = ``head_dim``; Gemma 3:
#: six layers, the last global).
OVERRIDES: dict[str, dict[str, Any]] = {
    "gemma2": {"query_pre_attn_scalar": 32},
    "gemma3": {"query_pre_attn_scalar": 32, "num_hidden_layers": 6,
               "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
}


@pytest.fixture(scope="module", params=sorted(KINDS))
def files(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> dict[str, Any]:
    kind = request.param
    return gguf_files(tmp_path_factory.mktemp(f"gguf_{kind}"), kind, KINDS[kind],
                      OVERRIDES[kind])




def test_f32_file_equals_transformers(files: dict[str, Any]) -> None:
    model = gguf_checks(files, "f32", "hf").logits_and_greedy_tokens()
    assert model.embed_tokens.scale == 8.0  # sqrt(hidden_size 64), applied by the layer
    assert model.lm_head.weight is model.embed_tokens.weight  # tied: the unscaled table


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_q8_0_file_equals_transformers_on_rounded_weights(
        files: dict[str, Any], quantization: str | None) -> None:
    options = {} if quantization is None else {"quantization": "gguf",
                                               "linear_kernel": "gguf_dequant"}
    model = gguf_checks(files, "q8", "q8_reference", **options).logits_and_greedy_tokens()
    attention = model.layers[0].self_attn
    table = model.embed_tokens.weight
    if quantization:
        assert table.dtype == torch.uint8  # Q8_0 blocks: 34 bytes a block of 32
        assert table.shape == (model.config.vocab_size, model.config.hidden_size // 32 * 34)
        assert attention.qkv_proj.weight.dtype == torch.uint8
        assert model.lm_head.weight is table
    else:
        assert table.dtype == torch.float32 and attention.qkv_proj.weight.dtype == torch.float32
