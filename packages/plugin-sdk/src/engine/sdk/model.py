"""``ModelInterface``: what a model class must provide to be served.

A model plugin publishes its class in ``engine.models`` under the Hugging Face architecture
name it implements (the ``architectures`` entry of ``config.json``, e.g.
``"LlamaForCausalLM"``). The class is usually also a ``torch.nn.Module``::

    class MyForCausalLM(torch.nn.Module, ModelInterface):
        def __init__(self, ctx: ModelContext, prefix: str = "") -> None:
            torch.nn.Module.__init__(self)
            ...

.. versionadded:: 1.0
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.sdk.capture import CaptureContext, not_declared
from engine.sdk.context import PluginContext
from engine.sdk.plugin import Plugin
from engine.sdk.support import Support

if TYPE_CHECKING:
    import torch

    from engine.sdk.layers import LayerFactory


@dataclass(frozen=True, kw_only=True)
class ModelContext(PluginContext):
    """What a model is built from.

    Attributes:
        hf_config: The checkpoint's configuration (a ``transformers.PretrainedConfig`` or an
            object with the same attributes).
        dtype: Parameter and activation dtype (``"bfloat16"``, ``"float32"``, ...).
        quant_config: The selected ``QuantizationConfig`` instance, or None.
        layers: The engine's layer factory for this model (see
            :class:`~engine.sdk.layers.LayerFactory`), so a model plugin builds layers that
            honour quantization, attention, linear-kernel and custom-op plugins and tensor
            parallelism. The engine always sets it; ``None`` only in a context built by
            hand.

    .. versionadded:: 1.0
    .. versionchanged:: 1.1 ``layers`` is typed as :class:`~engine.sdk.layers.LayerFactory`
       (it was ``Any``; the engine passes the same object as in 1.0).
    """

    hf_config: Any
    dtype: str = "float32"
    quant_config: Any = None
    layers: LayerFactory | None = None


class ModelInterface(Plugin, ABC):
    """The methods the model runner calls.

    Called: in each worker; ``forward`` and ``compute_logits`` once per step.

    .. versionadded:: 1.0
    """

    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any
    ) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` for the flattened tokens of the step.

        Args:
            input_ids: ``[num_tokens]`` int64 token ids of all scheduled requests, concatenated.
            positions: ``[num_tokens]`` int64 positions of those tokens in their sequences.
            attn_metadata: The attention backend's metadata for this step; pass it to every
                attention layer unchanged.
        """

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits ``[rows, vocab]`` (float32) for the given hidden-state rows.

        Under tensor parallelism every rank calls it with the same rows, the same number of
        times in the same order (the LM head gathers across ranks): rank 0's result is the
        full ``[rows, vocab]``; the other ranks' results are not used (the engine's
        column-parallel LM head returns their own vocabulary shard there).
        """

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (name in the checkpoint's naming). Returns the names used."""

    def capture_support(self, ctx: CaptureContext) -> Support:
        """Whether a graph of ``ctx.kind`` can record this model's forward pass.

        Called: in the worker, before the engine records the pass (see
        :mod:`engine.sdk.capture`); the layers built by ``ctx.layers`` (linear layers,
        attention, custom ops, the embedding) are asked on their own.

        The model answers for its own module tree: ``forward``, ``compute_logits``, and
        every module of the pass that has no ``capture_support`` of its own (the decoder
        layers, blocks and plain ``torch.nn`` modules the model built itself). Say yes when
        none of them has an effect a replay would skip (counting, logging, caching or
        branching on tensor values from the host). A subclass inherits the answer.

        Default: no (the model runs eagerly, with that reason logged).

        Returns:
            ``Support.yes()``, or ``Support.no(reason)``.

        Must: not raise.

        .. versionadded:: 1.1
        """
        return not_declared(f"the model {type(self).__qualname__}", ctx)
