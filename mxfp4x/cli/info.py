"""version, ISA in use, ISAs, OpenMP, threads"""
import json

import mxfp4x


def add_arguments(parser):
    parser.add_argument("--json", action="store_true")


def check(args, error):
    pass  # argparse checked every argument


def run(args):
    info = mxfp4x.backend_info()
    if args.json:
        print(json.dumps(info))
    else:
        for k, v in info.items():
            print(f"{k:14s} {v}")
    return 0
