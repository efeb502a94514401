"""Who may be recorded by a graph: every component of the forward pass answers for itself.

The engine records a forward pass (the CPU step graph, CUDA graphs) only where each
component it runs says, through ``capture_support(ctx)`` (:mod:`engine.sdk.capture`), that
a replay may skip its Python. ``PassComponents`` asks them:

* the model first (``model_refusal``): it answers for its own module tree;
* then, as the pass runs (``checked``: a global forward pre-hook), each module called:
  the module itself where it declares (an engine layer, a custom op, a plugin module that
  defines ``capture_support``), else the nearest ancestor that declares (the model at the
  root); and every SDK component the module holds (:data:`HELD_COMPONENTS`: a linear
  layer's quantization method and the linear kernel that method holds, an attention
  layer's implementation), however deep.

What the engine checks itself, whatever the components say: no module of the pass may
have forward hooks (a replay would not call them), and no global module hooks may be
registered. A refusal names the module's path and the component, with its plugin (group,
distribution) where it is one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from engine.core.plugin_faults import ForwardAttribution, describe
from engine.core.plugins._loader import identity
from engine.sdk.attention import AttentionImpl, AttentionMetadataBuilder
from engine.sdk.capture import CaptureContext
from engine.sdk.linear_kernel import LinearKernel
from engine.sdk.model import ModelInterface
from engine.sdk.ops import CustomOp
from engine.sdk.quantization import QuantizeMethod
from engine.sdk.support import Support

#: SDK components a module may hold in its attributes; each is asked as well (and the
#: components they hold: a quantization method's linear kernel, a kernel composing another).
HELD_COMPONENTS = (QuantizeMethod, LinearKernel, AttentionImpl)
_KINDS = ((ModelInterface, "model"), (CustomOp, "custom op"), (LinearKernel, "linear kernel"),
          (QuantizeMethod, "quantization method"), (AttentionImpl, "attention implementation"),
          (AttentionMetadataBuilder, "attention metadata builder"))


def declares(obj: object) -> bool:
    """Whether ``obj`` answers ``capture_support`` itself."""
    return callable(getattr(obj, "capture_support", None))


def held_components(obj: object) -> list[object]:
    """The SDK components ``obj`` holds (attributes, lists), and theirs; depth first, once."""
    found: list[object] = []
    seen = {id(obj)}

    def visit(holder: object) -> None:
        for value in getattr(holder, "__dict__", {}).values():
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(item, HELD_COMPONENTS) and id(item) not in seen:
                    seen.add(id(item))
                    found.append(item)
                    visit(item)

    visit(obj)
    return found


def held_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Tensors the model's components hold outside its parameters (packed weights, ...).

    oneDNN's own copies are left out: they have no storage a graph could point at.
    """
    return [t for module in model.modules() for component in held_components(module)
            for t in own_tensors(component)]


def own_tensors(component: object) -> list[torch.Tensor]:
    """The tensors in ``component``'s attributes that a graph can point at."""
    return [v for v in vars(component).values() if isinstance(v, torch.Tensor)
            and v.layout == torch.strided and not v.is_mkldnn]


