"""The mixture-of-experts layer ``LayerFactory.fused_moe`` builds: the op, its loader, TP.

The computation is the ``fused_moe`` custom op (``engine.sdk.ops.FusedMoEOp``: the
built-in reference or a selected replacement), which holds the stacked weights ``w13``
``[E, 2 * I_shard, H]`` and ``w2`` ``[E, H, I_shard]`` (with ``bias`` also ``w13_bias``
``[E, 2 * I_shard]`` and ``w2_bias`` ``[E, H]``). This layer adds what the op does not
know about:

* tensor parallelism: every rank holds every expert with an even share of its
  intermediate size (w1/w3 rows and their bias, w2 columns: column- then row-parallel,
  like a dense MLP); the op returns the rank's partial sum and the layer all-reduces it,
  as a row-parallel ``Linear`` does. The down projection's bias ``w2_bias`` is loaded on
  rank 0 only (the others keep zeros), so the sum counts it once;
* loading: each expert's checkpoint tensors (Mixtral ``J.w1/w3/w2.weight``, Qwen-MoE
  ``J.gate_proj/up_proj/down_proj.weight``) go to their expert's rows, this rank's slice;
  so do tensors of every expert stacked along a first dimension: per projection
  (``w1.weight`` ``[E, I, H]``, ``w2.weight`` ``[E, H, I]``, ...: how GGUF files store
  experts, ``blk.N.ffn_gate_exps``) or in the op's layout (``gate_up_proj``
  ``[E, 2 * I, H]``, ``down_proj`` ``[E, H, I]``, ``gate_up_proj_bias`` ``[E, 2 * I]``,
  ``down_proj_bias`` ``[E, H]``), this rank's slice.
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

#: Stacked checkpoint name (every expert, dim 0) -> the op's parameter it fills.
STACKED = {
    "gate_up_proj": "w13", "down_proj": "w2",
    "gate_up_proj_bias": "w13_bias", "down_proj_bias": "w2_bias",
}


class MoELayer(nn.Module):
    """``out = layer(hidden, router_logits)``: ``fused_moe`` summed over the ranks.

    Attributes:
        op: The op (parameters ``w13``, ``w2``; with bias ``w13_bias``, ``w2_bias``).
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

        ``param_name`` is one expert's ``"J.w1.weight"`` (gate), ``"J.w3.weight"`` (up),
        ``"J.w2.weight"`` (down), or the Qwen-MoE names ``gate_proj``, ``up_proj``,
        ``down_proj``; without ``J.`` (``"w1.weight"``) the tensor holds every expert,
        stacked along a first dimension of ``num_experts``; or a stacked tensor of
        :data:`STACKED` in the op's layout (see the module docstring).

        Raises:
            ValueError: an unknown name, an expert out of range, a bias for an op without
                biases, or a shape that does not fit.
        """
        name = f"{self.prefix}.{param_name}"
        if param_name in STACKED and shard is None:
            self._load_stacked(name, STACKED[param_name], tensor)
            return
        parts = param_name.split(".")
        stacked = len(parts) == 2
        if stacked:
            parts = ["*", *parts]
        if (len(parts) != 3 or not (stacked or parts[0].isdigit())
                or parts[1] not in PROJECTIONS or parts[2] != "weight" or shard is not None):
            raise ValueError(f"checkpoint tensor {name!r}: a fused MoE layer takes "
                             f"'[J.]<w1|w3|w2|gate_proj|up_proj|down_proj>.weight' (without "
                             f"J: every expert stacked) or a stacked '<{'|'.join(STACKED)}>'")
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

    def _load_stacked(self, name: str, target: str, tensor: torch.Tensor) -> None:
        """Every expert's ``target`` from one ``[E, ...]`` tensor, this rank's slice."""
        param: torch.Tensor | None = getattr(self.op, target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r}: the fused MoE layer was built "
                             f"without expert biases (bias=False)")
        experts, hidden = self.op.num_experts, self.op.hidden_size
        start, size = self.intermediate_slice.start, self.intermediate_slice.size
        full_i = size * self.tp.size
        expected = {"w13": (experts, 2 * full_i, hidden), "w2": (experts, hidden, full_i),
                    "w13_bias": (experts, 2 * full_i), "w2_bias": (experts, hidden)}[target]
        if tuple(tensor.shape) != expected:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"the model expects {expected}")
        if target in ("w13", "w13_bias"):
            # Gate rows [start, start + size) and the same rows of up, which follow gate.
            piece = torch.cat((tensor[:, start:start + size],
                               tensor[:, full_i + start:full_i + start + size]), dim=1)
        elif target == "w2":
            piece = tensor[:, :, start:start + size]
        elif self.tp.rank == 0:
            piece = tensor  # w2_bias: added once, by rank 0 (the others keep zeros)
        else:
            return
        param.data.copy_(piece)
