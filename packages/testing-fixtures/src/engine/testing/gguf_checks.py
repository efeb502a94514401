"""Model checks with the engine on a GGUF file and transformers on the HF checkpoint.

The GGUF tests of each architecture write a tiny checkpoint to GGUF files
(:mod:`engine.testing.gguf_writer`) and compare the engine on a file with transformers on
the checkpoint the file came from (or on its quantization round trip)::

    files = gguf_files(tmp_path / "qwen3", "qwen3", Qwen3ForCausalLM)
    gguf_checks(files, "q8", "q8_reference", quantization="gguf").logits_and_greedy_tokens()
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType as QT

from engine.testing.gguf_writer import round_trip_checkpoint, write_checkpoint_gguf
from engine.testing.model_checks import ModelChecks
from engine.testing.models import build_tiny_checkpoint


@dataclass
class GGUFChecks(ModelChecks):
    """:class:`ModelChecks` with the engine on a GGUF file, transformers on ``checkpoint``."""

    gguf_file: Path | None = None

    def llm(self, **kwargs: Any) -> Any:
        from engine.core import LLM

        return LLM(str(self.gguf_file), tokenizer=str(self.checkpoint),
                   **{**self.options, **kwargs})


def gguf_files(root: Path, kind: str, cls: type, overrides: dict[str, Any] | None = None,
               *, f16: bool = False) -> dict[str, Any]:
    """A tiny ``kind`` checkpoint under ``root`` and its GGUF files.

    Returns ``kind``, ``cls``, ``hf`` (the checkpoint), ``f32`` and ``q8`` (GGUF files;
    ``f16`` too when asked) and ``q8_reference`` (the checkpoint with every matrix passed
    through Q8_0 and back: what the Q8_0 file holds).
    """
    hf = build_tiny_checkpoint(root / "hf", kind, **(overrides or {}))
    files: dict[str, Any] = {
        "kind": kind, "cls": cls, "hf": hf,
        "f32": write_checkpoint_gguf(root / "f32.gguf", hf),
        "q8": write_checkpoint_gguf(root / "q8.gguf", hf, default=QT.Q8_0),
        "q8_reference": round_trip_checkpoint(hf, root / "hf_q8", QT.Q8_0),
    }
    if f16:
        files["f16"] = write_checkpoint_gguf(root / "f16.gguf", hf, default=QT.F16)
    return files


def gguf_checks(files: dict[str, Any], file: str, reference: str, **options: Any
                ) -> GGUFChecks:
    """Checks of ``files[file]`` against transformers on ``files[reference]``."""
    cls = files["cls"]
    result = GGUFChecks(files[reference], cls, gguf_file=files[file])
    result.options = {**result.options, "model_impl": f"{cls.__module__}:{cls.__qualname__}",
                      **options}
    return result


__all__ = ["GGUFChecks", "gguf_checks", "gguf_files"]
