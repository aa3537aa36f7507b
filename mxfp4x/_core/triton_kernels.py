"""The Triton kernels of the GPU path (``mxfp4x._core.triton_impl`` says what they compute and
launches them); imported on the first call that runs them, so that ``import mxfp4x``
never imports Triton."""
import triton
import triton.language as tl


@triton.jit
def _e2m1(code):
    """int32 nibble codes -> their float32 values: the magnitude bits placed in the
    exponent and mantissa give the value times 2^-126 (0.5 a subnormal), exactly."""
    bits = ((code & 7) << 22) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e+37  # 2^126


@triton.jit
def _e8m0(s):
    """int32 scale bytes -> 2^(s - 127) as float32: 0 the subnormal 2^-127, 255 NaN."""
    bits = tl.where(s == 0, 0x400000, s << 23)
    return tl.where(s == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def _row_pointers(packed_ptr, scale_ptr, expert, rows, stride_pe, stride_po, stride_pg,
                  stride_se, stride_so, stride_sg, LISTED: tl.constexpr):
    """Expert ``expert``'s ``rows``: the address of each row's first group and first
    scale byte, and the group strides that step them (64-bit addresses, whatever the
    strides): from the stacked tensors' strides, or from tables of (address, row stride,
    group stride) per expert (lists of tensors, each with its own strides)."""
    if LISTED:
        w = tl.load(packed_ptr + 3 * expert).to(tl.pointer_type(tl.uint8))
        w_row = tl.load(packed_ptr + 3 * expert + 1)
        w_group = tl.load(packed_ptr + 3 * expert + 2)
        s = tl.load(scale_ptr + 3 * expert).to(tl.pointer_type(tl.uint8))
        s_row = tl.load(scale_ptr + 3 * expert + 1)
        s_group = tl.load(scale_ptr + 3 * expert + 2)
    else:
        w = packed_ptr + expert * stride_pe
        s = scale_ptr + expert * stride_se
        w_row, w_group, s_row, s_group = stride_po, stride_pg, stride_so, stride_sg
    return w + rows * w_row, w_group, s + rows * s_row, s_group


@triton.jit
def _group_scale(w_at, s_at, in_rows, GGUF: tl.constexpr):
    """The current group's 2^(s - 127) per row: the scale byte leads a GGUF block, or
    sits in the scale tensor."""
    if GGUF:
        s = tl.load(w_at, mask=in_rows, other=127)
    else:
        s = tl.load(s_at, mask=in_rows, other=127)
    return _e8m0(s.to(tl.int32))


@triton.jit
def tile_kernel(x_ptr, x_row_ptr, out_row_ptr, tile_expert_ptr, tile_start_ptr,
                tile_count_ptr, packed_ptr, scale_ptr, out_ptr,
                n_groups, d_out, stride_x, stride_pe, stride_po, stride_pg,
                stride_se, stride_so, stride_sg, GGUF: tl.constexpr,
                LISTED: tl.constexpr, TILE: tl.constexpr, BO: tl.constexpr):
    """Up to TILE pairs of one expert (a tile) times BO rows: tl.dot per group."""
    tile = tl.program_id(0)
    count = tl.load(tile_count_ptr + tile)
    if count > 0:
        expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
        start = tl.load(tile_start_ptr + tile).to(tl.int64)
        slots = tl.arange(0, TILE)
        in_tile = slots < count
        x_rows = tl.load(x_row_ptr + start + slots, mask=in_tile, other=0)
        rows = tl.program_id(1).to(tl.int64) * BO + tl.arange(0, BO)
        in_rows = rows < d_out
        w_at, w_group, s_at, s_group = _row_pointers(
            packed_ptr, scale_ptr, expert, rows, stride_pe, stride_po, stride_pg, stride_se,
            stride_so, stride_sg, LISTED)
        # position q of a group's 32 holds the low (q even) or high nibble of byte
        # q // 2: element q (gpt-oss) or element q // 2 + 16 (q % 2) (GGUF), whose
        # latent the step loads at q
        q = tl.arange(0, 32)
        x_cols = (q // 2 + 16 * (q % 2)) if GGUF else q
        byte_cols = tl.arange(0, 16) + (1 if GGUF else 0)
        x_at = x_ptr + x_rows[:, None] * stride_x + x_cols[None, :]
        acc = tl.zeros((TILE, BO), dtype=tl.float32)
        for _ in range(0, n_groups):
            byte = tl.load(w_at[:, None] + byte_cols[None, :], mask=in_rows[:, None],
                           other=0).to(tl.int32)
            scale = _group_scale(w_at, s_at, in_rows, GGUF)
            code = tl.reshape(tl.join(byte & 15, byte >> 4), (BO, 32))
            w = _e2m1(code) * scale[:, None]  # (BO, 32), exact
            x = tl.load(x_at, mask=in_tile[:, None], other=0.0)
            acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
            w_at += w_group
            s_at += s_group
            x_at += 32
        out_rows = tl.load(out_row_ptr + start + slots, mask=in_tile, other=0)
        tl.store(out_ptr + out_rows[:, None] * d_out + rows[None, :], acc,
                 mask=in_tile[:, None] & in_rows[None, :])


@triton.jit
def pair_kernel(x_ptr, sel_ptr, out_ptr, packed_ptr, scale_ptr, n_groups, d_out,
                top_k, stride_x, stride_pe, stride_po, stride_pg, stride_se,
                stride_so, stride_sg, PER_SLOT: tl.constexpr, GGUF: tl.constexpr,
                LISTED: tl.constexpr, BO: tl.constexpr):
    """One pair times BO rows: the tile kernel's multiply-adds, in its order (position
    q = 0..31 of each group, groups in order), one fma at a time."""
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(sel_ptr + pair)
    x_row = pair if PER_SLOT else pair // top_k
    rows = tl.program_id(1).to(tl.int64) * BO + tl.arange(0, BO)
    in_rows = rows < d_out
    w_at, w_group, s_at, s_group = _row_pointers(
        packed_ptr, scale_ptr, expert, rows, stride_pe, stride_po, stride_pg, stride_se,
        stride_so, stride_sg, LISTED)
    x_at = x_ptr + x_row * stride_x
    acc = tl.zeros((BO,), dtype=tl.float32)
    for _ in range(0, n_groups):
        scale = _group_scale(w_at, s_at, in_rows, GGUF)
        for j in tl.static_range(16):
            byte = tl.load(w_at + j + (1 if GGUF else 0), mask=in_rows,
                           other=0).to(tl.int32)
            x_lo = tl.load(x_at + (j if GGUF else 2 * j)).to(tl.float32)
            x_hi = tl.load(x_at + (j + 16 if GGUF else 2 * j + 1)).to(tl.float32)
            acc = tl.fma(x_lo, _e2m1(byte & 15) * scale, acc)
            acc = tl.fma(x_hi, _e2m1(byte >> 4) * scale, acc)
        w_at += w_group
        s_at += s_group
        x_at += 32
    tl.store(out_ptr + pair * d_out + rows, acc, mask=in_rows)
