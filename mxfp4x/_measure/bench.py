"""Benchmark cases, shared by ``python -m mxfp4x bench`` and ``benchmarks/`` (through
``mxfp4x.testing.bench``, which adds the targets the benchmarks hold each case to: the
command shows a user the floors, not our targets): model-like layers, the floors of a
case from the machine's roofs (``roofline.measure``, measured in the same process), a torch
matmul roof, and torch on experts decoded ahead of time."""
import numpy as np
import torch

from .._core import threads as _threads
from .._core.format import GROUP, GROUP_BYTES
from .._core.memory import available_memory
from .roofline import best_time


def _shapes():
    """name: (n_experts, top_k, d_out, d_in), from the families' own sizes."""
    from ..models.gpt_oss import GPT_OSS_20B as g
    from ..models.kimi_k3 import K3_SIZES as k

    ff, latent = k["moe_intermediate_size"], k["routed_expert_hidden_size"]
    e, top_k = k["num_experts"], k["num_experts_per_token"]
    return {
        "gpt-oss-20b-gate-up": (g["num_local_experts"], g["num_experts_per_tok"],
                                2 * g["intermediate_size"], g["hidden_size"]),
        "gpt-oss-20b-down": (g["num_local_experts"], g["num_experts_per_tok"],
                             g["hidden_size"], g["intermediate_size"]),
        "kimi-like": (384, 8, 4096, 7168),  # a DeepSeek-like layer past 2^31 bytes
        "kimi-k3-w1": (e, top_k, ff, latent),  # w1 and w3 (gate, up)
        "kimi-k3-w2": (e, top_k, latent, ff),  # w2 (down)
    }


SHAPES = _shapes()


def make_experts(n_experts, d_out, d_in, seed=0):
    """Random MXFP4 experts: every byte value, scales near 2^-4 (trained-weight range)."""
    rng = np.random.default_rng(seed)
    n_groups = d_in // GROUP
    packed = torch.from_numpy(rng.integers(0, 256, (n_experts, d_out, n_groups, GROUP_BYTES),
                                           dtype=np.uint8))
    scales = torch.from_numpy(rng.integers(119, 125, (n_experts, d_out, n_groups),
                                           dtype=np.uint8))
    return packed, scales


def make_tokens(n_tokens, top_k, n_experts, d_in, d_out, dtype=torch.float32, seed=1,
                call=0):
    """Latents and a routing that, call after call, rotates over all experts (so
    repeated calls stream weights from memory, not from cache)."""
    g = torch.Generator().manual_seed(seed + call)
    x = torch.randn(n_tokens, d_in, generator=g).to(dtype)
    if n_tokens * top_k <= n_experts:
        base = (call * n_tokens * top_k) % n_experts
        sel = (base + torch.arange(n_tokens * top_k)) % n_experts
        sel = sel.reshape(n_tokens, top_k)
    else:
        sel = torch.stack([torch.randperm(n_experts, generator=g)[:top_k]
                           for _ in range(n_tokens)])
    mix = torch.rand(n_tokens, top_k, generator=g).to(dtype)
    shared = torch.randn(n_tokens, d_out, generator=g).to(dtype)
    return x, sel, mix, shared


def streamed_bytes(packed, scales, sel):
    """B: packed bytes + scale bytes of the distinct selected experts."""
    n = len(torch.unique(sel))
    return n * (packed[0].numel() + scales[0].numel())


def flops(n_tokens, top_k, d_out, d_in):
    return 2.0 * n_tokens * top_k * d_out * d_in


def matmul_roof(n_tokens, top_k, d_out, d_in, threads, dtype=torch.float32, repeats=3):
    """Seconds of torch.matmul for the same per-expert products on already decoded
    weights (top_k products of (n_tokens, d_in) x (d_in, d_out))."""
    w = torch.randn(d_out, d_in).to(dtype)
    x = torch.randn(n_tokens, d_in).to(dtype)
    def run(_):
        for _k in range(top_k):
            x @ w.T
    with _threads.torch_threads(threads):
        run(0)
        return best_time(run, repeats=repeats)


