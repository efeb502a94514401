"""A floating-point checkpoint tensor reaches a layer's parameter in that parameter's dtype.

The weight iterators cast floating-point tensors to the model dtype: a model's
``load_weights`` is promised that (docs/plugins/models.md). A quantize method may create a
parameter in another floating dtype, e.g. a float32 ``weight_scale`` in a bfloat16 model;
rounding its values to bfloat16 on the way would lose what the checkpoint stored. So, when
a quantization method is in use, a tensor the iterator cast keeps a reference to the
checkpoint's own tensor (:func:`cast_weight`), and the engine's layers (``Linear``, the
quantized embedding) load each parameter from that one, cast once, straight to the
parameter's dtype (:func:`for_parameter`)::

    checkpoint float32 --cast_weight--> bfloat16 tensor t (what load_weights sees)
    for_parameter(t, float32 weight_scale) --> the checkpoint's float32 values, unrounded
    for_parameter(t, bfloat16 weight)      --> t itself

Only the tensor object the iterator yielded carries the reference, and only while it
lives: a model that derives a new tensor from it (a slice, a transpose, a concatenation)
passes values already in the model dtype, which are then cast to the parameter's dtype.
"""

from __future__ import annotations

import torch

_CHECKPOINT_TENSOR = "_engine_checkpoint_tensor"


def cast_weight(tensor: torch.Tensor, dtype: torch.dtype, *, keep_original: bool) -> torch.Tensor:
    """``tensor`` cast to ``dtype`` if it is floating-point (integer tensors are unchanged).

    Args:
        tensor: A checkpoint tensor as stored.
        dtype: The model dtype.
        keep_original: Let :func:`for_parameter` reach ``tensor`` from the cast one.
    """
    if not tensor.is_floating_point() or tensor.dtype == dtype:
        return tensor
    cast = tensor.to(dtype)
    if keep_original:
        setattr(cast, _CHECKPOINT_TENSOR, tensor)
    return cast


def for_parameter(tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Checkpoint ``tensor`` in ``param``'s dtype when both are floating-point.

    Cast from the checkpoint's own values when :func:`cast_weight` kept them; integer
    tensors and integer parameters are left alone (a packed weight is copied as stored).
    """
    if tensor.dtype == param.dtype or not (tensor.is_floating_point()
                                           and param.is_floating_point()):
        return tensor
    source: torch.Tensor = getattr(tensor, _CHECKPOINT_TENSOR, tensor)
    return source.to(param.dtype)
