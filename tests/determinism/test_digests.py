"""Bit-identity over time: sha256 of the results of a fixed set of calls, per ISA, recorded
once and checked on every run.  A refactor, a moved module or a new build must leave every
bit of these results as it was; a kernel change that moves bits on purpose records new
digests (``MXFP4X_RECORD_DIGESTS=1 pytest tests/determinism/test_digests.py -s`` prints them).

The inputs are made here with numpy's PCG64 (fixed seeds), not by package helpers, so that
moving or changing a helper cannot move the inputs.  The float64 path gives the same bits
under every ISA (its vector kernels do the scalar ones' arithmetic), so its digests are one
value for all ISAs.  ISAs without recorded digests (none recorded on hosts that cannot run
them) are skipped with the reason.
"""
import hashlib
import os

import numpy as np
import pytest
import torch

import mxfp4x
from mxfp4x.testing.layers import gguf_blocks_of

RECORD = os.environ.get("MXFP4X_RECORD_DIGESTS") == "1"


def _layer(seed, n_tokens, top_k, n_experts, d_out, n_groups, dtype):
    rng = np.random.default_rng(seed)
    d_in = 32 * n_groups
    x = torch.from_numpy(rng.standard_normal((n_tokens, d_in))).to(dtype)
    packed = torch.from_numpy(rng.integers(0, 256, (n_experts, d_out, n_groups, 16), np.uint8))
    scales = torch.from_numpy(rng.integers(119, 134, (n_experts, d_out, n_groups), np.uint8))
    sel = torch.from_numpy(rng.integers(0, n_experts, (n_tokens, top_k)))
    mix = torch.from_numpy(rng.random((n_tokens, top_k))).to(dtype)
    shared = torch.from_numpy(rng.standard_normal((n_tokens, d_out))).to(dtype)
    return x, packed, scales, sel, mix, shared


def _cases():
    cases = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        name = str(dtype).replace("torch.", "")
        for n_tokens in (1, 5, 300):  # gemv, multi-token gemv, panels
            layer = _layer(n_tokens, n_tokens, 4, 6, 100, 9, dtype)
            cases[f"forward-{name}-T{n_tokens}"] = (
                lambda isa, a=layer: mxfp4x.mxfp4_experts(*a, isa=isa))
    a = _layer(11, 40, 3, 5, 70, 5, torch.float32)
    cases["slots-float32"] = lambda isa: mxfp4x.mxfp4_experts_slots(*a[:4], isa=isa)
    rng = np.random.default_rng(12)
    per_slot = torch.from_numpy(rng.standard_normal((40, 3, 160))).float()
    cases["per-slot-latents-float32"] = lambda isa: mxfp4x.mxfp4_experts(
        per_slot, *a[1:], isa=isa)
    grad = torch.from_numpy(rng.standard_normal((40, 70))).float()
    cases["transposed-float32"] = lambda isa: torch.ops.mxfp4x.mxfp4_experts_grad_latents(
        grad, a[1], a[2], a[3], a[4], a[0], isa=isa)
    a64 = (a[0].double(), a[1], a[2], a[3], a[4].double())
    cases["transposed-float64"] = lambda isa, a=a64: (
        torch.ops.mxfp4x.mxfp4_experts_grad_latents(grad.double(), *a[1:], a[0], isa=isa))
    listed = (a[0], list(a[1].unbind(0)), list(a[2].unbind(0)), *a[3:])
    cases["list-form-float32"] = lambda isa: mxfp4x.mxfp4_experts(*listed, isa=isa)
    for n_tokens in (1, 300):  # GGUF blocks: the gemv and the panels
        x, packed, scales, *rest = _layer(20 + n_tokens, n_tokens, 4, 6, 100, 9,
                                          torch.float32)
        blocks = torch.from_numpy(gguf_blocks_of(packed.numpy(), scales.numpy()))
        cases[f"gguf-float32-T{n_tokens}"] = (
            lambda isa, a=(x, blocks, None, *rest): mxfp4x.mxfp4_experts(*a, isa=isa))
        x16 = x.bfloat16()
        cases[f"gguf-bfloat16-T{n_tokens}"] = (
            lambda isa, a=(x16, blocks, None, *rest): mxfp4x.mxfp4_experts(*a, isa=isa))
        g64 = (x.double(), blocks, None,
               *(v.double() if v.is_floating_point() else v for v in rest))
        cases[f"gguf-float64-T{n_tokens}"] = (
            lambda isa, a=g64: mxfp4x.mxfp4_experts(*a, isa=isa))
    return cases


