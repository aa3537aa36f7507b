"""python -m mxfp4x: info, check, quantize, --help (bench is CI's main job)."""
import json
import os
import subprocess
import sys

import pytest
import torch

import mxfp4x
from mxfp4x.checkpoints.safetensors import SafeTensorsFile, save_file

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(*args):
    return subprocess.run([sys.executable, "-m", "mxfp4x", *args], capture_output=True,
                          text=True, timeout=600, cwd=HERE)


def test_info_json():
    out = _run("info", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["isa"] == mxfp4x.backend_info()["isa"] and "openmp" in info


def test_check_passes():
    out = _run("check")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all checks passed" in out.stdout


@pytest.mark.parametrize("cmd", ["info", "bench", "check", "quantize"])
def test_help(cmd):
    out = _run(cmd, "--help")
    assert out.returncode == 0 and "usage" in out.stdout


def test_quantize_file(tmp_path):
    w = torch.randn(3, 8, 64)
    bias = torch.randn(3, 8)
    src, dst = str(tmp_path / "f.safetensors"), str(tmp_path / "q.safetensors")
    save_file({"experts.w": w, "experts.bias": bias, "norm": torch.randn(5)}, src)
    out = _run("quantize", src, dst, "--only", "experts.w")
    assert out.returncode == 0, out.stderr
    q = SafeTensorsFile(dst)
    assert set(q.keys()) == {"experts.w_blocks", "experts.w_scales", "experts.bias", "norm"}
    packed, scales = mxfp4x.quantize(w)
    assert torch.equal(q.get("experts.w_blocks"), packed)
    assert torch.equal(q.get("experts.w_scales"), scales)
    assert torch.equal(q.get("experts.bias"), bias)


def test_roofline_json():
    out = _run("roofline", "--json", "--quick", "--threads", "1")
    assert out.returncode == 0, out.stderr
    roofs = json.loads(out.stdout)
    assert roofs["isas"] == mxfp4x.backend_info()["isas"]
    assert roofs["read_gbps"]["1"] > 0
    peaks = roofs["fma_gflops"]["1"]
    assert set(peaks) == set(roofs["isas"]) and all(v > 0 for v in peaks.values())
    assert roofs["matmul_gflops"]["1"]["float32"] > 0 and roofs["cpu"]["model"]
