"""GGUF files (llama.cpp, Ollama, LM Studio), read in place: the header parsed as hostile
input, the tensors handed out as views of a memory mapping of the file.

The container (GGUF v2 and v3, little-endian; the format as ggml's ``docs/gguf.md``
describes it and the ``gguf`` package's ``GGUFReader``/``GGUFWriter`` and ggml's
``gguf.cpp`` read and write it)::

    "GGUF"  u32 version  u64 n_tensors  u64 n_kv
    n_kv times:       string key, u32 value type, value
    n_tensors times:  string name, u32 n_dims, u64 ne[n_dims] (fastest first),
                      u32 ggml type, u64 offset (relative to the data section)
    padding to the alignment, then the data section

A string is a u64 byte count and UTF-8 bytes; an array value is a u32 element type, a
u64 count and the elements (arrays may nest).  The alignment is the ``general.alignment``
key (a u32, a power of two; default 32); every tensor offset is a multiple of it.
``ne[0]`` is the fastest-varying dimension, so a GGUF tensor of ``ne = [d_in, d_out,
n_experts]`` is our row-major ``(n_experts, d_out, d_in)``.  A quantized type stores
``ne[0] / block_size`` blocks of ``type_size`` bytes per row (``GGML_TYPES``).

MXFP4 is GGML type 39 (``gguf.GGMLQuantizationType.MXFP4``): blocks of 32 weights in 17
bytes, ``struct block_mxfp4 { uint8 e; uint8 qs[16]; }``, the E8M0 scale byte first,
then element j in the low nibble of ``qs[j]`` and element j + 16 in its high nibble (not
the 2j / 2j + 1 of gpt-oss's safetensors).  :meth:`GGUFFile.get` hands such a tensor out
as uint8 ``(..., d_out, n_groups, 17)``, a view of the mapped file: what
``mxfp4x.mxfp4_experts(x, blocks, None, ...)`` takes.  An expert-stacked tensor
(``blk.{L}.ffn_{gate,up,down}_exps.weight``) is ``(n_experts, d_out, n_groups, 17)``, and
:meth:`GGUFFile.get_rows` maps just some experts' bytes.  Dense tensors come out as
views too (F32, F16, BF16, F64, I8..I64); other quantized types (Q8_0, the K-quants...)
are dequantized once by the ``gguf`` package (``pip install gguf``), an optional import.

Split files (``name-00001-of-00003.gguf``, as ``llama-gguf-split`` and ``GGUFWriter``
write them) open as one :class:`GGUFCheckpoint`: every file carries ``split.no``
(0-based), ``split.count`` and ``split.tensors.count`` (the total over the files;
``gguf.Keys.Split``), and the first holds the model's metadata.

Files are untrusted input.  Every number is an exact Python int, every count and length
is checked against the bytes left in the file before anything proportional to it is
allocated, arrays nest at most ``MAX_ARRAY_DEPTH`` deep, keys and tensor names are unique,
every tensor's byte range lies inside the data section and overlaps no other, and every
read is bounded by its own tensor's range.  A header costs memory in proportion to its
bytes, whatever it holds: arrays of numbers are numpy arrays, arrays of strings or of
arrays are a :class:`GGUFList` (their bytes and an offset per element, each element
decoded when read), and a header declares at most ``MAX_KEYS`` key-value pairs and
``MAX_TENSORS`` tensors (the caps, beside ggml's own limits, are constants of this module).
A malformed file is a ``ValueError`` naming the file and the key or tensor.  Only regular
files are opened (symbolic links followed): a named pipe, a device or a folder is a
``ValueError`` naming it.  The file is opened read-only and never written.  Every call
that hands out tensors makes a new copy-on-write mapping of just their bytes (as the
safetensors reader does): a tensor is a view of the file's pages, and a write to it
copies the page it touches for that call's tensors alone.  Each call checks the file's
size then: a file truncated after it was opened is a ``ValueError``.  A file truncated
or rewritten in place while tensors already handed out are in use cannot be guarded
against (a bus error, or changed numbers): replace a model's file by renaming a new one
over it.

This module is the reader's public face; its parts lie beside it, one job each:
``_gguf_format`` (the format's facts and the caps), ``_gguf_values`` (the header read in
sequence, its metadata values and :class:`GGUFList`), ``_gguf_header`` (the header
checked), ``_gguf_file`` (:class:`GGUFFile`, one file's tensors) and ``_gguf_split``
(:class:`GGUFCheckpoint`, split sets); ``_files`` opens and maps files for both readers.
"""
from ._gguf_file import GGUFFile, decode_mxfp4_blocks, is_gguf
from ._gguf_format import (
    ALIGNMENT_KEY,
    ARCHITECTURE_KEY,
    DEFAULT_ALIGNMENT,
    GGML_TYPES,
    MAGIC,
    MAX_ARRAY_DEPTH,
    MAX_DIMS,
    MAX_KEY_BYTES,
    MAX_KEYS,
    MAX_NAME_BYTES,
    MAX_STRING_BYTES,
    MAX_TENSORS,
    MXFP4,
    MXFP4_BLOCK_BYTES,
    SPLIT_COUNT,
    SPLIT_NAME,
    SPLIT_NO,
    SPLIT_TENSORS,
    VALUE_TYPES,
    VERSIONS,
    GGMLType,
    GGUFTensorInfo,
)
from ._gguf_split import GGUFCheckpoint, split_files
from ._gguf_values import GGUFList

__all__ = ["GGUFFile", "GGUFCheckpoint", "GGUFTensorInfo", "GGUFList", "is_gguf",
           "split_files", "decode_mxfp4_blocks", "GGMLType", "GGML_TYPES", "VALUE_TYPES",
           "MXFP4", "MXFP4_BLOCK_BYTES", "MAGIC", "VERSIONS", "DEFAULT_ALIGNMENT",
           "ALIGNMENT_KEY", "ARCHITECTURE_KEY", "SPLIT_NO", "SPLIT_COUNT", "SPLIT_TENSORS",
           "SPLIT_NAME", "MAX_DIMS", "MAX_NAME_BYTES", "MAX_KEY_BYTES", "MAX_STRING_BYTES",
           "MAX_ARRAY_DEPTH", "MAX_KEYS", "MAX_TENSORS"]
