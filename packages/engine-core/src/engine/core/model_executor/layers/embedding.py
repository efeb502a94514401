"""``VocabEmbedding``: token ids to vectors; also the tied LM head's weight.

Under tensor parallelism the table is split by rows (``distributed.vocab_slice``): each
rank holds ``ceil(vocab / tp)`` contiguous rows (padding rows past the vocabulary stay
zero), looks up the ids it holds, writes zeros for the others, and the ranks' results are
summed, so every rank ends with the full embeddings.

A quantization method that handles ``kind="embedding"`` gets a
:class:`QuantizedVocabEmbedding` instead: its parameters (rows first) come from the
method, and the lookup is the method's ``apply`` on this rank's local ids.

Either may scale what it looks up by a number (``scale``, Gemma's ``sqrt(hidden_size)``),
rounded to the model dtype first and multiplied as torch multiplies a tensor of that dtype
by it (transformers' ``embeds * normalizer``, the normaliser a tensor of the model dtype).
The table itself stays unscaled, so a tied LM head reading ``weight`` reads it as stored.
The CPU step graph records the product (``scale_rows``) after the lookup.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.core.distributed import SINGLE, Slice, TensorParallelGroup, all_reduce, vocab_slice
from engine.core.model_executor.layers.linear import tensor_parallel_refusal
from engine.core.model_loader.checkpoint_dtype import for_parameter
from engine.sdk.capture import CaptureContext
from engine.sdk.quantization import LayerInfo, QuantizeMethod
from engine.sdk.support import Support


def load_vocab_rows(target: torch.Tensor, tensor: torch.Tensor, rows: Slice, vocab_size: int,
                    name: str) -> None:
    """Copy this rank's ``rows`` of a full checkpoint table into ``target``.

    The checkpoint's vocabulary may differ from the config's: rows the checkpoint lacks stay
    0, rows past the config's vocabulary are ignored.
    """
    if tensor.shape[1:] != target.shape[1:]:
        raise ValueError(
            f"checkpoint tensor for {name} has shape {tuple(tensor.shape)}, the layer "
            f"expects {(vocab_size, *target.shape[1:])}"
        )
    end = min(tensor.shape[0], vocab_size)
    held = max(0, min(rows.size, end - rows.start))
    if held:
        target[:held].copy_(tensor.narrow(0, rows.start, held))
    target[held:].zero_()


def output_scale(scale: float | None, dtype: torch.dtype, prefix: str) -> float | None:
    """``scale`` rounded to ``dtype`` (as a tensor of that dtype holds it), or None.

    Raises:
        ValueError: ``scale`` is not a finite number.
    """
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(
            scale):
        raise ValueError(f"{prefix}: the embedding's scale must be a finite number or None, "
                         f"got {scale!r}")
    return float(torch.tensor(float(scale), dtype=dtype).item())


class VocabEmbedding(nn.Module):
    """An embedding table ``[vocab_size, hidden_size]`` (this rank's rows of it).

    Args:
        vocab_size: Rows of the whole table.
        hidden_size: Width of each row.
        dtype: Parameter dtype.
        prefix: Checkpoint name of the layer.
        tp: The tensor-parallel group the rows are split across.
        scale: Multiply each row looked up by this number, rounded to ``dtype`` (module
            docstring); None: rows as stored.
    """

    weight: torch.Tensor

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, prefix: str,
                 tp: TensorParallelGroup = SINGLE, scale: float | None = None) -> None:
        super().__init__()
        self.prefix = prefix
        self.vocab_size = vocab_size
        self.tp = tp
        #: The output scale rounded to the model dtype, or None.
        self.scale = output_scale(scale, dtype, prefix)
        self.rows = vocab_slice(vocab_size, tp.rank, tp.size)
        self.weight = nn.Parameter(torch.zeros(self.rows.size, hidden_size, dtype=dtype),
                                   requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_parallel:
            out = F.embedding(input_ids, self.weight)
        else:
            start = self.rows.start
            held = (input_ids >= start) & (input_ids < start + self.rows.size)
            out = F.embedding(torch.where(held, input_ids - start, 0), self.weight)
            out.masked_fill_(~held.unsqueeze(-1), 0)
            out = all_reduce(out, self.tp)
        return out if self.scale is None else out.mul_(self.scale)  # a fresh lookup

    def capture_support(self, ctx: CaptureContext) -> Support:
        """Yes on one rank: a lookup (the CPU step graph records a row gather and the scale)."""
        return tensor_parallel_refusal(self.tp)

    def load_weight(self, param_name: str, tensor: torch.Tensor, shard: int | None) -> None:
        """Copy this rank's rows of the checkpoint's full table.

        The checkpoint's vocabulary may differ from the config's: rows the checkpoint lacks
        stay 0, rows past the config's vocabulary are ignored.
        """
        if param_name != "weight" or shard is not None:
            raise ValueError(f"{self.prefix} has only an unsharded 'weight' to load")
        load_vocab_rows(self.weight.data, tensor, self.rows, self.vocab_size,
                        f"{self.prefix}.weight")


class QuantizedVocabEmbedding(nn.Module):
    """An embedding table whose storage and lookup belong to a quantize method.

    Args:
        info: ``kind="embedding"``: ``input_size`` the vocabulary, ``output_size`` the
            width, ``input_size_per_partition`` this rank's rows.
        quant_method: Registers the parameters (dimension 0: this rank's rows, unless a
            parameter has a ``weight_loader``) and looks ids up (``apply(layer, ids)``).
        tp: The tensor-parallel group the rows are split across.
        scale: Multiply each row looked up by this number, rounded to the model dtype
            (``info.params_dtype``; module docstring); None: rows as the method gives them.
    """

    #: Registered by the quantize method (the built-in ``gguf`` names its table so).
    weight: torch.Tensor

    def __init__(self, info: LayerInfo, quant_method: QuantizeMethod,
                 tp: TensorParallelGroup = SINGLE, scale: float | None = None) -> None:
        super().__init__()
        self.info = info
        self.prefix = info.prefix
        self.vocab_size = info.input_size
        self.tp = tp
        #: The output scale rounded to the model dtype, or None.
        self.scale = output_scale(scale, getattr(torch, info.params_dtype), info.prefix)
        self.rows = vocab_slice(info.input_size, tp.rank, tp.size)
        self.quant_method = quant_method
        quant_method.create_weights(self, info)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_parallel:
            out = self.quant_method.apply(self, input_ids)
        else:
            start = self.rows.start
            held = (input_ids >= start) & (input_ids < start + self.rows.size)
            out = self.quant_method.apply(self, torch.where(held, input_ids - start, 0))
            out.masked_fill_(~held.unsqueeze(-1), 0)
            out = all_reduce(out, self.tp)
        # Not in place: a method's lookup may return a view of what it keeps.
        return out if self.scale is None else out * self.scale

    def capture_support(self, ctx: CaptureContext) -> Support:
        """Yes on one rank (the engine asks the quantize method too)."""
        return tensor_parallel_refusal(self.tp)

    def load_weight(self, param_name: str, tensor: torch.Tensor, shard: int | None) -> None:
        """Copy this rank's rows of checkpoint ``tensor`` into ``param_name``.

        In the parameter's dtype, as :meth:`Linear.load_weight
        <engine.core.model_executor.layers.linear.Linear.load_weight>` does.
        """
        param = getattr(self, param_name, None)
        if not isinstance(param, torch.Tensor):
            raise ValueError(f"{self.prefix} has no parameter {param_name!r} to load into")
        tensor = for_parameter(tensor, param)
        loader = getattr(param, "weight_loader", None)
        if loader is not None:
            loader(param, tensor, shard)
            return
        load_vocab_rows(param.data, tensor, self.rows, self.vocab_size,
                        f"{self.prefix}.{param_name}")

    def process_weights_after_loading(self) -> None:
        """Let the quantize method repack what was loaded."""
        self.quant_method.process_weights_after_loading(self)
