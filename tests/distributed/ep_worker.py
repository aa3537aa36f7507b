"""One rank of the expert-parallel tests (tests/distributed/test_distributed.py runs N of these).

Every rank builds the same global layers (same seeds), runs the single-process op on all
tokens, then the expert-parallel op on its own tokens and its own experts, and reports
whether its rows are bit-identical.  argv: scenario names; prints one JSON line."""
import builtins
import datetime
import functools
import json
import os
import sys
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist

import mxfp4x
import mxfp4x.distributed as mdist
import mxfp4x.distributed._agreement  # noqa: F401 (patched and read by the error cases)
import mxfp4x.distributed._autograd  # noqa: F401
import mxfp4x.distributed._routing  # noqa: F401
from mxfp4x.testing.layers import gguf_blocks_of, random_layer


def split(n, world, uneven):
    if not uneven:
        return np.linspace(0, n, world + 1).astype(int)
    cuts = np.sort(np.random.default_rng(n * 7 + world).choice(np.arange(0, n + 1), world - 1))
    return np.concatenate(([0], cuts, [n])).astype(int)


def token_counts(rank, world, base):
    # rank 0 has no tokens (when there are others), the rest differ
    counts = [0 if (r == 0 and world > 1) else base + r for r in range(world)]
    return counts, sum(counts[:rank]), counts[rank]


def bits(t):
    return t.contiguous().view(torch.uint8)


def scenario(name, rank, world):
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f64": torch.float64}[
        name.split("-")[1]] if "-" in name and name.split("-")[1] in ("f32", "bf16", "f64") \
        else torch.float32
    counts, start, n = token_counts(rank, world, 4)
    total = sum(counts)
    n_experts = 9
    layer = random_layer(np.random.default_rng(11), total, 4, n_experts, 45, 3, dtype=dtype,
                         repeat_expert=True)
    layer["selected_experts"][:, 0] = layer["selected_experts"][:, 0] % 5  # some idle experts
    cuts = split(n_experts, world, uneven=name.endswith("uneven"))
    e0, e1 = int(cuts[rank]), int(cuts[rank + 1])
    mine = slice(start, start + n)
    local = {k: v[mine] for k, v in layer.items() if k not in ("packed_weights", "scale_bytes")}
    if "gguf" in name:  # the same matrices as GGUF blocks, read in place (scales None)
        layer["packed_weights"] = torch.from_numpy(gguf_blocks_of(layer["packed_weights"],
                                                                  layer["scale_bytes"]))
        layer["scale_bytes"] = None
    packed = layer["packed_weights"][e0:e1]
    scales = None if layer["scale_bytes"] is None else layer["scale_bytes"][e0:e1]
    if "gguf" in name and name.startswith("list"):
        packed = [p.clone() for p in packed]
    elif name.startswith("list"):
        packed = [p.clone() for p in packed]
        scales = [s.clone() for s in scales]
    if name.startswith("slots"):
        want = mxfp4x.mxfp4_experts_slots(layer["latent_tokens"], layer["packed_weights"],
                                          layer["scale_bytes"], layer["selected_experts"])
        got = mdist.mxfp4_experts_slots(local["latent_tokens"], packed, scales,
                                        local["selected_experts"], expert_range=(e0, e1))
    elif name.startswith("perslot"):
        xs = torch.from_numpy(np.random.default_rng(5).standard_normal(
            (total, 4, 96))).to(dtype)
        want = mxfp4x.mxfp4_experts(**dict(layer, latent_tokens=xs))
        got = mdist.mxfp4_experts(xs[mine], packed, scales, local["selected_experts"],
                                  local["mixture_weights"], local["shared_output"],
                                  expert_range=(e0, e1))
    else:
        want = mxfp4x.mxfp4_experts(**layer)
        got = mdist.mxfp4_experts(local["latent_tokens"], packed, scales,
                                  local["selected_experts"], local["mixture_weights"],
                                  local["shared_output"], expert_range=(e0, e1))
    return {"equal": bool(torch.equal(bits(got), bits(want[mine]))), "rows": n,
            "range": [e0, e1]}


def bad_input(name, rank, world):
    layer = random_layer(np.random.default_rng(3), 3, 2, 4, 16, 1)
    cuts = split(4, world, False)
    e0, e1 = int(cuts[rank]), int(cuts[rank + 1])
    sel = layer["selected_experts"]
    x = layer["latent_tokens"]
    if rank == world - 1 and name == "bad-id":
        sel = sel.clone()
        sel[1, 1] = 4
    if rank == world - 1 and name == "bad-shape":
        x = x[:, :16]
    try:
        mdist.mxfp4_experts(x, layer["packed_weights"][e0:e1], layer["scale_bytes"][e0:e1],
                            sel, layer["mixture_weights"], layer["shared_output"],
                            expert_range=(e0, e1))
    except (ValueError, IndexError, RuntimeError) as exc:
        return {"raised": type(exc).__name__, "message": str(exc)[:300]}
    return {"raised": None}


