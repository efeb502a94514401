"""Which class serves the checkpoint: ``engine.models`` candidates and ``--model-impl``.

Several distributions may register a model for the same architecture (the engine's own
``LlamaForCausalLM`` and a plugin's, say): both are candidates, never a start-up error.
The checkpoint's ``architectures`` are tried in order; for the first one that has a
candidate, ``--model-impl`` (``EngineConfig.model_impl``) decides:

* ``auto`` (default): a third party's model takes precedence over the engine's own (as
  vLLM lets an out-of-tree model override an in-tree one); two third parties' for the same
  architecture are an error naming both and how to choose;
* ``engine`` (``vllm`` is accepted, vLLM's spelling of the same): the engine's own model;
* a distribution name: that distribution's model;
* ``module:Class``: that class, whatever the architecture (no entry point needed).

Reads metadata only; the worker imports the chosen class.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.core.plugins import PluginCatalog, PluginEntry, normalize_dist_name
from engine.sdk.errors import PluginError, ValidationError
from engine.sdk.groups import MODELS

#: ``--model-impl`` values that are no distribution.
AUTO = "auto"
ENGINE = "engine"
_ENGINE_ALIASES = (ENGINE, "vllm")


@dataclass(frozen=True)
class ModelChoice:
    """The model class for a checkpoint, and why.

    Attributes:
        architecture: The checkpoint architecture it serves (its ``plugin_name``).
        entry: The chosen entry (for ``module:Class``, one made from the path).
        reason: Why, in words.
        candidates: Every allowed entry for ``architecture``.
    """

    architecture: str
    entry: PluginEntry
    reason: str
    candidates: tuple[PluginEntry, ...] = ()


def architectures_of(hf_config: Any) -> list[str]:
    """The checkpoint's ``architectures``, in order."""
    return list(getattr(hf_config, "architectures", None) or [])


def _impl_error(model_impl: str, architectures: Sequence[str], catalog: PluginCatalog) -> str:
    served = [f"{arch}: {', '.join(e.provider for e in catalog.candidates(MODELS, arch))}"
              for arch in architectures if catalog.candidates(MODELS, arch)]
    return (f"--model-impl {model_impl}: no allowed model of that "
            f"{'kind' if model_impl in _ENGINE_ALIASES else 'distribution'} serves the "
            f"checkpoint's architectures {list(architectures)}; models for them: "
            f"{'; '.join(served) or 'none'}. Use auto, engine, a distribution listed here, "
            f"or module:Class")


def choose_model(catalog: PluginCatalog, architectures: Sequence[str],
                 model_impl: str = AUTO) -> ModelChoice:
    """The model for a checkpoint with ``architectures`` (module docstring).

    Raises:
        PluginError: no allowed model serves any of the architectures (listing those that
            exist), or two third parties serve the first one under ``auto`` (naming both).
        ValidationError: ``model_impl`` names nothing that serves them.
    """
    if ":" in model_impl:
        entry = catalog.resolve(MODELS, model_impl)
        arch = architectures[0] if architectures else entry.name
        return ModelChoice(arch, entry, f"--model-impl {model_impl}")
    wanted = normalize_dist_name(model_impl)
    for arch in architectures:
        candidates = catalog.candidates(MODELS, arch)
        if not candidates:
            continue
        if wanted == AUTO:
            return ModelChoice(arch, _auto(arch, candidates), _auto_reason(candidates),
                               tuple(candidates))
        picked = [e for e in candidates if (e.is_first_party if wanted in _ENGINE_ALIASES
                                            else e.distribution == wanted)]
        if picked:
            return ModelChoice(arch, picked[0], f"--model-impl {model_impl}", tuple(candidates))
    if wanted != AUTO and any(catalog.candidates(MODELS, a) for a in architectures):
        raise ValidationError(_impl_error(model_impl, architectures, catalog),
                              param="model_impl")
    raise PluginError(
        f"no installed model implements the checkpoint's architectures "
        f"{list(architectures)}; available: {', '.join(catalog.names(MODELS)) or '(none)'}. "
        f"A model plugin registers its class in the engine.models group under the "
        f"architecture name.")


def _auto(arch: str, candidates: list[PluginEntry]) -> PluginEntry:
    third_party = [e for e in candidates if not e.is_first_party]
    if len(third_party) > 1:
        found = ", ".join(f"{e.value} ({e.provider})" for e in third_party)
        choices = " or ".join(f"--model-impl {e.distribution or e.value}" for e in third_party)
        raise PluginError(
            f"{len(third_party)} model plugins serve architecture {arch!r}: {found}. Choose "
            f"one with {choices} (--model-impl engine for the engine's own), or keep one "
            f"with ENGINE_PLUGINS", plugin=arch, group=MODELS)
    return (third_party or candidates)[0]


def _auto_reason(candidates: list[PluginEntry]) -> str:
    if len(candidates) == 1:
        return "the only model for the architecture"
    return ("auto: a plugin's model takes precedence over the engine's own "
            "(--model-impl engine uses the engine's)")


__all__ = ["AUTO", "ENGINE", "ModelChoice", "architectures_of", "choose_model"]
