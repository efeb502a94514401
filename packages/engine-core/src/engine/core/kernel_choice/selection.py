"""``--kernel-selection measured``: the linear kernel of each layer shape, measured.

Where more than one installed kernel can run an unquantized layer on the CPU, the
selector times them (``timing``) on the layer's shape at each row bucket of the step's
token budget and gives the layer the plan's kernel (``plan``), or a ``RowDispatchKernel``
where buckets chose different ones. The decision is kept on disk (``store``) and read
back by later starts; one INFO line per layer shape says what was chosen, with the times.
``--linear-kernel`` and ``--disabled-kernels`` apply first, as with ``priority``.

Measured only what the engine can make weights for without the layer's quantization
method: unquantized layers, of ``MIN_MEASURED_WEIGHTS`` elements or more. A quantized
scheme or a tiny layer keeps the priority order.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from engine.core.kernel_choice import KernelSelection, store
from engine.core.kernel_choice.buckets import bucket_triples, row_buckets
from engine.core.kernel_choice.plan import KernelPlan, choose
from engine.core.kernel_choice.row_dispatch import RowDispatchKernel
from engine.core.kernel_choice.timing import time_kernels
from engine.core.machine import cpu_flags, cpu_model, target_arch
from engine.sdk.errors import UnsupportedError
from engine.sdk.linear_kernel import LinearKernel, LinearKernelConfig, select_linear_kernel
from engine.sdk.platform import PlatformInfo

logger = logging.getLogger(__name__)

#: A choice whose leading kernels' rounds differ more (second best over best) was made
#: on a busy machine: the next start measures again, up to ``MAX_ATTEMPTS`` times in all
#: (on a machine that stays busy, the last one is used from then on).
STEADY_SPREAD = 1.5
MAX_ATTEMPTS = 3
#: Weights of fewer elements are not measured: their product takes microseconds whichever
#: kernel runs it, less than the timings' noise (test models; priority decides).
MIN_MEASURED_WEIGHTS = 1 << 18
#: The only scheme measured (see the module docstring).
MEASURED_SCHEME = "unquantized"


def label(kernel: type[LinearKernel]) -> str:
    return kernel.name or f"{kernel.__module__}:{kernel.__qualname__}"


@functools.cache
def _source_digest(path: str | None) -> str:
    if path is None:
        return ""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    except OSError:
        return ""


def identity(name: str, cls: type, version: str) -> list[str]:
    """What a candidate's timings depend on: its name, class, distribution, source."""
    try:
        source = inspect.getsourcefile(cls)
    except TypeError:
        source = None
    return [name, f"{cls.__module__}:{cls.__qualname__}", version, _source_digest(source)]


#: Variables that hold torch, oneDNN and MKL to fewer instructions than the CPU has
#: (``benchmarks/isa_avx2.py``): a choice made under them is not one made without.
ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
                 "MKL_ENABLE_INSTRUCTIONS")


def machine_key() -> dict[str, Any]:
    """What every measurement here depends on besides its candidates and shapes.

    The CPU and its flags, torch, the thread count, the ``-march`` the engine's kernels are
    built for (``ENGINE_CPU_KERNELS_MARCH``) and the instruction-set limits set in the
    environment.
    """
    flags = hashlib.sha256(cpu_flags().encode()).hexdigest()[:16]
    key = {"cpu": cpu_model(), "cpu_flags": flags, "torch": torch.__version__,
           "threads": torch.get_num_threads()}
    limits = {name: os.environ[name] for name in ISA_VARIABLES if os.environ.get(name)}
    if target_arch() != "native" or limits:  # absent otherwise: records made before agree
        key["isa"] = {"march": target_arch(), **limits}
    return key


def eligible_kernels(kernels: Sequence[type[LinearKernel]], info: PlatformInfo,
                     config: LinearKernelConfig, disabled: Sequence[str]
                     ) -> list[type[LinearKernel]]:
    """Every kernel that can run ``config`` here, in priority order.

    Raises:
        UnsupportedError: none can (every kernel with its reason).
    """
    found: list[type[LinearKernel]] = []
    skip = list(disabled)
    while True:
        try:
            kernel = select_linear_kernel(kernels, info, config, disabled=tuple(skip))
        except UnsupportedError:
            if found:
                return found
            raise
        found.append(kernel)
        skip.append(label(kernel))