class Predecoded:
    """The op as torch runs it on experts decoded ahead of time, as a model dequantized
    when it is loaded holds them (in the latents' dtype: 4x the packed bytes in bfloat16,
    8x in float32): for each selected expert its tokens gathered, one ``torch.matmul``
    with its decoded matrix, the weighted rows added back with ``index_add_`` (the loop
    Hugging Face transformers' expert layers run on CPUs).  Experts (stacked or listed;
    ``scales`` None: GGUF blocks) are decoded on first use and kept; ``fits`` says whether
    a routing's experts fit in ``budget()``, half the memory left (with what is kept)."""

    def __init__(self, packed, scales, dtype):
        self.packed, self.scales, self.dtype = packed, scales, dtype
        n = packed[0].numel()
        elements = 2 * n if scales is not None else n // (GROUP_BYTES + 1) * GROUP
        self.matrix_bytes = elements * torch.finfo(dtype).bits // 8
        self.decoded = {}

    def bytes_needed(self, sel):
        """Bytes of decoded experts held once the routings in ``sel`` have run (those kept
        and those ``sel`` adds)."""
        return len(set(torch.unique(sel).tolist()) | set(self.decoded)) * self.matrix_bytes

    def budget(self):
        free = available_memory()
        kept = len(self.decoded) * self.matrix_bytes
        return 4 * 2**30 if free is None else (free + kept) // 2

    def fits(self, sel):
        return self.bytes_needed(sel) <= self.budget()

    def weight(self, e):
        if e not in self.decoded:
            from .._core.torch_impl import decode_expert
            self.decoded[e] = decode_expert(
                self.packed[e], None if self.scales is None else self.scales[e], self.dtype)
        return self.decoded[e]

    def __call__(self, x, sel, mix, shared):
        out = shared.to(self.dtype, copy=True)
        for e in torch.unique(sel).tolist():
            tok, slot = (sel == e).nonzero(as_tuple=True)
            y = x[tok].to(self.dtype) @ self.weight(e).T
            out.index_add_(0, tok, y * mix[tok, slot].to(self.dtype).unsqueeze(1))
        return out


def predecoded_time(pre, calls, threads, repeats=2):
    """Seconds of ``pre`` (a ``Predecoded``) on ``calls``: the best of max(repeats,
    len(calls)) calls, call after call as the kernels are timed (the experts decoded
    first, untimed); None where the experts would not fit in ``pre.budget()``."""
    sel = torch.cat([c[1].reshape(-1) for c in calls])
    if not pre.fits(sel):
        return None
    for c in calls:  # decode (untimed), and a first run
        pre(*c)
    with _threads.torch_threads(threads):
        return best_time(lambda i: pre(*calls[i % len(calls)]),
                         repeats=max(repeats, len(calls)))


def floors(n_bytes, n_flops, roofs, threads, isa, dtype="float32"):
    """The two floors of a case from ``roofline.measure`` figures: B / read bandwidth
    and F / the ISA's FMA peak, both with ``threads`` threads; ``floor_s`` is the larger.
    bfloat16 latents on an ISA whose bf16 unit has a measured peak (``bf16_dot_gflops``)
    take that peak instead: their products run there.
    ``read_floor_torch_s``: B / the read bandwidth of torch's memory, where the weights of
    a torch tensor sit (informational: the targets use the machine's best read)."""
    read_s = n_bytes / (roofs["read_gbps"][threads] * 1e9)
    peak = roofs["fma_gflops"][threads][isa]
    if str(dtype).replace("torch.", "") == "bfloat16":
        peak = roofs.get("bf16_dot_gflops", {}).get(threads, {}).get(isa, peak)
    fma_s = n_flops / (peak * 1e9)
    out = {"read_floor_s": read_s, "fma_floor_s": fma_s, "floor_s": max(read_s, fma_s)}
    torch_gbps = roofs.get("read_gbps_torch", {}).get(threads)
    if torch_gbps:
        out["read_floor_torch_s"] = n_bytes / (torch_gbps * 1e9)
    return out
