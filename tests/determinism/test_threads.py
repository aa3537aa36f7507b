"""Determinism: bit-identical across thread counts, repeated calls and batches.  The
threads themselves: one parallel mechanism for every step (mxfp4x._core.cpu.parallel_tasks),
one owner of the policy (mxfp4x._core.threads), and steps that really run on the threads
asked for, in every threaded build (the normal OpenMP one, and the pthreads one of the
.ci/run lane)."""
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import mxfp4x
from mxfp4x._core import arguments as _arguments
from mxfp4x._core import cpu as _cpu
from mxfp4x._core import cpu_impl as _cpu_impl
from mxfp4x._core import probes as _probes
from mxfp4x._core import threads as _threads
from mxfp4x._core.format import accumulation_dtype
from mxfp4x.testing.layers import random_layer

THREADED = _threads.backend() != "serial"


def _cpus():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("n_tokens", [1, 37])
def test_bitwise_equal_across_thread_counts(isa, rng, dtype, n_tokens):
    layer = random_layer(rng, n_tokens, 4, 6, 300, 9, dtype=dtype, repeat_expert=True)
    results = [mxfp4x.mxfp4_experts(**layer, num_threads=n, isa=isa) for n in (1, 2, 3, 1)]
    for r in results[1:]:
        assert torch.equal(r.view(torch.uint8), results[0].view(torch.uint8))


def test_batch_invariance(isa, rng):
    # a token's row does not depend on the batch around it (gemv vs panel paths)
    layer = random_layer(rng, 40, 4, 3, 150, 7)
    full = mxfp4x.mxfp4_experts(**layer, isa=isa)
    for t in (0, 17, 39):
        alone = mxfp4x.mxfp4_experts(**{k: v[t:t + 1] if k != "packed_weights" and
                                        k != "scale_bytes" else v for k, v in layer.items()},
                                     isa=isa)
        assert torch.equal(alone[0], full[t])
    seven = mxfp4x.mxfp4_experts(**{k: v[10:17] if k not in ("packed_weights", "scale_bytes")
                                    else v for k, v in layer.items()}, isa=isa)
    assert torch.equal(seven, full[10:17])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_long_batches_run_in_token_chunks_with_the_same_bits(isa, rng, monkeypatch, dtype):
    # a long prefill runs in chunks of tokens (flat memory): forced down to chunks of 3
    # tokens here, every product (per token, per slot, per-slot latents, the transposed
    # one, the mixture weights' gradient; operands converted or copied chunk by chunk)
    # must keep its bits, and a chunk boundary must not drop or repeat a token
    from mxfp4x._core import cpu_impl as _cpu_impl
    layer = random_layer(rng, 11, 3, 5, 70, 5, dtype=dtype, repeat_expert=True)
    w = (layer["packed_weights"], layer["scale_bytes"])
    x, sel, mix = layer["latent_tokens"], layer["selected_experts"], layer["mixture_weights"]
    slot_x = torch.from_numpy(rng.standard_normal((11, 3, x.shape[1]))).to(dtype)
    grad = torch.from_numpy(rng.standard_normal((11, 70))).to(dtype)
    # strided latents, int32 ids, a shared output of another dtype, a broadcast gradient
    wide_x = torch.stack((x, -x), dim=2).flatten(1)[:, ::2]
    other = torch.float32 if dtype == torch.float64 else torch.float64
    shared_other = layer["shared_output"].to(other)

    def mix_grad():
        m = mix.detach().clone().requires_grad_(True)
        mxfp4x.mxfp4_experts(x, *w, sel, m, layer["shared_output"], isa=isa).backward(grad)
        return m.grad

    calls = {
        "tokens": lambda: mxfp4x.mxfp4_experts(**layer, isa=isa),
        "slots": lambda: mxfp4x.mxfp4_experts_slots(x, *w, sel, isa=isa),
        "slot_latents": lambda: mxfp4x.mxfp4_experts(slot_x, *w, sel, mix,
                                                     layer["shared_output"], isa=isa),
        "grad": lambda: torch.ops.mxfp4x.mxfp4_experts_grad_latents(grad, *w, sel, mix, x,
                                                                    isa=isa),
        "staged": lambda: mxfp4x.mxfp4_experts(wide_x, *w, sel.int(), mix, shared_other,
                                               isa=isa),
        "grad_broadcast": lambda: torch.ops.mxfp4x.mxfp4_experts_grad_latents(
            grad[:1].expand(11, 70), *w, sel, mix, x, isa=isa),
        "mix_grad": mix_grad,
    }
    whole = {name: call() for name, call in calls.items()}
    # the mixture weights' gradient: g . W x per slot, W x in the accumulation dtype
    acc = accumulation_dtype(dtype)
    slots = mxfp4x.mxfp4_experts_slots(x.to(acc), *w, sel, isa=isa)
    want = (slots * grad.to(acc).unsqueeze(1)).sum(-1).to(mix.dtype)
    assert torch.equal(whole["mix_grad"], want)
    monkeypatch.setattr(_cpu_impl, "_CHUNK_BYTES", 1)
    monkeypatch.setattr(_cpu_impl, "_CHUNK_WEIGHT_SHARE", 1 << 40)
    monkeypatch.setattr(_cpu_impl, "_MIN_CHUNK_TOKENS", 3)
    assert _cpu_impl._chunk_bound(_cpu_impl.experts_of(*w)) == 1
    assert len(_cpu_impl._chunks(11, 4, 1)) == 4
    for name, call in calls.items():
        chunked = call()
        assert chunked.shape == whole[name].shape and chunked.dtype == whole[name].dtype
        assert torch.equal(chunked.view(torch.uint8), whole[name].view(torch.uint8)), name


