"""What every front end (``LLMEngine``, ``AsyncLLM``) builds from a setup, in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.core.config import EngineConfig
from engine.core.extra_args_keys import front_end_plugins
from engine.core.frontend.input_processor import InputProcessor
from engine.core.frontend.output_processor import OutputProcessor
from engine.core.plugin_construction import logits_processor_classes
from engine.core.startup import EngineSetup
from engine.core.structured_output import frontend_validator
from engine.core.tokenizer import Tokenizer, load_tokenizer, read_chat_template


def eos_token_id_of(tokenizer: Tokenizer, hf_config: Any) -> int | None:
    """The id that ends generation: the tokenizer's EOS, else the model config's."""
    if tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos if isinstance(eos, int) else None


@dataclass(frozen=True)
class FrontEndParts:
    """One engine's tokenizer, EOS id, and request and output processors.

    The tokenizer carries the ``--chat-template`` override, if any.
    """

    tokenizer: Tokenizer
    eos_token_id: int | None
    input_processor: InputProcessor
    output_processor: OutputProcessor

    @classmethod
    def build(cls, config: EngineConfig, setup: EngineSetup) -> FrontEndParts:
        """Load the tokenizer and make the processors for ``setup``."""
        template = None if config.chat_template is None else read_chat_template(
            config.chat_template)
        tokenizer = load_tokenizer(setup.source, chat_template=template)
        eos = eos_token_id_of(tokenizer, setup.hf_config)
        return cls(
            tokenizer=tokenizer,
            eos_token_id=eos,
            input_processor=InputProcessor(
                tokenizer, max_model_len=setup.max_model_len, vocab_size=setup.vocab_size,
                extra_args_plugins=front_end_plugins(setup, logits_processor_classes(setup)),
                max_logprobs=config.max_logprobs,
                structured_outputs=frontend_validator(
                    setup, tokenizer.hf_tokenizer, () if eos is None else (eos,))),
            output_processor=OutputProcessor(tokenizer),
        )
