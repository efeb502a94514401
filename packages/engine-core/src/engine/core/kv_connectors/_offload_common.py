"""What both sides of the ``offload`` connector share: options, metadata, the store's keys.

A stored block is keyed by the chained hash of the prompt up to the end of that block (the
prefix cache's hash, ``engine.core.kv_cache.block_hash``), so a block is found again by any
later prompt with the same prefix. Blocks of engines that could not use each other's KV
never meet: a directory store keeps them under a *namespace* derived from everything the
KV depends on (the model's weights, dtype, block size, layer count, per-rank head geometry,
tensor-parallel size, the operator's ``namespace`` option and the file format), with one
sub-directory per tensor-parallel rank::

    PATH/<namespace>/namespace.json          what the namespace stands for (for people)
    PATH/<namespace>/rank0/layout.json        the cache layout rank 0 wrote the files in
    PATH/<namespace>/rank0/3f/3fa2...e1.kv    one block, every layer, raw bytes
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from engine.sdk.kv_connector import KVConnectorContext, KVConnectorMetadata
from engine.sdk.plugin import PluginOptions

#: Bump when the file layout changes: older files then live in another namespace.
FORMAT_VERSION = 1

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class OffloadOptions(PluginOptions):
    """Options of ``offload`` (``--kv-connector-option KEY=VALUE``)."""

    path: str | None = Field(
        None, description="directory to save blocks in (shared by every engine started on "
        "it); default: this engine's CPU memory")
    cpu_memory_gib: float = Field(
        1.0, gt=0, description="without path: GiB of CPU memory for saved blocks (least "
        "recently used blocks are dropped)")
    load_async: bool = Field(
        False, description="load blocks on a background thread; the request waits, holding "
        "its blocks, until they are in place (instead of loading before the forward pass)")
    namespace: str = Field(
        "", description="an extra key: engines with different values never share blocks")


#: A block id in the KV cache: never the null block 0.
BlockId = Annotated[int, Field(ge=1)]
#: A block's key: the hex digest of its chained hash.
BlockKey = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class BlockTransfer(BaseModel):
    """One block to move between the cache and the store."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    req_id: str
    block_id: BlockId
    key: BlockKey


class OffloadMeta(KVConnectorMetadata):
    """One step of ``offload``: blocks to load (store -> cache) and save (cache -> store).

    Attributes:
        loads: Blocks to fill before their layer's attention (or in the background).
        saves: Blocks whose KV this step completes, to store once written.
        evictions: Keys to drop from a CPU-memory store after this step's saves.
        load_async: Whether ``loads`` run on a background thread (reported per request
            by ``get_finished``).
    """

    loads: tuple[BlockTransfer, ...] = ()
    saves: tuple[BlockTransfer, ...] = ()
    evictions: tuple[BlockKey, ...] = ()
    load_async: bool = False


def options_of(ctx: KVConnectorContext) -> OffloadOptions:
    """The context's options as :class:`OffloadOptions` (validating plain options)."""
    options = ctx.options
    if isinstance(options, OffloadOptions):
        return options
    return OffloadOptions.model_validate(options.model_dump())


def bytes_per_block(ctx: KVConnectorContext) -> int:
    """Bytes of one block's keys and values over every layer on one rank."""
    element = _DTYPE_BYTES.get(ctx.kv_cache_dtype, 4)
    return 2 * ctx.block_size * ctx.num_kv_heads * ctx.head_size * element * ctx.num_layers


def _weights_fingerprint(model: str) -> list[Any]:
    """Names, sizes and modification times of the model's files (the model string if none)."""
    path = Path(model).expanduser()
    if path.is_file():
        stat = path.stat()
        return [[path.name, stat.st_size, stat.st_mtime_ns]]
    if path.is_dir():
        found = []
        for file in sorted(path.iterdir()):
            if file.suffix in (".safetensors", ".gguf", ".bin") or file.name == "config.json":
                stat = file.stat()
                found.append([file.name, stat.st_size, stat.st_mtime_ns])
        if found:
            return found
    return [model]


def namespace_fields(ctx: KVConnectorContext, options: OffloadOptions) -> dict[str, Any]:
    """Everything the stored KV depends on (equal on both sides of one engine)."""
    return {
        "format": FORMAT_VERSION, "weights": _weights_fingerprint(ctx.model),
        "kv_cache_dtype": ctx.kv_cache_dtype, "block_size": ctx.block_size,
        "num_layers": ctx.num_layers, "num_kv_heads_per_rank": ctx.num_kv_heads,
        "head_size": ctx.head_size, "tp_size": ctx.tp_size, "namespace": options.namespace,
    }


def namespace_id(fields: dict[str, Any]) -> str:
    """The directory name of a namespace."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]


def rank_dir(root: Path, namespace: str, rank: int) -> Path:
    """Where tensor-parallel rank ``rank`` keeps its share of each block."""
    return root / namespace / f"rank{rank}"


def block_file(directory: Path, key: str) -> Path:
    """The file of block ``key`` in a rank's directory."""
    return directory / key[:2] / f"{key}.kv"
