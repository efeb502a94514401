"""Layers models are built from; each honours the engine's plugin seams."""

from engine.core.model_executor.layers.attention import Attention
from engine.core.model_executor.layers.embedding import VocabEmbedding
from engine.core.model_executor.layers.factory import LayerFactory
from engine.core.model_executor.layers.linear import Linear, UnquantizedLinearMethod

__all__ = ["Attention", "LayerFactory", "Linear", "UnquantizedLinearMethod", "VocabEmbedding"]
