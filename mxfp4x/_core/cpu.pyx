# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, nonecheck=False
"""The CPU backend's boundary, its parallel driver, and the driver's one parallel
mechanism (``parallel_tasks``, shared with mxfp4x/_core/probes.pyx through cpu.pxd).

The boundary: a call is described by one C struct (``mxfp4x_call`` in
include/mxfp4x/mxfp4x.h, mirrored in capi.pxd) held by a :class:`Call`.  Python
builds a Call from numpy views of its tensors in one place
(``mxfp4x._core.cpu_impl``); the Call checks it in one place (``_check``).  Modes are
named keywords; nothing that a mode does not use is passed.

The driver (``Call.run``): one skeleton for both products.  Route the token-expert
pairs by expert (a stable counting sort, which also checks every expert id), then
split the work into tasks that each own disjoint output elements: row tiles of the
output for the forward product, column tiles of the latents for the transposed
one.  ``parallel_tasks`` hands whole tasks to threads; each output element is
accumulated by one thread in a fixed order (ascending expert id, then the pair order),
so results are bit-identical for any thread count and for any batch a token sits in.
No locks, no atomics.  The steps around it (the latents into the kernel layout, the
transposed result out of it, :func:`combine`) are tasks of whole rows through the same
mechanism.

How many threads a call gets is decided in mxfp4x/_core/threads.py; the roofline probes and
the test hooks live in mxfp4x/_core/probes.pyx, outside this module.
"""
import os

import numpy as np

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cython.parallel cimport parallel, prange, threadid
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memset

cimport mxfp4x._core.capi as c

ctypedef fused real:
    float
    double

GROUP = c.MXFP4X_GROUP
GROUP_BYTES = c.MXFP4X_GROUP_BYTES
GGUF_BLOCK_BYTES = c.MXFP4X_GGUF_BLOCK_BYTES

# Rows of W per forward task and the bytes of decoded rows a thread holds at once come
# from the ISA's kernel table (tile_rows, panel_bytes: each ISA's header says why); the
# float64 path uses the scalar entry's.  Groups (of input columns) per transposed task
# and rows per transposed panel:
cdef enum:
    T_TILE_GROUPS = 8
    T_PANEL_ROWS = 32
# A forward task takes an expert's pairs in blocks of at most PAIR_BLOCK, so a thread's
# dot-product scratch is bounded (PAIR_BLOCK x its task's rows) however many pairs one expert
# gets: 100000 tokens all routed to one expert need the same scratch as 512.  A token's
# dots do not depend on the pairs beside it (the gemv and panel paths give the same bits),
# and the blocks are combined in the pair order, so the bits do not change.
cdef enum:
    PAIR_BLOCK = 512
# Forward tiles grow up to WIDE_TILES x the ISA's tile rows, while every thread keeps >=
# TASKS_PER_THREAD tasks to balance.  With many tokens an expert's latents (64 tokens of
# gpt-oss-20b: 737 KB) are then read from L3 once per wide tile instead of once per tile;
# with few, each thread streams an expert's rows in runs of several tiles instead of
# jumping over the other threads' tiles.  A tile's size changes no bit: each dot is the
# kernels', each element combined in the pairs' order.
# bfloat16 latents on a bf16 unit (48-row tiles, tokens 2 bytes wide) go up to 16x: an
# expert's 64 gpt-oss-20b tokens (368 KB) are otherwise read from L3 for every 69 KB of
# weights; float32 latents gain nothing from more than 4x.
# With wide tiles and more than one thread, the last TAIL_TASKS tasks per thread are of the
# ISA's own tile rows: tasks are handed out in order, and a thread that took the last wide
# tile would keep the others waiting in libgomp's spin.
# The measurements behind each: docs/performance.md, "Tiles, tasks and panels".
cdef enum:
    WIDE_TILES = 4
    WIDE_TILES_BF16 = 16
    TASKS_PER_THREAD = 8
    TAIL_TASKS = 2

# The layout copies of a call and :func:`combine` run in tasks of whole rows of at least
# ROW_TASK_ELEMS elements: a pthreads build starts its threads per parallel step, and
# below about this much work per task (a few tens of microseconds) a started thread
# costs more than it saves.  A row is converted or combined alone, so the split never
# changes a bit.  The bf16 unit's gather (one task per active expert) runs in the calling
# thread below 2 x ROW_TASK_ELEMS latents (on pthreads builds: one thread per
# ROW_TASK_ELEMS), else on the call's team.
cdef enum:
    ROW_TASK_ELEMS = 1 << 16

# A forward task hints its slices of the shared output and the result into L2 before its
# first dot products when they are this small (a few tokens; more tokens amortise the
# misses over more work, and would crowd the panel out of L2).
cdef enum:
    PREFETCH_SLICE_BYTES = 64 << 10

# The most threads this boundary takes (threads.h's MXFP4X_MAX_THREADS).  threads.py reads it from
# here and owns the policy: how a request becomes a count in [1, MAX_THREADS].
MAX_THREADS = c.MXFP4X_MAX_THREADS

# names <-> C enums: the modes of a call are named, never inferred
_DTYPES = {"float32": c.MXFP4X_DTYPE_F32, "float64": c.MXFP4X_DTYPE_F64,
           "bfloat16": c.MXFP4X_DTYPE_BF16, "float16": c.MXFP4X_DTYPE_F16}
_ITEMSIZE = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
_PRODUCTS = {"forward": c.MXFP4X_FORWARD, "transposed": c.MXFP4X_TRANSPOSED}
_ROWS = {"token": c.MXFP4X_ROWS_PER_TOKEN, "slot": c.MXFP4X_ROWS_PER_SLOT}
DTYPES = tuple(_DTYPES)


# The module, by job: each file below is textually part of it.
include "cpu_runtime.pxi"
include "cpu_call.pxi"
include "cpu_plan.pxi"
include "cpu_tasks.pxi"
include "cpu_dense.pxi"
include "cpu_act.pxi"
include "cpu_attention.pxi"
include "cpu_decode.pxi"
