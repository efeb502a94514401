"""Tiny, deterministic, random-initialised checkpoints built with ``transformers``.

Nothing is downloaded: the config is written here and the weights come from a fixed seed,
so every run (and CI) gets the same checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: Small enough for CPU tests, with GQA and more than one block of context.
TINY_LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def build_tiny_checkpoint(path: Path, kind: str = "llama", seed: int = 0,
                          **overrides: Any) -> Path:
    """Write a random checkpoint of ``kind`` to ``path``.

    Kinds: ``llama`` (llama3 rope scaling), ``qwen2`` (q/k/v bias, tied embeddings),
    ``mistral``, ``qwen3`` (per-head q/k norms with random weights, ``head_dim`` 32: not
    ``hidden_size / num_attention_heads``), ``phi3`` (fused ``qkv_proj`` and
    ``gate_up_proj`` in the checkpoint), ``mixtral`` (4 experts of intermediate size 96,
    top 2, a router of a wide init spread so that routing is no near-tie), ``qwen3_moe``
    (qwen3's attention; 3 layers, the middle one dense through ``mlp_only_layers``, the
    others of 6 experts of intermediate size 48, top 2, a router as mixtral's; transformers'
    default ``norm_topk_prob`` unless overridden), ``gemma2`` (4 layers, sliding window 8
    on the even ones, ``head_dim`` 32, ``query_pre_attn_scalar`` 24, final logit soft cap
    4 and attention logit soft cap 2: small enough to matter; tied embeddings), ``gemma3``
    (text only: 4 layers of ``layer_types`` sliding, sliding, full, sliding with window 8,
    per-type rope (full: linear scaling 2, base 1e5; sliding: base 1e4), ``head_dim`` 32,
    per-head q/k norms, tied embeddings), ``gpt_oss`` (4 layers alternating a sliding
    window of 8 and full attention, per-head sinks, q/k/v/o biases, YaRN rope (factor 4
    over 64 positions), ``head_dim`` 16; 4 experts of intermediate size 48 with biases and
    the clamped SwiGLU, top 2; a router as mixtral's, its bias too, and every bias and sink
    drawn at random so that they matter). Gemma's norms scale by ``1 + weight``: their
    weights are drawn from [-0.5, 0.5] so that they matter. Returns ``path`` (config.json +
    model.safetensors + a byte-level tokenizer).
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    params: dict[str, Any] = dict(TINY_LLAMA)
    if kind == "llama":
        config: Any = LlamaConfig(**params, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128,
        }, rope_theta=500000.0, **overrides)
    elif kind == "qwen2":
        config = Qwen2Config(**params, tie_word_embeddings=True, **overrides)
    elif kind == "mistral":
        config = MistralConfig(**params, sliding_window=None, **overrides)
    elif kind == "qwen3":
        from transformers import Qwen3Config

        config = Qwen3Config(**{**params, "head_dim": 32, "tie_word_embeddings": False,
                                **overrides})
    elif kind == "mixtral":
        from transformers import MixtralConfig

        config = MixtralConfig(**{**params, "intermediate_size": 96, "num_local_experts": 4,
                                  "num_experts_per_tok": 2, "sliding_window": None,
                                  "tie_word_embeddings": False, **overrides})
    elif kind == "phi3":
        from transformers import Phi3Config

        # pad_token_id: Phi3Config's default (32000) lies outside the tiny vocabulary.
        config = Phi3Config(**{**params, "original_max_position_embeddings": 256,
                               "pad_token_id": 0, **overrides})
    elif kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        config = Qwen3MoeConfig(**{**params, "num_hidden_layers": 3, "head_dim": 32,
                                   "num_experts": 6, "num_experts_per_tok": 2,
                                   "moe_intermediate_size": 48, "mlp_only_layers": [1],
                                   "decoder_sparse_step": 1, "tie_word_embeddings": False,
                                   **overrides})
    elif kind in ("gemma2", "gemma3"):
        config = _gemma_config(kind, params, overrides)
    elif kind == "gpt_oss":
        from transformers import GptOssConfig

        config = GptOssConfig(**{
            **params, "num_hidden_layers": 4, "head_dim": 16, "intermediate_size": 48,
            "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                "original_max_position_embeddings": 64},
            "tie_word_embeddings": False, **overrides})
    else:
        raise ValueError(f"unknown tiny checkpoint kind {kind!r}: llama, qwen2, mistral, "
                         f"qwen3, phi3, mixtral, qwen3_moe, gemma2, gemma3 or gpt_oss")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # a larger init spread makes logits (and greedy paths) distinct
        for name, param in model.named_parameters():
            if ((kind in ("mixtral", "qwen3_moe") and name.endswith(".gate.weight"))
                    or (kind == "gpt_oss" and name.endswith(".router.weight"))):
                param.normal_(0.0, 0.5)  # decisive routing: no top-k near-ties
            elif kind in ("gemma2", "gemma3") and name.endswith("embed_tokens.weight"):
                param.normal_(0.0, 0.15)  # the tied head's logits: spread, not flat
            elif kind == "gpt_oss" and (name.endswith("bias") or name.endswith(".sinks")):
                param.normal_(0.0, 0.5)  # biases (the router's too) and sinks matter
            elif param.dim() > 1:
                param.normal_(0.0, 0.08)
            elif kind in ("qwen3", "qwen3_moe") and name.endswith("_norm.weight"):
                param.uniform_(0.5, 1.5)  # the per-head norms matter
            elif kind in ("gemma2", "gemma3") and name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)  # scales of 1 + weight: 0.5 to 1.5
    model.save_pretrained(path, safe_serialization=True)
    _write_tokenizer(path, config.vocab_size)
    return path


