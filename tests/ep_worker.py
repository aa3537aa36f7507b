"""One rank of the expert-parallel tests (tests/test_distributed.py runs N of these).

Every rank builds the same global layers (same seeds), runs the single-process op on all
tokens, then the expert-parallel op on its own tokens and its own experts, and reports
whether its rows are bit-identical.  argv: scenario names; prints one JSON line."""
import datetime
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from mxfp4x._testing import random_layer

import mxfp4x
import mxfp4x.distributed as mdist


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
    packed, scales = layer["packed_weights"][e0:e1], layer["scale_bytes"][e0:e1]
    if name.startswith("list"):
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
    full = nn.KimiK3Experts(mats["w1"], mats["w3"], mats["w2"])
    counts, start, n = token_counts(rank, world, 3)
    h = torch.from_numpy(rng.standard_normal((sum(counts), lat))).float()
    sel = torch.from_numpy(rng.integers(0, n_exp, (sum(counts), 4)))
    w = torch.from_numpy(rng.random((sum(counts), 4))).float()
    cuts = split(n_exp, world, uneven=False)  # a module holds at least one expert
    e0, e1 = int(cuts[rank]), int(cuts[rank + 1])
    part = nn.KimiK3Experts(*[(p[e0:e1], s[e0:e1]) for p, s in
                              (mats["w1"], mats["w3"], mats["w2"])],
                            expert_ids=range(e0, e1), group=dist.group.WORLD)
    mine = slice(start, start + n)
    got = part(h[mine], sel[mine], w[mine])
    return {"equal": bool(torch.equal(bits(got), bits(full(h, sel, w)[mine]))),
            "bytes": part.last_routing.bytes_sent}


def modules(name, rank, world):
    """MXFP4Experts and GptOssExperts, expert-parallel, against one process (bitwise)."""
    from mxfp4x._safetensors import save_file

    from mxfp4x import nn
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
    return {"equal": bool(ok_gpt and ok_bank), "gpt": bool(ok_gpt), "bank": bool(ok_bank),
            "local_experts": int(part.gate_up_blocks.shape[0])}


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
        mdist._local_products = lambda *a, **k: os._exit(3)
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


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for name in sys.argv[1:]:
        fn = bad_input if name.startswith("bad") else gradcheck if name == "gradcheck" \
            else die if name == "die" else kimi if name == "kimi" \
            else modules if name == "modules" else scenario
        results[name] = fn(name, rank, world)
    print(json.dumps({"rank": rank, "results": results}), flush=True)
    if "die" in sys.argv:
        os._exit(0)  # the peer is gone: nothing to tear down with it
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
