"""Attention groups: a model's layers grouped by spec, one metadata builder per group.

Layers of one model may differ in what their backend needs to know per step: Gemma 2/3 and
GPT-OSS alternate sliding-window and global layers, and a backend's metadata may depend on
the window (the ``torch`` backend builds its masks from it). So the engine groups the
attention layers by :class:`~engine.sdk.attention.AttentionSpec` (:func:`group_layers`,
model order) and builds one metadata builder per group, its ``AttentionContext`` holding
the group's spec and layer names.

Models pass the ``metadata`` they are given through to their attention layers unchanged.
With one group that is the group's own metadata, exactly as before groups existed. With
several, :class:`GroupedMetadataBuilder` builds every group's metadata each step into one
:class:`GroupedMetadata`, and each attention layer picks its group's
(``engine.core.model_executor.layers.attention``). The CPU step graph and CUDA graphs see
one builder either way: the grouped one's ``graph_metadata`` holds every group's fixed
buffers (or none, when a group's builder has none: the model then runs eagerly, the reason
logged), and a CUDA graph replays what each group's ``build`` prepared.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from engine.sdk.attention import (
    AttentionBackend,
    AttentionContext,
    AttentionMetadataBuilder,
    AttentionSpec,
    CommonAttentionMetadata,
    GraphMetadata,
)
from engine.sdk.capture import CaptureContext


def group_layers(specs: Mapping[str, AttentionSpec]
                 ) -> list[tuple[AttentionSpec, tuple[str, ...]]]:
    """The layers (name -> spec, in model order) grouped by equal spec, in order of first use."""
    groups: dict[AttentionSpec, list[str]] = {}
    for name, spec in specs.items():
        groups.setdefault(spec, []).append(name)
    return [(spec, tuple(names)) for spec, names in groups.items()]


def make_builder(backend: type[AttentionBackend], specs: Mapping[str, AttentionSpec],
                 **context: Any) -> AttentionMetadataBuilder[Any]:
    """The step's metadata builder for layers of ``specs`` (name -> spec, model order).

    One group: ``backend``'s builder for it, as it is. Several: a
    :class:`GroupedMetadataBuilder` over one builder per group. ``context``: the other
    :class:`~engine.sdk.attention.AttentionContext` fields (device, limits, options, ...).
    """
    builders = [backend.get_builder_cls()(AttentionContext(spec=spec, layer_names=names,
                                                           **context))
                for spec, names in group_layers(specs)]
    return builders[0] if len(builders) == 1 else GroupedMetadataBuilder(builders)


class GroupedMetadata:
    """One step's metadata of every attention group; a layer takes its group's.

    Attributes:
        groups: Each group's metadata, in group order.
    """

    __slots__ = ("_index", "groups")

    def __init__(self, groups: Sequence[Any], index: Mapping[str, int]) -> None:
        self.groups = tuple(groups)
        self._index = index

    def for_layer(self, layer_name: str) -> Any:
        """The metadata of ``layer_name``'s group.

        Raises:
            KeyError: the layer is in no group (it was built after the groups were made).
        """
        try:
            return self.groups[self._index[layer_name]]
        except KeyError:
            raise KeyError(f"attention layer {layer_name!r} is in no attention group "
                           f"(known: {', '.join(self._index)})") from None


class GroupedMetadataBuilder(AttentionMetadataBuilder[GroupedMetadata]):
    """Builds every group's metadata (see the module docstring); engine-internal.

    Args:
        builders: One builder per group, each constructed with its group's context (spec,
            layer names).
    """

    def __init__(self, builders: Sequence[AttentionMetadataBuilder[Any]]) -> None:
        if len(builders) < 2:
            raise ValueError("a grouped builder joins two or more groups' builders")
        super().__init__(builders[0].ctx)
        self.builders = tuple(builders)
        self.index = {name: i for i, builder in enumerate(builders)
                      for name in builder.ctx.layer_names}

    def build(self, common: CommonAttentionMetadata) -> GroupedMetadata:
        return GroupedMetadata([builder.build(common) for builder in self.builders], self.index)

    def graph_metadata(self, ctx: CaptureContext) -> GraphMetadata[GroupedMetadata] | None:
        """Every group's fixed buffers, or None where a group's builder has none."""
        parts = [builder.graph_metadata(ctx) for builder in self.builders]
        if any(part is None for part in parts):
            return None
        return GroupedGraphMetadata([p for p in parts if p is not None], self.index)


class GroupedGraphMetadata(GraphMetadata[GroupedMetadata]):
    """The groups' :class:`~engine.sdk.attention.GraphMetadata`, side by side."""

    def __init__(self, parts: Sequence[GraphMetadata[Any]], index: Mapping[str, int]) -> None:
        self.parts = tuple(parts)
        self.index = index

    def tensors(self) -> list[torch.Tensor]:
        return [t for part in self.parts for t in part.tensors()]

    def view(self, num_tokens: int) -> GroupedMetadata:
        return GroupedMetadata([part.view(num_tokens) for part in self.parts], self.index)

    def fill(self, common: CommonAttentionMetadata) -> None:
        for part in self.parts:
            part.fill(common)


__all__ = ["GroupedGraphMetadata", "GroupedMetadata", "GroupedMetadataBuilder",
           "group_layers", "make_builder"]
