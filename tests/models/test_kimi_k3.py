"""Kimi K3 MoE layers from checkpoints in the release's layout (tiny sizes, real names
and config nesting): router, routed experts, the whole block against a float64
reference, partial loads, byte dtypes, and untouched pages."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import mxfp4x
from mxfp4x import nn
from mxfp4x._core import dense as _dense
from mxfp4x.testing.kimi_k3 import k3_config, kimi_k3_reference, write_k3_checkpoint

TINY = dict(hidden_size=256, routed_expert_hidden_size=128, num_experts=16,
            num_experts_per_token=4, moe_intermediate_size=64, num_shared_experts=2,
            num_hidden_layers=3)
# |block - float64 reference| <= TOL * max|reference|, the routing shared: float32
# matmuls and activations (~1e-7 relative each, over sums of a few hundred terms);
# bfloat16 rounds the dense matmuls and every cast to 8 bits
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("k3"))
    write_k3_checkpoint(folder, k3_config(**TINY), [1, 2], seed=3, shards=2,
                        dense_dtype=torch.float32)
    return folder


def test_checkpoint_has_the_release_layout(ckpt):
    with open(os.path.join(ckpt, "config.json")) as f:
        config = json.load(f)
    q = config["text_config"]["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "mxfp4-pack-quantized"
    assert q["config_groups"]["group_0"]["weights"]["group_size"] == 32
    with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
        names = json.load(f)["weight_map"]
    assert "language_model.model.layers.1.block_sparse_moe.experts.15.w2.weight_packed" in names
    assert len(set(names.values())) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layer", [1, 2])
def test_block_matches_float64_reference(isa, ckpt, rng, dtype, layer):
    block = nn.KimiK3MoE.from_checkpoint(ckpt, layer=layer, progress=False)
    block.experts.isa = isa
    x = torch.from_numpy(rng.standard_normal((11, 256))).to(dtype)
    y = block(x)
    assert y.shape == (11, 256) and y.dtype == dtype
    sel, w = block.router(x)
    ref = kimi_k3_reference(block, x, sel, w)
    err = np.abs(y.double().numpy() - ref).max()
    assert err <= TOL[dtype] * np.abs(ref).max(), (err, np.abs(ref).max())


def test_one_token_is_batch_invariant(ckpt, rng):
    block = nn.KimiK3MoE.from_checkpoint(ckpt, layer=1, progress=False)
    x = torch.from_numpy(rng.standard_normal((7, 256))).float()
    h = torch.from_numpy(rng.standard_normal((7, 128))).float()
    sel, w = block.router(x)
    full = block.experts(h, sel, w)
    for t in (0, 6):
        assert torch.equal(block.experts(h[t:t + 1], sel[t:t + 1], w[t:t + 1])[0], full[t])


def test_router_ties_go_to_the_lower_id():
    router = nn.KimiK3Router(torch.zeros(8, 4), torch.zeros(8), top_k=3)
    sel, w = router(torch.randn(5, 4))
    assert sel.tolist() == [[0, 1, 2]] * 5
    torch.testing.assert_close(w, torch.full((5, 3), 1 / 3))


def test_router_against_brute_force(rng):
    n_exp, top_k = 12, 3
    weight = torch.from_numpy(rng.standard_normal((n_exp, 16))).float()
    bias = torch.from_numpy(rng.standard_normal(n_exp)).float()
    x = torch.from_numpy(rng.standard_normal((20, 16))).float()
    for n_group, topk_group, scaling in ((1, 1, 1.0), (4, 2, 2.5)):
        router = nn.KimiK3Router(weight, bias, top_k, scaling=scaling, n_group=n_group,
                                 topk_group=topk_group)
        sel, w = router(x)
        scores = 1 / (1 + np.exp(-(x.double().numpy() @ weight.double().numpy().T)))
        choice = scores + bias.double().numpy()
        for t in range(20):
            allowed = np.arange(n_exp)
            if n_group > 1:
                g = choice[t].reshape(n_group, -1)
                best = np.argsort(-np.sort(g, axis=1)[:, -2:].sum(1), kind="stable")[:topk_group]
                allowed = np.concatenate([np.arange(i * 3, i * 3 + 3) for i in sorted(best)])
            order = allowed[np.argsort(-choice[t][allowed], kind="stable")][:top_k]
            assert sorted(sel[t].tolist()) == sorted(order.tolist())
            want = scores[t][sel[t].numpy()]
            np.testing.assert_allclose(w[t].numpy(), want / want.sum() * scaling, rtol=1e-5)
            if n_group > 1:
                assert set(sel[t].tolist()) <= set(allowed.tolist())


def test_partial_load_maps_only_the_asked_experts(ckpt, rng):
    full = nn.KimiK3MoE.from_checkpoint(ckpt, layer=1, progress=False)
    part = nn.KimiK3MoE.from_checkpoint(ckpt, layer=1, expert_range=(8, 16), progress=False)
    assert part.experts.n_local == 8 and part.experts.expert_ids == list(range(8, 16))
    h = torch.from_numpy(rng.standard_normal((6, 128))).float()
    sel = torch.from_numpy(rng.integers(8, 16, (6, 4)))
    w = torch.from_numpy(rng.random((6, 4))).float()
    assert torch.equal(part.experts(h, sel, w), full.experts(h, sel, w))
    with pytest.raises(IndexError, match="expert 3 is not held"):
        part.experts(h, torch.full((6, 4), 3), w)
    for bad in ((3, 3), (8, 99), (-1, 4), range(0, 8, 2)):
        with pytest.raises(ValueError, match="expert_range"):
            nn.KimiK3MoE.from_checkpoint(ckpt, layer=1, expert_range=bad, progress=False)


def test_files_holding_only_some_experts_load_their_range(tmp_path, ckpt, rng):
    """An expert-parallel rank's own file set (experts 8..15 of layer 1, the rest of the
    layer, nothing of experts 0..7) loads that range: the prefix is found by an expert
    the files hold, not by expert 0."""
    import glob
    import shutil

    from mxfp4x.checkpoints.safetensors import SafeTensorsCheckpoint, save_file
    full = SafeTensorsCheckpoint(ckpt)
    keep = {n: full.get(n).clone() for n in full.keys()
            if not any(f".experts.{e}." in n for e in range(8))}
    assert len(keep) < len(full.keys())
    save_file(keep, str(tmp_path / "model.safetensors"))
    shutil.copy(glob.glob(ckpt + "/config.json")[0], tmp_path / "config.json")
    part = nn.KimiK3MoE.from_checkpoint(str(tmp_path), layer=1, expert_range=(8, 16),
                                        progress=False)
    whole = nn.KimiK3MoE.from_checkpoint(ckpt, layer=1, expert_range=(8, 16), progress=False)
    h = torch.from_numpy(rng.standard_normal((5, 128))).float()
    sel = torch.from_numpy(rng.integers(8, 16, (5, 4)))
    w = torch.from_numpy(rng.random((5, 4))).float()
    assert torch.equal(part.experts(h, sel, w), whole.experts(h, sel, w))


@pytest.mark.skipif(getattr(torch, "float8_e8m0fnu", None) is None, reason="no e8m0 dtype")
def test_no_prefix_and_typed_bytes(tmp_path, ckpt, rng):
    """No "language_model." prefix, bytes stored I8 and scales F8_E8M0: read by view,
    the same layer."""
    write_k3_checkpoint(str(tmp_path), k3_config(**TINY), [1, 2], seed=3, shards=2,
                        dense_dtype=torch.float32, prefix="", packed_dtype=torch.int8,
                        scale_dtype=torch.float8_e8m0fnu)
    a = nn.KimiK3MoE.from_checkpoint(ckpt, layer=1, progress=False)
    b = nn.KimiK3MoE.from_checkpoint(str(tmp_path), layer=1, progress=False)
    x = torch.from_numpy(rng.standard_normal((5, 256))).float()
    assert torch.equal(a(x), b(x))


def test_progress_bar_is_plain_off_a_terminal(ckpt, capsys):
    nn.KimiK3MoE.from_checkpoint(ckpt, layer=1, progress=True)
    err = capsys.readouterr().err
    assert "\r" not in err and "layer 1 experts: 16/16" in err


_RSS = r"""
import sys, torch, mxfp4x
from mxfp4x import nn
from mxfp4x._core import dense as _dense
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
before = rss()
block = nn.KimiK3MoE.from_checkpoint(sys.argv[1], layer=1, progress=False)
print(block.experts.n_local, (rss() - before) / 2**20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_full_size_layer_maps_without_touching_pages(tmp_path):
    """A real-size K3 layer (896 experts, 14.8 GB of expert bytes, as holes in a sparse
    file): loading it grows the resident set by less than 64 MiB."""
    write_k3_checkpoint(str(tmp_path), k3_config(), [1], shards=4, sparse=True)
    out = subprocess.run([sys.executable, "-c", _RSS, str(tmp_path)], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    n, grown = out.stdout.split()
    assert int(n) == 896
    assert float(grown) < 64, f"RSS grew by {grown} MiB"


def test_nn_exports():
    assert mxfp4x.nn.KimiK3MoE is nn.KimiK3MoE


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "mxfp4x", *args], capture_output=True,
                          text=True, timeout=900)


