"""The default linear-kernel choice against every forced one, in one run.

    .venv/bin/python benchmarks/kernel_selection.py [--rounds 2] [--model llama-100m]

The engine on the peers' offline workload (``peers.py``: 64 prompts x 32 -> 128 tokens,
greedy) with its default ``--kernel-selection measured``, with ``priority``, and with each
unquantized kernel forced (``--linear-kernel``), in turns for ``--rounds`` rounds, best
of the rounds; then the default's ratio to the best. The measured choice is made fresh
(a temporary ``ENGINE_CACHE_DIR``) in the first round and read back from disk after, and
the time of each start (LLM() to ready) is printed too: the first includes measuring.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import peers

from engine.core.machine import cache_dir

CONFIGS: dict[str, dict[str, Any]] = {
    "default (measured)": {},
    "priority": {"kernel_selection": "priority"},
    "--linear-kernel cpu": {"linear_kernel": "cpu"},
    "--linear-kernel onednn": {"linear_kernel": "onednn"},
    "--linear-kernel torch": {"linear_kernel": "torch"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-100m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    model = peers.PEERS_HOME / args.model
    cache = Path(tempfile.mkdtemp(prefix="engine-kernel-choice-"))
    native = cache_dir() / "native"
    if native.exists():  # the compiled kernels, not the choices
        shutil.copytree(native, cache / "native")
    os.environ["ENGINE_CACHE_DIR"] = str(cache)
    rates: dict[str, list[float]] = {name: [] for name in CONFIGS}
    starts: list[float] = []
    try:
        for _ in range(args.rounds):
            for name, options in CONFIGS.items():
                rate = peers.engine_offline(
                    model, args.threads, dtype=args.dtype,
                    starts=starts if name.startswith("default") else None, **options)
                rates[name].append(rate)
                print(f"  {name}: {rate:.1f} tok/s", flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    best = max(max(r) for r in rates.values())
    print(f"\n{'configuration':<26} {'tok/s (best)':>12} {'x best':>7}")
    for name, values in rates.items():
        print(f"{name:<26} {max(values):>12.1f} {max(values) / best:>7.2f}")
    print("starts of the default (LLM() to ready, s): "
          + ", ".join(f"{s:.1f}" for s in starts) + " (the first measures)")


if __name__ == "__main__":
    main()
