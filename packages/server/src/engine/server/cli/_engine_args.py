"""Command-line flags for every ``EngineConfig`` field, generated from the model.

``max_num_seqs`` becomes ``--max-num-seqs``; booleans get ``--x/--no-x``; the field's
description is the help text (with its default, once); values are validated by
``EngineConfig`` itself, so a bad value reports what is allowed: one line per bad flag,
e.g. ``--load-format 'pt': ...`` (choices too: vLLM spellings such as ``--dtype half``
are accepted there, and refused ones say why).
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from typing import Any, Literal, get_args, get_origin

import pydantic

from engine.core.config import EngineConfig
from engine.sdk.errors import ValidationError
from engine.server.cli._help import with_default

#: Fields with a hand-written flag (or none): the model is positional for serve/generate.
_SPECIAL = {"plugin_options", "logits_processors", "worker_extensions", "kv_connector_options"}
#: vLLM's other spellings: short ones, and the older name of the structured-output backend.
_SHORT = {"tensor_parallel_size": "-tp",
          "structured_outputs_backend": "--guided-decoding-backend"}


def _base_type(annotation: Any) -> Any:
    if get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return annotation


def _comma_list(value: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in value.split(",") if item.strip())


def add_engine_args(
    parser: argparse.ArgumentParser, *, skip: frozenset[str] = frozenset()
) -> None:
    """Add one flag per ``EngineConfig`` field (defaults left to the model)."""
    group = parser.add_argument_group("engine options")
    for name, field in EngineConfig.model_fields.items():
        if name in _SPECIAL or name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        flags = (flag, _SHORT[name]) if name in _SHORT else (flag,)
        kind = _base_type(field.annotation)
        help_text = with_default(field.description or "", field.get_default(
            call_default_factory=True))
        if kind is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        elif get_origin(kind) is tuple:
            group.add_argument(*flags, type=_comma_list, default=None, help=help_text)
        elif get_origin(kind) is Literal:  # EngineConfig checks it (aliases, reasons)
            metavar = "{" + ",".join(get_args(kind)) + "}"
            group.add_argument(*flags, default=None, metavar=metavar, help=help_text)
        else:
            group.add_argument(*flags, type=kind if kind in (int, float) else str,
                               default=None, help=help_text)
    group.add_argument(
        "--logits-processor", dest="logits_processors", action="append", default=None,
        metavar="MODULE:CLASS", help="an extra logits processor (repeatable)")
    group.add_argument(
        "--worker-extension", dest="worker_extensions", action="append", default=None,
        metavar="NAME|MODULE:CLASS",
        help="a worker extension (engine.worker_extensions name or module:Class) whose "
        "methods collective_rpc reaches on every worker (repeatable, or comma-separated)")
    group.add_argument(
        "--kv-connector-option", dest="kv_connector_options", action="append", default=None,
        metavar="KEY=VALUE", help="an option for the --kv-connector (repeatable); VALUE is "
        "parsed as JSON when it can be")
    group.add_argument(
        "--plugin-option", dest="plugin_options", action="append", default=None,
        metavar="[GROUP:]NAME.KEY=VALUE",
        help="an option for a plugin (repeatable); VALUE is parsed as JSON when it can be; "
        "GROUP (e.g. attention_backends) picks one of same-named plugins")


def parse_plugin_options(items: list[str] | None) -> dict[str, dict[str, Any]]:
    """``["p.k=1", "p.s=x"]`` -> ``{"p": {"k": 1, "s": "x"}}``.

    Raises:
        ValidationError: an item is not ``NAME.KEY=VALUE``.
    """
    options: dict[str, dict[str, Any]] = {}
    for item in items or []:
        target, sep, raw = item.partition("=")
        name, dot, key = target.rpartition(".")
        if not sep or not dot or not name or not key:
            raise ValidationError(f"--plugin-option {item!r} must look like "
                                  f"[GROUP:]NAME.KEY=VALUE (e.g. my_processor.strength=0.5 "
                                  f"or attention_backends:torch.key=1)", param="plugin_option")
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        options.setdefault(name, {})[key] = value
    return options


def parse_key_values(items: list[str] | None, flag: str) -> dict[str, Any]:
    """``["path=/x", "n=2"]`` -> ``{"path": "/x", "n": 2}`` (JSON values when they parse).

    Raises:
        ValidationError: an item is not ``KEY=VALUE``.
    """
    options: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValidationError(f"{flag} {item!r} must look like KEY=VALUE (e.g. "
                                  f"{flag} path=/tmp/kv)", param=flag.lstrip("-"))
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        options[key.strip()] = value
    return options


def _flag_errors(exc: pydantic.ValidationError, values: dict[str, Any]) -> ValidationError:
    """One line per bad flag: ``--flag 'value': what is wrong and what is allowed``."""
    lines = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else ""
        message = str(error["msg"]).removeprefix("Value error, ")
        flag = "--" + field.replace("_", "-")
        if field in values and message.startswith(f"{field} {values[field]!r}"):
            lines.append(flag + message[len(field):])  # "--load-format 'pt' would read ..."
        elif field in values:
            lines.append(f"{flag} {values[field]!r}: {message}")
        else:
            lines.append(message)
    first = str(exc.errors()[0]["loc"][0]) if exc.errors() and exc.errors()[0]["loc"] else None
    return ValidationError("\n".join(lines), param=first)


def engine_config_from_args(args: argparse.Namespace, **fixed: Any) -> EngineConfig:
    """Build the config from parsed flags; unset flags keep the model's defaults.

    Raises:
        ValidationError: a flag's value is invalid (one line per bad flag, saying what is
            allowed).
    """
    values: dict[str, Any] = {}
    for name in EngineConfig.model_fields:
        value = getattr(args, name, None)
        if value is not None:
            values[name] = value
    values["plugin_options"] = parse_plugin_options(getattr(args, "plugin_options", None))
    values["logits_processors"] = tuple(getattr(args, "logits_processors", None) or ())
    values["kv_connector_options"] = parse_key_values(
        getattr(args, "kv_connector_options", None), "--kv-connector-option")
    values["worker_extensions"] = tuple(
        name for item in getattr(args, "worker_extensions", None) or ()
        for name in _comma_list(item))
    values.update(fixed)
    try:
        return EngineConfig(**values)
    except pydantic.ValidationError as exc:
        raise _flag_errors(exc, values) from None
