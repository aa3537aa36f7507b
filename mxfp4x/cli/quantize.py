"""float tensors of a .safetensors file -> MXFP4 (<name>_blocks, <name>_scales)

Groups of 32 run along the last dimension; the scale rule is one of OCP MX v1.0's. The
output may be the input itself: it is replaced whole once written. The input's
__metadata__ entries are kept, beside ours (mxfp4x, scale_rule), which win on a clash."""
import mxfp4x
from mxfp4x._core.format import GROUP
from mxfp4x.checkpoints import safetensors as _safetensors

from ._args import existing_file, message, outputs


def add_arguments(parser):
    parser.add_argument("input")
    parser.add_argument("output", help="may be the input itself: it is replaced when done")
    parser.add_argument("--scale-rule", choices=["floor", "ceil", "even"], default="floor")
    parser.add_argument("--only", nargs="+", metavar="SUBSTRING",
                        help=f"quantize only tensors whose names contain one of these "
                             f"(default: every float tensor of rank >= 2 with a last "
                             f"dimension divisible by {GROUP}, except *bias; groups run "
                             f"along the last dimension)")


def _quantizable(t):
    """Float weights (not E8M0 scales, which are bytes) of rank >= 2 whose rows are whole
    groups."""
    return (t.is_floating_point() and t.element_size() >= 2 and t.dim() >= 2
            and t.shape[-1] % GROUP == 0)


def check(args, error):
    """Opens the input (headers only) and chooses its tensors: ``args.source``,
    ``args.chosen``."""
    existing_file(args.input, "argument input", error)
    # the input read is no refusal here: written over in place is what quantize f f means
    outputs([(args.output, "argument output")], error)
    try:
        args.source = _safetensors.SafeTensorsFile(args.input)
        # views of one mapping (get_many: one per tensor would meet the kernel's cap on
        # mappings, ~65000, in a file of that many tensors): no bytes are read, but every
        # entry's dtype is checked
        tensors = args.source.get_many(list(args.source.keys()))
    except (OSError, TypeError, ValueError) as exc:
        error(f"argument input: {message(exc)}")
    for part in args.only or ():
        if not any(part in name for name in tensors):
            error(f"argument --only: no tensor name of {args.input} contains {part!r}")
    args.chosen = {name for name, t in tensors.items() if _quantizable(t) and (
        any(s in name for s in args.only) if args.only
        else not name.endswith("bias"))}  # biases stay as they are unless asked for
    if not args.chosen:
        error(f"argument input: no tensor of {args.input} to quantize (float, rank >= 2, a "
              f"last dimension divisible by {GROUP}"
              + (", a name containing one of --only)" if args.only else ", not *bias)"))
    made = set(tensors) - args.chosen
    for name in sorted(args.chosen):
        for new in (name + "_blocks", name + "_scales"):
            if new in made:
                error(f"argument input: quantizing {name!r} would overwrite the tensor "
                      f"{new!r} the file also holds")
            made.add(new)


def run(args):
    out = {}
    for name, t in args.source.get_many(list(args.source.keys())).items():
        if name in args.chosen:
            packed, scales = mxfp4x.quantize(t, args.scale_rule)
            out[name + "_blocks"], out[name + "_scales"] = packed, scales
        else:
            out[name] = t
    # the kept tensors are views of the input's mapping: save_file replaces the output
    # whole, so writing over the input itself (output == input) is safe
    metadata = {**args.source.metadata, "mxfp4x": mxfp4x.__version__,
                "scale_rule": args.scale_rule}
    _safetensors.save_file(out, args.output, metadata)
    n_q = len(args.chosen)
    print(f"quantized {n_q} tensors, kept {len(out) - 2 * n_q} as they were -> {args.output}")
    return 0
