"""``--kernel-selection measured``: a custom op's implementation, measured.

Where no ``--custom-ops`` item names an op and two or more of its implementations have a
path of their own for the CPU (``is_supported``), the worker times them on the model's
shape (``op_timing``) at each row bucket and builds the op from the one fastest in most
buckets (ties: the order ``custom_op_selection`` ranks them in). The decision is kept with
the other measured choices (``store``; ``engine kernels list``) and read back by later
starts; one INFO line says what was chosen, with the times. Models of a hidden size below
:data:`MIN_MEASURED_HIDDEN` are not measured (their ops take microseconds whichever
implementation runs them: test models); the ranking decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from engine.core.kernel_choice.buckets import bucket_triples, row_buckets
from engine.core.kernel_choice.op_timing import OpShape, time_ops
from engine.core.kernel_choice.plan import KernelPlan, choose
from engine.core.kernel_choice.selection import decide, identity, logger, machine_key
from engine.core.plugins import PluginEntry
from engine.sdk.ops import CustomOp

#: Hidden sizes below this keep the ranked order (the module docstring).
MIN_MEASURED_HIDDEN = 512


def label(entry: PluginEntry) -> str:
    """How an implementation is named in timings and log lines: its distribution."""
    return entry.distribution or entry.value


class OpMeasurer:
    """Picks each op's fastest implementation on this CPU (``custom_op_selection.OpMeasure``).

    Args:
        shape: The model's sizes.
        dispatch_key: The platform's device type (what the ops are built with).
        step_tokens: The token budget (the largest step measured).
    """

    def __init__(self, shape: OpShape, dispatch_key: str, step_tokens: int) -> None:
        self.shape = shape
        self.dispatch_key = dispatch_key
        self.buckets = row_buckets(step_tokens)

    def __call__(self, op: str, candidates: Sequence[tuple[PluginEntry, type[CustomOp]]],
                 ) -> PluginEntry | None:
        if self.shape.hidden_size < MIN_MEASURED_HIDDEN:
            return None
        by_label = {label(entry): (entry, cls) for entry, cls in candidates}
        parts = {"what": "custom_op", "op": op, "device": self.dispatch_key, **machine_key(),
                 "implementations": [identity(name, cls, entry.provider)
                                     for name, (entry, cls) in by_label.items()],
                 "shape": asdict(self.shape),
                 "buckets": bucket_triples(self.buckets)}

        def measure() -> KernelPlan | None:
            measured = time_ops(op, [(name, cls) for name, (_, cls) in by_label.items()],
                                self.shape, self.dispatch_key, self.buckets)
            if measured is None:
                return None
            timings, failed = measured
            for name, reason in failed.items():
                logger.warning("custom op %s from %s left out of the measured choice: %s",
                               op, by_label[name][0].value + f" ({name})", reason)
            if not timings:
                return None
            return choose(timings, self.buckets, list(by_label), failed)

        plan = decide(parts, f"custom op {op}", measure)
        return None if plan is None else by_label[plan.names[0]][0]


__all__ = ["MIN_MEASURED_HIDDEN", "OpMeasurer", "OpShape", "label"]
