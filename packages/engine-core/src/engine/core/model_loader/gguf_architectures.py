"""How each llama.cpp architecture of a GGUF file maps to ``transformers``: classes and names.

One :class:`GGUFArchitecture` per ``general.architecture`` the engine loads, with

* the ``transformers`` config class and model class name;
* whether llama.cpp's converter permuted the ``attn_q``/``attn_k`` rows (only ``llama``:
  its graph rotates interleaved pairs; qwen2/qwen3/qwen3moe/phi3/gemma2/gemma3 rotate
  halves as ``transformers`` does, and their converters write the rows unchanged);
* the per-layer tensor names (``blk.N.<gguf>`` -> ``model.layers.N.<hf>``): the Llama
  family's table (:data:`LLAMA_LAYER_NAMES`) with the architecture's changes;
* the offset llama.cpp added to the RMS-norm weights: Gemma's norms compute
  ``x * (1 + w)`` and llama.cpp stores ``1 + w`` (its graph multiplies by the stored
  weight), so ``w = stored - 1`` gives the Hugging Face parameter back.

Mixture-of-experts files store each layer's experts stacked: ``ffn_gate_exps`` /
``ffn_up_exps`` ``[E, I, H]`` and ``ffn_down_exps`` ``[E, H, I]`` (torch order), named
here after the Hugging Face projection without an expert index (``...experts.w1.weight``,
``...experts.gate_proj.weight``); the engine's MoE layer takes such stacked tensors.
llama.cpp writes Mixtral (and other Llama-layout MoE checkpoints) as ``llama`` with
``llama.expert_count``: :func:`resolve_architecture` picks :data:`LLAMA_MOE` for those (its
first Mixtral files held one tensor per expert, ``blk.N.ffn_gate.J.weight``: the loader
names those ``...experts.J.w1.weight`` from the same table).
"""

from __future__ import annotations

from dataclasses import dataclass, field

LLAMA_LAYER_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
"""Per-layer modules of the Llama family: ``blk.N.<gguf>`` -> ``model.layers.N.<hf>``."""

_GEMMA_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one llama.cpp architecture maps to ``transformers``.

    Attributes:
        config_class: The ``transformers`` config class name.
        hf_architecture: The model class name written to ``config.architectures``.
        permutes_qk: Whether llama.cpp's converter permuted the rows of ``attn_q`` /
            ``attn_k`` (see the module docstring).
        layer_names: Per-layer GGUF module name -> Hugging Face module name.
        norm_offset: What llama.cpp added to every ``*norm.weight`` (Gemma: 1.0).
        stacked_experts: Whether ``ffn_*_exps`` tensors (and the router ``ffn_gate_inp``)
            belong to this architecture.
    """

    config_class: str
    hf_architecture: str
    permutes_qk: bool
    layer_names: dict[str, str] = field(default_factory=lambda: dict(LLAMA_LAYER_NAMES))
    norm_offset: float = 0.0
    stacked_experts: bool = False


def _names(**changes: str) -> dict[str, str]:
    return {**LLAMA_LAYER_NAMES, **changes}


LLAMA_MOE = GGUFArchitecture(
    "MixtralConfig", "MixtralForCausalLM", permutes_qk=True, stacked_experts=True,
    layer_names=_names(ffn_gate_inp="block_sparse_moe.gate",
                       ffn_gate_exps="block_sparse_moe.experts.w1",
                       ffn_up_exps="block_sparse_moe.experts.w3",
                       ffn_down_exps="block_sparse_moe.experts.w2"),
)
"""``llama`` with ``llama.expert_count`` > 0: llama.cpp's layout of Mixtral."""

GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("LlamaConfig", "LlamaForCausalLM", permutes_qk=True),
    "qwen2": GGUFArchitecture("Qwen2Config", "Qwen2ForCausalLM", permutes_qk=False),
    "qwen3": GGUFArchitecture("Qwen3Config", "Qwen3ForCausalLM", permutes_qk=False),
    "qwen3moe": GGUFArchitecture(
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM", permutes_qk=False, stacked_experts=True,
        layer_names=_names(ffn_gate_inp="mlp.gate", ffn_gate_exps="mlp.experts.gate_proj",
                           ffn_up_exps="mlp.experts.up_proj",
                           ffn_down_exps="mlp.experts.down_proj"),
    ),
    # Phi-3: q, k, v fused in ``attn_qkv``; gate and up fused in ``ffn_up`` (gate rows
    # first, as in Hugging Face's ``gate_up_proj``).
    "phi3": GGUFArchitecture(
        "Phi3Config", "Phi3ForCausalLM", permutes_qk=False,
        layer_names=_names(attn_qkv="self_attn.qkv_proj", ffn_up="mlp.gate_up_proj"),
    ),
    "gemma2": GGUFArchitecture("Gemma2Config", "Gemma2ForCausalLM", permutes_qk=False,
                               layer_names=_names(**_GEMMA_NORMS), norm_offset=1.0),
    "gemma3": GGUFArchitecture("Gemma3TextConfig", "Gemma3ForCausalLM", permutes_qk=False,
                               layer_names=_names(**_GEMMA_NORMS), norm_offset=1.0),
}
"""``general.architecture`` -> how to load it (``llama`` with experts: :data:`LLAMA_MOE`)."""


def resolve_architecture(arch: str, expert_count: int | None) -> GGUFArchitecture | None:
    """The mapping of ``general.architecture`` ``arch`` (``None``: not supported).

    ``expert_count`` is the file's ``<arch>.expert_count``: a ``llama`` file with experts is
    llama.cpp's Mixtral layout.
    """
    if arch == "llama" and expert_count:
        return LLAMA_MOE
    return GGUF_ARCHITECTURES.get(arch)
