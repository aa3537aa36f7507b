"""python -m mxfp4x: the one place commands are listed, each command's --help, and the
commands a quick run can afford (layer runs in tests/models/test_kimi_k3.py; bench is CI's main
job)."""
import argparse
import json
import os
import pkgutil
import subprocess
import sys

import pytest
import torch

import mxfp4x
from mxfp4x import cli
from mxfp4x._measure import bench as _bench
from mxfp4x.checkpoints.safetensors import SafeTensorsFile, save_file
from mxfp4x.testing.layers import gguf_blocks_of

NAMES = ["info", "bench", "check", "quantize", "verify", "layer", "roofline", "ep-bench"]


def test_every_command_module_is_a_command():
    """A module of mxfp4x/cli/ not in COMMANDS would be a command --help never shows."""
    modules = {m.name for m in pkgutil.iter_modules(cli.__path__) if not m.name.startswith("_")}
    assert {m.__name__.rpartition(".")[2] for m in cli.COMMANDS} == modules
    assert [cli.command_name(m) for m in cli.COMMANDS] == NAMES
    for module in cli.COMMANDS:  # the help line --help shows
        assert module.__doc__.split("\n\n")[0].strip(), module


def test_commands_do_not_import_the_test_helpers():
    """The commands take what they share with the tests from mxfp4x._synthetic and
    mxfp4x._measure, never from mxfp4x.testing (the tests' and benchmarks' package)."""
    code = ("import pkgutil, sys, importlib, mxfp4x.cli as c\n"
            "for m in pkgutil.iter_modules(c.__path__):\n"
            "    importlib.import_module('mxfp4x.cli.' + m.name)\n"
            "print(sorted(n for n in sys.modules if n.startswith('mxfp4x.testing')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_help_lists_every_command(cli_run):
    out = cli_run("--help")
    assert out.returncode == 0, out.stderr
    for name in NAMES:
        assert name in out.stdout
    assert "(the default)" in out.stdout


@pytest.mark.parametrize("name", NAMES)
def test_help(cli_main, name):
    code, out, _ = cli_main(name, "--help")
    assert code == 0 and out.startswith(f"usage: python -m mxfp4x {name} ")
    assert "-h, --help" in out


def test_info_json(cli_run):
    out = cli_run("info", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["isa"] == mxfp4x.backend_info()["isa"] and "openmp" in info


def test_check_passes(cli_run):
    out = cli_run("check")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all checks passed" in out.stdout


# a wrong kernel (every output off by one, or a column short), then the result checks:
# under python -O, which strips assert statements, they must still fail
WRONG_UNDER_O = """
import sys
import numpy as np
import mxfp4x
from mxfp4x import cli
from mxfp4x.cli import bench
from mxfp4x.testing.layers import assert_matches_reference, random_layer

if __debug__:
    sys.exit("not run with python -O")
right = mxfp4x.mxfp4_experts
layer = random_layer(np.random.default_rng(0), 3, 2, 4, 40, 2)
y = right(**layer)
passed = []
for what, wrong in (("values", y + 1.0), ("shape", y[:, :-1])):
    try:
        assert_matches_reference(wrong, layer)
        passed.append(what)
    except AssertionError:
        pass
mxfp4x.mxfp4_experts = lambda *a, **k: right(*a, **k) + 1.0
call = tuple(layer[k] for k in ("latent_tokens", "selected_experts", "mixture_weights",
                                "shared_output"))
try:
    bench._check_result(call, layer["packed_weights"], layer["scale_bytes"], 40)
    passed.append("bench")
except AssertionError:
    pass
print("passed wrongly:", passed)
sys.exit(cli.main(["check"]))
"""


def test_result_checks_fail_on_wrong_results_under_python_O(tmp_path):
    """The self-test and bench's result check test something under ``python -O`` too:
    assert_matches_reference was bare ``assert`` statements, which -O strips (``check``
    passed a kernel off by one)."""
    out = subprocess.run([sys.executable, "-O", "-c", WRONG_UNDER_O], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert "passed wrongly: []" in out.stdout, out.stdout + out.stderr
    assert out.returncode == 1, out.stdout + out.stderr
    assert "checks FAILED" in out.stdout and "all checks passed" not in out.stdout
    assert "FAILED: AssertionError: error " in out.stdout


def test_quantize_file(tmp_path, cli_run):
    w = torch.randn(3, 8, 64)
    bias = torch.randn(3, 8)
    src, dst = str(tmp_path / "f.safetensors"), str(tmp_path / "q.safetensors")
    save_file({"experts.w": w, "experts.bias": bias, "norm": torch.randn(5)}, src)
    out = cli_run("quantize", src, dst, "--only", "experts.w")
    assert out.returncode == 0, out.stderr
    q = SafeTensorsFile(dst)
    assert set(q.keys()) == {"experts.w_blocks", "experts.w_scales", "experts.bias", "norm"}
    packed, scales = mxfp4x.quantize(w)
    assert torch.equal(q.get("experts.w_blocks"), packed)
    assert torch.equal(q.get("experts.w_scales"), scales)
    assert torch.equal(q.get("experts.bias"), bias)


def test_roofline_json(cli_run):
    out = cli_run("roofline", "--json", "--quick", "--threads", "1")
    assert out.returncode == 0, out.stderr
    roofs = json.loads(out.stdout)
    assert roofs["isas"] == mxfp4x.backend_info()["isas"]
    assert roofs["read_gbps"]["1"] > 0 and roofs["read_gbps_torch"]["1"] > 0
    peaks = roofs["fma_gflops"]["1"]
    assert set(peaks) == set(roofs["isas"]) and all(v > 0 for v in peaks.values())
    # the bf16 units' own peak where the entry measures one (avx512bf16's vdpbf16ps loop,
    # amx's tdpbf16ps loop)
    bf16 = roofs["bf16_dot_gflops"]["1"]
    assert set(bf16) == {isa for isa in roofs["isas"] if isa in ("avx512bf16", "amx")}, bf16
    assert all(v > 0 for v in bf16.values())
    assert roofs["matmul_gflops"]["1"]["float32"] > 0 and roofs["cpu"]["model"]


def test_ep_bench_takes_the_shapes_of_its_checkpoint(tmp_path, k3, cli_run):
    """ep-bench --checkpoint with a checkpoint smaller than the released model: tokens in
    its own shapes (they were made in Kimi K3's 3584-wide latent)."""
    out = cli_run("ep-bench", "--checkpoint", k3, "--tokens", "3", "--threads", "1",
                  "--repeats", "1", "--json", tmp_path / "ep.json")
    assert out.returncode == 0, out.stdout + out.stderr
    (row,) = json.loads((tmp_path / "ep.json").read_text())
    assert row["tokens"] == 3 and row["experts"] == 16
    assert os.listdir(tmp_path) == ["ep.json"]


def test_bf16_latents_take_the_bf16_units_floor():
    """bench's compute floor for bfloat16 latents is the bf16 unit's peak where the ISA
    has one measured, the float32 FMA peak otherwise (and for every other dtype)."""
    roofs = {"read_gbps": {1: 10.0}, "fma_gflops": {1: {"avx512": 100.0, "avx512bf16": 100.0}},
             "bf16_dot_gflops": {1: {"avx512bf16": 400.0}}}
    def floor(isa, dtype, r=roofs):
        return _bench.floors(1, 4e9, r, 1, isa, dtype)["fma_floor_s"]
    # 4 GFLOP: 40 ms at 100 GFLOP/s, 10 ms at 400
    assert floor("avx512bf16", "bfloat16") == pytest.approx(0.01)
    assert floor("avx512bf16", "float32") == pytest.approx(0.04)
    assert floor("avx512", "bfloat16") == pytest.approx(0.04)
    assert floor("avx512bf16", "bfloat16", dict(roofs, bf16_dot_gflops={})) == pytest.approx(0.04)


def test_bench_floors_take_the_read_roofs_measured_beside_the_case(monkeypatch, capsys):
    """bench measures the read roofs again just before and just after each case and takes
    the better (a noisy host's bandwidth moves between minutes), for that case only; with
    too little memory for the probe's buffers it keeps the roofs of the start and says so."""
    from mxfp4x._measure import roofline
    from mxfp4x.cli import bench

    class Probe:  # 20 GB/s before the case, 30 after; torch's memory 10 and 12
        seen = []

        def measure(self, threads):
            self.seen.append(threads)
            n = len(self.seen)
            return {"read_gbps": 20.0 if n % 2 else 30.0,
                    "read_gbps_torch": 10.0 if n % 2 else 12.0}
    packed, scales = _bench.make_experts(4, 64, 64, seed=5)
    calls = [_bench.make_tokens(1, 2, 4, 64, 64, call=0)]
    start = {"read_gbps": {1: 99.0, 2: 50.0}, "read_gbps_torch": {1: 99.0, 2: 40.0},
             "fma_gflops": {1: {"scalar": 1.0}}}
    args = argparse.Namespace(repeats=1, no_torch=True, dtype="float32")
    r = bench._measure(args, calls, packed, scales, 1, (1, 2, 64, 64), start, "scalar",
                       probe=Probe())
    assert Probe.seen == [1, 1]
    assert (r["read_gbps"], r["read_gbps_torch"]) == (30.0, 12.0)
    n_bytes = _bench.streamed_bytes(packed, scales, calls[0][1])
    assert r["read_floor_ms"] == pytest.approx(n_bytes / 30e9 * 1e3)
    assert r["vs_read_torch"] == pytest.approx(r["cpu_ms"] / (n_bytes / 12e9 * 1e3))
    assert start["read_gbps"] == {1: 99.0, 2: 50.0}  # the start's roofs are left as they were
    r = bench._measure(args, calls, packed, scales, 1, (1, 2, 64, 64), start, "scalar")
    assert r["read_gbps"] == 99.0
    # the probe itself: two buffers, both roofs, positive
    got = roofline.ReadProbe(1 << 20).measure(1, repeats=1)
    assert got["read_gbps"] > 0 and got["read_gbps_torch"] > 0
    monkeypatch.setattr(_bench, "available_memory", lambda: bench.PROBE_BYTES)
    assert bench._read_probe() is None
    assert "measured once at the start" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_predecoded_peer_computes_the_op(dtype, monkeypatch):
    """bench's predecoded-experts peer is the op (torch on experts decoded ahead of time):
    float32 within the op's bound of the float64 reference (bfloat16 rounds each product's
    rows and each addition, as torch does: within 2^-6 of the largest value), with an
    expert chosen twice by one token, experts nobody chose left undecoded, and None where
    its experts would not fit."""
    from mxfp4x.testing.layers import assert_matches_reference, reference_and_bound

    packed, scales = _bench.make_experts(6, 70, 96, seed=3)
    x, sel, mix, shared = _bench.make_tokens(9, 3, 6, 96, 70, dtype, call=2)
    sel[0] = torch.tensor([4, 4, 1])
    sel[sel == 5] = 2  # expert 5 unused
    pre = _bench.Predecoded(packed, scales, dtype)
    y = pre(x, sel, mix, shared)
    assert y.dtype == dtype and y.shape == shared.shape
    layer = dict(latent_tokens=x, packed_weights=packed, scale_bytes=scales,
                 selected_experts=sel, mixture_weights=mix, shared_output=shared)
    if dtype == torch.float32:
        assert_matches_reference(y, layer)
    else:
        ref = torch.from_numpy(reference_and_bound(layer, torch.float64)[0])
        assert (y.double() - ref).abs().max() <= 2**-6 * ref.abs().max()
    assert sorted(pre.decoded) == [0, 1, 2, 3, 4]
    assert pre.bytes_needed(sel) == 5 * 70 * 96 * torch.finfo(dtype).bits // 8
    threads = torch.get_num_threads()
    assert _bench.predecoded_time(pre, [(x, sel, mix, shared)], 1) > 0
    assert torch.get_num_threads() == threads
    # GGUF blocks: the same matrices, the same products
    blocks = torch.from_numpy(gguf_blocks_of(packed.numpy(), scales.numpy()))
    gguf = _bench.Predecoded(blocks, None, dtype)
    assert gguf.matrix_bytes == pre.matrix_bytes
    assert torch.equal(gguf(x, sel, mix, shared), y)
    # half the memory left: 2 experts' worth fits 2 experts, not 5
    small = _bench.Predecoded(packed, scales, dtype)
    monkeypatch.setattr(_bench, "available_memory", lambda: 4 * small.matrix_bytes)
    assert small.fits(sel[sel < 2]) and not small.fits(sel)
    assert _bench.predecoded_time(small, [(x, sel, mix, shared)], 1) is None
    assert not small.decoded


def test_bench_device_path_runs_off_a_gpu(tmp_path, capsys):
    """bench --device cuda's measuring code, run on the CPU with small roofs (the CI has
    no GPU; tests/cuda runs the command itself on one): a checked result, one row per T
    with its floors and peer, and the JSON it writes."""
    from mxfp4x.cli import bench

    out = tmp_path / "gpu.json"
    args = argparse.Namespace(shape="gpt-oss-20b-down", tokens=[1, 3], dtype="bfloat16",
                              repeats=1, json=str(out), plot=None)
    assert bench._run_cuda(args, torch.device("cpu"), roof_sizes=(1 << 20, 128)) == 0
    text = capsys.readouterr().out
    assert "roofs: cpu: read" in text and "torch.matmul float32" in text
    assert text.count("T=") == 2 and text.count("torch backend") == 3
    assert "check: a slice" in text
    rows = json.loads(out.read_text())
    assert [r["tokens"] for r in rows] == [1, 3]
    for r in rows:
        assert r["cuda_ms"] > 0 and r["torch_ms"] > 0 and r["matmul_ms"] > 0
        assert r["vs_read"] == pytest.approx(r["cuda_ms"] / r["read_floor_ms"])
        assert r["floor_ms"] >= r["read_floor_ms"]
