"""Parsing the GGUF container: metadata values and where each tensor's bytes lie.

`gguf.GGUFReader` builds a numpy view per array element, which takes seconds
on a 49k-token vocabulary; this reader decodes the same layout in one pass and
hands each tensor's raw bytes (a zero-copy view of a memory map) to
`gguf.dequantize`. Layout (little-endian):

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv x (key: str, type: u32, value)          str = u64 length + utf-8 bytes
    n_tensors x (name: str, n_dims: u32, dims: n_dims x u64, ggml_type: u32, offset: u64)
    padding to `general.alignment` (default 32) | tensor data (offsets relative to here)
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from pdserve.models.hf_config import ModelLoadError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
STRING_TYPE, ARRAY_TYPE, BOOL_TYPE = 8, 9, 7

# GGUF value type -> numpy dtype of its scalar encoding (strings and arrays are handled apart).
SCALAR_DTYPES: Mapping[int, np.dtype] = MappingProxyType({
    0: np.dtype("<u1"), 1: np.dtype("<i1"), 2: np.dtype("<u2"), 3: np.dtype("<i2"),
    4: np.dtype("<u4"), 5: np.dtype("<i4"), 6: np.dtype("<f4"), 7: np.dtype("<u1"),
    10: np.dtype("<u8"), 11: np.dtype("<i8"), 12: np.dtype("<f8"),
})


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order: dims[0] is the innermost (row length)
    ggml_type: int
    offset_bytes: int  # from the start of the data section


class _Cursor:
    """Sequential little-endian reads over the mapped file."""

    def __init__(self, buffer: mmap.mmap):
        self.buffer = buffer
        self.pos = 0

    def scalar(self, dtype: np.dtype) -> Any:
        value = np.frombuffer(self.buffer, dtype=dtype, count=1, offset=self.pos)[0]
        self.pos += dtype.itemsize
        return value.item()

    def u32(self) -> int:
        (value,) = struct.unpack_from("<I", self.buffer, self.pos)
        self.pos += 4
        return value

    def u64(self) -> int:
        (value,) = struct.unpack_from("<Q", self.buffer, self.pos)
        self.pos += 8
        return value

    def string(self) -> str:
        length = self.u64()
        raw = self.buffer[self.pos : self.pos + length]
        self.pos += length
        return raw.decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type == STRING_TYPE:
            return self.string()
        if value_type == ARRAY_TYPE:
            return self.array()
        dtype = SCALAR_DTYPES.get(value_type)
        if dtype is None:
            raise ModelLoadError(f"GGUF metadata has unknown value type {value_type}")
        value = self.scalar(dtype)
        return bool(value) if value_type == BOOL_TYPE else value

    def array(self) -> list[Any]:
        item_type, count = self.u32(), self.u64()
        if item_type == STRING_TYPE:
            return [self.string() for _ in range(count)]
        if item_type == ARRAY_TYPE:
            return [self.array() for _ in range(count)]
        dtype = SCALAR_DTYPES.get(item_type)
        if dtype is None:
            raise ModelLoadError(f"GGUF metadata has unknown array type {item_type}")
        values = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.pos)
        self.pos += dtype.itemsize * count
        return [bool(v) for v in values] if item_type == BOOL_TYPE else values.tolist()


class GGUFContainer:
    """Metadata dict and tensor table of one GGUF file, its data memory-mapped."""

    def __init__(self, path: str):
        with open(path, "rb") as f:
            self._buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        cursor = _Cursor(self._buffer)
        if self._buffer[:4] != GGUF_MAGIC:
            raise ModelLoadError(f"{path} is not a GGUF file")
        cursor.pos = 4
        version = cursor.u32()
        if version not in (2, 3):
            raise ModelLoadError(f"{path}: GGUF version {version} is not supported (big-endian file?)")
        num_tensors, num_kv = cursor.u64(), cursor.u64()
        self.metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = cursor.string()
            self.metadata[key] = cursor.value(cursor.u32())
        self.tensors: dict[str, TensorInfo] = {}
        for _ in range(num_tensors):
            name = cursor.string()
            dims = tuple(cursor.u64() for _ in range(cursor.u32()))
            self.tensors[name] = TensorInfo(name, dims, cursor.u32(), cursor.u64())
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        self._data_start = -(-cursor.pos // alignment) * alignment

    def raw(self, info: TensorInfo, block_size: int, type_size: int) -> np.ndarray:
        """The tensor's bytes as uint8 [*outer dims (reversed), row bytes], zero-copy."""
        row_length = info.dims[0]
        if row_length % block_size:
            raise ModelLoadError(f"{info.name}: row length {row_length} is not a multiple of block size {block_size}")
        row_bytes = row_length // block_size * type_size
        outer = tuple(reversed(info.dims[1:]))
        num_bytes = row_bytes * int(np.prod(outer, dtype=np.int64))
        start = self._data_start + info.offset_bytes
        if start + num_bytes > len(self._buffer):
            raise ModelLoadError(f"{info.name}: tensor data runs past the end of the file")
        flat = np.frombuffer(self._buffer, dtype=np.uint8, count=num_bytes, offset=start)
        return flat.reshape(*outer, row_bytes)
