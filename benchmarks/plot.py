"""Plot a pytest-benchmark JSON of bench_experts.py: achieved GB/s and GFLOP/s
across T against the floors measured in the same run.

    pytest benchmarks/bench_experts.py --benchmark-only --benchmark-json=out.json
    python benchmarks/plot.py out.json benchmarks/results.png
"""
import json
import sys
from collections import defaultdict


def main(src, dst, shape="gpt-oss-20b-gate-up", dtype="float32"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(src) as f:
        rows = [b["extra_info"] for b in json.load(f)["benchmarks"]
                if b["extra_info"].get("impl") == "cpu" and "time_s" in b["extra_info"]]
    rows = [r for r in rows if r["shape"] == shape and r["dtype"] == dtype]
    by_threads = defaultdict(list)
    for r in rows:
        by_threads[r["threads"]].append(r)
    fig, (ax_bw, ax_fl) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red")
    for (threads, rs), color in zip(sorted(by_threads.items()), colors, strict=False):
        rs.sort(key=lambda r: r["tokens"])
        t = [r["tokens"] for r in rs]
        ax_bw.plot(t, [r["gbps"] for r in rs], "o-", color=color,
                   label=f"mxfp4x, {threads} thread(s)")
        ax_bw.plot(t, [r["bytes"] / r["read_floor_s"] / 1e9 for r in rs], "--", color=color,
                   label=f"memory read, {threads} thread(s)")
        ax_fl.plot(t, [r["gflops"] for r in rs], "o-", color=color,
                   label=f"mxfp4x, {threads} thread(s)")
        ax_fl.plot(t, [r["flops"] / r["matmul_s"] / 1e9 for r in rs], "--", color=color,
                   label=f"torch.matmul on decoded weights, {threads} thread(s)")
    for ax, name in ((ax_bw, "GB/s of MXFP4 weights streamed"), (ax_fl, "GFLOP/s")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens T")
        ax.set_ylabel(name)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"mxfp4x CPU kernels, {shape}, {dtype} latents, isa={rows[0]['isa']}"
                 if rows else "no rows")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:])
