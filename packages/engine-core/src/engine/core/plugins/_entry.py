"""``PluginEntry``: one discovered entry point, with the distribution that provides it."""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Distributions whose entries are the engine's own built-ins: always available, whatever
#: the allowlist says (the allowlist governs what *other* distributions may add).
BUILTIN_DISTRIBUTIONS = frozenset({"engine-core", "engine-server"})

#: The engine's own distributions, engine-kernels included: where one of their entries and a
#: third party's share a name, the third party's takes precedence (it "shadows" the engine's,
#: as an out-of-tree model overrides an in-tree one in vLLM). engine-kernels reaches the
#: engine only through its entry points, like a plugin; it holds the engine's default
#: kernels (the CPU's C++, the GPU's Triton), so the allowlist (``ENGINE_PLUGINS``, which
#: governs what third parties add) always allows it: ``--attention-backend``,
#: ``--linear-kernel``, ``--disabled-kernels`` and ``--custom-ops`` choose among kernels.
FIRST_PARTY_DISTRIBUTIONS = BUILTIN_DISTRIBUTIONS | {"engine-kernels"}


def normalize_dist_name(name: str) -> str:
    """PEP 503 normalisation: ``Engine_Test.Plugin`` -> ``engine-test-plugin``."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class PluginEntry:
    """An entry point in one of the engine's groups, not yet imported.

    Attributes:
        group: The entry-point group (``engine.logits_processors``, ...).
        name: The entry-point name.
        value: ``module:attr`` it points to.
        distribution: Normalised name of the installed distribution providing it, or None
            for a plugin given directly as ``module:Class``.
        version: That distribution's version.
    """

    group: str
    name: str
    value: str
    distribution: str | None
    version: str | None

    @property
    def key(self) -> tuple[str, str]:
        """``(group, name)``: what must be unique across distributions."""
        return (self.group, self.name)

    @property
    def is_builtin(self) -> bool:
        """True for the engine's own entries."""
        return self.distribution in BUILTIN_DISTRIBUTIONS

    @property
    def is_first_party(self) -> bool:
        """True for the engine's own entries, engine-kernels' included."""
        return self.distribution in FIRST_PARTY_DISTRIBUTIONS

    @property
    def provider(self) -> str:
        """``"dist version"`` for messages, or a note that it is not from a distribution."""
        if self.distribution is None:
            return "no distribution (given as module:Class)"
        return f"{self.distribution} {self.version}" if self.version else self.distribution
