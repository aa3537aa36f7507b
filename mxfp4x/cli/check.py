"""self-test: every ISA, dtype and backend vs the float64 reference

The self-test after install: each ISA this machine runs, each latent dtype, both backends
(the CPU kernels and torch), on small random layers, against the float64 reference."""
import numpy as np
import torch

import mxfp4x
from mxfp4x._core import cpu as _cpu
from mxfp4x._core import threads as _threads
from mxfp4x._synthetic import layers as _layers

from ._args import nonnegative_int

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# (n_tokens, top_k, n_experts, d_out, n_groups): odd sizes, one token and many
SHAPES = ((1, 4, 8, 37, 3), (33, 2, 5, 70, 5))


def add_arguments(parser):
    parser.add_argument("--seed", type=nonnegative_int, default=0)


def check(args, error):
    pass  # argparse checked every argument


def run(args):
    failures = 0
    rng = np.random.default_rng(args.seed)
    print(f"mxfp4x {mxfp4x.__version__} self-test (seed {args.seed}); "
          f"isas {_cpu.runnable_isas()}, openmp {_threads.have_openmp()}")
    for isa in _cpu.runnable_isas():
        for dtype in DTYPES:
            for backend in ("cpu", "torch"):
                for shape in SHAPES:
                    layer = _layers.random_layer(rng, *shape, dtype=dtype, repeat_expert=True)
                    try:
                        y = mxfp4x.mxfp4_experts(**layer, backend=backend, isa=isa)
                        _layers.assert_matches_reference(y, layer)
                        status = "ok"
                    except Exception as exc:  # noqa: BLE001 - reported, then counted
                        failures += 1
                        status = f"FAILED: {type(exc).__name__}: " \
                                 f"{(str(exc).splitlines() or [''])[0]}"
                    print(f"  {isa:7s} {str(dtype)[6:]:9s} {backend:6s} T={shape[0]:<3d} "
                          f"{status}")
    print("all checks passed" if not failures else f"{failures} checks FAILED")
    return 1 if failures else 0
