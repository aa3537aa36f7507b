"""Peak extra memory of one call: at most 64 MiB + the output, for any E and T (long
prefills run in chunks of tokens: Kimi K3 w1 at T = 8192 is the case measured).

Measured in a fresh process: build the inputs, reset the kernel's resident-set
high-water mark (``/proc/self/clear_refs``), make one call, and read how far the
peak rose above the resident set before the call (``VmHWM - VmRSS``).
"""
import json
import os
import subprocess
import sys

import pytest

SMALL = os.environ.get("MXFP4X_BENCH_SMALL") == "1"

_PROBE = r"""
import json, sys, torch, mxfp4x
from mxfp4x.testing import bench as _bench
E, K, O, I = _bench.SHAPES[sys.argv[1]]
T, dtype = int(sys.argv[2]), getattr(torch, sys.argv[3])
if sys.argv[4] == "1":
    E, O, I = min(E, 8), 96, 128
    K = min(K, 4)
packed, scales = _bench.make_experts(E, O, I)
x, sel, mix, shared = _bench.make_tokens(T, K, E, I, O, dtype)
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
mxfp4x.mxfp4_experts(x[:1], packed, scales, sel[:1], mix[:1], shared[:1])  # warm up
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS:")
y = mxfp4x.mxfp4_experts(x, packed, scales, sel, mix, shared)
peak = status("VmHWM:")
print(json.dumps({"extra": peak - before, "output": y.numel() * y.element_size()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape,n_tokens", [("gpt-oss-20b-gate-up", 1),
                                            ("gpt-oss-20b-gate-up", 512),
                                            ("kimi-k3-w1", 8192)])
def test_peak_extra_memory(benchmark, shape, n_tokens, dtype):
    def measure():
        out = subprocess.run([sys.executable, "-c", _PROBE, shape, str(n_tokens), dtype,
                              "1" if SMALL else "0"], capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    got = benchmark.pedantic(measure, rounds=1, iterations=1)
    limit = 64 * 2**20 + got["output"]
    benchmark.extra_info.update(shape=shape, tokens=n_tokens, dtype=dtype,
                                extra_bytes=got["extra"], output_bytes=got["output"],
                                limit_bytes=limit, extra_mib=got["extra"] / 2**20)
    assert got["extra"] <= limit, f"peak extra {got['extra'] / 2**20:.1f} MiB > limit"
