"""The Triton kernels compiled for NVIDIA GPUs without one: Triton's compiler and the ptxas it
ships turn each kernel variant into PTX and a cubin for sm_90 and sm_80, and the PTX shows
what the kernels rely on.  Triton's interpreter (test_triton_kernel.py) runs none of this.
Run without ``TRITON_INTERPRET`` (CI's Triton lane does); skipped without Triton or where its
ahead-of-time API differs from the one written here (``MXFP4X_REQUIRE_TRITON=1``: Triton
missing is a failure)."""
import os
import re
import subprocess
import tempfile

import pytest

from mxfp4x._core import triton_impl as ti

_missing = None
if not ti.available():
    _missing = "Triton is not installed"
elif os.environ.get("TRITON_INTERPRET") == "1":
    _missing = "TRITON_INTERPRET=1 makes the kernels interpreted functions: nothing to compile"
if _missing == "Triton is not installed" and os.environ.get("MXFP4X_REQUIRE_TRITON") == "1":
    raise RuntimeError(f"MXFP4X_REQUIRE_TRITON=1: {_missing}")
pytestmark = pytest.mark.skipif(_missing is not None, reason=str(_missing))

TOKEN_ARGS = ["x_ptr", "sel_ptr", "mix_ptr", "shared_ptr", "out_ptr", "packed_ptr", "scale_ptr",
              "n_experts", "n_groups", "d_out", "top_k", "stride_x", "stride_mix",
              "stride_shared", "stride_pe", "stride_po", "stride_pg", "stride_se", "stride_so",
              "stride_sg"]
TILE_ARGS = ["x_ptr", "x_row_ptr", "out_row_ptr", "tile_expert_ptr", "tile_start_ptr",
             "tile_count_ptr", "packed_ptr", "scale_ptr", "out_ptr", "n_groups", "d_out",
             "stride_x", "stride_pe", "stride_po", "stride_pg", "stride_se", "stride_so",
             "stride_sg"]
# what a launch on gpt-oss's stacked layout specialises: pointers and these strides
# divisible by 16 (the group stride is 16 bytes, a row's 1440)
DIVISIBLE = {"stride_x", "stride_shared", "stride_pe", "stride_po", "stride_pg", "stride_se",
             "stride_so"}


def _compile(fn, names, types, constants, options, arch):
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:  # another Triton's layout of these names
        pytest.skip(f"Triton's ahead-of-time API differs here: {e}")
    signature = dict(zip(names, types, strict=True))
    signature.update({c: "constexpr" for c in constants})
    attrs = {(i,): [["tt.divisibility", 16]]
             for i, (n, t) in enumerate(zip(names, types, strict=True))
             if t.startswith("*") or n in DIVISIBLE}
    try:
        source = ASTSource(fn, signature, constants, attrs)
    except TypeError as e:
        pytest.skip(f"Triton's ASTSource takes other arguments here: {e}")
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    assert kernel.asm.get("cubin"), "ptxas gave no cubin"
    _LAST_CUBIN[:] = [kernel.asm["cubin"]]
    return kernel.asm["ptx"]


_LAST_CUBIN: list = []


