"""``--load-format dummy``: random weights, for benchmarks and tests (vLLM's dummy loader).

Only the model's config is read (``config.json`` or the GGUF metadata); no weight file is
opened. The model is built as usual, then every floating-point parameter is filled from
a uniform distribution on ``[-1e-3, 1e-3]`` (as vLLM does, with a fixed seed, so two runs
get the same weights) and every integer parameter (packed or quantized storage) with
zeros. The model's own ``load_weights`` then runs on no tensors, so what it does after
loading (tied embeddings, ``process_weights_after_loading`` of quantize methods) still
happens.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

#: Seed of the random weights (the same on every run and every rank).
DUMMY_SEED = 1234
#: Floating-point weights are uniform on ``[-DUMMY_RANGE, DUMMY_RANGE]``.
DUMMY_RANGE = 1e-3


class DummyWeights(Iterable[tuple[str, torch.Tensor]]):
    """The weights of a ``--load-format dummy`` model: no tensors (see the module)."""

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(())


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int = DUMMY_SEED) -> None:
    """Fill every parameter of ``model`` in place: floats uniform, integers zero."""
    generators: dict[torch.device, torch.Generator] = {}
    for param in model.parameters():
        if not param.is_floating_point():
            param.zero_()
            continue
        generator = generators.get(param.device)
        if generator is None:
            generator = torch.Generator(device=param.device).manual_seed(seed)
            generators[param.device] = generator
        if param.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            param.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=generator)
        else:  # e.g. float8 storage: draw in float32, then cast
            values = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            param.copy_(values.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=generator))


def load_weights_into(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
    """``model.load_weights(weights)``, after random initialisation for :class:`DummyWeights`.

    Returns:
        What the model's ``load_weights`` returns.
    """
    if isinstance(weights, DummyWeights):
        initialize_dummy_weights(model)
    return model.load_weights(weights)  # type: ignore[operator]
