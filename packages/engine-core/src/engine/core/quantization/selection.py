"""Which quantization method a model loads with, decided at start-up in every process.

``resolve_quantization`` runs inside ``startup.prepare`` (front end, EngineCore, workers),
before anything reads a weight::

    1. the method:   --quantization NAME|module:Class               (always wins)
                     else config.json quantization_config.quant_method
                     else the entry whose config_filenames() file the checkpoint holds
                     else none (a GGUF file: see GGUF_PACKED_BY_DEFAULT)
    2. the settings: config.json quantization_config, else the first file of the
                     method's config_filenames() found, else {}; for a GGUF file the
                     settings describe its tensors (engine.kernels.gguf.method)
    3. check_quantization_support(cls, platform, dtype)  -> UnsupportedError with reasons
    4. cls.from_config(settings)                          -> ValidationError naming the key

A ``quant_method`` that no allowed ``engine.quantization`` entry provides stops start-up
with its name and the installed methods: a quantized checkpoint is never loaded as if it
were not. A checkpoint can only name an entry (never ``module:Class``: opening a
checkpoint must not import arbitrary code).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.core.model_loader import ModelSource
from engine.sdk.errors import EngineSDKError, PluginError, UnsupportedError, ValidationError
from engine.sdk.groups import QUANTIZATION
from engine.sdk.quantization import QuantizationConfig, check_quantization_support

if TYPE_CHECKING:
    from engine.core.plugins import PluginCatalog
    from engine.sdk.platform import Platform

logger = logging.getLogger("engine")

#: Whether a GGUF file without ``--quantization`` keeps its blocks packed (``gguf``) or is
#: dequantized when it loads. Dequantized: per-layer dequantization makes large batches
#: slower (docs/plugins/quantization.md has the numbers); ``--quantization gguf`` opts in.
GGUF_PACKED_BY_DEFAULT = False

#: JSON files of a Hugging Face checkpoint that never hold quantization settings.
_STANDARD_FILES = frozenset({
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "chat_template.json",
    "model.safetensors.index.json", "preprocessor_config.json",
})


@dataclass(frozen=True)
class QuantizationSelection:
    """The quantization method an engine loads with.

    Attributes:
        name: The ``engine.quantization`` entry name (or the ``module:Class`` given).
        origin: Where the choice came from, for messages: ``"--quantization"``,
            ``"config.json quantization_config"``, a settings file name, ``"GGUF file"``.
        settings: What ``from_config`` received.
        config: The method's configuration (built in this process).
    """

    name: str
    origin: str
    settings: dict[str, Any]
    config: QuantizationConfig

    @property
    def keeps_gguf_blocks(self) -> bool:
        """Whether the loader must yield GGUF tensors packed (the ``gguf`` method)."""
        return bool(type(self.config).reads_gguf_blocks)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValidationError(f"cannot read quantization settings from {path}: {exc}",
                              param="quantization") from exc
    if not isinstance(data, dict):
        raise ValidationError(f"{path} must hold a JSON object, got {type(data).__name__}",
                              param="quantization")
    return data


def checkpoint_quantization_config(source: ModelSource) -> dict[str, Any] | None:
    """``quantization_config`` of a Hugging Face checkpoint's ``config.json``, if any.

    Read from the file itself: ``transformers`` rewrites or drops the entries it knows.
    """
    if source.kind != "hf":
        return None
    config = _read_json(source.path / "config.json")
    settings = config.get("quantization_config")
    if settings is None:
        return None
    if not isinstance(settings, dict):
        raise ValidationError(f"{source.path / 'config.json'}: quantization_config must be an "
                              f"object, got {settings!r}", param="quantization")
    return settings


def _from_files(cls: type[QuantizationConfig], folder: Path) -> tuple[str, dict[str, Any]] | None:
    for filename in cls.config_filenames():
        if (folder / filename).is_file():
            return filename, _read_json(folder / filename)
    return None


def _detect_from_files(catalog: PluginCatalog, folder: Path
                       ) -> tuple[str, str, dict[str, Any]] | None:
    """``(name, file, settings)`` of the one allowed method whose settings file is present.

    Only entries are imported, and only when the checkpoint holds a JSON file that is not a
    standard one. An entry that fails to import is logged and not considered.

    Raises:
        PluginError: the files of two methods are present (naming both).
    """
    extra = {p.name for p in folder.glob("*.json")} - _STANDARD_FILES
    if not extra:
        return None
    found: list[tuple[str, str, dict[str, Any]]] = []
    for name in catalog.names(QUANTIZATION):
        try:
            cls = catalog.load(QUANTIZATION, name)
        except PluginError as exc:
            logger.warning("quantization settings files of %s not checked: %s", name, exc)
            continue
        hit = _from_files(cls, folder)
        if hit is not None:
            found.append((name, *hit))
    if len(found) > 1:
        raise PluginError(
            f"the checkpoint {folder} holds settings files of several quantization methods: "
            + ", ".join(f"{file} ({name})" for name, file, _ in found)
            + "; choose one with --quantization NAME", group=QUANTIZATION)
    return found[0] if found else None


def _checkpoint_method(catalog: PluginCatalog, method: Any, where: str) -> str:
    """The entry the checkpoint's ``quant_method`` names (it must be installed and allowed)."""
    installed = ", ".join(catalog.names(QUANTIZATION)) or "(none)"
    if not isinstance(method, str) or not method.strip() or ":" in method:
        raise ValidationError(
            f"{where} quant_method must be the name of an engine.quantization method, got "
            f"{method!r}; installed: {installed}", param="quantization")
    if method in catalog.names(QUANTIZATION):
        return method
    if any(e.group == QUANTIZATION and e.name == method for e in catalog.entries):
        try:
            catalog.resolve(QUANTIZATION, method)  # installed but not allowed: says why
        except PluginError as exc:
            raise PluginError(f"the checkpoint is quantized with quant_method {method!r} "
                              f"({where}): {exc.cause}", plugin=exc.plugin, group=exc.group,
                              distribution=exc.distribution, version=exc.version) from None
    raise PluginError(
        f"the checkpoint is quantized with quant_method {method!r} ({where}), which no "
        f"installed engine.quantization plugin provides. Installed: {installed}. Install a "
        f"plugin that provides it, or choose a method with --quantization NAME.",
        group=QUANTIZATION)


