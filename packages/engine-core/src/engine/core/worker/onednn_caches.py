"""Bound oneDNN's per-shape caches in a process that runs the model on the CPU.

oneDNN (``torch._C._nn.mkldnn_linear`` of the ``onednn`` linear kernel, and the bf16
``F.linear`` path, which goes to oneDNN's matmul) builds one primitive per input shape,
and two caches keep them: ideep's (``LRU_CACHE_CAPACITY``) and oneDNN's own
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY``), 1,024 entries each by default. A served model sees
a new shape whenever a step has a token count it has not had before (``M`` of every linear
layer is the step's token count, up to the token budget), and each new shape costs about
0.5-0.7 MiB of malloc heap in the two caches together, whatever the weight's size. Under
varied traffic that is hundreds of MiB of growth over minutes, and 0.8-1.2 GiB before both
caches are full (``benchmarks/soak.py``; benchmarks/README.md, "Memory under a soak").

Both caches are LRU, so a smaller capacity keeps the shapes that recur (decode steps at
the running batch sizes) and evicts the one-off prefill shapes; a miss costs ~0.5 ms
(primitive creation), once per new shape in a step, not per layer.
``bound_onednn_caches`` sets both capacities to :data:`DEFAULT_CAPACITY` unless the
operator set the variable. oneDNN reads them when it creates its first primitive in the
process, so this runs before the model is loaded.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("engine.worker")

#: Entries per cache: ~50 token counts x 5 weight shapes; 150-200 MiB for both at most.
DEFAULT_CAPACITY = 256

#: The variables oneDNN and ideep read, each at the first primitive of the process.
CAPACITY_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_onednn_caches(capacity: int = DEFAULT_CAPACITY) -> dict[str, str]:
    """Set both cache capacities to ``capacity`` where the environment does not set them.

    Called: by ``Worker.__init__`` on the CPU, before the model is loaded (the first oneDNN
    primitive of the process reads the variables; later changes are not seen).

    Args:
        capacity: Entries per cache; 0 disables caching (a primitive per call).

    Returns:
        The capacities in effect, by variable (the operator's value where one was set).

    Raises:
        ValueError: ``capacity`` is negative.
    """
    if capacity < 0:
        raise ValueError(f"oneDNN cache capacity must be 0 or more, not {capacity}")
    for name in CAPACITY_VARIABLES:
        os.environ.setdefault(name, str(capacity))
    in_effect = {name: os.environ[name] for name in CAPACITY_VARIABLES}
    logger.debug("oneDNN cache capacities: %s", in_effect)
    return in_effect
