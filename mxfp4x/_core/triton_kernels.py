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
def _decoded(byte, scale, MMA: tl.constexpr):
    """A group's (BO, 16) bytes -> (BO, 32) weights at positions q (low nibble of byte
    q // 2 at q even, high at q odd): scaled float32 (exact), or for the tensor cores
    the bare E2M1 values in the latents' 16-bit type (exact; the scale applies to the
    group's partial sums)."""
    code = tl.reshape(tl.join(byte & 15, byte >> 4), (byte.shape[0], 32))
    if MMA:
        return _e2m1(code)
    return _e2m1(code) * scale[:, None]


@triton.jit
def _group_step(acc, x, byte, scale, MMA: tl.constexpr, WIDEN: tl.constexpr):
    """acc (M, BO) after one group: x (M, 32) latents at positions q, byte (BO, 16).
    float32: one IEEE tl.dot from acc, a chain of fmas over q in order per element.
    MMA: the group's 32 products of E2M1 values (16-bit, exact) and 16-bit latents summed
    by the tensor cores into a fresh float32 partial, then acc = fma(partial, scale,
    acc): a power of two, so the group's order of sums is the instruction's alone.
    WIDEN (Triton's interpreter only, whose tl.dot multiplies bf16 operands as their
    uint16 storage): both operands widened to float32 first, exactly."""
    if MMA:
        w = _decoded(byte, scale, MMA).to(x.dtype)
        if WIDEN:
            partial = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)),
                             input_precision="ieee")
        else:
            partial = tl.dot(x, tl.trans(w), out_dtype=tl.float32)
        return tl.fma(partial, scale[None, :], acc)
    w = _decoded(byte, scale, MMA)
    return tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")


@triton.jit
def tile_kernel(x_ptr, x_row_ptr, out_row_ptr, tile_expert_ptr, tile_start_ptr,
                tile_count_ptr, packed_ptr, scale_ptr, out_ptr,
                n_groups, d_out, stride_x, stride_pe, stride_po, stride_pg,
                stride_se, stride_so, stride_sg, GGUF: tl.constexpr,
                LISTED: tl.constexpr, MMA: tl.constexpr, WIDEN: tl.constexpr,
                TILE: tl.constexpr, BO: tl.constexpr):
    """Up to TILE pairs of one expert (a tile) times BO rows, group by group
    (``_group_step``)."""
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
            x = tl.load(x_at, mask=in_tile[:, None], other=0.0)
            acc = _group_step(acc, x, byte, scale, MMA, WIDEN)
            w_at += w_group
            s_at += s_group
            x_at += 32
        out_rows = tl.load(out_row_ptr + start + slots, mask=in_tile, other=0)
        tl.store(out_ptr + out_rows[:, None] * d_out + rows[None, :], acc,
                 mask=in_tile[:, None] & in_rows[None, :])


@triton.jit
def _rounded(y, out_ptr, INTERPRETED: tl.constexpr):
    """float32 -> the output's dtype, to nearest even (a GPU's conversion: torch's bits,
    NaN included); under Triton's interpreter, whose cast to bf16 truncates, bf16 by
    integer operations (the same values; NaN as torch's CPU conversion writes it)."""
    if INTERPRETED and out_ptr.dtype.element_ty == tl.bfloat16:
        b = y.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        b = tl.where(y != y, 0x7FC0, b)  # NaN stays NaN
        return b.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return y.to(out_ptr.dtype.element_ty)