CASES = _cases()

# sha256 (first 16 hex digits) of the result's bytes, by ISA; "float64" rows hold for all
EXPECTED = {
    ('any', 'forward-float64-T1'): 'fe03a3a9c61c33fb',
    ('any', 'forward-float64-T300'): '7f30772cc067c7df',
    ('any', 'forward-float64-T5'): '4a8393326eb888b9',
    ('any', 'gguf-float64-T1'): 'fb41c82ae7641c1d',
    ('any', 'gguf-float64-T300'): '0dc2581cb9ed10ad',
    ('any', 'transposed-float64'): 'dada09f7b2d612bd',
    ('avx2', 'forward-bfloat16-T1'): 'f7ec011c493021ce',
    ('avx2', 'forward-bfloat16-T300'): '58b3d7c8842f8adf',
    ('avx2', 'forward-bfloat16-T5'): '7b8a286b5c0dcc32',
    ('avx2', 'forward-float32-T1'): 'ee93ab1448df7737',
    ('avx2', 'forward-float32-T300'): 'e35ec64a98232a4f',
    ('avx2', 'forward-float32-T5'): 'cea792d61ac29329',
    ('avx2', 'list-form-float32'): '3ec22ef33e0cd29f',
    ('avx2', 'per-slot-latents-float32'): '24f3bc457c9bc4f3',
    ('avx2', 'slots-float32'): '4f39da95425f671e',
    ('avx2', 'transposed-float32'): 'dcbd9be4e84b3941',
    ('scalar', 'forward-bfloat16-T1'): 'f7ec011c493021ce',
    ('scalar', 'forward-bfloat16-T300'): 'a99b4c89fac4a3c6',
    ('scalar', 'forward-bfloat16-T5'): '7b8a286b5c0dcc32',
    ('scalar', 'forward-float32-T1'): '4c131002dcce3e8c',
    ('scalar', 'forward-float32-T300'): '49c7aef6893e0317',
    ('scalar', 'forward-float32-T5'): '9fe5d22fe4d56230',
    ('scalar', 'list-form-float32'): '8c2c018a265e752e',
    ('scalar', 'per-slot-latents-float32'): 'be4e5da5152d4071',
    ('scalar', 'slots-float32'): '550d72d955f08427',
    ('scalar', 'transposed-float32'): 'fbdcffa295ae8548',
    ('avx512', 'forward-float32-T1'): '5f3af7db6e5dca33',
    ('avx512', 'forward-float32-T5'): 'd091b47252258762',
    ('avx512', 'forward-float32-T300'): 'd73c913aff9b7cd0',
    ('avx512', 'forward-bfloat16-T1'): 'f7ec011c493021ce',
    ('avx512', 'forward-bfloat16-T5'): '7b8a286b5c0dcc32',
    ('avx512', 'forward-bfloat16-T300'): 'a99b4c89fac4a3c6',
    ('avx512', 'slots-float32'): '8508eb5e77d2a8ef',
    ('avx512', 'per-slot-latents-float32'): '0e9df274070dacce',
    ('avx512', 'transposed-float32'): 'dcbd9be4e84b3941',
    ('avx512', 'list-form-float32'): '2fbcd28b2d0daa12',
    ('avx512', 'gguf-float32-T1'): 'ecfb5938011ea21e',
    ('avx512', 'gguf-float32-T300'): 'ccf1d7e12eb8527c',
    ('avx2', 'gguf-float32-T1'): 'bca39c9ffd982f8d',
    ('avx2', 'gguf-float32-T300'): '43ff966920750b3d',
    ('scalar', 'gguf-float32-T1'): '8743ee025bddbe0b',
    ('scalar', 'gguf-float32-T300'): '5d4c230a97563d75',
    ('amx', 'forward-bfloat16-T1'): 'f7ec011c493021ce',
    ('amx', 'forward-bfloat16-T300'): '987dc10890ec8e71',
    ('amx', 'forward-bfloat16-T5'): '7b8a286b5c0dcc32',
    ('amx', 'forward-float32-T1'): '5f3af7db6e5dca33',
    ('amx', 'forward-float32-T300'): 'd73c913aff9b7cd0',
    ('amx', 'forward-float32-T5'): 'd091b47252258762',
    ('amx', 'gguf-bfloat16-T1'): '57384b85a89c4294',
    ('amx', 'gguf-bfloat16-T300'): '3020d4275c683c6f',
    ('amx', 'gguf-float32-T1'): 'ecfb5938011ea21e',
    ('amx', 'gguf-float32-T300'): 'ccf1d7e12eb8527c',
    ('amx', 'list-form-float32'): '2fbcd28b2d0daa12',
    ('amx', 'per-slot-latents-float32'): '0e9df274070dacce',
    ('amx', 'slots-float32'): '8508eb5e77d2a8ef',
    ('amx', 'transposed-float32'): 'dcbd9be4e84b3941',
    ('avx512bf16', 'forward-bfloat16-T1'): 'f7ec011c493021ce',
    ('avx512bf16', 'forward-bfloat16-T300'): '84645f8194d9d3d7',
    ('avx512bf16', 'forward-bfloat16-T5'): '7b8a286b5c0dcc32',
    ('avx512bf16', 'forward-float32-T1'): '5f3af7db6e5dca33',
    ('avx512bf16', 'forward-float32-T300'): 'd73c913aff9b7cd0',
    ('avx512bf16', 'forward-float32-T5'): 'd091b47252258762',
    ('avx512bf16', 'gguf-bfloat16-T1'): '57384b85a89c4294',
    ('avx512bf16', 'gguf-bfloat16-T300'): '476568e391a2ee17',
    ('avx512bf16', 'gguf-float32-T1'): 'ecfb5938011ea21e',
    ('avx512bf16', 'gguf-float32-T300'): 'ccf1d7e12eb8527c',
    ('avx512bf16', 'list-form-float32'): '2fbcd28b2d0daa12',
    ('avx512bf16', 'per-slot-latents-float32'): '0e9df274070dacce',
    ('avx512bf16', 'slots-float32'): '8508eb5e77d2a8ef',
    ('avx512bf16', 'transposed-float32'): 'dcbd9be4e84b3941',
    ('avx2', 'gguf-bfloat16-T1'): '57384b85a89c4294',
    ('avx2', 'gguf-bfloat16-T300'): '5a572d5387a7e228',
    ('avx512', 'gguf-bfloat16-T1'): '57384b85a89c4294',
    ('avx512', 'gguf-bfloat16-T300'): 'ef1f5e6e19dfef2e',
    ('scalar', 'gguf-bfloat16-T1'): '57384b85a89c4294',
    ('scalar', 'gguf-bfloat16-T300'): 'ef1f5e6e19dfef2e',
}


