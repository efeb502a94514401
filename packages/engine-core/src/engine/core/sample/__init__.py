"""Sampling: the sampler, its per-step metadata, and the built-in logits processors."""

from engine.core.logits_processors import (
    BUILTIN_LOGITS_PROCESSORS,
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from engine.core.sample.batch_params import BatchSamplingParams, TokenBuffers
from engine.core.sample.logprobs import (
    LogprobsTensors,
    compute_logprobs,
    gather_logprobs,
    to_sample_logprobs,
)
from engine.core.sample.metadata import PenaltyMetadata, SamplingMetadata
from engine.core.sample.sampler import Sampler, SamplerOutput, make_request_generator

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "PenaltyMetadata",
    "BatchSamplingParams",
    "TokenBuffers",
    "LogprobsTensors",
    "compute_logprobs",
    "gather_logprobs",
    "to_sample_logprobs",
    "make_request_generator",
    "BUILTIN_LOGITS_PROCESSORS",
    "LogitBiasLogitsProcessor",
    "MinPLogitsProcessor",
    "MinTokensLogitsProcessor",
]