class MeasuredSelector:
    """The ``measured`` linear-kernel selector (one per model built)."""

    def __init__(self, kernels: Sequence[type[LinearKernel]], info: PlatformInfo, *,
                 disabled: Sequence[str], step_tokens: int,
                 versions: Mapping[str, str], step_graph: bool = True) -> None:
        self.kernels = list(kernels)
        self.info = info
        self.disabled = tuple(disabled)
        self.buckets = row_buckets(step_tokens)
        #: Per kernel name, its distribution and version, for the key and for messages.
        self.versions = dict(versions)
        #: Steps may run as a CPU step graph (not ``--enforce-eager``): see ``plan``.
        self.step_graph = step_graph and info.device_type == "cpu"
        self._chosen: dict[LinearKernelConfig, type[LinearKernel]] = {}

    def __call__(self, config: LinearKernelConfig) -> type[LinearKernel]:
        if config not in self._chosen:
            self._chosen[config] = self._select(config)
        return self._chosen[config]

    def _select(self, config: LinearKernelConfig) -> type[LinearKernel]:
        eligible = eligible_kernels(self.kernels, self.info, config, self.disabled)
        if len(eligible) < 2 or config.scheme != MEASURED_SCHEME or (
                self.info.device_type != "cpu") or (
                config.input_size * config.output_size < MIN_MEASURED_WEIGHTS):
            return eligible[0]
        classes = {label(k): k for k in eligible}
        plan = self._plan(config, eligible)
        if plan is None:
            return eligible[0]
        if len(plan.names) == 1:
            return classes[plan.names[0]]
        return RowDispatchKernel.of(plan, classes)

    def key(self, config: LinearKernelConfig,
            eligible: Sequence[type[LinearKernel]]) -> dict[str, Any]:
        """What a decision for ``config`` depends on (see ``store``)."""
        return {"device": self.info.name, **machine_key(),
                "kernels": [identity(label(k), k, self.versions.get(label(k), ""))
                            for k in eligible],
                "config": asdict(config), "step_graph": self.step_graph,
                "buckets": bucket_triples(self.buckets)}

    def _plan(self, config: LinearKernelConfig,
              eligible: Sequence[type[LinearKernel]]) -> KernelPlan | None:
        def measure() -> KernelPlan | None:
            timings, failed = time_kernels(eligible, config, self.buckets, self.info,
                                           step_graph=self.step_graph)
            for name, reason in failed.items():
                logger.warning("linear kernel %s%s left out of the measured choice for %s: "
                               "%s", name, self._provider(name), config.describe(), reason)
            if not timings:
                return None
            return choose(timings, self.buckets, [label(k) for k in eligible], failed)

        return decide(self.key(config, eligible), f"linear kernel for {config.describe()}",
                      measure)

    def _provider(self, name: str) -> str:
        version = self.versions.get(name)
        return f" ({version})" if version else ""


def decide(parts: dict[str, Any], what: str,
           measure: Callable[[], KernelPlan | None]) -> KernelPlan | None:
    """The plan kept on disk for ``parts``, else ``measure()``'s, kept (logged as ``what``).

    A record made on a busy machine is measured again, up to ``MAX_ATTEMPTS`` times in all.
    None where ``measure`` found nothing to choose from.
    """
    found = store.load(parts)
    if found is not None and (found.steady or found.attempts >= MAX_ATTEMPTS):
        logger.info("%s: %s (measured %s, kept in %s)", what, found.plan.describe(),
                    found.measured_at, found.path)
        return found.plan
    start = time.perf_counter()
    plan = measure()
    if plan is None:
        return None
    took = time.perf_counter() - start
    steady = plan.steady(STEADY_SPREAD)
    attempts = 1 + (found.attempts if found is not None else 0)
    saved = store.save(parts, plan, steady=steady, attempts=attempts)
    kept = f", kept in {saved.path}" if saved else ""
    if not steady:
        again = ("the next start measures again" if attempts < MAX_ATTEMPTS else
                 f"kept after {attempts} tries: `engine kernels clear` measures again")
        kept += (f"; its rounds differed by more than {round((STEADY_SPREAD - 1) * 100)}%"
                 f": the machine is busy, so {again}")
    logger.info("%s: %s (measured in %.2f s%s)", what, plan.describe(), took, kept)
    return plan


def make_selector(kind: KernelSelection, kernels: Sequence[type[LinearKernel]],
                  info: PlatformInfo, *, forced: str | None, disabled: Sequence[str],
                  step_tokens: int, versions: Mapping[str, str], step_graph: bool = True,
                  ) -> Callable[[LinearKernelConfig], type[LinearKernel]] | None:
    """The measured selector, or None where priority decides (forced, or ``priority``).

    ``step_graph``: False under ``--enforce-eager`` (every kernel is timed as it is called).
    """
    if kind == "priority" or forced is not None:
        return None
    return MeasuredSelector(kernels, info, disabled=disabled, step_tokens=step_tokens,
                            versions=versions, step_graph=step_graph)
