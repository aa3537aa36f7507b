"""Helpers shared by the tests and the benchmarks: random MXFP4 layers and the error
bound a float32 (or float64) computation is held to (``mxfp4x._synthetic.layers``, what
``python -m mxfp4x check`` runs), llama.cpp's GGUF blocks of a layer's experts, and
threads started together."""
import threading

import numpy as np

from .._synthetic.layers import (
    acc_name,
    assert_matches_reference,
    dtype_name,
    random_layer,
    reference_and_bound,
)

__all__ = ["acc_name", "assert_matches_reference", "dtype_name", "random_layer",
           "reference_and_bound", "gguf_blocks_of", "run_threads"]


def gguf_blocks_of(packed, scale_bytes):
    """The same matrices as llama.cpp's GGUF block_mxfp4 blocks: packed (..., G, 16) in
    gpt-oss's arrangement (byte j: elements 2j, 2j+1) and scale bytes (..., G) ->
    (..., G, 17) uint8, each block the scale byte then 16 bytes whose byte j holds
    element j (low nibble) and element j+16 (high nibble).  numpy arrays in and out."""
    packed = np.asarray(packed, dtype=np.uint8)
    lo, hi = packed & 0xF, packed >> 4  # elements 2j and 2j+1
    codes = np.empty(packed.shape[:-1] + (32,), np.uint8)
    codes[..., 0::2], codes[..., 1::2] = lo, hi
    blocks = np.empty(packed.shape[:-1] + (17,), np.uint8)
    blocks[..., 0] = scale_bytes
    blocks[..., 1:] = codes[..., :16] | (codes[..., 16:] << 4)
    return blocks


def run_threads(n, work):
    """work(i) in n threads started together; returns the exceptions they raised."""
    errors = []
    barrier = threading.Barrier(n)

    def body(i):
        try:
            barrier.wait()
            work(i)
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors
