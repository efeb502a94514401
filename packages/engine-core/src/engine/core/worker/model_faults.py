"""A model plugin's own failure while the worker builds it names the plugin.

The model class (an ``engine.models`` entry, built-in or a plugin's) runs its own code in
``__init__`` and ``load_weights``; an exception there (e.g. ``AttributeError: 'Qwen3Config'
object has no attribute 'rope_theta'``) becomes a :class:`~engine.sdk.errors.PluginError`
naming the model's entry, its distribution and version, with the exception's type and
message, and the exception as ``__cause__``::

    with naming_model(entry, "constructing it"):
        model = model_cls(ctx)
    with naming_model(entry, "loading its weights") as loader_errors:
        model.load_weights(watched(weights, loader_errors))

What already names its cause passes unchanged: a ``PluginError`` (e.g. one naming a
linear kernel the model's layers use), an ``UnsupportedError`` (the layer factory's "no
linear kernel / attention backend can run this", which lists every candidate with its
reason, as the docs of those seams promise), and an exception of the engine's weight
reader (:func:`watched` notes those as they go through the model).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from engine.core.model_loader.dummy import DummyWeights
from engine.core.plugins import PluginEntry
from engine.core.plugins._loader import plugin_error
from engine.sdk.errors import PluginError, UnsupportedError

if TYPE_CHECKING:
    import torch

    Weights = Iterable[tuple[str, torch.Tensor]]

#: Said after an ``AttributeError`` about rope settings (the usual transformers 5 surprise).
ROPE_HINT = ("; transformers 5 keeps rope settings in config.rope_parameters (4.x: "
             "rope_theta, rope_scaling): engine.sdk.layers.rope_settings(config) reads a "
             "config of either")


@contextmanager
def naming_model(entry: PluginEntry, doing: str) -> Iterator[list[BaseException]]:
    """Turn an exception of the model's own code into a PluginError naming the model.

    Args:
        entry: The model's ``engine.models`` entry (``ModelChoice.entry``).
        doing: What the engine was doing, e.g. ``"constructing it"``.

    Yields:
        A list for :func:`watched`: exceptions in it pass unchanged.

    Raises:
        PluginError: ``plugin 'ARCH' (group engine.models, distribution D V): DOING failed:
            TYPE: MESSAGE``.
    """
    passing: list[BaseException] = []
    try:
        yield passing
    except (PluginError, UnsupportedError):
        raise
    except Exception as exc:
        if any(exc is seen for seen in passing):
            raise
        hint = ROPE_HINT if isinstance(exc, AttributeError) and "rope" in str(exc) else ""
        raise plugin_error(entry, f"{doing} failed: {type(exc).__name__}: {exc}{hint}"
                           ) from exc


def watched(weights: Weights, passing: list[BaseException]) -> Weights:
    """``weights``, noting in ``passing`` an exception the iteration itself raises.

    ``DummyWeights`` (no tensors) is returned as is, so the loader still recognises it.
    """
    if isinstance(weights, DummyWeights):
        return weights
    return _watch(iter(weights), passing)


def _watch(items: Iterator[tuple[str, torch.Tensor]], passing: list[BaseException],
           ) -> Iterator[tuple[str, torch.Tensor]]:
    while True:
        try:
            item = next(items)
        except StopIteration:
            return
        except Exception as exc:
            passing.append(exc)
            raise
        yield item
