"""Fixtures of the command-line tests: the command line run in this process or in a new
one, tiny Kimi K3 checkpoints in the release's layout, and a tensor's bytes tampered with
in its file."""
import subprocess
import sys

import pytest
import torch

from mxfp4x import cli
from mxfp4x.testing.kimi_k3 import k3_config, write_k3_checkpoint

# config.json says 3 layers, the files hold layers 1 and 5: the loader reads both
TINY = dict(hidden_size=256, routed_expert_hidden_size=128, num_experts=16,
            num_experts_per_token=4, moe_intermediate_size=64, num_shared_experts=2,
            num_hidden_layers=3)


@pytest.fixture
def cli_main(capsys):
    """(exit status, stdout, stderr) of ``python -m mxfp4x *argv``, in this process."""
    def call(*argv):
        try:
            code = cli.main([str(a) for a in argv])
        except SystemExit as exc:
            code = exc.code
        out = capsys.readouterr()
        return code, out.out, out.err
    return call


@pytest.fixture
def cli_run(tmp_path):
    """``python -m mxfp4x *argv`` in a new process (run in a temporary folder)."""
    def call(*argv, **kw):
        kw.setdefault("cwd", tmp_path)
        return subprocess.run([sys.executable, "-m", "mxfp4x", *map(str, argv)],
                              capture_output=True, text=True, timeout=600, **kw)
    return call


@pytest.fixture(scope="session")
def make_k3():
    """A tiny Kimi K3 checkpoint with these MoE layers in ``folder``."""
    def make(folder, layers=(1, 5)):
        write_k3_checkpoint(str(folder), k3_config(**TINY), list(layers), seed=7, shards=2,
                            dense_dtype=torch.float32)
        return str(folder)
    return make


@pytest.fixture(scope="session")
def k3(tmp_path_factory, make_k3):
    """Read-only: tests that change a checkpoint write their own."""
    return make_k3(tmp_path_factory.mktemp("k3"))


@pytest.fixture
def flip_byte():
    """``flip(checkpoint, name)``: one bit of the middle byte of tensor ``name`` flipped
    in its file, in place (``checkpoint``: a SafeTensorsCheckpoint or a GGUFCheckpoint,
    whose ``byte_range`` says where the tensor's bytes are)."""
    def flip(checkpoint, name):
        path, begin, end = checkpoint.byte_range(name)
        with open(path, "r+b") as f:
            f.seek((begin + end) // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x10]))
    return flip