def test_verify_cli_and_a_corrupted_byte(tmp_path):
    """verify proves the kernels get the file's bytes; a manifest catches one flipped byte
    in the file."""
    folder = str(tmp_path / "ck")
    write_k3_checkpoint(folder, k3_config(**TINY), [1, 2], seed=5, shards=2,
                        dense_dtype=torch.float32)
    manifest = str(tmp_path / "sha256.json")
    out = _cli("verify", folder, "--write-manifest", manifest)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "192 expert tensors of layers [1, 2]" in out.stdout
    from mxfp4x.checkpoints.safetensors import SafeTensorsCheckpoint
    name = "language_model.model.layers.2.block_sparse_moe.experts.7.w3.weight_packed"
    path, begin, end = SafeTensorsCheckpoint(folder).byte_range(name)
    with open(path, "r+b") as f:
        f.seek(begin + (end - begin) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    out = _cli("verify", folder, "--manifest", manifest)
    assert out.returncode == 1
    assert f"MISMATCH {name}: the file's bytes differ from the manifest" in out.stdout


def test_verify_catches_bytes_the_kernels_would_not_get(ckpt):
    from mxfp4x.checkpoints.verify import verify_experts
    from mxfp4x.models.kimi_k3 import expert_tensors
    block = nn.KimiK3MoE.from_checkpoint(ckpt, layer=1, progress=False)
    handed = expert_tensors(block.experts, "language_model.", 1)
    assert not verify_experts(ckpt, layers=[1], handed=handed)["mismatches"]
    victim = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_scale"
    handed[victim] = handed[victim].clone()
    handed[victim][0, 0] ^= 1
    bad = verify_experts(ckpt, layers=[1], handed=handed)["mismatches"]
    assert bad == [(victim, "the bytes handed to the kernels differ from the file's")]


def test_layer_main_job_runs(tmp_path):
    out = _cli("layer", "--model", "kimi-k3", "--experts", "16", "--tokens", "1", "3",
               "--threads", "1", "--repeats", "1", "--dir", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "tokens/s" in out.stdout and out.stdout.count("check: T=") == 2
    assert not os.listdir(tmp_path)  # the written layer is removed


def test_layer_main_job_gpt_oss(tmp_path):
    out = _cli("layer", "--model", "gpt-oss-20b", "--experts", "8", "--tokens", "2",
               "--threads", "1", "--repeats", "1", "--dir", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "tokens/s" in out.stdout and "check: T=2" in out.stdout


def test_router_weight_converted_once_and_again_when_it_changes():
    from mxfp4x.models.kimi_k3 import KimiK3Router

    def same(a, b):
        return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

    g = torch.Generator().manual_seed(5)
    w = torch.randn(12, 64, generator=g).bfloat16()
    bias = torch.randn(12, generator=g)
    router = KimiK3Router(w.clone(), bias, top_k=3)  # (the module shares storage)
    # more tokens than the compiled dense product takes (it reads the bf16 weight itself)
    x = torch.randn(_dense.MAX_TOKENS + 1, 64, generator=g).bfloat16()
    first = router(x)
    wide = router._wide[1]
    assert same(router(x), first) and router._wide[1] is wide  # not converted again
    with torch.no_grad():
        router.weight.mul_(-1)  # in place: the next call sees it
    assert same(router(x), KimiK3Router(-w, bias, top_k=3)(x))
    assert router._wide[1] is not wide
    router.to(torch.float16)  # another dtype: converted again from it
    assert same(router(x.half()), KimiK3Router((-w).half(), bias.half(), top_k=3)(x.half()))
    # a weight put in place of the converted one cannot take its address: the cache
    # holds that memory, so (address, version) never names two weights
    held = router.weight.data_ptr()
    router.weight = torch.nn.Parameter(w.clone().half(), requires_grad=False)
    router.weight = torch.nn.Parameter(w.clone().half(), requires_grad=False)
    assert router._wide[2].data_ptr() == held != router.weight.data_ptr()
    assert same(router(x.half()), KimiK3Router(w.half(), bias.half(), top_k=3)(x.half()))


def test_block_threads_reach_every_compiled_product(tmp_path, rng, monkeypatch):
    # bf16 dense weights at one token: router, latent projections and shared experts run
    # the compiled dense kernel, on the experts' thread count (not torch's), same bits
    folder = str(tmp_path)
    write_k3_checkpoint(folder, k3_config(**TINY), [1], seed=4, shards=1)
    block = nn.KimiK3MoE.from_checkpoint(folder, layer=1, progress=False, num_threads=1)
    x = torch.from_numpy(rng.standard_normal((1, 256))).bfloat16()
    seen = []
    real = _dense._cpu.dense_bf16

    def spy(*args, n_threads, **kw):
        seen.append(n_threads)
        return real(*args, n_threads=n_threads, **kw)

    monkeypatch.setattr(_dense._cpu, "dense_bf16", spy)
    outs = {}
    for n in (1, 2):
        seen.clear()
        block.experts.num_threads = n
        outs[n] = block(x)
        # router, down, up, shared gate / up / down
        assert seen == [n] * 6, (n, seen)
    assert torch.equal(outs[1].view(torch.int16), outs[2].view(torch.int16))


def _with_config(ckpt, folder, **changes):
    """The checkpoint ``ckpt`` seen through ``folder``: its files linked, config.json's
    text config changed (a value None: the key removed)."""
    for name in os.listdir(ckpt):
        if name != "config.json":
            os.symlink(os.path.join(ckpt, name), os.path.join(folder, name))
    with open(os.path.join(ckpt, "config.json")) as f:
        config = json.load(f)
    text = config.get("text_config", config)
    for key, value in changes.items():
        if value is None:
            text.pop(key)
        else:
            text[key] = value["null"] if isinstance(value, dict) else value
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return str(folder)


@pytest.mark.parametrize("changes, match", [
    (dict(num_experts=None), "'num_experts' is missing"),
    (dict(num_experts_per_token=None), "'num_experts_per_token' is missing"),
    (dict(num_experts_per_token=17), "top_k 17 .* more than the 16 experts"),
    (dict(num_experts_per_token=0), r"num_experts_per_token\): expected an integer >= 1"),
    (dict(num_experts="16"), "num_experts: expected an integer"),
    (dict(num_experts=12), "the router scores 16 experts, config.json's num_experts is 12"),
    (dict(num_expert_group=3), "3 expert groups do not divide 16 experts"),
    (dict(num_expert_group=4, topk_group=5), "topk_group 5 is more than the 4"),
    (dict(num_expert_group=8, topk_group=1), "top_k 4 .* more than the 2 experts"),
    (dict(routed_scaling_factor="2.5"), "routed_scaling_factor: expected a finite number"),
    (dict(routed_scaling_factor={"null": None}), "routed_scaling_factor: expected a finite"),
    (dict(rms_norm_eps={"null": None}), "rms_norm_eps: expected a finite number"),
    (dict(moe_renormalize="false"), "moe_renormalize: expected true or false"),
])
def test_config_values_are_checked_and_named(tmp_path, ckpt, changes, match):
    """Each hyperparameter of config.json is checked where the block is loaded, and a
    bad one is named (they were KeyErrors, torch's TypeErrors or shape errors at the
    first forward, or silently accepted: top-k above the experts ran on all of them, 0
    dropped the routed experts)."""
    path = _with_config(ckpt, tmp_path, **changes)
    with pytest.raises(ValueError, match=match):
        nn.KimiK3MoE.from_checkpoint(path, layer=1, progress=False)


def test_from_checkpoint_takes_a_path_object(tmp_path, ckpt, rng):
    import pathlib

    x = torch.from_numpy(rng.standard_normal((3, 256))).float()
    want = nn.KimiK3MoE.from_checkpoint(ckpt, layer=1, progress=False)(x)
    got = nn.KimiK3MoE.from_checkpoint(pathlib.Path(ckpt), layer=1, progress=False)(x)
    assert torch.equal(got, want)  # it read config.json at the file system's root ("/")
    # groups that do divide the experts: the block loads and runs
    grouped = _with_config(ckpt, tmp_path, num_expert_group=4, topk_group=2)
    assert torch.isfinite(nn.KimiK3MoE.from_checkpoint(pathlib.Path(grouped), layer=1,
                                                       progress=False)(x)).all()


def _in_threads(fns, rounds):
    """Each fn called `rounds` times in its own thread, switching threads as often as the
    interpreter allows; the first exception of any thread is raised."""
    import threading
    errors = []

    def run(fn):
        try:
            for _ in range(rounds):
                fn()
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=run, args=(fn,)) for fn in fns]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    if errors:
        raise errors[0]


def test_router_in_threads_with_two_accumulation_dtypes():
    # float64 and float32 calls at once: each must keep its own converted weight (one
    # call returned the other's, and the product raised a dtype mismatch)
    from mxfp4x.models.kimi_k3 import KimiK3Router
    g = torch.Generator().manual_seed(6)
    router = KimiK3Router(torch.randn(12, 64, generator=g).bfloat16(),
                          torch.randn(12, generator=g), top_k=3)
    xs = [torch.randn(_dense.MAX_TOKENS + 1, 64, generator=g).to(d)
          for d in (torch.float32, torch.float64)]
    want = [router(x) for x in xs]

    def call(i):
        def fn():
            got = router(xs[i])
            assert torch.equal(got[0], want[i][0]) and torch.equal(got[1], want[i][1])
        return fn

    _in_threads([call(0), call(1)], 300)


def test_block_forwards_in_threads(ckpt, rng):
    block = nn.KimiK3MoE.from_checkpoint(ckpt, layer=1, progress=False)
    xs = [torch.from_numpy(rng.standard_normal((n, 256))).to(d)
          for n, d in ((1, torch.float32), (5, torch.float64), (9, torch.bfloat16))]
    want = [block(x) for x in xs]

    def call(i):
        def fn():
            assert torch.equal(block(xs[i]), want[i])
        return fn

    _in_threads([call(i) for i in range(3)], 20)