def _settings_source(requested: str | None, catalog: PluginCatalog, source: ModelSource
                     ) -> tuple[str, str, dict[str, Any]] | None:
    """``(method name, origin, settings)``, or None for an unquantized load."""
    if source.kind == "gguf":
        # A method that reads GGUF blocks (the gguf method, any plugin's that says so) gets
        # the file's tensor types; for any other the loader dequantizes the file, which is
        # then an unquantized checkpoint ({}).
        from engine.core.model_loader.gguf_loader import gguf_quantization_settings

        if requested is None and not GGUF_PACKED_BY_DEFAULT:
            return None
        name = requested or "gguf"
        if not catalog.load(QUANTIZATION, name).reads_gguf_blocks:
            return name, "--quantization", {}
        return name, "GGUF file", gguf_quantization_settings(source.weights_path)
    in_config = checkpoint_quantization_config(source)
    if requested is not None:
        if in_config is not None:
            return requested, "config.json quantization_config", in_config
        hit = _from_files(catalog.load(QUANTIZATION, requested), source.path)
        if hit is not None:
            return requested, hit[0], hit[1]
        return requested, "--quantization", {}
    if in_config is not None:
        where = "config.json quantization_config"
        return _checkpoint_method(catalog, in_config.get("quant_method"), where), where, in_config
    detected = _detect_from_files(catalog, source.path)
    if detected is None:
        return None
    name, filename, settings = detected
    if "quant_method" in settings and settings["quant_method"] != name:
        name = _checkpoint_method(catalog, settings["quant_method"], filename)
    return name, filename, settings


def resolve_quantization(
    requested: str | None, catalog: PluginCatalog, source: ModelSource,
    platform: type[Platform], dtype: str,
) -> QuantizationSelection | None:
    """The quantization method of this engine, checked and configured (see the module doc).

    Args:
        requested: ``--quantization`` (a name or ``module:Class``), or None.
        catalog: This process's plugin catalog.
        source: The model.
        platform: The selected platform.
        dtype: The model (activation) dtype, e.g. ``"bfloat16"``.

    Returns:
        The selection, or None when the model loads unquantized.

    Raises:
        PluginError: the method is not installed or not allowed (listing the installed
            ones), or it fails to load.
        UnsupportedError: the method cannot run on this platform or dtype (its reason).
        ValidationError: its settings are invalid (the method's message).
    """
    found = _settings_source(requested, catalog, source)
    if found is None:
        return None
    name, origin, settings = found
    cls: type[QuantizationConfig] = catalog.load(QUANTIZATION, name)
    support = check_quantization_support(cls, platform.info(), dtype)
    if not support.ok:
        raise UnsupportedError(
            f"quantization method {name!r} (from {origin}) cannot run on platform "
            f"{platform.name} with dtype {dtype}", [(name, support.reason)])
    try:
        config = cls.from_config(dict(settings))
    except ValidationError as exc:
        raise ValidationError(f"quantization method {name!r}: {exc.message} (settings from "
                              f"{origin})", param=exc.param or "quantization") from exc
    except EngineSDKError:
        raise
    except Exception as exc:
        raise catalog.error(QUANTIZATION, name, f"from_config() raised "
                                                f"{type(exc).__name__}: {exc}") from exc
    return QuantizationSelection(name, origin, dict(settings), config)
