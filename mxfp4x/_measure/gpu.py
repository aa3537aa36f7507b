"""The roofs of a CUDA device and its timer, measured in-process for ``python -m mxfp4x
bench --device cuda``: memory read bandwidth over more than the L2 (a float32 sum of a
buffer of 2 GiB), ``torch.matmul``'s rate in float32 (TF32 off: the exact float32 products
the torch backend computes in) and in the latents' dtype, the wall time of a call
between two device synchronisations (so that host work inside a call, such as the
per-expert loop, counts as a user would see it), and of a CUDA graph's replay of it (the
device's work and launches alone, as a captured decoding step runs it)."""
import contextlib

import torch

from .roofline import best_time


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synchronized_time(fn, device, repeats=5):
    """Smallest wall time of ``repeats`` calls of ``fn(i)``, each between two
    synchronisations of ``device``, after one call not counted (the first call's
    allocations and library loads)."""
    def call(i):
        fn(i)
        _sync(device)
    call(0)
    return best_time(call, repeats)


def graph_time(fn, device, repeats=5):
    """Smallest wall time of replaying a CUDA graph that holds one call of ``fn()`` (captured
    after two warm-up calls on a side stream), each replay between two synchronisations:
    the call's device work and launches without its host work; None off CUDA."""
    if device.type != "cuda":
        return None
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return synchronized_time(lambda _: graph.replay(), device, repeats)


@contextlib.contextmanager
def exact_float32():
    """TF32 off for float32 matmuls while measuring (and restored): the float32 roof and
    peer are the exact float32 products."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def read_bandwidth(device, n_bytes=2 << 30, repeats=5):
    """Bytes per second of reading ``n_bytes`` of device memory once (a float32 sum)."""
    buf = torch.ones(n_bytes // 4, dtype=torch.float32, device=device)
    return n_bytes / synchronized_time(lambda _: buf.sum(), device, repeats)


def matmul_rate(device, dtype, n=8192, repeats=5):
    """FLOP/s of torch.matmul of two n x n matrices of ``dtype`` on ``device``."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    with exact_float32():
        return 2.0 * n ** 3 / synchronized_time(lambda _: a @ b, device, repeats)


def measure(device, dtype, n_bytes=2 << 30, n=8192):
    """The roofs ``bench --device cuda`` divides by: read GB/s, float32 and ``dtype``
    matmul GFLOP/s, and the device's name (smaller sizes: a quick check off a GPU)."""
    name = (torch.cuda.get_device_properties(device).name if device.type == "cuda"
            else str(device))
    read = read_bandwidth(device, n_bytes) / 1e9
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the read buffer's 2 GiB back before the matmuls
    return {"device": name, "read_gbps": read,
            "matmul_gflops": {"float32": matmul_rate(device, torch.float32, n) / 1e9,
                              str(dtype).replace("torch.", ""):
                              matmul_rate(device, dtype, n) / 1e9}}


def matmul_peer(n_tokens, top_k, d_out, d_in, dtype, device, repeats=5):
    """Seconds of the same per-expert products as torch.matmul on weights already decoded
    to ``dtype`` on ``device`` (top_k products of (n_tokens, d_in) x (d_in, d_out)), each
    product on its own expert's weights (so they stream from memory, not the L2)."""
    ws = [torch.randn(d_out, d_in, device=device).to(dtype) for _ in range(top_k)]
    x = torch.randn(n_tokens, d_in, device=device).to(dtype)

    def run(_):
        for w in ws:
            x @ w.T
    with exact_float32():
        return synchronized_time(run, device, repeats)
