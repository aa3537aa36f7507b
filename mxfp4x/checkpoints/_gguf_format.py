"""The GGUF format's facts, in one place: the magic and versions, the keys the reader
reads, the caps on what a header may declare, the GGML tensor types (``GGML_TYPES``:
elements and bytes per block), the metadata value types, and one tensor's info as
checked (:class:`GGUFTensorInfo`).  The public names are :mod:`.gguf`'s."""
import math
import re
import struct
from typing import Any, Dict, NamedTuple, Optional, Tuple

import numpy as np
import torch

from .._core.format import GROUP

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"
ARCHITECTURE_KEY = "general.architecture"
SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>[0-9]{5})-of-(?P<count>[0-9]{5})\.gguf$")

# What a header may declare, all in one place (docs/gguf.md and docs/guarantees.md quote
# them).  ggml's limits (GGML_MAX_DIMS, GGML_MAX_NAME: a name and its NUL in 64 bytes):
MAX_DIMS = 4
MAX_NAME_BYTES = 63
MAX_KEY_BYTES = 65535
# a chat template or a token is kilobytes: a longer string is not a model's
MAX_STRING_BYTES = 1 << 24
# ggml reads no nested arrays; the gguf package does: a few levels, never recursion
# as deep as a hostile file asks
MAX_ARRAY_DEPTH = 4
# llama.cpp's converters write a few dozen keys (a tokenizer's vocabulary, scores and
# merges are one key each, however long), and stack each layer's experts in one tensor
# per projection: the largest MoE files hold about a thousand tensors (DeepSeek-V3, Kimi
# K2), and one tensor per expert of Kimi K3 (896 experts, 3 projections, every
# layer) would be ~250,000.  Each key costs ~0.1 KiB and each tensor ~0.3 KiB of memory
# beyond its bytes: at most ~6 MiB and ~300 MiB, whatever the file
MAX_KEYS = 1 << 16
MAX_TENSORS = 1 << 20
# torch and numpy index with signed 64-bit strides (ggml's ne are int64 too)
_MAX_INDEX = 2 ** 63

MXFP4 = 39
MXFP4_BLOCK_BYTES = 17


class GGMLType(NamedTuple):
    name: str
    block_size: int   # elements per block
    type_size: int    # bytes per block


# the ggml types a GGUF file may hold, by id (ggml.h's ggml_type; gguf.constants'
# GGMLQuantizationType and GGML_QUANT_SIZES): ids 4, 5 and 31-33, 36-38 were removed
GGML_TYPES: Dict[int, GGMLType] = {t[0]: GGMLType(*t[1:]) for t in [
    (0, "F32", 1, 4), (1, "F16", 1, 2), (2, "Q4_0", 32, 18), (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22), (7, "Q5_1", 32, 24), (8, "Q8_0", 32, 34), (9, "Q8_1", 32, 40),
    (10, "Q2_K", 256, 84), (11, "Q3_K", 256, 110), (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176), (14, "Q6_K", 256, 210), (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66), (17, "IQ2_XS", 256, 74), (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50), (20, "IQ4_NL", 32, 18), (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82), (23, "IQ4_XS", 256, 136), (24, "I8", 1, 1), (25, "I16", 1, 2),
    (26, "I32", 1, 4), (27, "I64", 1, 8), (28, "F64", 1, 8), (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2), (34, "TQ1_0", 256, 54), (35, "TQ2_0", 256, 66),
    (MXFP4, "MXFP4", GROUP, MXFP4_BLOCK_BYTES), (40, "NVFP4", 64, 36), (41, "Q1_0", 128, 18),
]}
# the types a tensor is a view of (no decoding): numpy dtype, and the torch dtype to view
# it as where numpy has none
_VIEW_TYPES: Dict[int, Tuple[Any, Optional[torch.dtype]]] = {
    0: (np.float32, None), 1: (np.float16, None), 28: (np.float64, None),
    24: (np.int8, None), 25: (np.int16, None), 26: (np.int32, None), 27: (np.int64, None),
    30: (np.int16, torch.bfloat16)}

# GGUF metadata value types (gguf.constants.GGUFValueType): scalars by struct format
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL = range(8)
_STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = 8, 9, 10, 11, 12
VALUE_TYPES = {_UINT8: "UINT8", _INT8: "INT8", _UINT16: "UINT16", _INT16: "INT16",
               _UINT32: "UINT32", _INT32: "INT32", _FLOAT32: "FLOAT32", _BOOL: "BOOL",
               _STRING: "STRING", _ARRAY: "ARRAY", _UINT64: "UINT64", _INT64: "INT64",
               _FLOAT64: "FLOAT64"}
_SCALAR = {_UINT8: "<u1", _INT8: "<i1", _UINT16: "<u2", _INT16: "<i2", _UINT32: "<u4",
           _INT32: "<i4", _FLOAT32: "<f4", _BOOL: "<u1", _UINT64: "<u8", _INT64: "<i8",
           _FLOAT64: "<f8"}
_STRUCT = {t: struct.Struct("<" + c) for t, c in zip(
    (_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _UINT64, _INT64,
     _FLOAT64), "BbHhIifBQqd", strict=True)}
_INTEGER_TYPES = (_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _UINT64, _INT64)
_MIN_VALUE_BYTES = {**{t: np.dtype(f).itemsize for t, f in _SCALAR.items()},
                    _STRING: 8, _ARRAY: 12}

_TYPE_COUNT = struct.Struct("<IQ")  # an array's head; also a tensor info's type and offset


class GGUFTensorInfo(NamedTuple):
    """One tensor of a GGUF file, as checked: ``shape`` in row-major order (the reverse
    of GGUF's ``ne``), ``begin``/``end`` absolute offsets of its bytes in ``path``."""

    name: str
    ggml_type: int
    shape: Tuple[int, ...]
    begin: int
    end: int
    path: str

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.ggml_type].name

    @property
    def n_bytes(self) -> int:
        return self.end - self.begin

    @property
    def byte_shape(self) -> Tuple[int, ...]:
        """The bytes as an array: the shape for a dense type (elements of its size), and
        ``shape[:-1] + (blocks per row, type_size)`` for a block type (for MXFP4
        ``(..., d_out, n_groups, 17)``)."""
        t = GGML_TYPES[self.ggml_type]
        if t.block_size == 1:
            return self.shape
        rows = self.shape[:-1] if self.shape else ()
        last = self.shape[-1] if self.shape else 1
        return rows + (last // t.block_size, t.type_size)

    @property
    def row_bytes(self) -> int:
        """Bytes of one index of the first dimension (one expert of a stacked tensor):
        exact for every dense tensor, and for a block type's of at least two dimensions
        (0 for a 1-D one, whose elements share their blocks)."""
        t = GGML_TYPES[self.ggml_type]
        if not self.shape:
            return self.n_bytes
        if t.block_size > 1 and len(self.shape) < 2:
            return 0
        return math.prod(self.shape[1:]) // t.block_size * t.type_size