def _stack_bytes():
    """The last compiled kernel's stack frame (ptxas's spills) from its cubin, by the
    cuobjdump Triton ships; skipped where it has none."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    if not os.path.exists(tool):
        pytest.skip("this Triton ships no cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(_LAST_CUBIN[0])
        usage = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True,
                               text=True, check=True).stdout
    found = re.findall(r"STACK:(\d+)", usage)
    assert found, usage
    return int(found[-1])


def _ops(ptx):
    """PTX instruction -> how many times it is written."""
    counts: dict = {}
    for m in re.finditer(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)", ptx, re.M):
        counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


def _token_ptx(x_type, combine, mma, arch, gguf=False, top_k=4, warps=None, per_slot=False,
               listed=False):
    from mxfp4x._core import triton_kernels as k

    out_type = x_type if combine or mma else "fp32"
    weights = "*i64" if listed else "*u8"
    types = [f"*{x_type}", "*i64", "*fp32", f"*{x_type}", f"*{out_type}", weights,
             weights] + ["i32"] * 13
    constants = dict(PER_SLOT=per_slot, COMBINE=combine, GGUF=gguf, LISTED=listed,
                     BO=ti.TOKEN_BLOCK_O, KP=top_k)
    if mma:
        constants.update(WIDEN=False, M=ti.MMA_TILE)
    else:
        constants.update(INTERPRETED=False)
    return _ops(_compile(k.token_mma_kernel if mma else k.token_kernel, TOKEN_ARGS, types,
                         constants, dict(num_warps=warps or ti.token_warps(top_k),
                                         num_stages=ti.TOKEN_STAGES, enable_fp_fusion=False),
                         arch))


def _chains(top_k, warps):
    """(slot, row) chains a thread of the float32 token kernel holds."""
    return max(1, top_k * ti.TOKEN_BLOCK_O // (32 * warps))


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("combine", [True, False])
@pytest.mark.parametrize("warps", [1, 4])
def test_the_float32_token_kernel_loads_each_rows_bytes_at_once_and_runs_its_fma_chains(
        arch, combine, warps):
    """Each (slot, row) chain a thread holds: a group's 16 bytes in one 128-bit load, its
    columns split in registers (no shared memory), 32 fmas a group (one warp: a thread
    holds a row's four slots, four independent chains); the combine's
    multiply and add rounded apart (launched without contraction), as the torch path
    rounds them."""
    ops = _token_ptx("fp32", combine, False, arch, warps=warps)
    chains = _chains(4, warps)
    assert ops.get("ld.global.v4.b32", 0) == chains, ops
    if not combine or warps == 1:  # (the combine gathers a slot's row across warps
        # through shared memory, once a program: not in the loop over groups)
        assert not any(op.startswith(("st.shared", "ld.shared")) for op in ops), ops
    assert ops.get("fma.rn.f32") == 32 * chains, ops
    if combine:
        assert ops.get("add.rn.f32", 0) >= 1 and ops.get("mul.rn.f32", 0) >= 1, ops


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("x_type", ["bf16", "fp16"])
def test_16_bit_latents_run_on_the_tensor_cores(arch, x_type):
    from mxfp4x._core import triton_kernels as k

    ptx_type = {"bf16": ".bf16.", "fp16": ".f16."}[x_type]
    token = _token_ptx(x_type, True, True, arch)
    # the token kernel: a group's two k-steps of 16 for each n8 block of rows, every slot
    mmas = sum(n for op, n in token.items() if op.startswith("mma.sync") and ptx_type in op)
    assert mmas == 4 * 2 * ti.TOKEN_BLOCK_O // 8 // ti.token_warps(4), token
    _token_ptx(x_type, True, True, arch, top_k=16)  # Kimi K3's 16 slots
    assert _stack_bytes() == 0  # no spills (one warp for them spills)
    types = [f"*{x_type}", "*i64", "*i64", "*i64", "*i64", "*i32", "*u8", "*u8", "*fp32"] + \
        ["i32"] * 9
    tile = _ops(_compile(k.tile_kernel, TILE_ARGS, types,
                         dict(GGUF=False, LISTED=False, MMA=True, WIDEN=False,
                              TILE=ti.MMA_TILE, BO=ti.BLOCK_O),
                         dict(num_warps=4, enable_fp_fusion=True), arch))
    # a pair's bits are the instruction's: the same one in both kernels (sm_90's wgmma, which
    # Triton may pick from 64 rows, would make them follow the kernel)
    tensor_ops = {op for op in tile if op.startswith(("mma", "wgmma", "tcgen05"))}
    assert tensor_ops == {op for op in token if op.startswith(("mma", "wgmma", "tcgen05"))}
    assert len(tensor_ops) == 1 and ptx_type in next(iter(tensor_ops)), tensor_ops


@pytest.mark.parametrize("gguf", [False, True])
def test_every_layout_compiles(gguf):
    """GGUF's 17-byte blocks (byte loads: nothing is aligned) and float32 tiles."""
    from mxfp4x._core import triton_kernels as k

    ops = _token_ptx("fp32", True, False, 90, gguf=gguf, top_k=16)  # Kimi K3's 16 slots
    assert ops.get("fma.rn.f32") == 32 * _chains(16, ti.token_warps(16)), ops
    assert _stack_bytes() == 0  # no spills
    types = ["*fp32", "*i64", "*i64", "*i64", "*i64", "*i32", "*u8", "*u8", "*fp32"] + \
        ["i32"] * 9
    tile = _ops(_compile(k.tile_kernel, TILE_ARGS, types,
                         dict(GGUF=gguf, LISTED=False, MMA=False, WIDEN=False,
                              TILE=ti.TILE_TOKENS, BO=ti.BLOCK_O),
                         dict(num_warps=4, enable_fp_fusion=True), 90))
    assert not any(op.startswith(("mma", "wgmma")) for op in tile), tile  # never TF32


@pytest.mark.parametrize("x_type,mma", [("fp32", False), ("bf16", True)])
@pytest.mark.parametrize("per_slot", [False, True])
@pytest.mark.parametrize("listed", [False, True])
@pytest.mark.parametrize("combine", [False, True])
def test_every_token_kernel_variant_compiles(x_type, mma, per_slot, listed, combine):
    """Per-slot latents, expert lists (their table's addresses as pointers), the slots'
    own output (16-bit: rounded in the kernel) and the combine, for sm_90: stacked experts
    without spills; lists, whose per-slot strides are tensors, within a small stack frame
    (8-144 bytes measured, Kimi K3's 16 slots included)."""
    ops = _token_ptx(x_type, combine, mma, 90, per_slot=per_slot, listed=listed)
    assert ops.get("st.global.b32", 0) + ops.get("st.global.b16", 0) + sum(
        n for op, n in ops.items() if op.startswith("st.global.v")) >= 1, ops
    assert _stack_bytes() <= (256 if listed else 0)
    if listed:
        _token_ptx(x_type, combine, mma, 90, per_slot=per_slot, listed=True, top_k=16)
        assert _stack_bytes() <= 256
