"""Dense row encodings: float32 / float16 / bfloat16 little-endian bytes, base64, and back.

bfloat16 is the upper half of an IEEE float32, rounded to nearest-even, so every client can decode
it with integer shifts (numpy has no bfloat16 type).
"""

from __future__ import annotations

import base64
from typing import Literal

import numpy as np

Dtype = Literal["float32", "float16", "bfloat16"]
DTYPES: tuple[Dtype, ...] = ("float32", "float16", "bfloat16")
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))
    out = (rounded >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def from_bfloat16_bits(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def row_bytes(values: np.ndarray, dtype: Dtype) -> bytes:
    """Little-endian raw bytes of one row (or any array) in `dtype`."""
    if dtype == "float32":
        return np.ascontiguousarray(values, dtype="<f4").tobytes()
    if dtype == "float16":
        return np.ascontiguousarray(values, dtype="<f2").tobytes()
    return to_bfloat16_bits(values).astype("<u2", copy=False).tobytes()


def as_wire_array(rows: np.ndarray, dtype: Dtype) -> np.ndarray:
    """A [rows, vocab] float32 array as contiguous little-endian `dtype` values (no copy for float32)."""
    if dtype == "float32":
        return np.ascontiguousarray(rows, dtype="<f4")  # a no-op for the engines' float32 rows
    if dtype == "float16":
        return np.ascontiguousarray(rows, dtype="<f2")
    return to_bfloat16_bits(rows).astype("<u2", copy=False)


def row_views(rows: np.ndarray, dtype: Dtype) -> list[memoryview]:
    """Each row of a [rows, vocab] array as little-endian `dtype` bytes, without a copy per row:
    msgspec writes a memoryview as MessagePack `bin` straight from the array's memory."""
    return [memoryview(row).cast("B") for row in as_wire_array(rows, dtype)]


def matrix_view(rows: np.ndarray, dtype: Dtype) -> memoryview:
    """The whole [rows, vocab] array as little-endian `dtype` bytes, row-major."""
    return memoryview(as_wire_array(rows, dtype).reshape(-1).view(np.uint8))


def msgpack_bin_header(size: int) -> bytes:
    """The MessagePack `bin` header of `size` bytes, in the shortest form (as msgspec writes it)."""
    if size < 1 << 8:
        return b"\xc4" + size.to_bytes(1, "big")
    if size < 1 << 16:
        return b"\xc5" + size.to_bytes(2, "big")
    return b"\xc6" + size.to_bytes(4, "big")


def decode_row(raw: bytes | memoryview | str, dtype: Dtype) -> np.ndarray:
    """Raw bytes (or their base64 text) back to a float32 array (a view of them for float32)."""
    data = base64.b64decode(raw) if isinstance(raw, str) else raw
    if dtype == "float32":
        return np.frombuffer(data, dtype="<f4").astype(np.float32, copy=False)
    if dtype == "float16":
        return np.frombuffer(data, dtype="<f2").astype(np.float32)
    return from_bfloat16_bits(np.frombuffer(data, dtype="<u2"))


def row_base64(values: np.ndarray, dtype: Dtype) -> str:
    return base64.b64encode(row_bytes(values, dtype)).decode("ascii")