def kimi(name, rank, world):
    """A Kimi K3 experts module split across the ranks: bit-identical to one process."""
    from mxfp4x import nn
    n_exp, lat, ff = 10, 64, 96
    rng = np.random.default_rng(21)
    mats = {}
    for role, (o, i) in (("w1", (ff, lat)), ("w3", (ff, lat)), ("w2", (lat, ff))):
        mats[role] = (torch.from_numpy(rng.integers(0, 256, (n_exp, o, i // 32, 16), np.uint8)),
                      torch.from_numpy(rng.integers(119, 126, (n_exp, o, i // 32), np.uint8)))
        if "gguf" in name:  # the same matrices as GGUF blocks (llama.cpp's kimi-k3 files)
            mats[role] = (torch.from_numpy(gguf_blocks_of(*mats[role])), None)
    full = nn.KimiK3Experts(mats["w1"], mats["w3"], mats["w2"])
    counts, start, n = token_counts(rank, world, 3)
    h = torch.from_numpy(rng.standard_normal((sum(counts), lat))).float()
    sel = torch.from_numpy(rng.integers(0, n_exp, (sum(counts), 4)))
    w = torch.from_numpy(rng.random((sum(counts), 4))).float()
    cuts = split(n_exp, world, uneven=False)  # a module holds at least one expert
    e0, e1 = int(cuts[rank]), int(cuts[rank + 1])
    part = nn.KimiK3Experts(*[(p[e0:e1], None if s is None else s[e0:e1]) for p, s in
                              (mats["w1"], mats["w3"], mats["w2"])],
                            expert_range=(e0, e1), group=dist.group.WORLD)
    mine = slice(start, start + n)
    got = part(h[mine], sel[mine], w[mine])
    return {"equal": bool(torch.equal(bits(got), bits(full(h, sel, w)[mine]))),
            "bytes": part.last_routing.bytes_sent}


def modules(name, rank, world):
    """MXFP4Experts and GptOssExperts, expert-parallel, against one process (bitwise)."""
    from mxfp4x import nn
    from mxfp4x.checkpoints.safetensors import save_file
    rng = np.random.default_rng(31)
    n_exp, hid, ff = 6, 64, 64
    pre = "model.layers.0.mlp.experts."
    t = {pre + "gate_up_proj_blocks": rng.integers(0, 256, (n_exp, 2 * ff, hid // 32, 16),
                                                   np.uint8),
         pre + "gate_up_proj_scales": rng.integers(120, 127, (n_exp, 2 * ff, hid // 32),
                                                   np.uint8),
         pre + "gate_up_proj_bias": rng.standard_normal((n_exp, 2 * ff)).astype(np.float32),
         pre + "down_proj_blocks": rng.integers(0, 256, (n_exp, hid, ff // 32, 16), np.uint8),
         pre + "down_proj_scales": rng.integers(120, 127, (n_exp, hid, ff // 32), np.uint8),
         pre + "down_proj_bias": rng.standard_normal((n_exp, hid)).astype(np.float32)}
    path = os.path.join(os.environ["EP_TMP"], "gptoss.safetensors")
    if rank == 0:
        save_file({k: torch.from_numpy(v) for k, v in t.items()}, path)
    dist.barrier()
    counts, start, n = token_counts(rank, world, 3)
    x = torch.from_numpy(rng.standard_normal((sum(counts), hid))).float()
    sel = torch.from_numpy(rng.integers(0, n_exp, (sum(counts), 2)))
    w = torch.from_numpy(rng.random((sum(counts), 2))).float()
    cuts = split(n_exp, world, uneven=False)
    e0, e1 = int(cuts[rank]), int(cuts[rank + 1])
    mine = slice(start, start + n)
    full = nn.GptOssExperts.from_checkpoint(path, 0)
    part = nn.GptOssExperts.from_checkpoint(path, 0, expert_range=(e0, e1),
                                            group=dist.group.WORLD)
    ok_gpt = torch.equal(bits(part(x[mine], sel[mine], w[mine])), bits(full(x, sel, w)[mine]))
    key = "model.layers.0.mlp.experts.down_proj_blocks"
    bank = nn.MXFP4Experts.from_safetensors(path, key, key.replace("blocks", "scales"))
    part_bank = nn.MXFP4Experts.from_safetensors(path, key, key.replace("blocks", "scales"),
                                                 expert_range=(e0, e1),
                                                 group=dist.group.WORLD)
    xb = torch.from_numpy(rng.standard_normal((sum(counts), ff))).float()
    ok_bank = torch.equal(bits(part_bank(xb[mine], sel[mine], w[mine])),
                          bits(bank(xb, sel, w)[mine]))
    # the GGUF form (llama.cpp: gate rows 0::2, up rows 1::2, GGUF blocks) of the same block
    gb = torch.from_numpy(gguf_blocks_of(t[pre + "gate_up_proj_blocks"],
                                         t[pre + "gate_up_proj_scales"]))
    db = torch.from_numpy(gguf_blocks_of(t[pre + "down_proj_blocks"], t[pre + "down_proj_scales"]))
    gub, dbias = torch.from_numpy(t[pre + "gate_up_proj_bias"]), torch.from_numpy(
        t[pre + "down_proj_bias"])

    def gguf_block(r=slice(None), **kw):
        return nn.GptOssExperts.from_gguf_blocks(gb[r, 0::2], gb[r, 1::2], gub[:, 0::2],
                                                 gub[:, 1::2], db[r], dbias, **kw)
    part_gguf = gguf_block(slice(e0, e1), expert_range=(e0, e1), group=dist.group.WORLD)
    ok_gguf = torch.equal(bits(part_gguf(x[mine], sel[mine], w[mine])),
                          bits(gguf_block()(x, sel, w)[mine]))
    return {"equal": bool(ok_gpt and ok_bank and ok_gguf), "gpt": bool(ok_gpt),
            "bank": bool(ok_bank), "gguf": bool(ok_gguf),
            "local_experts": int(part.gate_up_blocks.shape[0])}


KEPT = []  # modules that outlive destroy_process_group(), as a script's model does


def outlive(name, rank, world):
    """An expert-parallel module kept to the end of the process: it must not keep its
    process group alive past destroy_process_group() (gloo's group destroyed at exit
    aborted the process, 4 runs in 10); main() checks the group is gone."""
    import weakref

    from mxfp4x import nn
    rng = np.random.default_rng(5)
    n_exp, d_out, d_in = 4, 32, 64
    packed = torch.from_numpy(rng.integers(0, 256, (n_exp, d_out, d_in // 32, 16), np.uint8))
    scales = torch.from_numpy(rng.integers(120, 127, (n_exp, d_out, d_in // 32), np.uint8))
    cuts = split(n_exp, world, uneven=False)
    e0, e1 = int(cuts[rank]), int(cuts[rank + 1])
    part = nn.MXFP4Experts(e1 - e0, d_out, d_in, expert_range=(e0, e1),
                           group=dist.group.WORLD)
    part.packed_weights.copy_(packed[e0:e1])
    part.scale_bytes.copy_(scales[e0:e1])
    x = torch.from_numpy(rng.standard_normal((3, d_in))).float()
    sel = torch.tensor([[0, 3], [1, 2], [3, 3]])
    w = torch.ones(3, 2)
    y = part(x, sel, w)
    KEPT.extend([part, weakref.ref(dist.group.WORLD)])
    return {"equal": bool(torch.isfinite(y).all())}


def gradcheck(name, rank, world):
    layer = random_layer(np.random.default_rng(8), 3, 2, 4, 7, 1, dtype=torch.float64,
                         repeat_expert=True)
    cuts = split(4, world, False)
    e0, e1 = int(cuts[rank]), int(cuts[rank + 1])
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(3, 32, dtype=torch.float64, generator=g, requires_grad=True)
    mix = torch.rand(3, 2, dtype=torch.float64, generator=g, requires_grad=True)
    shared = torch.randn(3, 7, dtype=torch.float64, generator=g, requires_grad=True)
    sel = torch.randint(0, 4, (3, 2), generator=g)

    def f(x, mix, shared):
        return mdist.mxfp4_experts(x, layer["packed_weights"][e0:e1],
                                   layer["scale_bytes"][e0:e1], sel, mix, shared,
                                   expert_range=(e0, e1))

    ok = torch.autograd.gradcheck(f, (x, mix, shared))

    def f2(x):
        return mdist.mxfp4_experts_slots(x, layer["packed_weights"][e0:e1],
                                         layer["scale_bytes"][e0:e1], sel,
                                         expert_range=(e0, e1))

    ok2 = torch.autograd.gradcheck(f2, (x,))
    return {"gradcheck": bool(ok and ok2)}


def die(name, rank, world):
    """Rank 1 dies in the middle of a call (after the pairs went out)."""
    if rank == 1:
        mdist._autograd._local_products = lambda *a, **k: os._exit(3)
    layer = random_layer(np.random.default_rng(3), 6, 2, 4, 16, 1)
    cuts = split(4, world, False)
    e0, e1 = int(cuts[rank]), int(cuts[rank + 1])
    try:
        mdist.mxfp4_experts(layer["latent_tokens"], layer["packed_weights"][e0:e1],
                            layer["scale_bytes"][e0:e1], layer["selected_experts"],
                            layer["mixture_weights"], layer["shared_output"],
                            expert_range=(e0, e1))
    except Exception as exc:  # noqa: BLE001 - reported
        return {"raised": type(exc).__name__, "message": str(exc)[:200]}
    return {"raised": None}


# ---- a world serving error cases (tests/distributed/test_distributed_errors.py) ------------
#
# The test writes one JSON case per line to every rank's stdin; each rank answers one JSON
# line.  A case names an entry point, a fault and the rank it hits; the rank reports what
# its call raised and how long that took, then makes the same call again without the
# fault, which must give the bits of the first clean call (the ranks are still in step).

class Boom(Exception):
    """An exception type no code path expects."""


class Unprintable(ValueError):
    """A ValueError whose message itself raises."""

    def __str__(self):
        raise RuntimeError("this message cannot be formatted")


def make_exception(name):
    cls = {"Boom": Boom, "Unprintable": Unprintable}.get(name) or getattr(builtins, name)
    return cls("injected on this rank")


def raiser(exc):
    def fail(*args, **kwargs):
        raise exc
    return fail


def reported(exc, limit):
    """(type name, message) of an exception a case raised, as the parent reads them: the
    message cut to ``limit`` characters, or "<unprintable>" where ``str`` itself raises."""
    try:
        message = str(exc)[:limit]
    except Exception:  # noqa: BLE001 - Unprintable
        message = "<unprintable>"
    return type(exc).__name__, message


class Entries:
    """Small layers for every distributed entry point and module, built once per world.
    ``call(entry, bad)`` runs one; ``bad`` holds the faults of this rank."""

    def __init__(self, rank, world):
        from mxfp4x import nn
        self.rank, self.world, self.nn = rank, world, nn
        n_exp, top_k, per_rank, d = 4, 2, 3, 32
        layer = random_layer(np.random.default_rng(5), per_rank * world, top_k, n_exp, d, 1)
        cuts = split(n_exp, world, False)
        self.e0, self.e1 = int(cuts[rank]), int(cuts[rank + 1])
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        self.layer = layer
        self.x, self.sel = layer["latent_tokens"][mine], layer["selected_experts"][mine]
        self.mix, self.shared = layer["mixture_weights"][mine], layer["shared_output"][mine]
        self.packed = layer["packed_weights"][self.e0:self.e1]
        self.scales = layer["scale_bytes"][self.e0:self.e1]
        self.d, self.mine = d, mine
        self.modules = {}
        self.want = {}

    def module(self, entry):
        if entry not in self.modules:
            self.modules[entry] = getattr(self, "_" + entry)()
        return self.modules[entry]

    def _mxfp4experts(self):
        return self.nn.MXFP4Experts.from_packed(self.packed, self.scales,
                                                expert_range=(self.e0, self.e1),
                                                group=dist.group.WORLD)

    def _gptoss(self):
        rng = np.random.default_rng(31)
        n_exp, hid, ff = 4, 32, 32
        blocks = torch.from_numpy(rng.integers(0, 256, (n_exp, 2 * ff, hid // 32, 16), np.uint8))
        scales = torch.from_numpy(rng.integers(120, 127, (n_exp, 2 * ff, hid // 32), np.uint8))
        down = torch.from_numpy(rng.integers(0, 256, (n_exp, hid, ff // 32, 16), np.uint8))
        down_s = torch.from_numpy(rng.integers(120, 127, (n_exp, hid, ff // 32), np.uint8))
        bias = torch.from_numpy(rng.standard_normal((n_exp, 2 * ff))).float()
        down_bias = torch.from_numpy(rng.standard_normal((n_exp, hid))).float()
        r = slice(self.e0, self.e1)
        return self.nn.GptOssExperts(blocks[r], scales[r], bias, down[r], down_s[r], down_bias,
                                     expert_range=(self.e0, self.e1), group=dist.group.WORLD)

    def _kimi(self):
        rng = np.random.default_rng(21)
        n_exp, lat, ff = 4, 32, 64
        mats = []
        for o, i in ((ff, lat), (ff, lat), (lat, ff)):
            mats.append((torch.from_numpy(rng.integers(0, 256, (n_exp, o, i // 32, 16),
                                                       np.uint8))[self.e0:self.e1],
                         torch.from_numpy(rng.integers(119, 126, (n_exp, o, i // 32),
                                                       np.uint8))[self.e0:self.e1]))
        return self.nn.KimiK3Experts(*mats, expert_range=(self.e0, self.e1),
                                     group=dist.group.WORLD)

    def local_fn(self, rows, ids):
        return mxfp4x.mxfp4_experts_slots(rows, self.packed, self.scales, ids.view(-1, 1))[:, 0]

    def call(self, entry, bad):
        inf_range = (self.e0, float("inf"))
        rng = inf_range if bad.get("range") else (self.e0, self.e1)
        x = self.x.numpy() if bad.get("numpy") else self.x
        isa = bad.get("isa")
        if entry in ("experts", "experts-grad"):
            xg = x.clone().requires_grad_() if entry == "experts-grad" else x
            out = mdist.mxfp4_experts(xg, self.packed, self.scales, self.sel, self.mix,
                                      self.shared, expert_range=rng, isa=isa)
            if entry == "experts-grad":
                out.sum().backward()
                return torch.cat((out.detach().flatten(), xg.grad.flatten()))
            return out
        if entry in ("slots", "slots-grad"):
            xg = x.clone().requires_grad_() if entry == "slots-grad" else x
            out = mdist.mxfp4_experts_slots(xg, self.packed, self.scales, self.sel,
                                            expert_range=rng, isa=isa)
            if entry == "slots-grad":
                out.sum().backward()
                return torch.cat((out.detach().flatten(), xg.grad.flatten()))
            return out
        if entry == "parallel":
            fn = raiser(bad["products"]) if "products" in bad else self.local_fn
            kw = {} if isa is None else {"isa": isa}
            return mdist.expert_parallel(fn, x, self.sel, self.mix, expert_range=rng,
                                         d_out=self.d, **kw)[0]
        m = self.module(entry)
        if entry in ("mxfp4experts", "gptoss"):
            saved = m.expert_range
            m.expert_range = inf_range if bad.get("range") else saved
            try:
                if entry == "gptoss":
                    return m(x, self.sel, object() if bad.get("prep") else self.mix)
                if bad.get("prep"):
                    return m(object(), self.sel, self.mix)  # no shared output: zeros made
                return m(x, self.sel, self.mix, self.shared)
            finally:
                m.expert_range = saved
        if entry == "kimi":
            saved = m.isa
            m.isa = isa if isa is not None else saved  # as if set after construction
            if "products" in bad:
                m.mlp = raiser(bad["products"])
            try:
                return m(x, self.sel, self.mix)
            finally:
                m.isa = saved
                m.__dict__.pop("mlp", None)
        raise ValueError(f"unknown entry {entry!r}")


def faulty(entries, case, rank):
    """The bad rank's faults: arguments (``bad``), and functions of mxfp4x.distributed
    patched to raise (restored by the caller)."""
    bad, patches = {}, {}
    if rank != case["bad_rank"]:
        return bad, patches
    fault = case["fault"]
    exc = make_exception(case["exception"]) if "exception" in case else None
    if fault == "check":  # before the agreement: every entry checks its thread count
        patches["check_num_threads"] = raiser(exc)
    elif fault == "products":  # between the all-to-alls
        if case["entry"] in ("parallel", "kimi"):
            bad["products"] = exc
        else:
            patches["_local_products"] = raiser(exc)
    elif fault == "backward":  # the owners' gradient products
        patches["mxfp4_experts_grad_latents_op"] = raiser(exc)
        patches["mxfp4_experts_grad_latents_list_op"] = raiser(exc)
        patches["_grad_latents_direct"] = raiser(exc)  # CPU tensors: the kernels directly
    else:  # a bad argument: range, numpy, isa
        bad[fault] = "bogus" if fault == "isa" else True
    return bad, patches


def run_case(entries, case, rank):
    entry = case["entry"]
    if entry not in entries.want:  # the first clean call of an entry: the reference bits
        entries.want[entry] = bits(entries.call(entry, {})).clone()
    bad, patches = faulty(entries, case, rank)
    # a name is patched in every module of the package that holds it (where it is called)
    modules = (mdist, mdist._agreement, mdist._routing, mdist._autograd)
    saved = {(m, name): getattr(m, name) for name in patches for m in modules
             if hasattr(m, name)}
    raised, message = None, ""
    t0 = time.perf_counter()
    try:
        for (m, name) in saved:
            setattr(m, name, patches[name])
        entries.call(entry, bad)
    except BaseException as exc:  # noqa: BLE001 - reported, whatever it is
        raised, message = reported(exc, 400)
    finally:
        for (m, name), fn in saved.items():
            setattr(m, name, fn)
    seconds = time.perf_counter() - t0
    again = bits(entries.call(entry, {}))
    return {"rank": rank, "raised": raised, "message": message, "seconds": seconds,
            "clean": bool(torch.equal(again, entries.want[entry]))}


def run_special(entries, name, rank, world):
    """Cases that are not a fault on one rank of one entry."""
    if name == "numpy-latents":
        # expert_parallel and KimiK3Experts take numpy latents as the single-process ops do
        return {"equal": all(bool(torch.equal(bits(entries.call(e, {"numpy": True})),
                                              bits(entries.call(e, {}))))
                             for e in ("parallel", "kimi"))}
    layer = random_layer(np.random.default_rng(9), 3 * world, 2, 4, 32, 1)
    mine = slice(3 * rank, 3 * rank + 3)
    local = {k: v[mine] for k, v in layer.items() if k not in ("packed_weights", "scale_bytes")}
    if name == "lists-on-an-empty-rank":
        # rank 0 holds every expert; the others hold none and pass their shared output as
        # nested lists
        e0, e1 = (0, 4) if rank == 0 else (4, 4)
        packed = layer["packed_weights"] if rank == 0 else []
        scales = layer["scale_bytes"] if rank == 0 else []
        shared = local["shared_output"] if rank == 0 else local["shared_output"].tolist()
        got = mdist.mxfp4_experts(local["latent_tokens"], packed, scales,
                                  local["selected_experts"], local["mixture_weights"], shared,
                                  expert_range=(e0, e1))
        want = mxfp4x.mxfp4_experts(**layer)[mine]
        return {"equal": bool(torch.equal(bits(got), bits(want)))}
    cuts = split(4, world, False)
    e0, e1 = int(cuts[rank]), int(cuts[rank + 1])
    packed, scales = layer["packed_weights"][e0:e1], layer["scale_bytes"][e0:e1]
    if name == "routing-bad-id":
        sel = local["selected_experts"].clone()
        if rank == world - 1:
            sel[0, 0] = -1
        plan = mdist._agreement._Plan(tuple((int(cuts[r]), int(cuts[r + 1])) for r in range(world)),
                           rank, world)

        def call():
            return mdist.ExpertRouting(plan, sel, False, None)
    else:
        x = local["latent_tokens"]
        if name == "dtype-disagreement" and rank == world - 1:
            x = x.double()

        def experts():
            return mdist.mxfp4_experts(x, packed, scales, local["selected_experts"],
                                       local["mixture_weights"], local["shared_output"],
                                       expert_range=(e0, e1))

        def parallel():
            return mdist.expert_parallel(
                lambda rows, ids: mxfp4x.mxfp4_experts_slots(rows, packed, scales,
                                                             ids.view(-1, 1))[:, 0],
                x, local["selected_experts"], local["mixture_weights"],
                expert_range=(e0, e1), d_out=32)
        # op-disagreement: the last rank calls expert_parallel, the others mxfp4_experts
        call = parallel if name == "op-disagreement" and rank == world - 1 else experts
    t0 = time.perf_counter()
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - reported
        return {"raised": type(exc).__name__, "message": str(exc)[:400],
                "seconds": time.perf_counter() - t0}
    return {"raised": None, "seconds": time.perf_counter() - t0}


# ---- whole blocks: two stacked layers, three requests (test_distributed_errors.py) ------
#
# A case {"stack": kind, "point": where, "exception": name, "bad_rank": r} runs three
# requests through two stacked expert-parallel layers A, B of one kind, as a server loop
# does (each request's error caught, the next request served); the fault hits layer B on
# the bad rank in the middle request.  Every rank reports, per request, what it raised,
# how long that took and whether what it returned has the bits of a clean run (whose
# forward rows are those of the same two layers in one process).

STACKS = ["kimi-moe", "gptoss-moe", "gptoss", "kimi", "mxfp4experts", "op"]
POINTS = {  # where a fault can hit each kind of layer; grad-*: in its backward
    "kimi-moe": ["enter", "router", "down_proj", "products", "norm", "shared", "leave"],
    "gptoss-moe": ["enter", "router", "products", "between", "leave", "grad-leave",
                   "grad-products", "grad-enter"],
    "gptoss": ["enter", "products", "between", "leave", "grad-leave", "grad-products",
               "grad-enter"],
    "kimi": ["enter", "products", "leave"],
    "mxfp4experts": ["enter", "products", "leave", "grad-leave", "grad-products",
                     "grad-enter"],
    "op": ["enter", "products", "between", "leave", "grad-leave", "grad-products",
           "grad-enter"],
}
DIFFERENTIABLE = ("gptoss-moe", "gptoss", "mxfp4experts", "op")  # Kimi K3's EP: inference
FAULT = {"point": None, "exc": None, "armed": False}  # armed while layer B runs, bad rank


def hit(point):
    """A place a layer's own work can fail: raises the case's fault there, in layer B."""
    if FAULT["armed"] and FAULT["point"] == point:
        raise FAULT["exc"]


class OpLayer(torch.nn.Module):
    """A layer made of two op calls and work around them, run by run_layer when
    expert-parallel (as mxfp4x's modules run their forwards)."""

    def __init__(self, packed, scales, sel, mix, rows, kw):
        super().__init__()
        self.packed, self.scales, self.sel, self.mix, self.rows, self.kw = \
            packed, scales, sel, mix, rows, kw

    def forward(self, x):
        if self.kw:
            return mdist.run_layer(self._forward, x, layer=self)
        return self._forward(x)

    def _forward(self, x):
        sel, mix = self.sel[self.rows], self.mix[self.rows]
        op = functools.partial(mdist.mxfp4_experts, **self.kw) if self.kw \
            else mxfp4x.mxfp4_experts
        y = op(x, self.packed, self.scales, sel, mix, torch.zeros_like(x)) * 0.5
        hit("between")
        return op(y, self.packed, self.scales, sel, mix, x)


class Stacks:
    """Two layers of each kind, expert-parallel and in one process, three requests."""

    def __init__(self, rank, world):
        from mxfp4x import nn
        self.rank, self.world, self.nn = rank, world, nn
        self.n_exp, self.hid, self.per_rank = 4, 64, 3
        cuts = split(self.n_exp, world, False)
        self.e0, self.e1 = int(cuts[rank]), int(cuts[rank + 1])
        self.mine = slice(rank * self.per_rank, (rank + 1) * self.per_rank)
        self.built = {}

    def _bytes(self, rng, o, i):
        return (torch.from_numpy(rng.integers(0, 256, (self.n_exp, o, i // 32, 16), np.uint8)),
                torch.from_numpy(rng.integers(119, 126, (self.n_exp, o, i // 32), np.uint8)))

    def _layer(self, kind, seed, parallel):
        nn, rng, hid, n_exp = self.nn, np.random.default_rng(seed), self.hid, self.n_exp
        r = slice(self.e0, self.e1) if parallel else slice(None)
        kw = dict(expert_range=(self.e0, self.e1), group=dist.group.WORLD) if parallel \
            else {}

        def f32(*shape, scale=0.2):
            return torch.from_numpy(rng.standard_normal(shape) * scale).float()

        if kind in ("kimi", "kimi-moe"):
            lat, ff = (32 if kind == "kimi-moe" else hid), 64
            mats = [self._bytes(rng, ff, lat), self._bytes(rng, ff, lat),
                    self._bytes(rng, lat, ff)]
            experts = nn.KimiK3Experts(*((p[r], s[r]) for p, s in mats), **kw)
            if kind == "kimi":
                return experts
            from mxfp4x.models.kimi_k3 import KimiK3MoE, KimiK3Router
            return KimiK3MoE(KimiK3Router(f32(n_exp, hid), f32(n_exp), 2), f32(lat, hid),
                             experts, 1 + f32(lat), f32(hid, lat), f32(32, hid),
                             f32(32, hid), f32(hid, 32))
        if kind in ("gptoss", "gptoss-moe"):
            blocks, scales = self._bytes(rng, 64, hid)
            down, down_s = self._bytes(rng, hid, 32)
            experts = nn.GptOssExperts(blocks[r], scales[r], f32(n_exp, 64), down[r],
                                       down_s[r], f32(n_exp, hid), **kw)
            if kind == "gptoss":
                return experts
            from mxfp4x.models.gpt_oss import GptOssMoE, GptOssRouter
            return GptOssMoE(GptOssRouter(f32(n_exp, hid), f32(n_exp), 2), experts)
        packed, scales = self._bytes(rng, hid, hid)
        if kind == "mxfp4experts":
            return nn.MXFP4Experts.from_packed(packed[r], scales[r], **kw)
        n = self.per_rank * self.world
        sel = torch.from_numpy(rng.integers(0, n_exp, (n, 2)))
        return OpLayer(packed[r], scales[r], sel, f32(n, 2, scale=1.0), self.mine, kw)

    def request(self, kind, layers, i, rows, backward):
        """One request through layers A then B: the bits of its output (and of the
        latents' gradient)."""
        b = self.built[kind]
        x = b["xs"][i][rows].clone().requires_grad_(backward)
        sel, mix = b["sels"][i][rows], b["mixes"][i][rows]
        with torch.set_grad_enabled(backward):
            y = x
            for layer in layers:
                y = layer(y) if kind in ("kimi-moe", "gptoss-moe", "op") else \
                    layer(y, sel, mix)
            if backward:
                (y * b["wts"][i][rows]).sum().backward()
                return torch.cat((bits(y.detach()).flatten(), bits(x.grad).flatten()))
        return bits(y).flatten()

    def get(self, kind):
        if kind not in self.built:
            rng = np.random.default_rng(77)
            n = self.per_rank * self.world
            self.built[kind] = b = dict(
                layers=[self._layer(kind, seed, True) for seed in (41, 42)],
                xs=[torch.from_numpy(rng.standard_normal((n, self.hid))).float()
                    for _ in range(3)],
                sels=[torch.from_numpy(rng.integers(0, self.n_exp, (n, 2))) for _ in range(3)],
                mixes=[torch.from_numpy(rng.random((n, 2))).float() for _ in range(3)],
                wts=[torch.from_numpy(rng.standard_normal((n, self.hid))).float()
                     for _ in range(3)])
            grad = kind in DIFFERENTIABLE
            b["want"] = [self.request(kind, b["layers"], i, self.mine, grad).clone()
                         for i in range(3)]
            # a clean expert-parallel forward has the bits of the same two layers, holding
            # every expert, in one process, on the same rows
            single = [self._layer(kind, seed, False) for seed in (41, 42)]
            size = self.per_rank * self.hid * 4
            b["one_process"] = all(
                torch.equal(b["want"][i][:size],
                            self.request(kind, single, i, self.mine, False))
                for i in range(3))
        return self.built[kind]


def _patches(kind, layer, point, exc):
    """(object, attribute, replacement) for the bad rank's fault at ``point`` of layer B
    (``layer``): its own forward wrapped (armed while it runs; enter, leave and the
    backward hooks), and the functions it calls at the other points."""
    # the modules whose functions the forwards look up at call time
    from mxfp4x.models.gpt_oss import experts as gpt_oss_experts
    from mxfp4x.models.kimi_k3 import block as kimi_block
    forward = layer._forward

    def wrapped(*args):
        FAULT["armed"] = True
        try:
            hit("enter")
            if point == "grad-enter":  # its backward's last step: the latents' gradient
                args = (args[0] * 1.0,) + args[1:]
                args[0].register_hook(raiser(exc))
            out = forward(*args)
            hit("leave")
            if point == "grad-leave":  # its backward's first step
                out = out * 1.0
                out.register_hook(raiser(exc))
            return out
        finally:
            FAULT["armed"] = False

    def before(fn, where):
        def call(*args, **kwargs):
            hit(where)
            return fn(*args, **kwargs)
        return call

    patches = [(layer, "_forward", wrapped)]
    if point == "router":
        patches.append((layer.router, "forward", before(layer.router.forward, "router")))
    elif point == "down_proj":
        patches.append((kimi_block, "_linear", before(kimi_block._linear, "down_proj")))
    elif point == "norm":
        patches.append((kimi_block, "_rms_norm", before(kimi_block._rms_norm, "norm")))
    elif point == "shared":
        patches.append((layer, "shared", before(layer.shared, "shared")))
    elif point == "between" and kind.startswith("gptoss"):
        patches.append((gpt_oss_experts, "accumulation_dtype",
                        before(gpt_oss_experts.accumulation_dtype, "between")))
    elif point == "products" and kind.startswith("kimi"):
        experts = layer.experts if kind == "kimi-moe" else layer
        patches.append((experts, "mlp", before(experts.mlp, "products")))
    elif point == "products":
        patches.append((mdist._autograd, "_local_products",
                        before(mdist._autograd._local_products, "products")))
    elif point == "grad-products":  # the owners' gradient products, in B's backward
        for name in ("mxfp4_experts_grad_latents_op", "mxfp4_experts_grad_latents_list_op",
                     "_grad_latents_direct"):
            patches.append((mdist._autograd, name, raiser(exc)))
    return patches


def run_stack(stacks, case, rank):
    kind, point = case["stack"], case["point"]
    b = stacks.get(kind)
    layer_b = b["layers"][1]
    grad = kind in DIFFERENTIABLE
    out = {"rank": rank, "one_process": b["one_process"], "requests": []}
    for i in range(3):
        patches = []
        if i == 1 and rank == case["bad_rank"]:
            exc = make_exception(case["exception"])
            FAULT.update(point=point, exc=exc, armed=False)
            patches = _patches(kind, layer_b, point, exc)
        saved = [(obj, name, obj.__dict__.get(name, _MISSING)) for obj, name, _ in patches]
        raised, message, equal = None, "", None
        t0 = time.perf_counter()
        try:
            for obj, name, fn in patches:
                setattr(obj, name, fn)
            equal = bool(torch.equal(bits(stacks.request(kind, b["layers"], i, stacks.mine,
                                                         grad)), b["want"][i]))
        except BaseException as exc:  # noqa: BLE001 - reported, whatever it is
            raised, message = reported(exc, 300)
        finally:
            FAULT.update(point=None, exc=None, armed=False)
            for obj, name, old in saved:
                if old is _MISSING:
                    delattr(obj, name)
                else:
                    setattr(obj, name, old)
        out["requests"].append({"raised": raised, "message": message, "equal": equal,
                                "seconds": time.perf_counter() - t0})
    return out


_MISSING = object()


def serve():
    """Answer cases from stdin until {"quit": true} or end of input."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    entries, stacks = Entries(rank, world), Stacks(rank, world)
    print(json.dumps({"ready": rank}), flush=True)
    for line in sys.stdin:
        case = json.loads(line)
        if case.get("quit"):
            break
        try:
            out = run_special(entries, case["special"], rank, world) if "special" in case \
                else run_stack(stacks, case, rank) if "stack" in case \
                else run_case(entries, case, rank)
        except BaseException:  # noqa: BLE001 - the test reports it; the world may be lost
            out = {"rank": rank, "error": traceback.format_exc()[-3000:]}
        print(json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main():
    if sys.argv[1:2] == ["--serve"]:
        return serve()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for name in sys.argv[1:]:
        fn = bad_input if name.startswith("bad") else gradcheck if name == "gradcheck" \
            else die if name == "die" else kimi if name.startswith("kimi") \
            else modules if name == "modules" else outlive if name == "outlive" \
            else scenario
        results[name] = fn(name, rank, world)
    print(json.dumps({"rank": rank, "results": results}), flush=True)
    if "die" in sys.argv:
        os._exit(0)  # the peer is gone: nothing to tear down with it
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()
    if KEPT:  # the kept module holds its group weakly: gone with the group
        import gc
        gc.collect()
        if KEPT[1]() is not None:
            sys.exit("a module kept its process group alive past destroy_process_group()")
        try:
            answered = KEPT[0].group
        except RuntimeError:  # named: the group was destroyed
            answered = None
        if answered is not None:
            sys.exit("the module's group still answered after destroy_process_group()")


if __name__ == "__main__":
    main()
