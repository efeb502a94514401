"""Which ``extra_args`` keys the plugins this engine uses take; any other key is refused.

A plugin *takes* a key in one of two ways:

* it declares it in ``extra_args_keys`` on its class (SDK 1.1; any kind of plugin: a
  scheduling policy, a scheduler, a KV connector, a logits processor, ...). The front end
  reads the declarations of its own plugins, and EngineCore's arrive in ``EngineInfo``
  (:mod:`engine.core.extra_args_keys`);
* a logits processor's ``validate_params`` reads it (SDK 1.0's way, still supported). The
  front end calls every loaded processor's ``validate_params`` with ``params.extra_args``
  wrapped in a dict that records the keys looked up (``get``, ``[]``, ``in``), so a
  processor written the usual way (``(params.extra_args or {}).get(KEY)``) takes ``KEY``
  with no other declaration. A ``validate_params`` that enumerates ``extra_args`` (iterates
  it, copies it, calls ``keys``/``items``/``values``/``len``) takes every key.

A logits processor that keeps the SDK's default ``validate_params`` and declares no
``extra_args_keys`` says nothing about its keys, so it is taken to accept every key: while
one is loaded, unknown keys cannot be told from its own and are accepted (the front end
logs this once, naming the processor).

A key that no plugin takes is a ``ValidationError`` naming it (HTTP 400, ``param``
``extra_args.KEY``) and listing the keys that are taken, by which plugin: a misspelt
parameter, or one meant for a plugin that is not loaded, fails instead of being silently
ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from engine.core.extra_args_keys import keys_taken
from engine.sdk.errors import ValidationError
from engine.sdk.logits_processor import LogitsProcessor
from engine.sdk.plugin import Plugin
from engine.sdk.sampling_params import SamplingParams

if TYPE_CHECKING:
    from _collections_abc import dict_items, dict_keys, dict_values

logger = logging.getLogger("engine.core")

_DEFAULT_VALIDATE = LogitsProcessor.validate_params.__func__  # type: ignore[attr-defined]


def sets_extra_args_keys(cls: type) -> bool:
    """True when ``cls`` (or a base below the SDK's ``Plugin``) sets ``extra_args_keys``."""
    return any("extra_args_keys" in vars(base) for base in cls.__mro__ if base is not Plugin)


def declares_keys(cls: type[LogitsProcessor]) -> bool:
    """True when a processor says which keys it takes.

    It does by overriding ``validate_params`` (the keys it reads are its own) or by
    setting ``extra_args_keys``.
    """
    overrides = getattr(cls.validate_params, "__func__", None) is not _DEFAULT_VALIDATE
    return overrides or sets_extra_args_keys(cls)


class _KeyRecorder(dict[str, Any]):
    """``extra_args`` as a processor sees it, recording who looked at which key."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        super().__init__(data)
        #: Key -> the processors (labels) that read it.
        self.read: dict[Any, list[str]] = {}
        self.enumerated = False
        #: The processor whose ``validate_params`` runs now.
        self.reader = ""

    def _note(self, key: Any) -> None:
        readers = self.read.setdefault(key, [])
        if self.reader not in readers:
            readers.append(self.reader)

    def __getitem__(self, key: Any) -> Any:
        self._note(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._note(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self._note(key)
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
    """Runs the logits processors' ``validate_params`` and refuses the keys nobody takes.

    Args:
        plugins: The front end's plugins whose keys requests may use, keyed by how
            messages name them (e.g. ``"logits processor 'no_repeat' (acme 0.3.0)"``):
            every loaded logits processor (its ``validate_params`` runs on every request)
            and the other plugins the front end uses. EngineCore's are added with
            :meth:`take` once it is up.
    """

    def __init__(self, plugins: Mapping[str, type[Plugin]]) -> None:
        self.processors: dict[str, type[LogitsProcessor]] = {
            label: cls for label, cls in plugins.items() if issubclass(cls, LogitsProcessor)}
        #: Key -> the plugins (labels) that declare it in ``extra_args_keys``.
        self.declared: dict[str, list[str]] = {
            key: list(labels) for key, labels in keys_taken(plugins).items()}
        #: Processors that declare no keys: while one is loaded, every key is accepted.
        self.undeclared = tuple(label for label, cls in self.processors.items()
                                if not declares_keys(cls))
        if self.undeclared:
            logger.warning(
                "logits processor(s) %s keep the default validate_params and set no "
                "extra_args_keys, so they do not say which extra_args keys they take: while "
                "they are loaded, extra_args keys that no plugin takes are accepted instead of "
                "refused (set extra_args_keys on the class, or override validate_params and "
                "read your keys there)", ", ".join(self.undeclared))

    def take(self, keys: Mapping[str, Sequence[str]]) -> None:
        """Accept ``keys`` too: key -> the plugins that take it (``EngineInfo``'s keys)."""
        for key, labels in keys.items():
            known = self.declared.setdefault(key, [])
            known.extend(label for label in labels if label not in known)

    def check(self, params: SamplingParams) -> None:
        """Validate ``params`` with every processor, then refuse keys that nobody takes.

        Raises:
            ValidationError: a processor refused its parameters (its own message), or a key
                of ``extra_args`` is taken by no plugin (``param`` ``extra_args.KEY``).
        """
        extra = params.extra_args
        if not extra:
            for cls in self.processors.values():
                cls.validate_params(params)
            return
        recorder = _KeyRecorder(extra)
        traced = params.replace(extra_args=recorder)
        for label, cls in self.processors.items():
            recorder.reader = label
            cls.validate_params(traced)
        if self.undeclared or recorder.enumerated:
            return
        unclaimed = [key for key in extra if key not in recorder.read
                     and key not in self.declared]
        if unclaimed:
            taken = dict(recorder.read)
            for key, labels in self.declared.items():
                taken[key] = list(dict.fromkeys([*taken.get(key, ()), *labels]))
            raise _unclaimed_error(unclaimed, taken)


def _unclaimed_error(unclaimed: list[Any], taken: Mapping[Any, list[str]]) -> ValidationError:
    names = ", ".join(repr(key) for key in unclaimed)
    what = (f"extra_args key {names} is" if len(unclaimed) == 1
            else f"extra_args keys {names} are")
    listed = "; ".join(f"{key!r} by {', '.join(taken[key])}"
                       for key in sorted(taken, key=repr)) or "none"
    return ValidationError(
        f"{what} not taken by any plugin this engine uses (the keys they take: {listed}); "
        f"check the spelling, or load the plugin that takes it",
        param=f"extra_args.{unclaimed[0]}")
