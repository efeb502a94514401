"""What one tensor-parallel rank reads from a safetensors checkpoint while it loads its shard.

Workload: a random-initialised Llama written to a temp dir (float32 safetensors; default
hidden 1024, intermediate 4096, 4 layers, 16 heads / 4 KV heads, vocab 32000: ~134M
parameters, ~535 MB). For each case the file is dropped from the page cache
(``posix_fadvise(DONTNEED)``), then a fresh spawned process builds and loads the model as
one rank would (``build_model`` with that rank's ``TensorParallelGroup``; loading needs no
process group) and reports:

* ``read MB``: bytes the process made the kernel fetch from storage (``/proc/self/io``
  ``read_bytes``; the page faults of the memory-mapped tensors are counted there);
* ``mapped MB``: checkpoint pages resident in the process: the peak growth of ``RssFile``
  (``/proc/self/status``) while the tensors are loaded (the checkpoint is memory-mapped,
  so this is what the rank's copies touched);
* ``load s``: wall time of ``build_model``.

The safetensors loader yields memory-mapped tensors and the layers narrow them to the rank's
rows/columns before copying, so only the shard's pages are touched, as long as no dtype cast
is needed (a cast converts the whole tensor first: the ``bfloat16`` rows). ``read MB`` is
larger than ``mapped MB`` because the kernel reads around each page fault
(``/sys/block/*/queue/read_ahead_kb``, 8 MB on the development machines); on one host the
ranks share the page cache, so the file is read from storage about once either way.

    .venv/bin/python benchmarks/tp_weight_loading.py
    .venv/bin/python benchmarks/tp_weight_loading.py --layers 2 --hidden 512
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def _load(model: str, dtype: str, rank: int, size: int) -> dict[str, float]:
    """One rank's load, in a fresh process."""
    import torch

    from engine.core.config import EngineConfig
    from engine.core.distributed import TensorParallelGroup
    from engine.core.model_loader import iter_weights
    from engine.core.startup import prepare
    from engine.core.worker.model_setup import build_model

    setup = prepare(EngineConfig(model=model, dtype=dtype, plugins="none"), process="worker")
    seen: dict[str, float] = {}

    def weights() -> Any:
        peak = 0
        for item in iter_weights(setup.source, setup.dtype, progress=False):
            yield item
            peak = max(peak, _status_kb("RssFile"))
        seen["mapped"] = (peak - mapped_before) / 1024

    mapped_before = _status_kb("RssFile")
    before, start = _read_bytes(), time.perf_counter()
    build_model(catalog=setup.catalog, platform=setup.platform, hf_config=setup.hf_config,
                dtype=setup.dtype, block_size=16, attention_backend=None, weights=weights(),
                device=torch.device("cpu"), tp=TensorParallelGroup(rank, size))
    seen["seconds"] = time.perf_counter() - start
    seen["read"] = (_read_bytes() - before) / 2**20
    return seen


def _drop_from_cache(folder: Path) -> None:
    for file in folder.glob("*.safetensors"):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()

    from engine.testing.models import build_random_llama

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_random_llama(Path(tmp) / "llama", {
            "hidden_size": args.hidden, "intermediate_size": args.intermediate,
            "num_hidden_layers": args.layers, "num_attention_heads": 16,
            "num_key_value_heads": 4, "vocab_size": args.vocab,
            "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
        })
        size_mb = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20
        print(f"checkpoint: {size_mb:.0f} MB float32 safetensors ({folder.name})\n")
        print(f"{'model dtype':<12}{'tp':>4}{'rank':>6}{'read MB':>10}{'mapped MB':>11}"
              f"{'load s':>8}")
        ctx = multiprocessing.get_context("spawn")
        for dtype, size, rank in (("float32", 1, 0), ("float32", 2, 0), ("float32", 2, 1),
                                  ("bfloat16", 1, 0), ("bfloat16", 2, 0)):
            _drop_from_cache(folder)
            with ProcessPoolExecutor(1, mp_context=ctx) as pool:
                seen = pool.submit(_load, str(folder), dtype, rank, size).result()
            print(f"{dtype:<12}{size:>4}{rank:>6}{seen['read']:>10.0f}{seen['mapped']:>11.0f}"
                  f"{seen['seconds']:>8.2f}")


if __name__ == "__main__":
    main()