def test_token_chunks_are_as_few_and_as_equal_as_the_bound_allows(monkeypatch):
    """The chunks cover [0, T) in order, each within the bound's token count, as few as it
    allows, and of equal length but the last (512 tokens under a bound of 435: 256 + 256,
    not 435 + 77)."""
    from mxfp4x._core import cpu_impl as _cpu_impl
    monkeypatch.setattr(_cpu_impl, "_MIN_CHUNK_TOKENS", 3)
    assert _cpu_impl._chunks(512, 1, 435) == [(0, 256), (256, 512)]
    assert _cpu_impl._chunks(0, 1, 435) == [(0, 0)]
    for n in (1, 2, 434, 435, 436, 870, 871, 1000, 4321):
        chunks = _cpu_impl._chunks(n, 1, 435)
        assert chunks[0][0] == 0 and chunks[-1][1] == n, (n, chunks)
        assert all(chunks[i][1] == chunks[i + 1][0] for i in range(len(chunks) - 1)), chunks
        sizes = [t1 - t0 for t0, t1 in chunks]
        assert max(sizes) <= 435 and len(chunks) == -(-n // 435), (n, sizes)
        assert all(sz == sizes[0] for sz in sizes[:-1]) and sizes[0] - sizes[-1] < len(sizes)


def test_large_experts_allow_chunks_of_a_share_of_their_bytes(isa):
    """Experts of more than 64 x the chunk bound's bytes allow a chunk 1/64 of their own
    bytes: Kimi K3's 896 w1 experts (5.2 GB) run a bf16 T = 512 as one chunk (as two,
    each read most of the experts); gpt-oss-20b's keep the fixed bound."""
    from types import SimpleNamespace
    k3_w1 = SimpleNamespace(n_experts=896, d_out=3072, n_groups=112)
    gate_up = SimpleNamespace(n_experts=32, d_out=5760, n_groups=90)
    weights = 896 * 3072 * 112 * 17
    assert _cpu_impl._chunk_bound(k3_w1) == weights // 64 > _cpu_impl._CHUNK_BYTES
    assert _cpu_impl._chunk_bound(gate_up) == _cpu_impl._CHUNK_BYTES
    per_token = _cpu_impl._forward_token_bytes(torch.bfloat16, 112, 3072, 16, 1, 1, 2, isa)
    if _cpu.has_bf16_unit(isa):  # every pair's latents gathered: 115 KB per token
        assert len(_cpu_impl._chunks(512, per_token, _cpu_impl._CHUNK_BYTES)) == 2
    assert len(_cpu_impl._chunks(512, per_token, _cpu_impl._chunk_bound(k3_w1))) == 1


@pytest.mark.parametrize("n_threads", [1, 2, 3, 8, 64])
def test_a_16_bit_result_counts_its_float32_sums_per_thread(isa, n_threads):
    """A 16-bit result's float32 sums live in the driver, per running thread (one task's
    columns of every row of the chunk), so the chunk bound counts those columns -- not
    whole float32 rows: gpt-oss-20b gate/up in bfloat16 on 2 threads then runs T = 512 as
    one chunk (as two of 256 it read every expert twice)."""
    base = 64 if isa == "amx" else 48  # the ISAs' own task rows (the headers' TILE_ROWS)
    for d_out in (1, 47, 48, 200, 2880, 5760, 7168):
        for bf16 in (False, True):
            cols = _cpu.forward_sums_columns(d_out, n_threads, isa=isa, bf16=bf16)
            tasks = -(-d_out // base)
            # every running thread's task, never fewer columns than the rows or threads
            assert cols >= min(d_out, n_threads * base), (d_out, bf16, cols)
            if d_out < 2 * 8 * base * n_threads:  # tasks too few to widen
                assert cols == min(n_threads, tasks) * base, (d_out, bf16, cols)
            # no more per token than whole float32 rows, far less where threads are few
            if n_threads <= 2 and d_out >= 2880:
                assert cols <= d_out // 4, (d_out, bf16, cols)
    # gpt-oss-20b gate/up, bf16, 2 threads: tasks of 7 (a bf16 unit; amx: 5) tiles or 4
    wide = {True: 320, False: 336}[isa == "amx"] if _cpu.has_bf16_unit(isa) else 192
    assert _cpu.forward_sums_columns(5760, 2, isa=isa, bf16=True) == 2 * wide
    gate_up = dict(n_groups=90, d_out=5760, top_k=4, k_in=1, k_out=1)

    def per_token(dtype, threads):
        return _cpu_impl._forward_token_bytes(dtype, gate_up["n_groups"], gate_up["d_out"],
                                              gate_up["top_k"], gate_up["k_in"],
                                              gate_up["k_out"], threads, isa)
    pairs = 4 * _cpu_impl._pair_bytes(4)
    # float32 latents: a float32 result, no sums; float16: the sums of its threads' tasks
    assert per_token(torch.float32, n_threads) == 4 * 2880 + pairs
    assert per_token(torch.float16, n_threads) == 4 * (2880 + _cpu.forward_sums_columns(
        5760, n_threads, isa=isa)) + pairs
    gathered = 4 * (2880 * 2 + 1) if _cpu.has_bf16_unit(isa) else 4 * 2880
    assert per_token(torch.bfloat16, n_threads) == gathered + 4 * _cpu.forward_sums_columns(
        5760, n_threads, isa=isa, bf16=True) + pairs
    if n_threads <= 2:
        for dtype in (torch.bfloat16, torch.float16):
            assert len(_cpu_impl._chunks(512, per_token(dtype, n_threads),
                                         _cpu_impl._CHUNK_BYTES)) == 1, dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_a_long_call_chunks_by_its_own_token_bytes(isa, rng, monkeypatch, dtype):
    """The forward call sizes its chunks by _forward_token_bytes of its own shape, threads
    and ISA, plus the chunk copies it makes of operands the driver cannot read as they
    are (here 16-bit mixture weights, converted to float32), under _chunk_bound of its
    experts (a call that counted whole float32 result rows, or the latents' float32 copy
    a bf16 unit never makes, fails here)."""
    layer = random_layer(rng, 9, 3, 5, 70, 5, dtype=dtype, repeat_expert=True)
    seen = []
    chunks = _cpu_impl._chunks

    def spy(n_tokens, bytes_per_token, bound):
        seen.append((n_tokens, bytes_per_token, bound))
        return chunks(n_tokens, bytes_per_token, bound)
    monkeypatch.setattr(_cpu_impl, "_chunks", spy)
    monkeypatch.setattr(_cpu_impl, "_MIN_CHUNK_TOKENS", 3)
    mxfp4x.mxfp4_experts(**layer, num_threads=2, isa=isa)
    ex = _cpu_impl.experts_of(layer["packed_weights"], layer["scale_bytes"])
    per_token = _cpu_impl._forward_token_bytes(dtype, ex.n_groups, ex.d_out, 3, 1, 1,
                                               _threads.resolve(2), isa)
    staged = 0 if dtype == torch.float32 else 3 * 4  # 3 weights per token, as float32
    assert seen == [(9, per_token + staged, _cpu_impl._chunk_bound(ex))]


# ---- the steps around the product: many row tasks, the same bits ---------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_layout_steps_in_many_tasks_keep_their_bits(isa, rng, dtype):
    # 700 tokens x 512 latents: the latents go into the kernel layout (forward) and dx out
    # of it (transposed) in several row tasks; any thread count, and each token alone (one
    # task), give the same bits
    layer = random_layer(rng, 700, 2, 4, 40, 16, dtype=dtype, repeat_expert=True)
    w = (layer["packed_weights"], layer["scale_bytes"])
    sel, mix, x = layer["selected_experts"], layer["mixture_weights"], layer["latent_tokens"]
    grad = torch.from_numpy(rng.standard_normal((700, 40))).to(dtype)

    def run(n, rows=slice(None)):
        y = mxfp4x.mxfp4_experts(x[rows], *w, sel[rows], mix[rows],
                                 layer["shared_output"][rows], num_threads=n, isa=isa)
        dx = torch.ops.mxfp4x.mxfp4_experts_grad_latents(grad[rows], *w, sel[rows],
                                                         mix[rows], x[rows], num_threads=n,
                                                         isa=isa)
        return y, dx

    first = run(1)
    for n in (2, 3):
        for a, b in zip(run(n), first, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), n
    for t in (0, 350, 699):
        for a, b in zip(run(2, slice(t, t + 1)), first, strict=True):
            assert torch.equal(a[0].view(torch.uint8), b[t].view(torch.uint8)), t


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_combine_in_many_tasks_is_the_ordered_sum(rng, dtype):
    # 300 tokens x 3 slots x 200 outputs: several token tasks; numpy's one rounding per
    # product and per sum, in ascending expert order, is the driver's arithmetic exactly
    n_tokens, top_k, d_out = 300, 3, 200
    sel = rng.integers(0, 5, (n_tokens, top_k)).astype(np.int64)
    dots = rng.standard_normal((n_tokens * top_k, d_out)).astype(dtype)
    mix = rng.random((n_tokens, top_k)).astype(dtype)
    base = rng.standard_normal((n_tokens, d_out)).astype(dtype)
    want = base.copy()
    order = np.argsort(sel, axis=1, kind="stable")
    for j in range(top_k):
        p = np.arange(n_tokens) * top_k + order[:, j]
        want = want + mix.reshape(-1)[p][:, None] * dots[p]
    for n in (1, 2, 3):
        out = base.copy()
        _cpu.combine(out, dots, sel, mix, n_threads=n)
        assert np.array_equal(out.view(np.uint8), want.view(np.uint8)), n


# ---- one owner of the policy -------------------------------------------------------------

def test_thread_policy_has_one_owner():
    assert _threads.backend() in _threads.BACKENDS
    assert _threads.have_openmp() == (_threads.backend() == "openmp")
    assert _threads.MAX_THREADS == _threads.max_threads() == _cpu.MAX_THREADS == 256
    torch_default = min(torch.get_num_threads(), _threads.MAX_THREADS)
    assert _threads.resolve(None) == _threads.resolve(0) == torch_default
    assert _threads.resolve(3) == 3 and _threads.resolve(10 ** 6) == _threads.MAX_THREADS
    info = mxfp4x.backend_info()
    assert (info["threads"], info["openmp"], info["num_threads"]) == (
        _threads.backend(), _threads.have_openmp(), torch_default)
    # the user-facing check keeps its errors and takes the cap from the owner
    assert _arguments.check_num_threads(None) == 0
    assert _arguments.check_num_threads(10 ** 6) == _threads.MAX_THREADS
    with pytest.raises(ValueError, match="num_threads"):
        _arguments.check_num_threads(0)
    with pytest.raises(TypeError, match="num_threads"):
        _arguments.check_num_threads(2.0)
    assert not hasattr(_arguments, "MAX_THREADS")


def test_torch_threads_restores_the_count_however_the_block_ends():
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    with _threads.torch_threads(other):
        assert torch.get_num_threads() == other
    assert torch.get_num_threads() == before
    with pytest.raises(KeyError), _threads.torch_threads(other):
        raise KeyError
    assert torch.get_num_threads() == before


def test_driver_boundary_takes_only_resolved_thread_counts():
    out = np.zeros((2, 3), np.float32)
    args = (np.zeros((4, 3), np.float32), np.zeros((2, 2), np.int64), np.ones((2, 2), np.float32))
    for bad in (0, _threads.MAX_THREADS + 1):
        with pytest.raises(ValueError, match="n_threads"):
            _cpu.combine(out, *args, n_threads=bad)
        with pytest.raises(ValueError, match="n_threads"):
            _probes.fma_peak(n_threads=bad, seconds=0.001)
        with pytest.raises(ValueError, match="n_threads"):
            _probes.bf16_dot_peak(n_threads=bad, seconds=0.001)


def test_one_parallel_mechanism_in_the_sources():
    """prange / parallel() appear once, in cpu.parallel_tasks: every step (the product's
    tasks, the layout copies, combine, the probes) goes through it."""
    here = Path(mxfp4x.__file__).parent / "_core"
    sources = sorted(here.glob("*.pyx")) + sorted(here.glob("*.pxi"))
    if not sources:
        pytest.skip("the .pyx sources are not installed beside the package")
    code = {p.name: re.sub(r"#[^\n]*|\"\"\".*?\"\"\"", "", p.read_text(), flags=re.S)
            for p in sources}
    assert {"cpu.pyx", "probes.pyx", "cpu_runtime.pxi"} <= set(code)
    found = {(name, m) for name, text in code.items()
             for m in re.findall(r"\b(prange|parallel)\(", text)}
    # cpu_runtime.pxi is part of cpu.pyx (included there)
    assert found == {("cpu_runtime.pxi", "prange"), ("cpu_runtime.pxi", "parallel")}, found
    assert sum(text.count("prange(") for text in code.values()) == 1


def test_probes_are_built_like_the_driver():
    assert _probes.built_with() == {"threads": _cpu.threads_backend(),
                                    "cflags": _cpu.build_info()["cflags"]}


# ---- every step on the threads asked for ---------------------------------------------------

def test_every_parallel_step_runs_on_the_threads_asked():
    """The forward product's tasks, the latents' layout copy, the transposed result's
    copy back and combine: each on 2 OS threads given 2 (1 in a serial build; given 1,
    always 1).  These steps ran serially in the pthreads builds before they went through
    the one mechanism."""
    steps = ("prepare", "tasks", "finish", "combine")
    assert _probes.step_threads(1) == dict.fromkeys(steps, 1)
    if not THREADED:
        assert _probes.step_threads(2) == dict.fromkeys(steps, 1)
        return
    if _cpus() < 2:
        pytest.skip("one CPU: a second thread may never get a task")
    best = dict.fromkeys(steps, 0)
    for _ in range(25):  # a busy machine can starve a thread for a whole (short) step
        got = _probes.step_threads(2)
        best = {s: max(best[s], got[s]) for s in steps}
        if all(v == 2 for v in best.values()):
            break
    assert best == dict.fromkeys(steps, 2), best


@pytest.mark.skipif(_threads.backend() != "openmp" or not os.path.isdir("/proc/self/task"),
                    reason="libgomp's thread pool, seen through Linux's /proc/self/task")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_calls_keep_their_openmp_team(rng, dtype):
    """Every parallel step of a call opens the call's whole team, however few tasks it
    has: libgomp ends the pool's threads that a smaller team leaves out and starts new
    ones for the next larger team, which cost a one-token bf16 call on 16 cores half its
    time.  Here the latents' layout copy (float32: 48 rows of 2048, two tasks) and the
    bf16 unit's gather run before a main step of more tasks than threads, and a dense
    product of two row tiles between the calls; calls in a row must then keep the OS
    threads of the first (an ended thread id is an ended thread; threads others start
    do not count)."""
    layer = random_layer(rng, 48, 2, 4, 512, 64, dtype=dtype)
    x = np.ones((1, 64), np.float32)
    w = np.full((128, 64), 0x3F80, np.uint16)  # bf16 ones: 2 tiles of 64 rows
    out = np.zeros((1, 128), np.float32)

    def tasks():
        return set(os.listdir("/proc/self/task"))

    mxfp4x.mxfp4_experts(**layer, num_threads=4)
    before = tasks()
    for _ in range(3):
        _cpu.dense_bf16(x, w, out, n_threads=4)
        mxfp4x.mxfp4_experts(**layer, num_threads=4)
    assert before <= tasks(), (before, tasks())
    assert (out == 64).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_a_call_leaves_no_work_to_torchs_threads(rng, dtype):
    """num_threads bounds a call's threads: the shared output's conversion into the sums and
    their rounding into a 16-bit result (and, for the latents' gradient, the gradient's
    conversion and dx's rounding) run in the driver's tasks, not as torch copies of the
    (T, O) / (T, I) rows on torch's own threads (which kept a second CPU busy at
    num_threads=1)."""
    layer = random_layer(rng, 9, 2, 3, 37, 2, dtype=dtype)
    layer["shared_output"] = layer["shared_output"].to(torch.bfloat16 if dtype ==
                                                       torch.float32 else torch.float32)
    want = mxfp4x.mxfp4_experts(**layer, num_threads=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        got = mxfp4x.mxfp4_experts(**layer, num_threads=1)
    assert torch.equal(got, want)
    grad = torch.randn(9, 37).to(dtype)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof_t:
        dx = _cpu_impl.grad_latents(grad, layer["packed_weights"], layer["scale_bytes"],
                                    layer["selected_experts"], layer["mixture_weights"],
                                    layer["latent_tokens"], 1)
    assert dx.dtype == dtype and torch.isfinite(dx).all()
    for p, rows in ((prof, ([9, 37],)), (prof_t, ([9, 37], [9, 64]))):
        events = [(e.name, e.input_shapes) for e in p.events()]
        assert any("to" in name for name, _ in events)  # the profiler saw the call's ops
        moved = [name for name, shapes in events if any(r in shapes for r in rows) and
                 any(w in name for w in ("copy", "clone", "add", "fill", "mul"))]
        assert not moved, moved


def test_fma_peak_scales_with_threads():
    """fma_peak runs one loop per thread through the one mechanism, so 2 threads give
    clearly more than 1 where 2 CPUs exist (the pthreads builds measured one thread's
    peak before).  The best of a few tries: other processes share the CPUs."""
    if not THREADED:
        pytest.skip(f"a {_threads.backend()} build runs one thread")
    if _cpus() < 2:
        pytest.skip("fewer than 2 CPUs")
    ratios = []
    for _ in range(5):  # the scalar loop: native in every build (the emulation lane's
        # default, SIMDe's AVX-512, is a loop of library calls that does not show the threads)
        one = _probes.fma_peak(isa="scalar", n_threads=1, seconds=0.1)
        two = _probes.fma_peak(isa="scalar", n_threads=2, seconds=0.1)
        ratios.append(round(two / one, 2))
        if two > 1.5 * one:
            return
    # one thread's peak (about 1.0) is what a serial build measured: that fails.  Between
    # that and 1.5 the two loops did run at once but the CPUs did not double (SMT siblings
    # under a VM, a busy host): not this code's fault, so not a failure
    assert max(ratios) > 1.15, f"2 threads / 1 gave {ratios}: the loops ran one at a time"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    pytest.skip(f"2 threads ran at once but gave only {ratios} of one thread's peak (load "
                f"{load:.1f} on {_cpus()} CPUs)")


@pytest.mark.skipif(_threads.backend() != "pthreads",
                    reason="threads.h's workers run only in pthreads builds (macOS, Linux "
                           "aarch64; MXFP4X_THREADS=pthreads, the .ci/run lane)")
def test_pthreads_build_runs_on_its_own_threads():
    assert not _threads.have_openmp() and "-fopenmp" not in _cpu.build_info()["cflags"]
    assert _probes.threads_used(1) == 1
    if _cpus() >= 2:
        assert max(_probes.threads_used(2) for _ in range(3)) == 2
    # threads.h caps what it starts at MXFP4X_MAX_THREADS, whatever a caller asks
    assert _probes.threads_used(_threads.MAX_THREADS, n_tasks=4) <= 4


def _same_bits_on_1_2_4_threads_and_alone(layer, isa, tokens):
    """The call's bits on 1 thread equal those on 2 and 4 and, for ``tokens``, those of
    each token alone; its first rows match the reference."""
    from mxfp4x.testing.layers import assert_matches_reference
    wide = mxfp4x.mxfp4_experts(**layer, num_threads=1, isa=isa)
    for n in (2, 4):
        y = mxfp4x.mxfp4_experts(**layer, num_threads=n, isa=isa)
        assert torch.equal(y.view(torch.uint8), wide.view(torch.uint8)), n
    for t in tokens:
        alone = mxfp4x.mxfp4_experts(**{k: v if k in ("packed_weights", "scale_bytes")
                                        else v[t:t + 1] for k, v in layer.items()}, isa=isa)
        assert torch.equal(alone[0].view(torch.uint8), wide[t].view(torch.uint8)), t
    assert_matches_reference(wide[:4], {k: v if k in ("packed_weights", "scale_bytes")
                                        else v[:4] for k, v in layer.items()})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_wide_tiles_keep_the_bits(isa, rng, dtype):
    # experts with many tokens (the panel path) run in wider row tiles when the rows allow
    # it for the threads asked: 1 thread gets 4x tiles here (the last one 105 rows wide),
    # 2 threads 2x, 4 threads 1x; expert 3 has 3 pairs (the gemv path inside the wide
    # tiles); one token alone takes the gemv path.  Same bits everywhere, and the
    # reference's values
    layer = random_layer(rng, 90, 2, 4, 1641, 3, dtype=dtype)
    layer["selected_experts"][:] = torch.from_numpy(rng.integers(0, 3, (90, 2)))
    layer["selected_experts"][:3, 1] = 3
    _same_bits_on_1_2_4_threads_and_alone(layer, isa, (0, 45, 89))


def test_wide_tiles_of_the_fused_bf16_path_keep_the_bits(isa, rng):
    # bf16 latents on a bf16 unit: experts of 5 or more tokens widen the tiles even on the
    # fused path (5-20 tokens here: fused on a Zen 5, on either side of the switch
    # elsewhere); 1, 2 and 4 threads, tokens alone, and the reference's values
    layer = random_layer(rng, 40, 2, 8, 1641, 3, dtype=torch.bfloat16)
    # tokens per expert fixed (the routing drawn at random could leave the range): the
    # 80 slots sorted by expert, token t taking slots t and t + 40 (two experts, as no
    # expert has 40 slots), then the experts' names and the tokens' order shuffled
    counts = np.array([5, 6, 8, 10, 11, 13, 17, 10])
    slots = np.repeat(np.arange(8), counts)
    pairs = np.stack([slots[:40], slots[40:]], axis=1)
    sel = rng.permutation(8)[pairs][rng.permutation(40)]
    layer["selected_experts"][:] = torch.from_numpy(sel)
    assert (sel[:, 0] != sel[:, 1]).all()
    assert sorted(np.bincount(sel.ravel(), minlength=8)) == sorted(counts)
    _same_bits_on_1_2_4_threads_and_alone(layer, isa, (0, 17, 39))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_batch_invariance_at_the_gemv_panel_switch(isa, rng, dtype):
    # expert 0 gets exactly the gemv path's most tokens, expert 1 one more (the panel
    # path, or on a bf16 unit its own: amx's tiles above 4, avx512bf16's panel above 12,
    # 32 on an AMD Zen 5),
    # expert 2 one token: every token's row is the one it gets alone
    m = _cpu.gemv_max_tokens(isa, bf16=dtype == torch.bfloat16)
    n = 2 * m + 2
    layer = random_layer(rng, n, 1, 3, 61, 3, dtype=dtype)
    layer["selected_experts"][:, 0] = torch.tensor([0] * m + [1] * (m + 1) + [2])
    full = mxfp4x.mxfp4_experts(**layer, isa=isa)
    for t in (0, m - 1, m, n - 2, n - 1):
        alone = mxfp4x.mxfp4_experts(**{k: v if k in ("packed_weights", "scale_bytes")
                                        else v[t:t + 1] for k, v in layer.items()}, isa=isa)
        assert torch.equal(alone[0].view(torch.uint8), full[t].view(torch.uint8)), t
