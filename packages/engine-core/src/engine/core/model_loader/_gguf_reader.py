"""Opening GGUF files: a faster :class:`gguf.GGUFReader`, cached per process, and typed metadata.

Why a subclass: ``GGUFReader`` parses every metadata array element (SmolLM2 has ~150k:
tokens, merges, token types) into its own numpy view through ``numpy.memmap.__getitem__``,
which makes opening the 100 MB default model take ~6 s on a 2-core machine. The subclass

* slices a plain ``ndarray`` view of the same read-only mapping in ``_get`` (the reader's
  one slicing helper): same bytes, same dtypes, no memmap bookkeeping;
* decodes metadata arrays of scalars and strings in one pass (``_build_fields``) into an
  :class:`_ArrayField` holding the Python values, instead of one numpy part per element
  (~150 ms instead of ~2 s for SmolLM2).

Other fields, the tensor infos and the tensor data are parsed by ``GGUFReader`` itself;
tensor data stays memory-mapped and read-only.

The reader is cached (:func:`open_gguf`) so the config, the weights and the tokenizer
metadata of one file share one parse per process.
"""

from __future__ import annotations

import functools
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from gguf import GGUFReader, GGUFValueType, ReaderField

_FLOAT_TYPES = (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64)


class _ArrayField(ReaderField):
    """A metadata array of scalars or strings, decoded once (see the module docstring).

    ``parts`` holds the key and type parts only; ``data`` is ``range(len(values))`` so that
    ``len(field.data)`` is the item count, as for ``GGUFReader``'s own fields.
    """

    values: list[Any]


class PlainViewGGUFReader(GGUFReader):
    """``GGUFReader`` slicing a plain ``ndarray`` view of its map: a drop-in replacement.

    Same fields and parts as the stock reader (``transformers``' GGUF loader can use it, as
    the reference tests do), only faster.
    """

    def _get(
        self,
        offset: int,
        dtype: Any,
        count: int = 1,
        override_order: Literal["I", "S", "<"] | None = None,
    ) -> Any:
        plain = self._plain()
        count = int(count)
        end = offset + np.dtype(dtype).itemsize * count
        arr = plain[offset:end].view(dtype=dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))

    def _plain(self) -> np.ndarray:
        plain = self.__dict__.get("_plain_data")
        if plain is None:
            plain = self.__dict__["_plain_data"] = self.data.view(np.ndarray)
        return plain


class _FastGGUFReader(PlainViewGGUFReader):
    """The engine's reader: metadata arrays decoded in one pass (:class:`_ArrayField`)."""

    def _build_fields(self, offs: int, count: int) -> int:
        for _ in range(count):
            start = offs
            key_len, key_data = self._get_str(offs)
            offs += int(key_len.nbytes + key_data.nbytes)
            raw_type = self._get(offs, np.uint32)
            offs += int(raw_type.nbytes)
            key = bytes(key_data).decode("utf-8")
            parts: list[Any] = [key_len, key_data, raw_type]
            array = self._read_array(offs) if raw_type[0] == GGUFValueType.ARRAY else None
            if array is not None:
                size, item_type, values = array
                field = _ArrayField(start, key, parts, range(len(values)),  # type: ignore[arg-type]
                                    [GGUFValueType.ARRAY, item_type])
                field.values = values
                self._push_field(field, skip_sum=True)
                offs += size
                continue
            size, more, indices, types = self._get_field_parts(offs, raw_type[0])
            self._push_field(ReaderField(start, key, parts + more,
                                         [i + len(parts) for i in indices], types),
                             skip_sum=True)
            offs += size
        return offs

    def _read_array(self, offs: int) -> tuple[int, GGUFValueType, list[Any]] | None:
        """``(bytes, item type, values)`` of an array of scalars or strings; else None."""
        if self.byte_order != "I":  # a file of the other byte order: the generic path
            return None
        item_type = GGUFValueType(int(self._get(offs, np.uint32)[0]))
        count = int(self._get(offs + 4, np.uint64)[0])
        start = pos = offs + 12
        if item_type == GGUFValueType.STRING:
            buffer = self._plain().data  # a memoryview of the mapping
            values: list[Any] = []
            for _ in range(count):
                (length,) = struct.unpack_from("<Q", buffer, pos)
                pos += 8
                values.append(bytes(buffer[pos:pos + length]).decode("utf-8",
                                                                     errors="replace"))
                pos += length
            return pos - offs, item_type, values
        np_type = self.gguf_scalar_to_np.get(item_type)
        if np_type is None:  # nested arrays
            return None
        items = self._get(start, np_type, count)
        if item_type == GGUFValueType.BOOL:
            values = [bool(v) for v in items]
        elif item_type in _FLOAT_TYPES:
            values = [float(v) for v in items.tolist()]
        else:
            values = [int(v) for v in items.tolist()]
        return 12 + int(items.nbytes), item_type, values


def open_gguf(path: str | os.PathLike[str]) -> GGUFReader:
    """Open a GGUF file, reusing this process's reader if the file is unchanged.

    Args:
        path: The ``.gguf`` file.

    Returns:
        A :class:`gguf.GGUFReader` over a read-only memory map of the file.

    Raises:
        FileNotFoundError: The file does not exist.
        ValueError: The file is not a GGUF file (raised by ``gguf``).
    """
    resolved = Path(path).resolve()
    stat = resolved.stat()
    return _open_cached(str(resolved), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, mtime_ns: int, size: int) -> GGUFReader:
    del mtime_ns, size  # part of the cache key only
    return _FastGGUFReader(path)


def _scalar(part: np.ndarray, value_type: GGUFValueType) -> Any:
    if value_type == GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    value = part[0]
    if value_type == GGUFValueType.BOOL:
        return bool(value)
    if value_type in _FLOAT_TYPES:
        return float(value)
    return int(value)


def field_value(field: ReaderField) -> Any:
    """Decode one metadata field to Python: ``int``, ``float``, ``bool``, ``str`` or a list.

    Args:
        field: A field of ``GGUFReader.fields``.

    Returns:
        The value; arrays become lists of their decoded items. Nested arrays (not used by
        any key this engine reads) come back as ``None``.
    """
    if isinstance(field, _ArrayField):
        return list(field.values)
    types = field.types
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        if len(types) < 2:  # an empty array records no item type
            return []
        item_type = types[-1]
        if item_type == GGUFValueType.ARRAY or len(types) > 2:
            return None
        return [_scalar(field.parts[i], item_type) for i in field.data]
    return _scalar(field.parts[field.data[0]], types[0])


def get_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """The decoded value of metadata ``key``, or ``default`` when the file lacks it."""
    field = reader.fields.get(key)
    return default if field is None else field_value(field)


def array_length(reader: GGUFReader, key: str) -> int | None:
    """The number of items of the array field ``key`` without decoding them (``None``: absent)."""
    field = reader.fields.get(key)
    if field is None or not field.types or field.types[0] != GGUFValueType.ARRAY:
        return None
    return len(field.data)


def tensor_names(reader: GGUFReader) -> Sequence[str]:
    """The names of the file's tensors, in file order."""
    return [t.name for t in reader.tensors]
