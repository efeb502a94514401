"""``engine kernels list|clear``: the kernel choices measured on this machine.

With ``--kernel-selection measured`` (the default) the engine times the linear kernels that
can run each layer shape, the attention backends that can serve the model and the custom
ops' implementations, and keeps each decision in the cache directory
(``engine.core.kernel_choice.store``); ``list`` shows them, ``clear`` removes them so the
next start measures again (after a BIOS change, say, or a machine that was busy when it
measured).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from engine.core.kernel_choice import store
from engine.server.cli._help import HelpFormatter
from engine.server.cli._logging_args import add_log_level

DESCRIPTION = (
    "With --kernel-selection measured (the default), an engine times the linear kernels "
    "that can run each layer shape, the attention backends that can serve the model and the "
    "custom ops' implementations on this machine and keeps each decision in the cache "
    "directory ($ENGINE_CACHE_DIR, else ~/.cache/engine) for later starts. list shows them; "
    "clear removes them, so the next start measures again (after the machine was busy "
    "while it measured, say).")


def add_parser(commands: Any) -> None:
    """Register ``kernels`` and its subcommands."""
    common = argparse.ArgumentParser(add_help=False)
    add_log_level(common, default_text="WARNING")
    parser = commands.add_parser(
        "kernels", help="show or clear the kernel choices measured on this machine",
        description=DESCRIPTION, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="kernels_command", metavar="SUBCOMMAND")
    sub.required = True
    lister = sub.add_parser("list", parents=[common], formatter_class=HelpFormatter,
                            help="one entry per layer shape (and attention spec): the "
                                 "kernel of each row bucket, with the times it was chosen "
                                 "from")
    lister.add_argument("--json", action="store_true", help="machine-readable output")
    lister.set_defaults(handler=_list)
    clearer = sub.add_parser("clear", parents=[common], formatter_class=HelpFormatter,
                             help="remove every kept choice (the next start measures again)")
    clearer.set_defaults(handler=_clear)


def _list(args: argparse.Namespace) -> int:
    records = store.stored()
    if args.json:
        print(json.dumps([{"path": str(r.path), "measured_at": r.measured_at, "key": r.key,
                           "plan": r.plan.to_json()} for r in records], indent=1))
        return 0
    if not records:
        print(f"no kernel choices kept in {store.choices_dir()} (an engine started with "
              f"--kernel-selection measured, the default, keeps them there)")
        return 0
    print(f"kernel choices kept in {store.choices_dir()}:")
    for record in records:
        print(f"- {_subject(record.key)}, {record.key.get('threads')} threads, "
              f"{record.key.get('cpu')}, measured {record.measured_at}:\n"
              f"    {record.plan.describe()}")
    return 0


def _subject(key: dict[str, Any]) -> str:
    """What a record chose for: a linear layer shape, or the attention of a layer spec."""
    if key.get("what") == "custom_op":
        shape = key.get("shape", {})
        return (f"custom op {key.get('op')} hidden={shape.get('hidden_size')} "
                f"{shape.get('dtype')}")
    if key.get("what") == "attention":
        spec = key.get("spec", {})
        return (f"attention heads={spec.get('num_heads')}/{spec.get('num_kv_heads')} "
                f"head_size={spec.get('head_size')} {spec.get('dtype')}")
    config = key.get("config", {})
    return (f"{config.get('scheme')} {config.get('weight_dtype')} "
            f"[{config.get('input_size')} -> {config.get('output_size')}]"
            + (" bias" if config.get("has_bias") else ""))


def _clear(args: argparse.Namespace) -> int:
    removed = store.clear()
    print(f"removed {removed} kernel choice(s) from {store.choices_dir()}")
    return 0