@triton.jit
def _halves(t):
    """(KP, BO, 2n) -> its even and its odd last-axis entries, (KP, BO, n) each (held by one
    thread)."""
    return tl.split(tl.reshape(t, (t.shape[0], t.shape[1], t.shape[2] // 2, 2)))


@triton.jit
def _fma_byte(acc, col, x_at, j: tl.constexpr, scale, GGUF: tl.constexpr):
    """The two multiply-adds of byte j of a group (its low nibble at position 2j, its
    high one at 2j + 1), one fma each, in the tile kernel's order."""
    x_lo = tl.load(x_at + (j if GGUF else 2 * j)).to(tl.float32)
    x_hi = tl.load(x_at + (j + 16 if GGUF else 2 * j + 1)).to(tl.float32)
    acc = tl.fma(x_lo, _e2m1(col & 15) * scale, acc)
    return tl.fma(x_hi, _e2m1(col >> 4) * scale, acc)


@triton.jit
def _fma_group(acc, byte, x_at, scale, GGUF: tl.constexpr):
    """One group's 32 multiply-adds for a (KP, BO) tile of (slot, row) chains from their
    (KP, BO, 16) bytes, loaded as one block (a vector load per row) and split into
    columns in registers; x_at a latents' address, or one per slot (KP, 1)."""
    b0, b1 = _halves(byte)  # byte j = d0 + 2 d1 + 4 d2 + 8 d3 is leaf b{d0}{d1}{d2}{d3}
    b00, b01 = _halves(b0)
    b10, b11 = _halves(b1)
    b000, b001 = _halves(b00)
    b010, b011 = _halves(b01)
    b100, b101 = _halves(b10)
    b110, b111 = _halves(b11)
    c0, c8 = tl.split(b000)
    c4, c12 = tl.split(b001)
    c2, c10 = tl.split(b010)
    c6, c14 = tl.split(b011)
    c1, c9 = tl.split(b100)
    c5, c13 = tl.split(b101)
    c3, c11 = tl.split(b110)
    c7, c15 = tl.split(b111)
    acc = _fma_byte(acc, c0, x_at, 0, scale, GGUF)
    acc = _fma_byte(acc, c1, x_at, 1, scale, GGUF)
    acc = _fma_byte(acc, c2, x_at, 2, scale, GGUF)
    acc = _fma_byte(acc, c3, x_at, 3, scale, GGUF)
    acc = _fma_byte(acc, c4, x_at, 4, scale, GGUF)
    acc = _fma_byte(acc, c5, x_at, 5, scale, GGUF)
    acc = _fma_byte(acc, c6, x_at, 6, scale, GGUF)
    acc = _fma_byte(acc, c7, x_at, 7, scale, GGUF)
    acc = _fma_byte(acc, c8, x_at, 8, scale, GGUF)
    acc = _fma_byte(acc, c9, x_at, 9, scale, GGUF)
    acc = _fma_byte(acc, c10, x_at, 10, scale, GGUF)
    acc = _fma_byte(acc, c11, x_at, 11, scale, GGUF)
    acc = _fma_byte(acc, c12, x_at, 12, scale, GGUF)
    acc = _fma_byte(acc, c13, x_at, 13, scale, GGUF)
    acc = _fma_byte(acc, c14, x_at, 14, scale, GGUF)
    return _fma_byte(acc, c15, x_at, 15, scale, GGUF)


@triton.jit
def _token_slots(sel_ptr, packed_ptr, scale_ptr, n_experts, d_out, top_k, stride_pe,
                 stride_po, stride_pg, stride_se, stride_so, stride_sg,
                 LISTED: tl.constexpr, KP: tl.constexpr, BO: tl.constexpr):
    """A token kernel program's token, rows and KP slots: the pairs, which slots are real
    (in_k) and have an id in [0, n_experts) (valid: else expert 0 is read in its place),
    the (slot, row) cells to load (live), and each cell's row pointers (_row_pointers)."""
    token = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1).to(tl.int64) * BO + tl.arange(0, BO)
    ks = tl.arange(0, KP)
    in_k = ks < top_k
    pairs = token * top_k + ks
    expert = tl.load(sel_ptr + pairs, mask=in_k, other=0).to(tl.int64)
    valid = (expert >= 0) & (expert < n_experts)
    expert = tl.where(valid, expert, 0)
    live = in_k[:, None] & (rows < d_out)[None, :]
    w_at, w_group, s_at, s_group = _row_pointers(
        packed_ptr, scale_ptr, expert[:, None], rows[None, :], stride_pe, stride_po,
        stride_pg, stride_se, stride_so, stride_sg, LISTED)
    return token, rows, ks, in_k, pairs, valid, live, w_at, w_group, s_at, s_group


@triton.jit
def _token_store(acc, valid, token, rows, ks, in_k, pairs, live, mix_ptr, shared_ptr,
                 out_ptr, d_out, top_k, stride_mix, stride_shared, COMBINE: tl.constexpr,
                 INTERPRETED: tl.constexpr, KP: tl.constexpr):
    """A token kernel's (KP, BO) products out: NaN for a bad id's slot; COMBINE: shared +
    sum_k mix_k * product_k, each product times its weight, then added, in order k =
    0..K-1 (the launch without contraction: the torch path's roundings), rounded once;
    else each slot's products in out[t, k]."""
    acc = tl.where(valid[:, None], acc, float("nan"))
    if COMBINE:
        y = tl.load(shared_ptr + token * stride_shared + rows, mask=rows < d_out,
                    other=0.0).to(tl.float32)
        weighted = acc * tl.load(mix_ptr + token * stride_mix + ks, mask=in_k,
                                 other=0.0).to(tl.float32)[:, None]
        for k in tl.static_range(KP):
            if k < top_k:  # slot k's row out of the tile: plus -0.0s, which change nothing
                y = y + tl.sum(tl.where(ks[:, None] == k, weighted, -0.0), axis=0)
        tl.store(out_ptr + token * d_out + rows, _rounded(y, out_ptr, INTERPRETED),
                 mask=rows < d_out)
    else:
        tl.store(out_ptr + pairs[:, None] * d_out + rows[None, :],
                 _rounded(acc, out_ptr, INTERPRETED), mask=live)


@triton.jit
def token_kernel(x_ptr, sel_ptr, mix_ptr, shared_ptr, out_ptr, packed_ptr, scale_ptr,
                 n_experts, n_groups, d_out, top_k, stride_x, stride_mix, stride_shared,
                 stride_pe, stride_po, stride_pg, stride_se, stride_so, stride_sg,
                 PER_SLOT: tl.constexpr, COMBINE: tl.constexpr, GGUF: tl.constexpr,
                 LISTED: tl.constexpr, INTERPRETED: tl.constexpr, KP: tl.constexpr,
                 BO: tl.constexpr):
    """Float32 latents: one token's K slots (KP, a power of two, at least K) times BO rows,
    every (slot, row) its own chain: the tile kernel's fmas in its order, one at a time,
    the slots side by side.  COMBINE: shared + sum_k mix_k * product_k, each product
    (float32) times its weight, then added, in order k = 0..K-1 (launched without
    contraction: the torch path's roundings), stored in the output's dtype; else each
    slot's product in out[t, k].  An expert id outside [0, n_experts) reads expert 0 and
    gives NaN in its place: never another expert's rows, never memory outside the
    weights."""
    (token, rows, ks, in_k, pairs, valid, live, w_at, w_group, s_at,
     s_group) = _token_slots(sel_ptr, packed_ptr, scale_ptr, n_experts, d_out, top_k,
                             stride_pe, stride_po, stride_pg, stride_se, stride_so,
                             stride_sg, LISTED, KP, BO)
    byte_cols = tl.arange(0, 16) + (1 if GGUF else 0)
    if PER_SLOT:
        x_at = x_ptr + tl.where(in_k, pairs, 0)[:, None] * stride_x
    else:
        x_at = x_ptr + token * stride_x
    acc = tl.zeros((KP, BO), dtype=tl.float32)
    for _ in range(0, n_groups):
        byte = tl.load(w_at[:, :, None] + byte_cols[None, None, :], mask=live[:, :, None],
                       other=0).to(tl.int32)
        scale = _group_scale(w_at, s_at, live, GGUF)
        acc = _fma_group(acc, byte, x_at, scale, GGUF)
        w_at += w_group
        s_at += s_group
        x_at += 32
    _token_store(acc, valid, token, rows, ks, in_k, pairs, live, mix_ptr, shared_ptr, out_ptr,
                 d_out, top_k, stride_mix, stride_shared, COMBINE, INTERPRETED, KP)


@triton.jit
def token_mma_kernel(x_ptr, sel_ptr, mix_ptr, shared_ptr, out_ptr, packed_ptr, scale_ptr,
                     n_experts, n_groups, d_out, top_k, stride_x, stride_mix, stride_shared,
                     stride_pe, stride_po, stride_pg, stride_se, stride_so, stride_sg,
                     PER_SLOT: tl.constexpr, COMBINE: tl.constexpr, GGUF: tl.constexpr,
                     LISTED: tl.constexpr, WIDEN: tl.constexpr, KP: tl.constexpr,
                     M: tl.constexpr, BO: tl.constexpr):
    """16-bit latents: one token's K slots (KP, a power of two, at least K) times BO rows,
    each slot the tile kernel's tensor-core steps (``_group_step``) on an M-row tile whose
    row 0 is the token (a tile's rows do not mix), the slots side by side (one batched
    tl.dot a group: K independent chains); the combine, the output and bad ids as in
    ``token_kernel``."""
    (token, rows, ks, in_k, pairs, valid, live, w_at, w_group, s_at,
     s_group) = _token_slots(sel_ptr, packed_ptr, scale_ptr, n_experts, d_out, top_k,
                             stride_pe, stride_po, stride_pg, stride_se, stride_so,
                             stride_sg, LISTED, KP, BO)
    byte_cols = tl.arange(0, 16) + (1 if GGUF else 0)
    q = tl.arange(0, 32)
    x_cols = (q // 2 + 16 * (q % 2)) if GGUF else q
    first = tl.arange(0, M) == 0
    x_row = tl.where(in_k, pairs, 0) if PER_SLOT else token + 0 * ks
    # (KP, M, 32): row 0 of slot k's tile is its latents, the other rows zeros
    x_at = x_ptr + x_row[:, None, None] * stride_x + x_cols[None, None, :] + \
        tl.zeros((1, M, 1), dtype=tl.int64)
    x_mask = in_k[:, None, None] & first[None, :, None]
    acc = tl.zeros((KP, M, BO), dtype=tl.float32)
    for _ in range(0, n_groups):
        byte = tl.load(w_at[:, :, None] + byte_cols[None, None, :], mask=live[:, :, None],
                       other=0).to(tl.int32)
        scale = _group_scale(w_at, s_at, live, GGUF)
        x = tl.load(x_at, mask=x_mask, other=0.0)
        code = tl.reshape(tl.join(byte & 15, byte >> 4), (KP, BO, 32))
        w = tl.permute(_e2m1(code).to(x.dtype), (0, 2, 1))  # (KP, 32, BO), exact
        if WIDEN:
            partial = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            partial = tl.dot(x, w, out_dtype=tl.float32)
        acc = tl.fma(partial, scale[:, None, :], acc)
        w_at += w_group
        s_at += s_group
        x_at += 32
    # row 0 of each slot's tile: plus -0.0s, which leave every value as it is
    acc0 = tl.sum(tl.where(first[None, :, None], acc, -0.0), axis=1)
    _token_store(acc0, valid, token, rows, ks, in_k, pairs, live, mix_ptr, shared_ptr,
                 out_ptr, d_out, top_k, stride_mix, stride_shared, COMBINE, WIDEN, KP)