def _digest(t):
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


# avx512bf16's bf16 digests: recorded on an Intel Xeon and found the same on an AMD EPYC
# Zen 4, except these, recorded (after the two-group decode changed their bits) on the
# Zen 4 only
_BF16DP_RECORDED_ON = {"forward-bfloat16-T300": ("AuthenticAMD",)}


def _cpu_vendor():
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":")[1].strip() for line in f
                         if line.startswith("vendor_id")), "")
    except OSError:
        return ""


@pytest.mark.parametrize("case", list(CASES))
def test_results_keep_their_bits(isa, case):
    vendors = _BF16DP_RECORDED_ON.get(case, ("GenuineIntel", "AuthenticAMD"))
    if isa == "avx512bf16" and "bfloat16" in case and _cpu_vendor() not in vendors:
        # vdpbf16ps's pair order and roundings are the hardware's: each digest is checked
        # only on the vendors whose CPUs produced it
        pytest.skip(f"avx512bf16's {case} digest is recorded on {vendors} CPUs only")
    got = _digest(CASES[case](isa))
    key = ("any" if "float64" in case else isa, case)
    if RECORD:
        print(f"    {key!r}: {got!r},")
        return
    if key not in EXPECTED:
        pytest.skip(f"no digest recorded for {key}")
    assert got == EXPECTED[key]


def test_digests_cover_this_hosts_best_isa():
    # a host whose best ISA has digests recorded must not skip them all
    best = mxfp4x.backend_info()["isa"]
    if best not in {isa for isa, _ in EXPECTED}:
        pytest.skip(f"no digests recorded for {best}")
    assert all((best, c) in EXPECTED or "float64" in c for c in CASES)
