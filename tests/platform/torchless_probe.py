"""The extension without torch, for runs under QEMU (``python torchless_probe.py PKG_DIR
ISA N_THREADS``; ISA "default" runs the default one): which ISAs it finds, all 256 x 256
bytes and scale bytes decoded bit for bit, and a whole call (one token and many) against
the float64 reference, through the typed boundary with numpy arrays.  Prints one JSON
line.  Shared by test_portability.py (CPUs without AVX2 / AVX-512) and test_emulation.py
(the SIMDe-emulated AVX-512 build on a CPU without AVX)."""
import json
import sys
import types

import numpy as np

pkg = types.ModuleType("mxfp4x")
pkg.__path__ = [sys.argv[1]]
sys.modules["mxfp4x"] = pkg  # the package's modules, without its torch-importing __init__
from mxfp4x._core import cpu, probes, reference  # noqa: E402

isa = None if sys.argv[2] == "default" else sys.argv[2]
n_threads = int(sys.argv[3])
result = {"isa": cpu.default_isa(), "isas": cpu.runnable_isas(),
          "emulated": cpu.build_info()["emulated"]}

packed = np.tile(np.arange(256, dtype=np.uint8).reshape(16, 16), (256, 1, 1))
scales = np.tile(np.arange(256, dtype=np.uint8)[:, None], (1, 16))
got = probes.decode_rows(packed, scales, isa=isa)
with np.errstate(over="ignore"):
    ref = reference.decode_expert(packed, scales).astype(np.float32)
nan = np.isnan(ref)
result["decode_ok"] = bool((np.isnan(got) == nan).all() and
                           (got[~nan].view(np.uint32) == ref[~nan].view(np.uint32)).all())

rng = np.random.default_rng(3)
T, K, E, O, G = 20, 3, 4, 37, 5  # noqa: E741 (tokens, top-k, experts, d_out, groups)
x = rng.standard_normal((T, 32 * G)).astype(np.float32)
pk = rng.integers(0, 256, (E, O, G, 16), dtype=np.uint8)
sc = rng.integers(120, 132, (E, O, G), dtype=np.uint8)
sel = rng.integers(0, E, (T, K)).astype(np.int64)
sel[0] = 1  # expert 1 gets a lone token: the one-token path as well as panels
mix = rng.random((T, K)).astype(np.float32)
shared = rng.standard_normal((T, O)).astype(np.float32)
y = shared.copy()
table = np.array([[pk[e].ctypes.data, sc[e].ctypes.data, pk.strides[1], sc.strides[1]]
                  for e in range(E)], dtype=np.int64)
experts = cpu.Experts(table, d_out=O, n_groups=G, owner=(pk, sc))
call = cpu.Call(experts, product="forward", compute="float32", selected=sel, mix=mix, src=x,
                 src_dtype="float32", src_rows="token", dst=y, dst_rows="token",
                 n_threads=n_threads, isa=isa)
call.run()
result["ran"] = call.isa
ref = reference.mxfp4_experts_reference(x, pk, sc, sel, mix, shared)
mag = reference.mxfp4_experts_reference(np.abs(x), pk, sc, sel, np.abs(mix), np.abs(shared),
                                         absolute=True)
bound = reference.error_bound(mag, 32 * G + K + 2, "float32")
result["moe_ok"] = bool((np.abs(y - ref) <= bound).all())
result["moe_worst"] = float((np.abs(y - ref) / bound).max())
print(json.dumps(result))
