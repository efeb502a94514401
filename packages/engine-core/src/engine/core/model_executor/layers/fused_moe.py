"""The mixture-of-experts layer ``LayerFactory.fused_moe`` builds: the op, its loader, TP.

The computation is the ``fused_moe`` custom op (``engine.sdk.ops.FusedMoEOp``: the
built-in reference or a selected replacement), which holds the stacked weights ``w13``
``[E, 2 * I_shard, H]`` and ``w2`` ``[E, H, I_shard]``. This layer adds what the op does
not know about:

* tensor parallelism: every rank holds every expert with an even share of its
  intermediate size (w1/w3 rows, w2 columns: column- then row-parallel, like a dense
  MLP); the op returns the rank's partial sum and the layer all-reduces it, as a
  row-parallel ``Linear`` does;
* loading: each expert's checkpoint tensors (Mixtral ``J.w1/w3/w2.weight``, Qwen-MoE
  ``J.gate_proj/up_proj/down_proj.weight``) go to their expert's rows, this rank's slice;
  so do tensors of every expert stacked (``w1.weight`` ``[E, I, H]``, ``w2.weight``
  ``[E, H, I]``, ...: how GGUF files store experts, ``blk.N.ffn_gate_exps``).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.core.distributed import SINGLE, Slice, TensorParallelGroup, all_reduce
from engine.sdk.ops import FusedMoEOp

#: Checkpoint projection name -> (parameter, part): gate and up fill w13's halves.
PROJECTIONS = {
    "w1": ("w13", 0), "gate_proj": ("w13", 0),
    "w3": ("w13", 1), "up_proj": ("w13", 1),
    "w2": ("w2", None), "down_proj": ("w2", None),
}


class MoELayer(nn.Module):
    """``out = layer(hidden, router_logits)``: ``fused_moe`` summed over the ranks.

    Attributes:
        op: The op (parameters ``w13``, ``w2``).
        prefix: The experts' checkpoint name.
        intermediate_slice: This rank's part of each expert's intermediate dimension.
        tp: The tensor-parallel group.
    """

    def __init__(self, op: FusedMoEOp, prefix: str, intermediate_slice: Slice,
                 tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__()
        self.op = op
        self.prefix = prefix
        self.intermediate_slice = intermediate_slice
        self.tp = tp

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.op(hidden, router_logits)
        return all_reduce(out, self.tp)

    def load_weight(self, param_name: str, tensor: torch.Tensor, shard: int | None = None
                    ) -> None:
        """Copy this rank's part of expert tensor ``{prefix}.{param_name}``.

        ``param_name`` is ``"J.w1.weight"`` (expert ``J``'s gate), ``"J.w3.weight"`` (up),
        ``"J.w2.weight"`` (down), or the Qwen-MoE names ``gate_proj``, ``up_proj``,
        ``down_proj``; without ``J.`` (``"w1.weight"``) the tensor holds every expert,
        stacked along a first dimension of ``num_experts``.

        Raises:
            ValueError: an unknown name, an expert out of range, or a shape that does not fit.
        """
        name = f"{self.prefix}.{param_name}"
        parts = param_name.split(".")
        stacked = len(parts) == 2
        if stacked:
            parts = ["*", *parts]
        if (len(parts) != 3 or not (stacked or parts[0].isdigit())
                or parts[1] not in PROJECTIONS or parts[2] != "weight" or shard is not None):
            raise ValueError(f"checkpoint tensor {name!r}: a fused MoE layer takes "
                             f"'[J.]<w1|w3|w2|gate_proj|up_proj|down_proj>.weight' (without "
                             f"J: every expert stacked)")
        experts = slice(None) if stacked else int(parts[0])
        if not stacked and int(parts[0]) >= self.op.num_experts:
            raise ValueError(f"checkpoint tensor {name!r}: expert {parts[0]} of "
                             f"{self.op.num_experts}")
        target, part = PROJECTIONS[parts[1]]
        hidden, whole = self.op.hidden_size, self.intermediate_slice
        full_i = whole.size * self.tp.size
        expected: tuple[int, ...] = (full_i, hidden) if target == "w13" else (hidden, full_i)
        if stacked:
            expected = (self.op.num_experts, *expected)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"the model expects {expected}")
        param: torch.Tensor = getattr(self.op, target)
        start, size = whole.start, whole.size
        if target == "w13":
            assert part is not None
            piece = tensor[..., start:start + size, :]
            destination = param.data[experts, part * size:(part + 1) * size]
        else:
            piece = tensor[..., start:start + size]
            destination = param.data[experts]
        destination.copy_(piece)
