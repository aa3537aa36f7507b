"""What a hostile caller found around the core op: weights replaced under a module's cached
tables, working memory that grew with the pairs of one expert, torch.compile with ``isa=``,
zero sizes, stride-0 views, uint64 ids, thread requests, typed checkpoint bytes.

Anything that could crash the interpreter (a use-after-free) or exhaust the machine runs in
a subprocess with a timeout, so a regression fails its test instead of the suite.
"""
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import mxfp4x
from mxfp4x.testing.layers import random_layer


def _run(code, timeout=240, **env):
    """Run ``code`` in a fresh interpreter (``env``: more environment variables); its
    stdout, or a failure with its output."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="2", **env))
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


# ---- KimiK3Experts: the weights are module state ------------------------------------------

def _k3_weights(rng, n_experts, d_latent, d_ff):
    def mats(rows, cols):
        return ([torch.from_numpy(rng.integers(0, 256, (rows, cols // 2), np.uint8))
                 for _ in range(n_experts)],
                [torch.from_numpy(rng.integers(118, 134, (rows, cols // 32), np.uint8))
                 for _ in range(n_experts)])
    return mats(d_ff, d_latent), mats(d_ff, d_latent), mats(d_latent, d_ff)


def _k3_inputs(rng, n_tokens, top_k, n_experts, d_latent):
    h = torch.from_numpy(rng.standard_normal((n_tokens, d_latent))).float()
    sel = torch.from_numpy(rng.integers(0, n_experts, (n_tokens, top_k)))
    w = torch.from_numpy(rng.random((n_tokens, top_k))).float()
    return h, sel, w


# random KimiK3Experts weights in a fresh interpreter (the tests below add to it)
_K3_SETUP = """
        import gc, numpy as np, torch
        from mxfp4x.nn import KimiK3Experts
        rng = np.random.default_rng({seed})
        E, L, F = {E}, {L}, {F}
        def mats(rows, cols):
            return ([torch.from_numpy(rng.integers(0, 256, (rows, cols // 2), np.uint8))
                     for _ in range(E)],
                    [torch.from_numpy(rng.integers(118, 134, (rows, cols // 32), np.uint8))
                     for _ in range(E)])
        w1, w3, w2 = mats(F, L), mats(F, L), mats(L, F)
"""


def test_replaced_expert_weights_are_seen_and_never_freed_under_the_kernels():
    # the first CPU call builds the driver's tables; a weight replaced afterwards (and the old
    # tensor collected) must be what the next call reads: no stale bytes, no freed memory,
    # the same bytes as the autograd path and as a module built with the new weights
    out = _run(_K3_SETUP.format(seed=7, E=4, L=4096, F=512) + """
        ex = KimiK3Experts(w1, w3, (list(w2[0]), list(w2[1])))
        h = torch.from_numpy(rng.standard_normal((3, L))).float()
        sel = torch.tensor([[0, 1], [2, 0], [0, 0]])
        w = torch.rand(3, 2)
        with torch.no_grad():
            before = ex(h, sel, w)
        new = torch.from_numpy(rng.integers(0, 256, (L, F // 2), np.uint8))
        ex.get_submodule("0.w2").weight_packed = new.clone()
        del w2[0][0]
        gc.collect()
        for _ in range(3):  # freed pages get reused: allocate over them
            junk = [torch.full((L, F // 2), 0xFF, dtype=torch.uint8) for _ in range(8)]
        with torch.no_grad():
            after = ex(h, sel, w)
        fresh = KimiK3Experts(w1, w3, ([new] + w2[0], w2[1]))
        with torch.no_grad():
            expected = fresh(h, sel, w)
        grad_path = ex(h.clone().requires_grad_(), sel, w).detach()
        assert not torch.equal(before, after)
        assert torch.equal(after, expected) and torch.equal(grad_path, expected)
        try:
            ex.down_packed[0] = new  # the tuple the kernels get cannot be edited behind them
        except TypeError:
            print("OK")
    """)
    assert out.strip() == "OK"


def test_weights_given_new_memory_in_place_are_seen_and_never_freed_under_the_kernels():
    # ``.data =`` and ``.set_()`` give a buffer other memory without a module-level
    # change: the tables of a first call pointed into the freed memory (garbage or NaN
    # from the next forward); each call now checks the experts it reads
    out = _run(_K3_SETUP.format(seed=11, E=3, L=1024, F=512) + """
        ex = KimiK3Experts(*(([t.clone() for t in p], [t.clone() for t in s])
                             for p, s in (w1, w3, w2)))
        h = torch.from_numpy(rng.standard_normal((3, L))).float()
        sel = torch.tensor([[0, 1], [2, 0], [1, 1]])
        w = torch.rand(3, 2)
        with torch.no_grad():
            ex(h, sel, w)  # the tables are built
            n1, n3 = mats(F, L), mats(F, L)
            ex.get_submodule("0.w1").weight_packed.data = n1[0][0].clone()
            ex.get_submodule("1.w3").weight_scale.set_(n3[1][1].clone())
            gc.collect()
            for _ in range(3):  # freed pages get reused: allocate over them
                junk = [torch.full((F, L // 2), 0xFF, dtype=torch.uint8) for _ in range(8)]
            after = ex(h, sel, w)
            w1[0][0], w3[1][1] = n1[0][0], n3[1][1]
            expected = KimiK3Experts(w1, w3, w2)(h, sel, w)
            assert torch.equal(after, expected), (after - expected).abs().max()
            # the expert-parallel owner's entry point too
            rows, ids = h[:2], torch.tensor([2, 1])
            ex.get_submodule("2.w2").weight_packed.data = n1[0][0].new_zeros((L, F // 2))
            gc.collect()
            assert torch.equal(ex.mlp(rows, ids)[0], torch.zeros(L))
        print("OK")
    """)
    assert out.strip() == "OK"


def test_k3_expert_matrices_and_experts_put_in_place_are_seen(rng):
    """A matrix module or a whole expert put in place after a first call (its tables
    built) is what the next call reads: a replaced matrix module below the expert's own
    module was not seen (the call kept the old weights)."""
    from mxfp4x.models._expert_state import ExpertMatrix, _ExpertWeights

    E, L, F = 3, 64, 96
    (g, gs), (u, us), (d, ds) = _k3_weights(rng, E, L, F)
    ex = mxfp4x.nn.KimiK3Experts((g, gs), (u, us), (d, ds))
    h, sel, w = _k3_inputs(rng, 6, 2, E, L)
    sel[0] = torch.tensor([0, 1])  # experts 0 and 1 are read
    with torch.no_grad():
        before = ex(h, sel, w)
        (g2, gs2), (u2, us2), (d2, ds2) = _k3_weights(rng, 2, L, F)
        ex.get_submodule("0").w1 = ExpertMatrix(g2[0], gs2[0])
        g[0], gs[0] = g2[0], gs2[0]
        after = ex(h, sel, w)
        assert not torch.equal(before, after)
        assert torch.equal(after, mxfp4x.nn.KimiK3Experts((g, gs), (u, us), (d, ds))(h, sel, w))
        ex.add_module("1", _ExpertWeights(ExpertMatrix(g2[1], gs2[1]),
                                          ExpertMatrix(u2[1], us2[1]),
                                          ExpertMatrix(d2[1], ds2[1])))
        g[1], gs[1], u[1], us[1], d[1], ds[1] = g2[1], gs2[1], u2[1], us2[1], d2[1], ds2[1]
        again = ex(h, sel, w)
        assert torch.equal(again, mxfp4x.nn.KimiK3Experts((g, gs), (u, us), (d, ds))(h, sel, w))
        # and a matrix replaced in that new expert (linked to the module by the call above)
        ex.get_submodule("1").w2 = ExpertMatrix(d[0], ds[0])
        d[1], ds[1] = d[0], ds[0]
        assert torch.equal(ex(h, sel, w),
                           mxfp4x.nn.KimiK3Experts((g, gs), (u, us), (d, ds))(h, sel, w))


def test_k3_experts_copy_and_pickle_after_a_call(rng):
    """A module that has run (its cached tables hold a lock and the driver's objects)
    deep-copies, pickles and saves as before its first call."""
    import copy
    import io
    import pickle

    E, L, F = 3, 64, 96
    ex = mxfp4x.nn.KimiK3Experts(*_k3_weights(rng, E, L, F))
    h, sel, w = _k3_inputs(rng, 5, 2, E, L)
    with torch.no_grad():
        y = ex(h, sel, w)
        for other in (copy.deepcopy(ex), pickle.loads(pickle.dumps(ex))):
            assert torch.equal(other(h, sel, w), y)
        buf = io.BytesIO()
        torch.save(ex, buf)
        buf.seek(0)
        assert torch.equal(torch.load(buf, weights_only=False)(h, sel, w), y)
        assert torch.equal(ex(h, sel, w), y)


def test_k3_experts_state_dict_load_and_to(rng):
    E, L, F = 3, 64, 96
    a = mxfp4x.nn.KimiK3Experts(*_k3_weights(rng, E, L, F))
    b = mxfp4x.nn.KimiK3Experts(*_k3_weights(rng, E, L, F))
    h, sel, w = _k3_inputs(rng, 5, 2, E, L)
    with torch.no_grad():
        ya, yb = a(h, sel, w), b(h, sel, w)  # both have built their tables
    assert not torch.equal(ya, yb)
    state = a.state_dict()
    assert sorted(state) == sorted(f"{e}.{p}.weight_{k}" for e in range(E)
                                   for p in ("w1", "w3", "w2") for k in ("packed", "scale"))
    b.load_state_dict(state)  # in place: same memory, new bytes
    with torch.no_grad():
        assert torch.equal(b(h, sel, w), ya)
    c = mxfp4x.nn.KimiK3Experts(*_k3_weights(rng, E, L, F))
    with torch.no_grad():
        c(h, sel, w)
    c.load_state_dict(state, assign=True)  # new tensors: the tables are rebuilt
    with torch.no_grad():
        assert torch.equal(c(h, sel, w), ya)
        assert torch.equal(c.to(torch.float64)(h, sel, w), ya)  # byte buffers stay uint8


def test_k3_experts_checks_its_inputs_as_the_op_does(rng):
    E, L, F = 4, 64, 96
    ex = mxfp4x.nn.KimiK3Experts(*_k3_weights(rng, E, L, F))
    h, sel, w = _k3_inputs(rng, 3, 2, E, L)
    with torch.no_grad():
        ref = ex(h, sel, w)
        # integer and numpy latents are accepted as the op accepts them
        assert torch.equal(ex(h.numpy(), sel, w), ref)
        assert ex(h.round().int(), sel, w).dtype == torch.get_default_dtype()
    bad = [
        ((h, sel.float(), w), TypeError, "selected_experts"),
        ((h, torch.tensor([[0, 4], [0, 0], [1, 1]]), w), IndexError,
         r"expert id 4 is outside \[0, 4\)"),
        ((h[:2], sel, w), ValueError, "selected_experts"),
        ((h, sel, w[:2]), ValueError, "routing_weights"),
        ((h[:, :32], sel, w), ValueError, r"h: expected \(n_tokens, 64\)"),
        (("text", sel, w), TypeError, "h"),
    ]
    for args, kind, match in bad:
        with pytest.raises(kind, match=match):
            ex(*args)
    held = mxfp4x.nn.KimiK3Experts(*_k3_weights(rng, E, L, F), expert_range=(8, 12))
    with pytest.raises(IndexError, match="not held by this module"):
        held(h, sel, w)
    with pytest.raises(ValueError, match="isa='bogus'"):
        mxfp4x.nn.KimiK3Experts(*_k3_weights(rng, E, L, F), isa="bogus")
    with pytest.raises(ValueError, match="beta"):
        mxfp4x.nn.KimiK3Experts(*_k3_weights(rng, E, L, F), beta=0)
    w1, w3, w2 = _k3_weights(rng, E, L, F)
    with pytest.raises(ValueError, match=r"w2\[1\]"):
        mxfp4x.nn.KimiK3Experts(w1, w3, (w2[0][:1] + [w2[0][1][:, :16]] + w2[0][2:],
                                         w2[1][:1] + [w2[1][1][:, :1]] + w2[1][2:]))


def test_situ_betas_come_from_the_config_and_are_never_guessed():
    from mxfp4x.models.kimi_k3 import situ_betas
    from mxfp4x.testing.kimi_k3 import k3_config
    text = k3_config()["text_config"]
    assert situ_betas(text) == (4.0, 25.0)
    assert situ_betas(dict(text, activation_situ_linear_beta=None)) == (4.0, None)
    for broken in ({k: v for k, v in text.items() if k != "activation_situ_beta"},
                   dict(text, activation_situ_beta=0), dict(text, activation_situ_beta=-1.0)):
        with pytest.raises(ValueError, match="activation_situ_beta"):
            situ_betas(broken)


# ---- the driver's working memory ----------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_working_memory_is_bounded_when_every_pair_goes_to_one_expert(dtype):
    # 100000 tokens x 16 slots, all routed to expert 0: the per-thread dot buffer and the
    # routing arrays used to grow with the pairs of the busiest expert (739 MiB here); in
    # bf16 a bf16 unit also gathers every pair's latents (98 MiB for the whole call) and
    # the driver keeps float32 sums of the 16-bit result, both per chunk
    out = _run(f"""
        import resource, torch, mxfp4x
        T, K, O = 100000, 16, 96
        g = torch.Generator().manual_seed(0)
        x = torch.randn(T, 32, generator=g).to(torch.{dtype})
        packed = torch.randint(0, 256, (2, O, 1, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(120, 130, (2, O, 1), dtype=torch.uint8, generator=g)
        sel = torch.zeros(T, K, dtype=torch.int64)
        mix = torch.rand(T, K, generator=g).to(x.dtype)
        shared = torch.randn(T, O, generator=g).to(x.dtype)
        mxfp4x.mxfp4_experts(x[:300], packed, scales, sel[:300], mix[:300], shared[:300],
                             num_threads=2)  # the runtime's own one-time allocations
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        y = mxfp4x.mxfp4_experts(x, packed, scales, sel, mix, shared, num_threads=2)
        grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        print(grew, y.numel() * y.element_size())
    """)
    grew, output = (int(v) for v in out.split())
    assert grew <= output + (48 << 20), f"grew {grew >> 20} MiB for a {output >> 20} MiB output"


# Operands the driver cannot read as they are (another dtype, not contiguous), and the
# backward's own arrays: each used to be converted or copied whole, outside the chunks
# (a float64 shared output for float32 latents: +73 MiB over 200000 more tokens; the
# mixture weights' gradient: (T, K, O) float32 slots and their product, 1.2 GiB for
# 100000 tokens of 16 slots), and chunk-sized copies made and freed chunk after chunk let
# glibc's heap grow with T too.  The peak is reset before each call (clear_refs), and
# glibc hands every block over 64 KiB back when it is freed (a fixed mmap threshold), so
# memory freed while the inputs were built cannot hide a call's growth.
_GROWTH_CASES = {
    "float64 shared output": "shared = shared.double()",
    "expanded shared output": "shared = shared[:1].expand(T, O)",
    "strided latents": "x = torch.randn(T, 2 * I, generator=g).to(x.dtype)[:, ::2]",
    "int32 expert ids": "sel = sel.int()",
    "int32 expert ids, with a gradient": "sel = sel.int(); mode = 'sum'",
    "broadcast gradient": "mode = 'sum'",
    "mixture weights' gradient": "mode = 'mix'",
}


@pytest.mark.parametrize("case", sorted(_GROWTH_CASES))
def test_working_memory_does_not_grow_with_the_tokens(case):
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak")
    out = _run(f"""
        import torch, mxfp4x
        T, K, O, I = 240000, 16, 96, 64
        g = torch.Generator().manual_seed(0)
        x = torch.randn(T, I, generator=g).to(torch.bfloat16)
        packed = torch.randint(0, 256, (2, O, I // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(120, 130, (2, O, I // 32), dtype=torch.uint8, generator=g)
        sel = torch.zeros(T, K, dtype=torch.int64)
        mix = torch.rand(T, K, generator=g).to(x.dtype)
        shared = torch.randn(T, O, generator=g).to(x.dtype)
        mode = "forward"
        {_GROWTH_CASES[case]}

        def status(key):
            with open("/proc/self/status") as f:
                return next(int(v.split()[1]) << 10 for v in f if v.startswith(key))

        def extra(n):  # the call's peak beyond what it returns (and the forward it needs)
            xs, ms = x[:n].detach(), mix[:n].detach()
            xs.requires_grad_(mode != "forward")
            ms.requires_grad_(mode == "mix")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            before = status("VmRSS:")
            y = mxfp4x.mxfp4_experts(xs, packed, scales, sel[:n], ms, shared[:n],
                                     num_threads=2)
            kept = y.numel() * y.element_size()
            if mode != "forward":
                (y.sum() if mode == "sum" else (y * y.detach()).sum()).backward()
                kept += xs.grad.numel() * xs.grad.element_size()
                if mode == "mix":  # y's gradient, and the weights' (float32, then rounded)
                    kept += y.numel() * y.element_size() + ms.numel() * 6
            return status("VmHWM:") - before - kept

        extra(300)  # the runtime's own one-time allocations
        print(extra(40000), extra(T))
    """, MALLOC_MMAP_THRESHOLD_="65536")
    small, large = (int(v) for v in out.split())
    assert large - small <= 16 << 20, \
        f"{case}: {small >> 20} MiB beside 40000 tokens, {large >> 20} MiB beside 240000"


def test_num_threads_beyond_the_cap_leaves_no_crowd_of_threads():
    out = _run("""
        import torch, mxfp4x
        from mxfp4x._core.threads import MAX_THREADS
        g = torch.Generator().manual_seed(0)
        packed = torch.randint(0, 256, (2, 6000, 1, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(120, 130, (2, 6000, 1), dtype=torch.uint8, generator=g)
        x = torch.randn(3, 32, generator=g)
        y = mxfp4x.mxfp4_experts(x, packed, scales, torch.zeros(3, 1, dtype=torch.int64),
                                 torch.ones(3, 1), torch.zeros(3, 6000), num_threads=10000)
        assert torch.equal(y, mxfp4x.mxfp4_experts(x, packed, scales,
                                                   torch.zeros(3, 1, dtype=torch.int64),
                                                   torch.ones(3, 1), torch.zeros(3, 6000),
                                                   num_threads=1))
        threads = int(next(line.split()[1] for line in open("/proc/self/status")
                           if line.startswith("Threads:")))
        print(threads, MAX_THREADS)
    """) if sys.platform.startswith("linux") else pytest.skip("reads /proc/self/status")
    threads, cap = (int(v) for v in out.split())
    # the cap's value is held in one test (test_threads.py's test_thread_policy_has_one_owner)
    assert threads <= cap + 16, (threads, cap)


# ---- torch.compile, zero sizes, strides, ids ----------------------------------------------

def test_compile_fullgraph_with_isa(rng):
    layer = random_layer(rng, 5, 2, 3, 64, 4)
    isa = mxfp4x.backend_info()["isas"][-1]
    compiled = torch.compile(lambda **kw: mxfp4x.mxfp4_experts(**kw, isa=isa), fullgraph=True)
    assert torch.equal(compiled(**layer), mxfp4x.mxfp4_experts(**layer, isa=isa))
    slots = torch.compile(lambda x, p, s, sel: mxfp4x.mxfp4_experts_slots(x, p, s, sel,
                                                                           isa=isa),
                          fullgraph=True)
    args = (layer["latent_tokens"], layer["packed_weights"], layer["scale_bytes"],
            layer["selected_experts"])
    assert torch.equal(slots(*args), mxfp4x.mxfp4_experts_slots(*args, isa=isa))


def _zero_cases(rng):
    x = torch.from_numpy(rng.standard_normal((3, 64))).float()
    sel = torch.tensor([[0, 1], [1, 1], [0, 0]])
    mix = torch.from_numpy(rng.random((3, 2))).float()
    listed0 = ([torch.zeros(0, 2, 16, dtype=torch.uint8)] * 2,
               [torch.zeros(0, 2, dtype=torch.uint8)] * 2)
    empty_in = (torch.zeros(2, 5, 0, 16, dtype=torch.uint8),
                torch.zeros(2, 5, 0, dtype=torch.uint8))
    return {
        "list d_out=0": lambda be, x=x: mxfp4x.mxfp4_experts(
            x, *listed0, sel, mix, torch.zeros(3, 0), backend=be),
        "list d_out=0 slots": lambda be, x=x: mxfp4x.mxfp4_experts_slots(
            x, *listed0, sel, backend=be),
        "per-slot latents (T, K, 0)": lambda be: mxfp4x.mxfp4_experts(
            torch.zeros(3, 2, 0), *empty_in, sel, mix, torch.ones(3, 5), backend=be),
        "per-slot latents (T, K, 0) slots": lambda be: mxfp4x.mxfp4_experts_slots(
            torch.zeros(3, 2, 0), *empty_in, sel, backend=be),
    }


@pytest.mark.parametrize("case", list(_zero_cases(np.random.default_rng(0))))
def test_zero_sizes_run_on_the_cpu_path_as_on_torch(rng, case):
    call = _zero_cases(rng)[case]
    got, expected = call("cpu"), call("torch")
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert torch.equal(got, expected)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_zero_size_gradients(rng, backend):
    x = torch.from_numpy(rng.standard_normal((3, 64))).float().requires_grad_()
    sel = torch.tensor([[0, 1], [1, 1], [0, 0]])
    packed, scales = torch.zeros(2, 0, 2, 16, dtype=torch.uint8), torch.zeros(2, 0, 2,
                                                                            dtype=torch.uint8)
    mxfp4x.mxfp4_experts_slots(x, packed, scales, sel, backend=backend).sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    x.grad = None
    mxfp4x.mxfp4_experts(x, list(packed.unbind(0)), list(scales.unbind(0)), sel,
                         torch.ones(3, 2), torch.zeros(3, 0), backend=backend).sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    xs = torch.zeros(3, 2, 0, requires_grad=True)
    empty = (torch.zeros(2, 5, 0, 16, dtype=torch.uint8), torch.zeros(2, 5, 0, dtype=torch.uint8))
    mxfp4x.mxfp4_experts(xs, *empty, sel, torch.ones(3, 2), torch.zeros(3, 5),
                         backend=backend).sum().backward()
    assert xs.grad.shape == (3, 2, 0)
    # no pairs (K = 0): the shared output passes through, untouched by latents holding inf
    xi = torch.full((3, 64), float("inf"), requires_grad=True)
    y = mxfp4x.mxfp4_experts(xi, torch.zeros(2, 5, 2, 16, dtype=torch.uint8),
                             torch.zeros(2, 5, 2, dtype=torch.uint8),
                             torch.zeros(3, 0, dtype=torch.int64), torch.ones(3, 0),
                             torch.ones(3, 5), backend=backend)
    assert torch.equal(y, torch.ones(3, 5))
    y.sum().backward()
    assert torch.equal(xi.grad, torch.zeros_like(xi))


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("view", ["row-stride-0", "expert-stride-0", "overlapping-rows"])
def test_stride_0_and_overlapping_byte_views_are_computed(rng, isa, backend, view):
    E, D, G = 3, 7, 2  # experts, d_out, groups
    base = torch.from_numpy(rng.integers(0, 256, E * D * G * 16 + 64, np.uint8))
    sb = torch.from_numpy(rng.integers(118, 135, E * D * G + 8, np.uint8))
    packed, scales = {
        "row-stride-0": (base[:E * G * 16].view(E, 1, G, 16).expand(E, D, G, 16),
                         sb[:E * G].view(E, 1, G).expand(E, D, G)),
        "expert-stride-0": (base[:D * G * 16].view(1, D, G, 16).expand(E, D, G, 16),
                            sb[:D * G].view(1, D, G).expand(E, D, G)),
        "overlapping-rows": (base.as_strided((E, D, G, 16), (D * 16, 16, 16, 1)),
                             sb.as_strided((E, D, G), (D, 1, 1))),
    }[view]
    x = torch.from_numpy(rng.standard_normal((5, G * 32))).float()
    sel = torch.from_numpy(rng.integers(0, E, (5, 2)))
    mix = torch.from_numpy(rng.random((5, 2))).float()
    shared = torch.from_numpy(rng.standard_normal((5, D))).float()
    kw = dict(backend=backend, isa=isa if backend == "cpu" else None)
    expected = mxfp4x.mxfp4_experts(x, packed.contiguous(), scales.contiguous(), sel, mix,
                                    shared, **kw)
    assert torch.equal(mxfp4x.mxfp4_experts(x, packed, scales, sel, mix, shared, **kw),
                       expected)
    assert torch.equal(mxfp4x.mxfp4_experts(x, list(packed.unbind(0)), list(scales.unbind(0)),
                                            sel, mix, shared, **kw), expected)


@pytest.mark.skipif(not hasattr(torch, "uint64"), reason="torch without uint64")
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_uint64_ids_at_or_above_2_63_are_reported_as_passed(backend):
    x, packed = torch.ones(1, 32), torch.zeros(2, 3, 1, 16, dtype=torch.uint8)
    scales = torch.zeros(2, 3, 1, dtype=torch.uint8)
    sel = torch.tensor([[2 ** 63 + 1]], dtype=torch.uint64)
    with pytest.raises(IndexError, match=f"expert id {2 ** 63 + 1} is outside"):
        mxfp4x.mxfp4_experts(x, packed, scales, sel, torch.ones(1, 1), torch.zeros(1, 3),
                             backend=backend)
    ok = torch.tensor([[1]], dtype=torch.uint64)
    assert mxfp4x.mxfp4_experts(x, packed, scales, ok, torch.ones(1, 1), torch.zeros(1, 3),
                                backend=backend).shape == (1, 3)


# ---- checkpoint loaders read typed bytes by view ------------------------------------------

def test_loaders_read_int8_typed_blocks_by_view(tmp_path, rng):
    from mxfp4x.checkpoints.safetensors import save_file
    E, F, H = 2, 64, 64
    gu = torch.from_numpy(rng.integers(0, 256, (E, 2 * F, H // 32, 16), np.uint8))
    gu_s = torch.from_numpy(rng.integers(118, 134, (E, 2 * F, H // 32), np.uint8))
    dn = torch.from_numpy(rng.integers(0, 256, (E, H, F // 32, 16), np.uint8))
    dn_s = torch.from_numpy(rng.integers(118, 134, (E, H, F // 32), np.uint8))
    bias = {"model.layers.0.mlp.experts.gate_up_proj_bias": torch.zeros(E, 2 * F),
            "model.layers.0.mlp.experts.down_proj_bias": torch.zeros(E, H)}
    p = "model.layers.0.mlp.experts."
    as_u8 = {p + "gate_up_proj_blocks": gu, p + "gate_up_proj_scales": gu_s,
             p + "down_proj_blocks": dn, p + "down_proj_scales": dn_s, **bias}
    as_i8 = {k: v.view(torch.int8) if v.dtype == torch.uint8 else v for k, v in as_u8.items()}
    save_file(as_u8, str(tmp_path / "u8.safetensors"))
    save_file(as_i8, str(tmp_path / "i8.safetensors"))
    h = torch.from_numpy(rng.standard_normal((3, H))).float()
    idx = torch.from_numpy(rng.integers(0, E, (3, 2)))
    w = torch.from_numpy(rng.random((3, 2))).float()
    ys = [mxfp4x.nn.GptOssExperts.from_checkpoint(str(tmp_path / f), 0)(h, idx, w)
          for f in ("u8.safetensors", "i8.safetensors")]
    assert torch.equal(ys[0], ys[1])
    banks = [mxfp4x.nn.MXFP4Experts.from_safetensors(str(tmp_path / f), p + "down_proj_blocks",
                                                     p + "down_proj_scales")
             for f in ("u8.safetensors", "i8.safetensors")]
    assert torch.equal(banks[0].packed_weights, banks[1].packed_weights)


def _tiny_op_args():
    x = torch.ones(3, 32)
    packed = torch.full((2, 1, 1, 16), 0x22, dtype=torch.uint8)
    packed[1] = 0x44
    scales = torch.full((2, 1, 1), 127, dtype=torch.uint8)
    return x, packed, scales


def test_direct_op_calls_are_checked_in_the_kernels_and_the_fake():
    """torch.ops.mxfp4x.* called directly: ids with other rows than the latents, float
    ids and mismatched mixture weights are errors naming the argument, in the CPU
    kernel and in the fake implementation alike (the fake's shape is the real one's)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    x, packed, scales = _tiny_op_args()
    op, slots = torch.ops.mxfp4x.mxfp4_experts, torch.ops.mxfp4x.mxfp4_experts_slots
    ids2 = torch.zeros(2, 1, dtype=torch.int64)
    bad = [
        ((x, packed, scales, ids2, torch.ones(2, 1), torch.zeros(2, 1)), ValueError,
         "selected_experts: expected 3 rows"),
        ((x[:2], packed, scales, torch.tensor([[0.9], [1.9]]), torch.ones(2, 1),
          torch.zeros(2, 1)), TypeError, "selected_experts: expected an integer"),
        ((x[:2], packed, scales, ids2, torch.ones(2, 2), torch.zeros(2, 1)), ValueError,
         "mixture_weights: expected shape (2, 1)"),
        ((x[:2], packed, scales, ids2, torch.ones(2, 1), torch.zeros(2, 3)), ValueError,
         "shared_output: expected shape (2, 1)"),
    ]
    for args, kind, text in bad:
        with pytest.raises(kind, match=re.escape(text)):
            op(*args)
        with FakeTensorMode() as mode, pytest.raises(kind, match=re.escape(text)):
            op(*[mode.from_tensor(a) for a in args])
    with pytest.raises(ValueError, match="selected_experts: expected 3 rows"):
        slots(x, packed, scales, ids2)
    good = op(x[:2], packed, scales, ids2, torch.ones(2, 1), torch.zeros(2, 1))
    assert good.tolist() == [[32.0], [32.0]]


def test_meta_tensors_on_the_torch_backend_and_with_integer_bytes():
    """Meta tensors (shape inference) work on every backend, integer-typed bytes too:
    there are no values to check or route by."""
    args = [torch.zeros(2, 32), torch.zeros(3, 4, 1, 16, dtype=torch.uint8),
            torch.zeros(3, 4, 1, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.long),
            torch.ones(2, 1), torch.zeros(2, 4)]
    meta = [t.to("meta") for t in args]
    for backend in ("auto", "torch"):
        y = mxfp4x.mxfp4_experts(*meta, backend=backend)
        assert y.is_meta and tuple(y.shape) == (2, 4)
        s = mxfp4x.mxfp4_experts_slots(*meta[:4], backend=backend)
        assert s.is_meta and tuple(s.shape) == (2, 1, 4)
    y = mxfp4x.mxfp4_experts(meta[0], meta[1].long(), *meta[2:])
    assert y.is_meta and tuple(y.shape) == (2, 4)


def test_numpy_views_torch_cannot_view_are_copied(rng):
    """A numpy field view whose strides are no multiple of its item size (a structured
    array's column) is read through a copy, with the bits of a contiguous array."""
    args = random_layer(rng, 3, 2, 4, 64, 2, dtype=torch.float32)
    rec = np.zeros((3, 64), dtype=[("x", "<f4"), ("flag", "u1")])
    rec["x"] = args["latent_tokens"].numpy()
    got = mxfp4x.mxfp4_experts(**{**args, "latent_tokens": rec["x"]})
    assert torch.equal(got, mxfp4x.mxfp4_experts(**args))


def test_functorch_reverse_transforms_get_a_clear_error_on_the_kernels(rng):
    """torch.func.grad on the compiled kernels' op is refused with what to use instead;
    backend='torch' and .backward() give the gradient."""
    args = random_layer(rng, 2, 2, 3, 32, 1, dtype=torch.float32)
    x = args.pop("latent_tokens")

    def loss(backend):
        return lambda t: mxfp4x.mxfp4_experts(t, **args, backend=backend).sum()
    with pytest.raises(NotImplementedError, match=r"backward\(\)"):
        torch.func.grad(loss("auto"))(x)
    want = torch.func.grad(loss("torch"))(x)
    xr = x.clone().requires_grad_()
    loss("auto")(xr).backward()
    # the two backends sum in other orders: equal within float32 rounding of the terms
    scale = float(want.abs().max()) + 1.0
    assert torch.allclose(xr.grad, want, rtol=0, atol=1e-4 * scale)


def test_mxfp4experts_module_checks_before_it_builds(rng):
    """nn.MXFP4Experts: sizes that are no non-negative integers, 0-D latents without a
    shared output and numpy bytes in from_packed give errors naming the argument (or
    work), never torch's internal messages."""
    from mxfp4x import nn
    for args, name in (((-1, 4, 32), "n_experts"), ((2, 4, 32.0), "d_in"),
                       ((True, 4, 32), "n_experts")):
        with pytest.raises(ValueError, match=f"^{name}: expected a non-negative integer"):
            nn.MXFP4Experts(*args)
    m = nn.MXFP4Experts.from_float(torch.from_numpy(rng.standard_normal((2, 4, 32))).float())
    with pytest.raises(ValueError, match="latent_tokens: expected a 2-D tensor"):
        m(torch.tensor(1.0), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1))
    n = nn.MXFP4Experts.from_packed(m.packed_weights.numpy(), m.scale_bytes.numpy())
    x = torch.from_numpy(rng.standard_normal((3, 32))).float()
    ids, mix = torch.tensor([[0], [1], [0]]), torch.ones(3, 1)
    assert torch.equal(n(x, ids, mix), m(x, ids, mix))


def test_k3_experts_report_uint64_ids_at_or_above_2_63_as_passed(rng):
    """KimiK3Experts checks its ids as the op does: a uint64 id >= 2^63 is an IndexError
    with the value passed, not an overflow of its int64 view."""
    if getattr(torch, "uint64", None) is None:
        pytest.skip("this torch has no uint64")
    from mxfp4x import nn

    def q(o, i):
        return mxfp4x.quantize(torch.from_numpy(rng.standard_normal((2, o, i))).float())
    m = nn.KimiK3Experts(q(32, 32), q(32, 32), q(32, 32))
    sel = torch.tensor([[2 ** 63 + 1]], dtype=torch.uint64)
    with pytest.raises(IndexError, match=f"expert id {2 ** 63 + 1} is outside"):
        m(torch.ones(1, 32), sel, torch.ones(1, 1))