class PassComponents:
    """Asks the components of ``model``'s forward pass whether ``ctx.kind`` can record them.

    Args:
        model: The model whose pass is recorded.
        ctx: What the components are told.
        attribution: Names the plugin a component's class comes from (the worker's);
            None names classes only.
    """

    def __init__(self, model: nn.Module, ctx: CaptureContext,
                 attribution: ForwardAttribution | None = None) -> None:
        self.model = model
        self.ctx = ctx
        self.attribution = attribution
        self._paths: dict[int, str] = {}
        self._cover: dict[int, nn.Module] = {}  # module -> the module that answers for it
        by_name: dict[str, nn.Module] = {}
        for name, module in model.named_modules():
            by_name[name] = module
            self._paths[id(module)] = name or type(model).__name__
            parent = by_name.get(name.rpartition(".")[0]) if name else None
            self._cover[id(module)] = module if declares(module) or parent is None else (
                self._cover[id(parent)])
        self._answers: dict[int, Support] = {}
        self._refusals: dict[int, str | None] = {}
        self._running: list[nn.Module] = []
        self._raised: BaseException | None = None

    def model_refusal(self) -> str | None:
        """Why the model refuses (None: it says yes)."""
        answer = self._answer(self.model)
        return None if answer.ok else f"{self.label(self.model)}: {answer.reason}"

    def refusal(self, module: nn.Module) -> str | None:
        """Why ``module`` cannot be recorded where the pass calls it (None: it can)."""
        key = id(module)
        if key not in self._refusals:
            self._refusals[key] = self._find_refusal(module)
        return self._refusals[key]

    def _find_refusal(self, module: nn.Module) -> str | None:
        where = self._paths.get(id(module), f"a {type(module).__name__} outside the model")
        if module._forward_hooks or module._forward_pre_hooks:
            return f"{where}: it has forward hooks, which a replay would not call"
        declarer = self._cover.get(id(module), self.model)
        for component in (declarer, *held_components(module)):
            answer = self._answer(component)
            if not answer.ok:
                return f"{where} ({self.label(component)}): {answer.reason}"
        return None

    def _answer(self, component: object) -> Support:
        key = id(component)
        if key not in self._answers:
            self._answers[key] = _ask(component, self.ctx)
        return self._answers[key]

    def label(self, component: object) -> str:
        """E.g. ``custom op 'rms_norm' (my_ops.FusedRMSNorm) of plugin 'rms_norm' (group ...)``."""
        cls = type(component)
        kind = next((word for base, word in _KINDS if isinstance(component, base)), "module")
        name = getattr(cls, "name", "") if isinstance(component, (LinearKernel, CustomOp)) else ""
        where = f"{cls.__module__}.{cls.__qualname__}"
        text = f"{kind} {name!r} ({where})" if name else f"{kind} {where}"
        entry = self.attribution.plugin_of_class(cls) if self.attribution is not None else None
        return text if entry is None else f"{text} of {identity(entry)}"

    def where(self, module: nn.Module) -> str:
        """``path (component, ...)``: the module and who computes in it, for messages."""
        held = held_components(module) or [self._cover.get(id(module), self.model)]
        return (f"{self._paths.get(id(module), type(module).__name__)} "
                f"({', '.join(self.label(c) for c in held)})")

    @contextlib.contextmanager
    def checked(self, refused: type[Exception]) -> Iterator[None]:
        """Every module the pass calls inside is checked first; ``refused`` says why not.

        A ``refused`` raised by what the pass runs (a recorder refusing an op) is raised
        again with the module it ran in named.
        """
        module_hooks = nn.modules.module
        if len(module_hooks._global_forward_hooks) or len(
                module_hooks._global_forward_pre_hooks):
            raise refused("global module hooks are registered, which a replay would not call")

        def enter(module: nn.Module, args: Any) -> None:
            reason = self.refusal(module)
            if reason is not None:
                self._raised = refused(reason)
                raise self._raised
            self._running.append(module)

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            if self._running and self._running[-1] is module:
                self._running.pop()

        self._running.clear()
        handles = [module_hooks.register_module_forward_pre_hook(enter),
                   module_hooks.register_module_forward_hook(leave)]
        try:
            yield
        except refused as exc:
            if exc is self._raised or not self._running:
                raise
            raise type(exc)(f"{exc}, in {self.where(self._running[-1])}") from None
        finally:
            for handle in handles:
                handle.remove()
            self._raised = None


def _ask(component: object, ctx: CaptureContext) -> Support:
    """``component.capture_support(ctx)``; a hook that raises or answers wrongly is a no."""
    hook = getattr(component, "capture_support", None)
    if not callable(hook):
        return Support.no("it does not declare capture support (no capture_support)")
    try:
        answer = hook(ctx)
    except Exception as exc:  # noqa: BLE001 - a plugin's bug: the pass runs eagerly
        return Support.no(f"its capture_support raised {describe(exc)}")
    if not isinstance(answer, Support):
        return Support.no(f"its capture_support returned {answer!r}, not an engine.sdk.Support")
    return answer


__all__ = ["HELD_COMPONENTS", "PassComponents", "declares", "held_components", "held_tensors",
           "own_tensors"]
