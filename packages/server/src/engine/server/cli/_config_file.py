"""``--config FILE.yaml``: options from a YAML file, read as ``vllm serve --config`` reads it.

The file is a flat mapping of long option names, without the dashes, to values; ``-`` and
``_`` are the same (``max-model-len`` and ``max_model_len``)::

    model: /models/Llama-3.2-1B-Instruct
    port: 8001
    max_model_len: 4096
    enforce-eager: true
    served-model-name: [llama, default]

The file's options are put right after the subcommand (and its ``MODEL``, if given), so
options on the command line win over the file's, as in vLLM. Values:

* ``true`` gives the flag (``--enforce-eager``); ``false`` gives ``--no-X`` where the
  option has one, else nothing (the flag is off unless given);
* a list gives one ``--X item`` per item for a repeatable option (``plugin-option``), all
  items after one ``--X`` for an option that takes several (``served-model-name``), and
  the items joined by commas for a comma-list option (``disabled-kernels``);
* a mapping gives ``KEY=VALUE`` items (``kv-connector-option: {path: /tmp/kv}``), and
  ``NAME.KEY=VALUE`` ones for ``plugin-option: {my_processor: {strength: 0.5}}``; values
  are JSON;
* ``null`` leaves the option at its default; anything else is passed as its text.

A key that is not an option of the subcommand is an error naming the file and the key.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml


class ConfigFileError(ValueError):
    """The ``--config`` file cannot be read or names something that is not an option."""


def normalize_flag(arg: str) -> str:
    """``--max_model_len=8`` -> ``--max-model-len=8`` (vLLM accepts both spellings)."""
    if not arg.startswith("--"):
        return arg
    key, sep, value = arg.partition("=")
    return key.replace("_", "-") + sep + value


def _config_path(argv: Sequence[str]) -> tuple[int, int, str] | None:
    """``(start, end, path)`` of the one ``--config`` in ``argv``, or None."""
    found = [i for i, arg in enumerate(argv) if arg == "--config" or arg.startswith("--config=")]
    if not found:
        return None
    if len(found) > 1:
        raise ConfigFileError("--config is given more than once; give one file")
    index = found[0]
    if argv[index] != "--config":
        return index, index + 1, argv[index].removeprefix("--config=")
    if index + 1 >= len(argv) or argv[index + 1].startswith("-"):
        raise ConfigFileError("--config needs a file: --config FILE.yaml")
    return index, index + 2, argv[index + 1]


def _subcommand(parser: argparse.ArgumentParser, argv: Sequence[str]
                ) -> tuple[int, argparse.ArgumentParser]:
    """Index in ``argv`` of the last subcommand word, and that subcommand's parser."""
    index, current = -1, parser
    while True:
        actions = [a for a in current._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions:
            return index, current
        choices = actions[0].choices
        found = next((i for i in range(index + 1, len(argv)) if argv[i] in choices), None)
        if found is None:
            raise ConfigFileError("--config goes after the subcommand, e.g. engine serve "
                                  "--config FILE.yaml")
        index, current = found, choices[argv[found]]


def load_config_file(path: str) -> dict[str, Any]:
    """The mapping in the YAML file ``path`` (``.yaml`` or ``.yml``; empty: ``{}``).

    Raises:
        ConfigFileError: wrong extension, unreadable, not YAML, or not a mapping.
    """
    if Path(path).suffix.lower() not in (".yaml", ".yml"):
        raise ConfigFileError(f"--config {path}: the file must be YAML (.yaml or .yml)")
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigFileError(f"--config {path}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"--config {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"--config {path} must hold a mapping of option names to "
                              f"values, got {type(data).__name__}")
    return data


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else json.dumps(value)


def _items(key: str, value: dict[str, Any]) -> list[str]:
    """``KEY=VALUE`` (or ``NAME.KEY=VALUE`` for nested mappings) items of a mapping."""
    items = []
    for name, inner in value.items():
        if isinstance(inner, dict) and key == "plugin-option":
            items += [f"{name}.{k}={_text(v)}" for k, v in inner.items()]
        else:
            items.append(f"{name}={_text(inner)}")
    return items


def _option_args(path: str, key: Any, value: Any,
                 actions: dict[str, argparse.Action], command: str) -> list[str]:
    flag = "--" + str(key).replace("_", "-")
    if flag == "--config":
        raise ConfigFileError(f"--config {path}: a config file cannot name another (config)")
    action = actions.get(flag)
    if action is None or not str(key):
        raise ConfigFileError(f"--config {path}: {key!r} is not an option of {command} (see "
                              f"{command} --help; keys are option names without the dashes)")
    if value is None:
        return []
    repeatable = isinstance(action, argparse._AppendAction)
    if action.nargs == 0:  # a flag
        if not isinstance(value, bool):
            raise ConfigFileError(f"--config {path}: {key} is a flag; give true or false, "
                                  f"got {value!r}")
        if value:
            return [flag]
        return [f"--no-{flag[2:]}"] if f"--no-{flag[2:]}" in actions else []
    if isinstance(value, dict):
        if not repeatable:
            raise ConfigFileError(f"--config {path}: {key} takes one value, not a mapping")
        value = _items(flag[2:], value)
    if isinstance(value, list):
        texts = [_text(v) for v in value]
        if repeatable:
            return [part for text in texts for part in (flag, text)]
        if action.nargs in ("+", "*"):
            return [flag, *texts] if texts else []
        return [flag, ",".join(texts)]
    return [flag, _text(value)]


def expand_config_file(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``argv`` with ``--config FILE`` replaced by the file's options (see the module).

    Raises:
        ConfigFileError: the file or one of its keys is wrong (the message says which).
    """
    located = _config_path(argv)
    if located is None:
        return list(argv)
    start, end, path = located
    rest = [*argv[:start], *argv[end:]]
    index, command_parser = _subcommand(parser, rest)
    if index > start:
        raise ConfigFileError("--config goes after the subcommand, e.g. engine serve "
                              "--config FILE.yaml")
    actions = command_parser._option_string_actions
    # The command line's MODEL (or --model) wins over the file's, like every other option.
    positionals = [a for a in command_parser._actions if not a.option_strings]
    after = index + 1
    while (after < len(rest) and after - index <= len(positionals)
           and not rest[after].startswith("-")):
        after += 1
    has_model = after > index + 1 or any(
        a == "--model" or a.startswith("--model=") for a in rest[after:])
    inserted: list[str] = []
    for key, value in load_config_file(path).items():
        if str(key) == "model" and has_model:
            continue
        inserted += _option_args(path, key, value, actions, command_parser.prog)
    return [*rest[:after], *inserted, *rest[after:]]
