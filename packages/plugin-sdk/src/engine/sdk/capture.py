"""Graph capture: whether a component's part of the forward pass can be recorded and replayed.

The engine records the model's forward pass once and replays it for later steps where it
can: the CPU step graph (every kernel call of the pass recorded, replayed in C: one call a
step instead of a few Python-wrapped calls per layer) and CUDA graphs (decode batches
captured per batch size, replayed as one launch). A replay skips the Python of the pass,
so the engine records only where every component of the pass says its part is safe to
skip: it asks each one ``capture_support(ctx)`` and runs the model eagerly when any
says no, logging that answer's reason once, with the component (and its plugin and
distribution) named. The components asked:

* the model (:meth:`ModelInterface.capture_support
  <engine.sdk.model.ModelInterface.capture_support>`), which answers for its own module
  tree: every module of the pass that does not answer itself, and ``compute_logits``;
* every custom op the pass calls (:meth:`CustomOp.capture_support
  <engine.sdk.ops.CustomOp.capture_support>`);
* every linear layer's quantization method and linear kernel
  (:meth:`QuantizeMethod.capture_support
  <engine.sdk.quantization.QuantizeMethod.capture_support>`,
  :meth:`LinearKernel.capture_support <engine.sdk.linear_kernel.LinearKernel.capture_support>`);
* every attention layer's implementation (:meth:`AttentionImpl.capture_support
  <engine.sdk.attention.AttentionImpl.capture_support>`; for CUDA graphs the backend's
  ``cudagraph_support`` too).

Every default is no: a component that does not declare keeps the pass eager. A module of
the model's own may answer for itself (and its children that do not) by defining
``capture_support(ctx)`` (:class:`Capturable`).

What a yes promises: the component's code in the forward pass has no effect but its
tensors' (nothing counted, logged, cached or branched on from the host that a replay
would have to repeat), and it computes the same thing at every replay. The engine still
checks what it can: the CPU step graph refuses any torch op that computes outside native
calls (:mod:`engine.sdk.graph_calls`; naming the op), and before a graph is used, a replay must give
the eager pass's results. Those checks cannot see Python side effects: the yes is the
component's word for them.

.. versionadded:: 1.1
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from engine.sdk.support import Support

if TYPE_CHECKING:
    from engine.sdk.platform import PlatformInfo

__all__ = ["Capturable", "CaptureContext", "GraphKind", "not_declared"]


class GraphKind(enum.Enum):
    """The kinds of graph the engine records a forward pass into.

    Attributes:
        CPU_STEP_GRAPH: The CPU step graph: the pass is recorded as native calls with
            fixed pointers and replayed in C for any step of up to ``max_tokens``
            tokens. Only calls made through a :class:`~engine.sdk.graph_calls.GraphFunction`
            (the engine's kernels make theirs so; a plugin's C code joins the same way),
            tensor views, allocations, copies and embedding lookups can be recorded: a
            component whose code computes with other torch ops cannot be replayed (the
            recorder refuses it, naming the op), whatever it answers.
        CUDA_GRAPHS: CUDA graphs: the pass is captured with ``torch.cuda.graph`` once per
            batch size; any CUDA work that does not synchronise with the host can be
            captured.

    .. versionadded:: 1.1
    """

    CPU_STEP_GRAPH = "cpu_step_graph"
    CUDA_GRAPHS = "cuda_graphs"


@dataclass(frozen=True, kw_only=True)
class CaptureContext:
    """What a component is told when asked whether a graph can record it.

    New fields are only ever added, with defaults: a ``capture_support`` hook never needs
    a new parameter.

    Attributes:
        kind: The graph being recorded.
        platform: The device the model runs on; ``None`` in a context built by hand.
        max_tokens: The most tokens one replay computes (the CPU step graph's largest
            step; the largest CUDA-graph batch).
        decode_only: True when the graph replays only batches whose every request has
            one query token (CUDA graphs today); False when it replays any mix of
            prefill and decode rows (the CPU step graph).
        max_reqs: The most requests one replay computes; 0 where not fixed.
        max_blocks_per_req: The most KV blocks of one request a replay reads (the
            block table's width); 0 where not fixed.

    .. versionadded:: 1.1
    """

    kind: GraphKind
    platform: PlatformInfo | None = None
    max_tokens: int = 0
    decode_only: bool = False
    max_reqs: int = 0
    max_blocks_per_req: int = 0


@runtime_checkable
class Capturable(Protocol):
    """Anything that answers whether a graph can record it: the components listed above.

    A ``torch.nn.Module`` of a model plugin may implement it too: it then answers for
    itself and for its submodules that do not, instead of the model.

    .. versionadded:: 1.1
    """

    def capture_support(self, ctx: CaptureContext) -> Support:
        """Whether ``ctx.kind`` can record this component's part of the forward pass.

        Called: in the worker, once per component (per instance) each time the engine
        records the pass (after the KV cache exists, and again after each
        ``collective_rpc``), before the recording.

        Returns:
            ``Support.yes()``, or ``Support.no(reason)``: the engine runs the model
            eagerly and logs the reason with the component named.

        Must: not raise; answer from the instance's state (a kernel whose fast path needs
        a packed weight answers no where it has none).

        .. versionadded:: 1.1
        """


def not_declared(what: str, ctx: CaptureContext) -> Support:
    """The default answer of every ``capture_support`` hook: no, saying how to declare.

    Args:
        what: The component, as the reason should name it (e.g. ``"linear kernel
            'my_kernel'"``).
        ctx: The context the hook was called with.

    .. versionadded:: 1.1
    """
    graph = _GRAPH_NAMES.get(ctx.kind, str(ctx.kind.value))
    return Support.no(f"{what} does not declare that {graph} can record it (its "
                      f"capture_support answers no unless overridden)")


_GRAPH_NAMES = {GraphKind.CPU_STEP_GRAPH: "the CPU step graph",
                GraphKind.CUDA_GRAPHS: "CUDA graphs"}
