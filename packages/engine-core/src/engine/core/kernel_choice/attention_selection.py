"""``--kernel-selection measured``: the attention backend, measured, where none is forced.

Every installed ``engine.attention_backends`` entry whose ``supports`` accepts the model's
layers on this platform is a candidate, the platform's default first (the reference the
others' outputs are checked against, and the tie-break). The worker times them on the
steps it will run (``attention_timing``) and the backend fastest in most row buckets serves
every layer (one backend per model: it decides the KV cache's layout). The decision is kept
on disk with the linear kernels' (``store``; ``engine kernels list`` shows both) and read
back by later starts; one INFO line says what was chosen, with the times.

Measured on the CPU only, and only for layers of at least :data:`MIN_MEASURED_WIDTH` query
elements per token (heads x head size): smaller ones take microseconds whichever backend
runs them (test models); the platform's default serves them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import Any

import torch

from engine.core.kernel_choice.attention_timing import CONTEXT, time_backends
from engine.core.kernel_choice.buckets import bucket_triples, row_buckets
from engine.core.kernel_choice.plan import KernelPlan, choose
from engine.core.kernel_choice.selection import decide, identity, machine_key
from engine.core.plugin_options import validated_options
from engine.core.plugins import PluginCatalog
from engine.sdk.attention import AttentionBackend, AttentionSpec, backend_supports
from engine.sdk.errors import PluginError
from engine.sdk.groups import ATTENTION_BACKENDS
from engine.sdk.platform import Platform
from engine.sdk.plugin import PluginOptions

logger = logging.getLogger(__name__)

#: Heads x head size below which the platform's default serves without measuring.
MIN_MEASURED_WIDTH = 512

Candidate = tuple[str, type[AttentionBackend], PluginOptions]


def _candidates(catalog: PluginCatalog, spec: AttentionSpec, default: str,
                options: Mapping[str, Mapping[str, Any]]
                ) -> tuple[list[Candidate], dict[str, str]]:
    """The backends that can serve ``spec``, ``default`` first; and their providers."""
    names = [default] + [n for n in catalog.names(ATTENTION_BACKENDS) if n != default]
    found: list[Candidate] = []
    providers: dict[str, str] = {}
    for name in names:
        try:
            entry = catalog.resolve(ATTENTION_BACKENDS, name)
            backend: type[AttentionBackend] = catalog.load_resolved(entry)
            support = backend_supports(backend, spec)
            if not support:
                logger.debug("attention backend %s: not a candidate (%s)", name,
                             support.reason)
                continue
            chosen_options = validated_options(catalog, ATTENTION_BACKENDS, name, backend,
                                               options)
        except Exception as exc:
            if name == default:
                raise
            logger.warning("attention backend %s left out of the measured choice: %s", name,
                           exc if isinstance(exc, PluginError) else repr(exc))
            continue
        found.append((name, backend, chosen_options))
        providers[name] = entry.provider
    return found, providers


def measured_attention_backend(catalog: PluginCatalog, platform: type[Platform],
                               spec: AttentionSpec, dtype: torch.dtype, *, default: str,
                               step_tokens: int,
                               options: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """The name of the backend to serve ``spec``: measured, else ``default``.

    Args:
        catalog: The worker's plugin catalog.
        platform: The platform (only the CPU is measured).
        spec: The layers' spec (the engine adds the platform to it).
        dtype: The activations' dtype.
        default: The platform's default backend for ``spec``.
        step_tokens: The token budget (the largest step measured).
        options: ``--plugin-option`` values (each candidate is timed with its own).
    """
    if platform.device_type != "cpu" or spec.num_heads * spec.head_size < MIN_MEASURED_WIDTH:
        return default
    here = replace(spec, platform=platform.info())
    candidates, providers = _candidates(catalog, here, default, options or {})
    if len(candidates) < 2:
        return default
    buckets = row_buckets(step_tokens)
    spec_key = {k: v for k, v in asdict(spec).items() if k != "platform"}
    parts = {"what": "attention", "device": platform.info().name, **machine_key(),
             "backends": [identity(name, cls, providers.get(name, ""))
                          for name, cls, _ in candidates],
             "spec": spec_key, "context": CONTEXT,
             "buckets": bucket_triples(buckets)}

    def measure() -> KernelPlan | None:
        timings, failed = time_backends(candidates, here, dtype, buckets)
        for name, reason in failed.items():
            logger.warning("attention backend %s (%s) left out of the measured choice for %s: "
                           "%s", name, providers.get(name, "?"), spec.describe(), reason)
        if not timings:
            return None
        return choose(timings, buckets, [name for name, _, _ in candidates], failed)

    plan = decide(parts, f"attention backend for {spec.describe()}", measure)
    return default if plan is None else plan.names[0]


__all__ = ["MIN_MEASURED_WIDTH", "measured_attention_backend"]
