"""the roofs of this machine: memory read bandwidth, FMA peak per ISA, torch.matmul"""
import json

from mxfp4x._measure import roofline as _roofline

from ._args import thread_count


def add_arguments(parser):
    parser.add_argument("--threads", type=thread_count, nargs="+", default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")


def check(args, error):
    pass  # argparse checked every argument


def run(args):
    roofs = _roofline.measure(args.threads, quick=args.quick)
    if args.json:
        print(json.dumps(roofs))
        return 0
    cpu = roofs["cpu"]
    print(f"{cpu['model']} ({cpu['machine']}, {cpu['cores']} cores; flags: "
          f"{' '.join(cpu['flags']) or '-'}); mxfp4x ISAs here: {roofs['isas']}")
    for th in roofs["threads"]:
        fma = ", ".join(f"{isa} {v:.0f}" for isa, v in roofs["fma_gflops"][th].items())
        bf16 = "".join(f"; bf16 unit {isa} {v:.0f}"
                       for isa, v in roofs["bf16_dot_gflops"][th].items())
        mm = roofs["matmul_gflops"][th]
        print(f"threads={th}: memory read {roofs['read_gbps'][th]:.1f} GB/s (torch's memory "
              f"{roofs['read_gbps_torch'][th]:.1f}); FMA peak "
              f"(GFLOP/s, float32) {fma}{bf16}; torch.matmul 2048^2 float32 "
              f"{mm['float32']:.0f}, bfloat16 {mm['bfloat16']:.0f} GFLOP/s")
    return 0
