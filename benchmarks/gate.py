"""Benchmark regression gate: ratios measured in one run, against a stored baseline.

The machine is noisy and CI machines differ, so the gate compares ratios, each taken in
the same run: kernel time / memory-read floor at T = 1, and kernel time / decoded
``torch.matmul`` at T = 128 (gpt-oss-20b down shape: E=32, K=4, O=2880, I=2880).  A case
fails when its ratio is more than ``--tolerance`` (default 2.0) times the stored one on
five measurements in a row, four seconds apart (a busy neighbour on a shared machine
passes; a real regression, like the scalar kernels' 6x at T = 1, does not).

Baselines are keyed by ISA and thread count ("avx512-2"): a host is compared only with
ratios measured on the same kind of kernels (amx and avx512bf16, which run avx512's float32
kernels, with avx512's).  On a host whose key has no baseline the
gate records one (in gate_baseline.json) and skips the comparison, saying so.

    python benchmarks/gate.py                      # check (CI runs this)
    python benchmarks/gate.py --update             # store new baseline ratios for this key
    MXFP4X_ISA=scalar python benchmarks/gate.py --cases t1 --expect-fail --against avx512
                                                   # a deliberately slowed kernel trips it
"""
import argparse
import json
import os
import sys
import time

import mxfp4x
from mxfp4x._core import cpu as _cpu
from mxfp4x._core import threads as _threads
from mxfp4x._core.files import atomic_write
from mxfp4x.testing import bench as _bench
from mxfp4x.testing import roofline as _roofline

BASELINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gate_baseline.json")
SHAPE = "gpt-oss-20b-down"


def measure(case, packed, scales, threads):
    n_experts, top_k, d_out, d_in = _bench.SHAPES[SHAPE]
    n_tokens = 1 if case == "t1" else 128
    calls = [_bench.make_tokens(n_tokens, top_k, n_experts, d_in, d_out, call=i)
             for i in range(8)]

    def run(i):
        c = calls[i % len(calls)]
        mxfp4x.mxfp4_experts(c[0], packed, scales, c[1], c[2], c[3], num_threads=threads)

    run(0)
    t = _roofline.best_time(run, repeats=8 if case == "t1" else 3)
    if case == "t1":
        # the bytes at the machine's read bandwidth, measured now (the roofline's figure)
        n_bytes = _bench.streamed_bytes(packed, scales, calls[0][1])
        floor = n_bytes / _roofline.read_bandwidth(threads)
    else:
        floor = _bench.matmul_roof(n_tokens, top_k, d_out, d_in, threads, repeats=3)
    return t / floor


def _load():
    """{"<isa>-<threads>": {case: ratio}} (an older single-baseline file is read as one key)."""
    if not os.path.exists(BASELINE):
        return {}
    with open(BASELINE) as f:
        data = json.load(f)
    if "ratios" in data:
        return {f"{data['isa']}-{data['threads']}": data["ratios"]}
    return data


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--update", action="store_true", help="store the measured ratios")
    ap.add_argument("--cases", nargs="+", default=["t1", "t128"], choices=["t1", "t128"])
    ap.add_argument("--tolerance", type=float, default=2.0)
    ap.add_argument("--attempts", type=int, default=5)
    ap.add_argument("--expect-fail", action="store_true",
                    help="exit 0 only if the gate trips (to prove it can)")
    ap.add_argument("--against", metavar="ISA",
                    help="compare with this ISA's baseline (default: the ISA that runs)")
    args = ap.parse_args(argv)
    threads = min(2, _threads.resolve(None))
    n_experts, _, d_out, d_in = _bench.SHAPES[SHAPE]
    packed, scales = _bench.make_experts(n_experts, d_out, d_in)
    isa = mxfp4x.backend_info()["isa"]
    # float32 latents: amx and avx512bf16 run avx512's kernels, and share its baselines
    key = f"{_cpu.float32_isa(args.against or isa)}-{threads}"
    baselines = _load()
    if args.update or key not in baselines:
        if key not in baselines and args.expect_fail:
            print(f"no baseline for {key} to trip against")
            return 1
        # the median of five: a typical value, not a lucky one
        ratios = {c: sorted(measure(c, packed, scales, threads) for _ in range(5))[2]
                  for c in ("t1", "t128")}
        baselines[key] = ratios
        with atomic_write(BASELINE, "w") as f:
            json.dump(baselines, f, indent=1, sort_keys=True)
        print(f"baseline {key} recorded: {ratios}" + ("" if args.update else
              " (this host's kind had none; nothing compared: baselines are per ISA)"))
        return 0
    base = baselines[key]
    failed = []
    for case in args.cases:
        limit = args.tolerance * base[case]
        tries = []
        for attempt in range(args.attempts):
            if attempt:
                time.sleep(4.0)
            tries.append(measure(case, packed, scales, threads))
            if tries[-1] <= limit:
                break
        ok = tries[-1] <= limit
        what = "kernel / read floor, T=1" if case == "t1" else "kernel / decoded matmul, T=128"
        print(f"{case}: {what} = {', '.join(f'{r:.2f}' for r in tries)} "
              f"(baseline {key} {base[case]:.2f}, limit {limit:.2f}, isa {isa}) "
              f"{'ok' if ok else 'REGRESSION'}")
        if not ok:
            failed.append(case)
    if args.expect_fail:
        print("gate tripped as expected" if failed else "gate did NOT trip")
        return 0 if failed else 1
    return 1 if failed else 0


if __name__ == "__main__":
    _info = mxfp4x.backend_info()
    if _info["build"].get("emulated") == _info["isa"]:
        # MXFP4X_EMULATE_AVX512=1 (a test build): SIMDe timings say nothing of the kernels
        print(f"gate skipped: this build emulates {_info['isa']} through SIMDe "
              "(MXFP4X_EMULATE_AVX512=1); rebuild without it to measure")
        sys.exit(0)
    sys.exit(main())
