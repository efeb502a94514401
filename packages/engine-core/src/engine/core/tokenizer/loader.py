"""Loading the tokenizer of a :class:`~engine.core.model_loader.ModelSource`.

* Hugging Face directory: ``AutoTokenizer.from_pretrained(dir, local_files_only=True)``
  (``tokenizer.json``, ``tokenizer_config.json`` and its chat template, or
  ``chat_template.jinja``).
* GGUF file: ``PreTrainedTokenizerFast.from_pretrained(dir, gguf_file=name)``: ``transformers``
  rebuilds the tokenizer from the file's ``tokenizer.ggml.*`` metadata and takes the chat
  template from ``tokenizer.chat_template``. This is what ``AutoTokenizer`` does for a GGUF,
  minus parsing the whole file a second time for the model config (2.5 s instead of 7-11 s
  for SmolLM2 on a 2-core machine).

A chat template override (``--chat-template``) replaces the tokenizer's own;
:func:`read_chat_template` turns the option's value (a file or the template itself) into
template text.
"""

from __future__ import annotations

import os
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from engine.core.model_loader.loader import ModelSource
from engine.core.tokenizer.tokenizer import Tokenizer
from engine.sdk.errors import ValidationError


def read_chat_template(value: str | os.PathLike[str]) -> str:
    """The chat template named by a ``--chat-template`` value.

    Args:
        value: A path to a Jinja file, or the template text itself (recognised by
            containing ``{{`` or ``{%``).

    Returns:
        The template text.

    Raises:
        ValidationError: ``value`` is neither an existing file nor template text.
    """
    text = os.fspath(value)
    try:
        is_file = "\n" not in text and Path(text).expanduser().is_file()
    except OSError:  # e.g. a one-line template longer than a file name may be
        is_file = False
    if is_file:
        return Path(text).expanduser().read_text(encoding="utf-8")
    if "{{" in text or "{%" in text:
        return text
    raise ValidationError(
        f"chat template {text!r} is neither a file nor a Jinja template", param="chat_template"
    )


def load_tokenizer(source: ModelSource, chat_template: str | None = None) -> Tokenizer:
    """Load the tokenizer of a model.

    Args:
        source: From :func:`~engine.core.model_loader.resolve_model`.
        chat_template: Jinja template text replacing the tokenizer's chat template (see
            :func:`read_chat_template` for the ``--chat-template`` option); ``None`` keeps
            the model's.

    Returns:
        The wrapped tokenizer.

    Raises:
        UnsupportedError: The directory's tokenizer is not a fast tokenizer.
    """
    source = source.tokenizer_source  # --tokenizer, if given
    if source.kind == "gguf":
        hf = PreTrainedTokenizerFast.from_pretrained(
            str(source.path), gguf_file=source.gguf_file, local_files_only=True
        )
    else:
        hf = AutoTokenizer.from_pretrained(str(source.path), local_files_only=True)
    return Tokenizer(hf, chat_template=chat_template)
