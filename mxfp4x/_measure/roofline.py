"""The roofs of the machine this runs on, measured in-process (``python -m mxfp4x
roofline``): memory read bandwidth over more than 1 GiB (numpy's memory, on huge pages where
Linux gives them, and torch's, as tensors get it), the float32 multiply-add peak of
every ISA the build can run here (a register-resident loop compiled for that ISA), and
``torch.matmul`` in float32 and bfloat16 at a large square size; with the CPU model and
the flags that matter."""
import os
import platform
import time
from typing import Dict, List, Optional

import numpy as np
import torch

from .._core import cpu as _cpu
from .._core import probes as _probes
from .._core import threads as _threads

FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile",
         "asimd", "asimddp", "bf16", "i8mm", "sve")


def cpu_model() -> Dict[str, object]:
    """The CPU model and the flags that matter (Linux /proc/cpuinfo; platform elsewhere)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model name") and model in ("", platform.machine(),
                                                                       platform.processor()):
                    model = value.strip()
                elif key in ("flags", "Features"):
                    flags |= set(value.split())
    except OSError:
        pass
    return {"model": model, "machine": platform.machine(), "cores": os.cpu_count(),
            "flags": [f for f in FLAGS if f in flags]}


def best_time(fn, repeats=5, min_time=0.0):
    """Smallest wall time of ``repeats`` calls of ``fn(i)`` (``i`` the call's index), calling
    on until the calls have taken ``min_time`` seconds in all: the one best-of timer of the
    roofs, the bench cases and the gate (the CUDA one adds the synchronisations)."""
    best = float("inf")
    total = 0.0
    i = 0
    while i < repeats or total < min_time:
        t0 = time.perf_counter()
        fn(i)
        dt = time.perf_counter() - t0
        best = min(best, dt)
        total += dt
        i += 1
    return best


def _read_numpy(buf, threads: int, repeats: int) -> float:
    """read_bandwidth's figure over ``buf``: the better of mxfp4x's own read loop and
    ``torch.sum`` on the same memory."""
    own = _probes.read_peak(buf, threads, repeats)
    tbuf = torch.from_numpy(buf.view(np.float32))
    with _threads.torch_threads(threads):
        tbuf.sum()
        return max(own, buf.nbytes / best_time(lambda _: tbuf.sum(), repeats))


def read_bandwidth(threads: int, n_bytes: int = 5 << 28, repeats: int = 3) -> float:
    """Bytes per second reading a buffer of ``n_bytes`` (> 1 GiB: DRAM, not cache) once:
    the better of mxfp4x's own read loop (64-bit words, 8 independent sums, on the
    driver's threads) and ``torch.sum`` (whose one-thread reduction can be slower than
    memory, which would make the floor too easy)."""
    return _read_numpy(np.ones(n_bytes // 8, dtype=np.uint64), threads, repeats)


def _torch_buffer(n_bytes: int) -> torch.Tensor:
    buf = torch.empty(n_bytes, dtype=torch.uint8)
    buf.fill_(1)
    return buf


def read_bandwidth_torch(threads: int, n_bytes: int = 5 << 28, repeats: int = 3) -> float:
    """The same read loop over a buffer from torch's allocator, where torch tensors (and
    so most expert weights) live.  ``read_bandwidth``'s buffer is numpy's, which asks Linux
    for transparent huge pages; torch's allocator does not, and where THP is only given on
    request (``madvise``, the common default) its memory is in 4 KiB pages, which stream
    slower (an Intel Xeon under KVM: 10.4-10.7 against 14.0 GB/s on one thread, 20.6-21.0
    against 28.1 on two)."""
    return _probes.read_peak(_torch_buffer(n_bytes).numpy(), threads, repeats)


class ReadProbe:
    """Both read roofs measured again beside each timed case, over two buffers of
    ``n_bytes`` kept for the probe's life.  A shared or virtual machine's memory
    bandwidth can move by 2x within minutes (an AMD EPYC Zen 5 under KVM read 48 GB/s on
    two threads in one minute and 79 in the next), so a ratio to a roof measured at the
    start of a run says as much about that minute as about the case; the roof measured
    just before and just after the case, the better of the two, makes the floor the case
    had then."""

    def __init__(self, n_bytes: int = 5 << 28):
        self._numpy = np.ones(n_bytes // 8, dtype=np.uint64)
        self._torch = _torch_buffer(n_bytes).numpy()

    def measure(self, threads: int, repeats: int = 2) -> Dict[str, float]:
        """GB/s read from numpy's memory (``read_gbps``) and torch's (``read_gbps_torch``)
        with ``threads`` threads, as ``read_bandwidth`` and ``read_bandwidth_torch``."""
        return {"read_gbps": _read_numpy(self._numpy, threads, repeats) / 1e9,
                "read_gbps_torch": _probes.read_peak(self._torch, threads, repeats) / 1e9}


def matmul_rate(threads: int, dtype, n: int = 2048, repeats: int = 3) -> float:
    """FLOP/s of torch.matmul of two n x n matrices of ``dtype``."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    with _threads.torch_threads(threads):
        a @ b
        return 2.0 * n ** 3 / best_time(lambda _: a @ b, repeats)


def measure(threads: Optional[List[int]] = None, quick: bool = False) -> Dict[str, object]:
    """Every roof, for each thread count (default 1 .. the threads a call gets by default,
    ``_threads.resolve(None)``)."""
    threads = threads or list(range(1, _threads.resolve(None) + 1))
    n_bytes = (1 << 24) if quick else (5 << 28)
    out: Dict[str, object] = {"cpu": cpu_model(), "threads": threads,
                              "isas": _cpu.runnable_isas(), "read_gbps": {},
                              "read_gbps_torch": {}, "fma_gflops": {}, "bf16_dot_gflops": {},
                              "matmul_gflops": {}}
    for th in threads:
        out["read_gbps"][th] = read_bandwidth(th, n_bytes) / 1e9  # type: ignore[index]
        out["read_gbps_torch"][th] = (  # type: ignore[index]
            read_bandwidth_torch(th, n_bytes) / 1e9)
        out["fma_gflops"][th] = {  # type: ignore[index]
            isa: _probes.fma_peak(isa, th, 0.02 if quick else 0.2) / 1e9
            for isa in _cpu.runnable_isas()}
        bf16 = {isa: _probes.bf16_dot_peak(isa, th, 0.02 if quick else 0.2)
                for isa in _cpu.runnable_isas() if _cpu.has_bf16_unit(isa)}
        out["bf16_dot_gflops"][th] = {  # type: ignore[index]
            isa: v / 1e9 for isa, v in bf16.items() if v is not None}
        out["matmul_gflops"][th] = {  # type: ignore[index]
            "float32": matmul_rate(th, torch.float32, 256 if quick else 2048) / 1e9,
            "bfloat16": matmul_rate(th, torch.bfloat16, 256 if quick else 2048) / 1e9}
    return out
