"""A GGUF file's metadata and tensor table, parsed in one pass over a memory map.

Contract: ``GGUFFile(path)`` presents what ``gguf.GGUFReader`` presents, as far as Kiln reads it:
``fields`` maps each metadata key, in file order, to a ``Field`` whose ``contents()`` equals the
reader's (a Python scalar, a ``str``, or a list for arrays) and whose ``types`` are the reader's
value types (``[ARRAY, item type]`` for an array); the reader's ``GGUF.*`` entries for the
header's counts are not fields. ``tensors`` lists ``Tensor`` entries in file order with the
reader's ``name``, ``tensor_type``, ``shape`` (GGUF dimension order, innermost first) and ``data``
(a read-only view of the map: float and integer types as their numpy dtype in torch dimension
order, every other type as ``uint8`` rows of whole blocks).

Why not ``GGUFReader``: it builds numpy views for every part of every field, and SmolLM2's
vocabulary and merges are ~100k strings: 0.8 s per parse, paid by each process that opens the
default model (the API server's config, the engine's config, weights and tokenizer). Reading the
strings with ``struct`` takes a tenth of that.

Little-endian files of GGUF versions 2 and 3 (every file llama.cpp has written since 2023); other
files raise ``ValueError``.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Scalar value types -> struct format (little-endian).
_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}

# Tensor types GGUFReader exposes as their element dtype; all others are exposed as block bytes.
_ELEMENT_DTYPES: dict[GGMLQuantizationType, type[np.generic]] = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class Field:
    """One metadata key's value and its GGUF value types."""

    name: str
    value: Any
    types: list[GGUFValueType]

    def contents(self) -> Any:
        return self.value


@dataclass(frozen=True)
class Tensor:
    """One tensor's entry: ``shape`` in GGUF order, ``data`` a read-only view of the file."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFFile:
    """The parsed header of one GGUF file; its tensor data stay memory-mapped.

    Raises:
        ValueError: not a GGUF file, a big-endian or version-1 file, a value type GGUF does not
            define, or a header that runs past the end of the file.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._offset = 0
        try:
            self.fields, self.tensors = self._parse()
        except struct.error as exc:
            raise ValueError(f"GGUF file {path!r} is truncated ({exc})") from None

    def _parse(self) -> tuple[dict[str, Field], list[Tensor]]:
        if self._map[:4] != GGUF_MAGIC:
            raise ValueError(f"{self.path!r} is not a GGUF file (no 'GGUF' magic)")
        self._offset = 4
        version = self._scalar("<I")
        if version not in (2, 3):
            raise ValueError(
                f"GGUF file {self.path!r} has version {version} (a big-endian file reads as a "
                "huge version); supported: little-endian versions 2 and 3"
            )
        tensor_count, kv_count = self._scalar("<Q"), self._scalar("<Q")
        fields: dict[str, Field] = {}
        for _ in range(kv_count):
            name = self._string()
            kind = self._value_type()
            if kind == GGUFValueType.ARRAY:
                item = self._value_type()
                fields[name] = Field(name, self._array(item), [kind, item])
            else:
                fields[name] = Field(name, self._value(kind), [kind])
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = (
            fields["general.alignment"].value
            if "general.alignment" in fields
            else DEFAULT_ALIGNMENT
        )
        start = -(-self._offset // alignment) * alignment
        return fields, [self._tensor(start, *info) for info in infos]

    # -- the header's pieces, read from self._offset on ------------------------------------------

    def _scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._map, self._offset)
        self._offset += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        size = self._scalar("<Q")
        end = self._offset + size
        if end > len(self._map):
            raise struct.error("a string runs past the end of the file")
        text = self._map[self._offset : end].decode("utf-8", errors="replace")
        self._offset = end
        return text

    def _value_type(self) -> GGUFValueType:
        raw = self._scalar("<I")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise ValueError(f"GGUF file {self.path!r} has unknown value type {raw}") from None

    def _value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string()
        return self._scalar(_SCALAR_FORMATS[kind])

    def _array(self, item: GGUFValueType) -> list[Any]:
        count = self._scalar("<Q")
        if item == GGUFValueType.STRING:
            return [self._string() for _ in range(count)]
        if item == GGUFValueType.ARRAY:
            raise ValueError(f"GGUF file {self.path!r} has an array of arrays (not supported)")
        fmt = _SCALAR_FORMATS[item]
        size = struct.calcsize(fmt) * count
        if self._offset + size > len(self._map):
            raise struct.error("an array runs past the end of the file")
        values = np.frombuffer(self._map, dtype=np.dtype(fmt), count=count, offset=self._offset)
        self._offset += size
        return values.tolist()

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = tuple(self._scalar("<Q") for _ in range(self._scalar("<I")))
        return name, dims, self._scalar("<I"), self._scalar("<Q")

    def _tensor(
        self, start: int, name: str, dims: tuple[int, ...], raw_type: int, offset: int
    ) -> Tensor:
        kind = GGMLQuantizationType(raw_type)
        shape = tuple(reversed(dims))  # numpy / torch order, outermost first
        count = int(np.prod(dims))
        dtype = _ELEMENT_DTYPES.get(kind)
        if dtype is None:
            block_size, type_size = GGML_QUANT_SIZES[kind]
            count = count * type_size // block_size
            shape = (*shape[:-1], shape[-1] * type_size // block_size)
            dtype = np.uint8
        data = np.frombuffer(self._map, dtype=dtype, count=count, offset=start + offset)
        return Tensor(name, kind, dims, data.reshape(shape))


__all__ = ["DEFAULT_ALIGNMENT", "GGUFFile", "GGUF_MAGIC", "Field", "Tensor"]
