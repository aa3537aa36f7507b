import os

import pytest

import mxfp4x
from mxfp4x._core import threads as _threads


def pytest_report_header(config):
    info = mxfp4x.backend_info()
    small = os.environ.get("MXFP4X_BENCH_SMALL") == "1"
    return [f"mxfp4x {info['version']} isa={info['isa']} isas={info['isas']} "
            f"openmp={info['openmp']} threads={info['num_threads']} small={small}"]


@pytest.fixture
def threads(request):
    n = request.param
    if n > os.cpu_count():
        pytest.skip(f"{n} threads > {os.cpu_count()} CPUs")
    with _threads.torch_threads(n):
        yield n


@pytest.fixture(scope="session")
def roofs():
    """The machine's roofs, measured once per session (``python -m mxfp4x roofline``):
    every case takes its floors from them."""
    from mxfp4x.testing import roofline as _roofline
    small = os.environ.get("MXFP4X_BENCH_SMALL") == "1"
    threads = sorted({1, min(2, os.cpu_count() or 1)})
    _ROOFS.update(_roofline.measure(threads=threads, quick=small))
    return _ROOFS


_ROOFS: dict = {}  # this pytest run's roofs, for the summary below


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The target table of bench_experts.py's cases, and the cross-case targets."""
    import sys
    rows = next((m.benchmark_rows for name, m in list(sys.modules.items())
                 if name.rpartition(".")[2] == "bench_experts"
                 and hasattr(m, "benchmark_rows")), [])
    if not rows:
        return
    from mxfp4x.testing import bench as _bench
    w = terminalreporter.write_line
    w("")
    w(f"mxfp4x targets, isa {rows[0]['isa']}: time / floor from this run's roofs")
    if _ROOFS:
        isa = rows[0]["isa"]
        cpu = _ROOFS['cpu']
        name = cpu.get('model', cpu) if isinstance(cpu, dict) else cpu
        w(f"roofs ({name}), by threads " + "; ".join(
            f"{th}: read {_ROOFS['read_gbps'][th]:.1f} GB/s (torch's memory "
            f"{_ROOFS['read_gbps_torch'][th]:.1f}), FMA {isa} "
            f"{_ROOFS['fma_gflops'][th].get(isa, float('nan')):.0f} GFLOP/s, torch.matmul "
            f"float32 {_ROOFS['matmul_gflops'][th]['float32']:.0f}" for th in _ROOFS["threads"]))
    w(f"{'shape':22s} {'T':>4s} {'dtype':8s} {'thr':>3s} {'ms':>9s} {'GFLOP/s':>8s} "
      f"{'xread':>6s} {'xrd-t':>6s} {'xfloor':>6s} {'xmatmul':>7s} {'xpredec':>7s} {'FMA%':>5s}"
      f"  target")
    for r in rows:
        w(f"{r['shape']:22s} {r['tokens']:4d} {r['dtype']:8s} {r['threads']:3d} "
          f"{r['time_s'] * 1e3:9.2f} {r['gflops']:8.1f} {r['vs_read_floor']:6.2f} "
          f"{r['vs_read_floor_torch']:6.2f} {r['vs_floor']:6.2f} {r['vs_matmul']:7.2f} "
          f"{'    n/a' if r['vs_predecoded'] is None else format(r['vs_predecoded'], '7.2f')} "
          f"{100 * r['fma_share']:5.1f}  "
          f"{'    ' if r['met'] is None else 'met ' if r['met'] else 'MISS'} {r['target']}")
    key = {(r["shape"], r["tokens"], r["dtype"], r["threads"]): r["time_s"] for r in rows}
    for (shape, t, dtype, th), s in sorted(key.items()):
        if dtype == "bfloat16" and (shape, t, "float32", th) in key:
            ratio = s / key[(shape, t, "float32", th)]
            w(f"{shape:22s} {t:4d} bfloat16 / float32 at {th} threads: {ratio:5.2f} "
              f"{'met ' if ratio <= 1.0 else 'MISS'} (never slower)")
        if dtype == "float32" and th == 1 and t >= _bench.BIG_T and (shape, t, dtype, 2) in key:
            speedup = s / key[(shape, t, dtype, 2)]
            w(f"{shape:22s} {t:4d} float32 2 threads vs 1: {speedup:5.2f}x "
              f"{'met ' if speedup >= 1.8 else 'MISS'} (>= 1.8x)")
