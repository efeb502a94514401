"""Finding a model and reading its config and weights: Hugging Face directories and GGUF files."""

from engine.core.model_loader.default_model import (
    DEFAULT_MODEL_REQUIREMENT,
    INSTALL_COMMAND,
    DefaultModelNotFoundError,
    default_model_path,
)
from engine.core.model_loader.dummy import (
    DummyWeights,
    initialize_dummy_weights,
    load_weights_into,
)
from engine.core.model_loader.generation_config import (
    GenerationDefaults,
    load_generation_defaults,
)
from engine.core.model_loader.gguf_loader import (
    GGUFTokenizerMetadata,
    dequantize_tensor,
    gguf_metadata,
    gguf_quantization_settings,
    gguf_to_hf_name,
    gguf_tokenizer_metadata,
    iter_gguf_weights,
    load_gguf_config,
    unpermute_qk,
)
from engine.core.model_loader.hf_loader import (
    iter_safetensors_weights,
    load_hf_config,
    safetensors_files,
)
from engine.core.model_loader.loader import (
    ModelKind,
    ModelSource,
    iter_weights,
    load_config,
    resolve_model,
    resolve_tokenizer,
)

__all__ = [
    # entry point
    "ModelKind",
    "ModelSource",
    "resolve_model",
    "resolve_tokenizer",
    "load_config",
    "iter_weights",
    # --load-format dummy
    "DummyWeights",
    "initialize_dummy_weights",
    "load_weights_into",
    # --generation-config
    "GenerationDefaults",
    "load_generation_defaults",
    # default model
    "DEFAULT_MODEL_REQUIREMENT",
    "INSTALL_COMMAND",
    "DefaultModelNotFoundError",
    "default_model_path",
    # GGUF
    "GGUFTokenizerMetadata",
    "dequantize_tensor",
    "gguf_metadata",
    "gguf_quantization_settings",
    "gguf_to_hf_name",
    "gguf_tokenizer_metadata",
    "iter_gguf_weights",
    "load_gguf_config",
    "unpermute_qk",
    # Hugging Face directories
    "iter_safetensors_weights",
    "load_hf_config",
    "safetensors_files",
]
