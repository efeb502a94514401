"""Which ``extra_args`` keys the loaded logits processors take; any other key is refused.

A processor *claims* the keys its ``validate_params`` reads. The front end calls every
loaded processor's ``validate_params`` with ``params.extra_args`` wrapped in a dict that
records the keys looked up (``get``, ``[]``, ``in``), so a processor written the usual
way (``(params.extra_args or {}).get(KEY)``) claims ``KEY`` with no extra declaration:

* a ``validate_params`` that enumerates ``extra_args`` (iterates it, copies it, calls
  ``keys``/``items``/``values``/``len``) claims every key;
* a processor that keeps the SDK's default ``validate_params`` declares nothing, so it
  claims every key too: while one is loaded, unknown keys cannot be told from its own and
  are accepted (the front end logs this once, naming the processor).

A key that no processor claims is a ``ValidationError`` naming it (HTTP 400, ``param``
``extra_args.KEY``): a misspelt parameter, or one meant for a processor that is not
loaded, fails instead of being silently ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from engine.sdk.errors import ValidationError
from engine.sdk.logits_processor import LogitsProcessor
from engine.sdk.sampling_params import SamplingParams

if TYPE_CHECKING:
    from _collections_abc import dict_items, dict_keys, dict_values

logger = logging.getLogger("engine.core")

_DEFAULT_VALIDATE = LogitsProcessor.validate_params.__func__  # type: ignore[attr-defined]


def declares_keys(cls: type[LogitsProcessor]) -> bool:
    """True when ``cls`` overrides ``validate_params`` (so the keys it reads are its own)."""
    return getattr(cls.validate_params, "__func__", None) is not _DEFAULT_VALIDATE


class _KeyRecorder(dict[str, Any]):
    """``extra_args`` as a processor sees it, recording the keys it looks at."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        super().__init__(data)
        self.read: set[Any] = set()
        self.enumerated = False

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.read.add(key)
        return super().__contains__(key)

    def __bool__(self) -> bool:  # ``extra_args or {}`` is not an enumeration
        return super().__len__() > 0

    def __iter__(self) -> Iterator[str]:
        self.enumerated = True
        return super().__iter__()

    def __len__(self) -> int:
        self.enumerated = True
        return super().__len__()

    def keys(self) -> dict_keys[str, Any]:
        self.enumerated = True
        return super().keys()

    def items(self) -> dict_items[str, Any]:
        self.enumerated = True
        return super().items()

    def values(self) -> dict_values[str, Any]:
        self.enumerated = True
        return super().values()


class ExtraArgsChecker:
    """Runs the processors' ``validate_params`` and refuses the keys none of them claims.

    Args:
        processors: The loaded logits processors by name.
    """

    def __init__(self, processors: Mapping[str, type[LogitsProcessor]]) -> None:
        self.processors = dict(processors)
        #: Processors that declare no keys: while one is loaded, every key is accepted.
        self.undeclared = tuple(name for name, cls in self.processors.items()
                                if not declares_keys(cls))
        if self.undeclared:
            logger.warning(
                "logits processor(s) %s keep the default validate_params, so they do not say "
                "which extra_args keys they take: while they are loaded, extra_args keys that "
                "no processor reads are accepted instead of refused (override validate_params "
                "and read your keys there to claim them)", ", ".join(self.undeclared))

    def check(self, params: SamplingParams) -> None:
        """Validate ``params`` with every processor, then refuse unclaimed keys.

        Raises:
            ValidationError: a processor refused its parameters (its own message), or a key
                of ``extra_args`` is read by no processor (``param`` ``extra_args.KEY``).
        """
        extra = params.extra_args
        if not extra:
            for cls in self.processors.values():
                cls.validate_params(params)
            return
        recorder = _KeyRecorder(extra)
        traced = params.replace(extra_args=recorder)
        for cls in self.processors.values():
            cls.validate_params(traced)
        if self.undeclared or recorder.enumerated:
            return
        unclaimed = [key for key in extra if key not in recorder.read]
        if unclaimed:
            raise _unclaimed_error(unclaimed, recorder.read)


def _unclaimed_error(unclaimed: list[Any], read: set[Any]) -> ValidationError:
    names = ", ".join(repr(key) for key in unclaimed)
    what = (f"extra_args key {names} is" if len(unclaimed) == 1
            else f"extra_args keys {names} are")
    taken = ", ".join(sorted(repr(key) for key in read)) or "none"
    return ValidationError(
        f"{what} not a parameter of any loaded logits processor (the keys they take: "
        f"{taken}); check the spelling, or load the processor that takes it",
        param=f"extra_args.{unclaimed[0]}")
