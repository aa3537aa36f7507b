"""Expert parallelism: one Kimi K3 layer's routed experts in 1 process x 2 threads against
2 processes x 1 thread (each holding half the experts), launched with torchrun.

The ranks time themselves (``python -m mxfp4x ep-bench``: a call's time is the slowest
rank's, after a barrier); this file launches both configurations and records, per T, in
``extra_info``: the time per call, the bytes sent per call (all ranks), the share of the
time spent in the all-to-alls, and resident and mapped memory per process.  The layer
has E = 896 experts (14.8 GB) unless MXFP4X_EP_EXPERTS says fewer (top-16 and the matrix
shapes stay); MXFP4X_BENCH_SMALL=1 runs 32 experts at T = 1, 8.
"""
import json
import os
import subprocess
import sys
import tempfile

import pytest

SMALL = os.environ.get("MXFP4X_BENCH_SMALL") == "1"
EXPERTS = 32 if SMALL else int(os.environ.get("MXFP4X_EP_EXPERTS", "896"))
TOKENS = [1, 8] if SMALL else [1, 32, 512]


@pytest.fixture(scope="module")
def runs():
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "k3")
        for name, procs, threads in (("1x2", 1, 2), ("2x1", 2, 1)):
            path = os.path.join(tmp, f"{name}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={procs}", "-m", "mxfp4x", "ep-bench", "--experts",
                   str(EXPERTS), "--threads", str(threads), "--json", path, "--tokens",
                   *map(str, TOKENS), "--dir", tmp]
            if os.path.isdir(ckpt):
                cmd += ["--checkpoint", ckpt]
            else:
                cmd += ["--keep"]
            env = dict(os.environ, OMP_NUM_THREADS=str(threads))
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
            assert done.returncode == 0, done.stderr[-3000:]
            if not os.path.isdir(ckpt):  # keep the first layer for the second launch
                kept = [d for d in os.listdir(tmp) if d.startswith("mxfp4x-ep-")]
                os.rename(os.path.join(tmp, kept[0]), ckpt)
            with open(path) as f:
                out[name] = {row["tokens"]: row for row in json.load(f)}
    return out


@pytest.mark.parametrize("config", ["1x2", "2x1"])
@pytest.mark.parametrize("n_tokens", TOKENS)
def test_ep(benchmark, runs, config, n_tokens):
    row = runs[config][n_tokens]
    benchmark.group = f"kimi-k3 experts E={EXPERTS} T={n_tokens}"
    benchmark.extra_info.update(row)
    benchmark.extra_info["vs_1x2"] = row["time_s"] / runs["1x2"][n_tokens]["time_s"]
    # the ranks timed the call themselves; record that figure as this case's time
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