def _gemma_config(kind: str, params: dict[str, Any], overrides: dict[str, Any]) -> Any:
    """The tiny Gemma 2 or Gemma 3 (text) config of :func:`build_tiny_checkpoint`."""
    common = {**params, "num_hidden_layers": 4, "head_dim": 32, "sliding_window": 8,
              "query_pre_attn_scalar": 24, "hidden_activation": "gelu_pytorch_tanh",
              "pad_token_id": 0, "tie_word_embeddings": True}
    if kind == "gemma2":
        from transformers import Gemma2Config

        return Gemma2Config(**{**common, "final_logit_softcapping": 4.0,
                               "attn_logit_softcapping": 2.0, **overrides})
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**{
        **common,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                        "sliding_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        **overrides,
    })


#: The throughput benchmark's model: ~102M parameters (DEVELOPERS' benchmark workload).
BENCH_LLAMA_100M = {
    "hidden_size": 768,
    "intermediate_size": 2560,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "vocab_size": 8192,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def build_random_llama(path: Path, config: dict[str, Any], seed: int = 0) -> Path:
    """Write a random Llama checkpoint with ``config`` (a ``LlamaConfig`` dict) to ``path``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**config), dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    _write_tokenizer(path, config["vocab_size"])
    return path


def _write_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer with no merges: one token per byte, ids < 256 + specials."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_vocab = {tok: i + 3 for i, tok in enumerate(sorted(
        pre_tokenizers.ByteLevel.alphabet()))}
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **byte_vocab}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(path / "tokenizer.json"))
    assert len(vocab) <= vocab_size
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "chat_template": template,
    }))


def build_tiny_llama_with(path: Path, seed: int = 0, **changes: Any) -> Path:
    """Write the tiny Llama of ``TINY_LLAMA`` with some config values changed to ``path``.

    E.g. ``num_key_value_heads=1`` (one KV head: replicated under tensor parallelism),
    ``vocab_size=509`` (a vocabulary no rank count divides), ``attention_bias=True``,
    ``mlp_bias=True``. Default rope; the same init spread as :func:`build_tiny_checkpoint`.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{**TINY_LLAMA, **changes})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # biases (zero in transformers' init) get values too
        for name, param in model.named_parameters():
            if param.dim() > 1 or name.endswith(".bias"):
                param.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    _write_tokenizer(path, config.vocab_size)
    return path
