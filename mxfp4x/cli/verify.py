"""sha256 of every expert tensor of a checkpoint: the file's bytes vs the bytes the
loader hands to the kernels

The checkpoint is a safetensors one (a folder with config.json, or a .safetensors file
beside one) or a GGUF model (a .gguf file, or any file of a split set
name-0000N-of-0000M.gguf). Every expert tensor of the layers asked (default: every layer
holding expert tensors) is hashed from its file's byte range and compared with the bytes
the loader maps for the kernels, and with a manifest if given (each of its entries is
checked). The family comes from config.json's model_type (gpt-oss: the stacked
model.layers.L.mlp.experts.{gate_up,down}_proj_{blocks,scales}; Kimi K3: each expert's
w1, w2, w3 weight_packed and weight_scale). In a GGUF file the expert tensors are
blk.L.ffn_{gate,up,down}_exps.weight,
hashed as stored (MXFP4 blocks, scale byte first); one in another type than MXFP4 is a
mismatch. Exit status 1 on any mismatch, and when nothing was checked (no expert's
bytes). --write-manifest writes the hashes only when everything matched, and never
over the --manifest file or a file of the checkpoint."""
import json
import os
import sys
import time

from mxfp4x._core.files import atomic_write
from mxfp4x.checkpoints import families as ck
from mxfp4x.checkpoints import verify as _verify
from mxfp4x.checkpoints._header import read_json
from mxfp4x.checkpoints.gguf import GGUFCheckpoint, is_gguf

from ._args import (
    CHECKPOINT_ERRORS,
    checkpoint_inputs,
    existing_file,
    message,
    nonnegative_int,
    outputs,
    regular_inputs,
)


def add_arguments(parser):
    parser.add_argument("checkpoint", help="a safetensors checkpoint (folder or file) or a "
                        "GGUF file (any file of a split set)")
    parser.add_argument("--layers", type=nonnegative_int, nargs="+", default=None,
                        help="default: every layer whose expert tensors the checkpoint holds")
    parser.add_argument("--manifest", metavar="JSON", help="also compare with these hashes")
    parser.add_argument("--write-manifest", metavar="JSON", help="write the hashes")


def _manifest(path, error):
    existing_file(path, "argument --manifest", error)
    try:
        doc = read_json(path, "the manifest")  # capped: MAX_JSON_BYTES
    except (OSError, ValueError) as exc:
        error(f"argument --manifest: {message(exc)}")
    try:
        return _verify.check_manifest(doc, "argument --manifest")
    except ValueError as exc:
        error(str(exc))


def check(args, error):
    """Opens the checkpoint (headers only) and reads the manifest: ``args.opened``,
    ``args.hashes``."""
    checkpoint_inputs(args.checkpoint, "argument checkpoint", error)
    args.gguf = os.path.isfile(args.checkpoint) and is_gguf(args.checkpoint)
    try:
        if args.gguf:
            args.opened = GGUFCheckpoint(args.checkpoint)
            available = sorted(ck.gguf_expert_tensors(args.opened))
            kind = "blk.L.ffn_*_exps.weight"
            files = args.opened.paths
        else:
            config = ck.read_config(args.checkpoint)
            naming = ck.family_of(config)
            ck.num_experts(config, naming)
            args.opened = ck.open_checkpoint(args.checkpoint)
            available = ck.moe_layers(args.opened, naming)
            kind = naming.name
            files = ck.checkpoint_files(args.opened)
    except CHECKPOINT_ERRORS as exc:
        error(f"argument checkpoint: {message(exc)}")
    regular_inputs(files, "argument checkpoint", error)
    if not available:
        error(f"argument checkpoint: {args.checkpoint} holds no {kind} expert tensors: "
              f"nothing to verify")
    for i, layer in enumerate(args.layers or ()):
        if layer in args.layers[:i]:
            error(f"argument --layers: layer {layer} given twice")
        if layer not in available:
            error(f"argument --layers: layer {layer} has no expert tensors in "
                  f"{args.checkpoint} (its expert layers: {available})")
    args.hashes = _manifest(args.manifest, error) if args.manifest else None
    # the manifest read is the reference: writing over it would replace it by the hashes
    # of the files it is meant to check
    reads = [(path, f"a file of the checkpoint {args.checkpoint!r}") for path in files]
    if args.manifest:
        reads.append((args.manifest, "the manifest of --manifest"))
    outputs([(args.write_manifest, "argument --write-manifest")], error, reads=reads,
            checkpoints=[args.checkpoint])


def run(args):
    t0 = time.perf_counter()
    try:
        verify = _verify.verify_gguf_experts if args.gguf else _verify.verify_experts
        report = verify(args.opened, layers=args.layers, manifest=args.hashes)
    except CHECKPOINT_ERRORS as exc:
        print(f"verify FAILED: {message(exc)}", file=sys.stderr)
        return 1
    for name, what in report["mismatches"][:20]:
        print(f"MISMATCH {name}: {what}")
    failed = bool(report["mismatches"]) or not report["bytes"]
    if args.write_manifest and not failed:
        with atomic_write(args.write_manifest, "w") as f:
            json.dump(report["hashes"], f, indent=0, sort_keys=True)
    other = report["manifest_other"]
    print(f"{report['checked']} expert tensors of layers {report['layers']}"
          + (f" and {other} other tensors of the manifest" if other else "")
          + f", {report['bytes'] / 1e9:.2f} GB, read in {time.perf_counter() - t0:.1f} s: "
          + ("the bytes handed to the kernels are the file's bytes"
             + (" and match the manifest" if args.hashes is not None else "")
             if not report["mismatches"] else f"{len(report['mismatches'])} MISMATCHES"))
    if args.write_manifest and failed:
        # a manifest is a reference: one written from files that failed would vouch for
        # their bad bytes
        print(f"--write-manifest: {args.write_manifest} not written: the checkpoint "
              f"failed verification", file=sys.stderr)
    return 1 if failed else 0
