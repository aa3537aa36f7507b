"""version, ISA in use, ISAs, OpenMP, threads; or what a GGUF file holds

Without a file: this build and this CPU (mxfp4x.backend_info()). With a GGUF file (a
llama.cpp / Ollama / LM Studio model; any file of a split set name-0000N-of-0000M.gguf
opens the whole set): its architecture, its expert tensors in MXFP4 (the kernels' GGUF
blocks, mapped in place: name, shape (n_experts, d_out, d_in), experts, bytes), the
expert tensors in other types, and a summary of all its tensors by GGML type. --json
prints the same as one JSON object."""
import json
from collections import Counter
from typing import List

import mxfp4x
from mxfp4x.checkpoints.families import GGUF_FAMILIES, gguf_expert_tensors
from mxfp4x.checkpoints.gguf import MXFP4, GGUFCheckpoint, is_gguf

from ._args import CHECKPOINT_ERRORS, existing_file, message


def add_arguments(parser):
    parser.add_argument("file", nargs="?", metavar="FILE.gguf",
                        help="a GGUF model (one file, or any file of a split set): list its "
                             "architecture and expert tensors instead")
    parser.add_argument("--json", action="store_true", help="one JSON object")


def check(args, error):
    """Opens the GGUF file (headers only): ``args.opened``."""
    args.opened = None
    if args.file is None:
        return
    existing_file(args.file, "argument file", error)
    if not is_gguf(args.file):
        error(f"argument file: {args.file!r} is not a GGUF file (it does not start with "
              f"'GGUF')")
    try:
        args.opened = GGUFCheckpoint(args.file)
    except CHECKPOINT_ERRORS as exc:
        error(f"argument file: {message(exc)}")


def gguf_report(ckpt: GGUFCheckpoint) -> dict:
    """What ``info FILE.gguf`` prints, as a dict."""
    experts: List[dict] = []
    others: List[dict] = []
    for layer, roles in gguf_expert_tensors(ckpt).items():
        for role, name in sorted(roles.items()):
            t = ckpt.tensor(name)
            row = {"name": name, "layer": layer, "role": role, "type": t.type_name,
                   "shape": list(t.shape), "experts": t.shape[0] if t.shape else 0,
                   "bytes": t.n_bytes, "file": t.path}
            (experts if t.ggml_type == MXFP4 and len(t.shape) == 3 else others).append(row)
    infos = [ckpt.tensor(name) for name in ckpt.keys()]
    arch = ckpt.architecture
    return {"file": ckpt.root, "files": ckpt.paths, "version": ckpt.files[0].version,
            "architecture": arch,
            "family": GGUF_FAMILIES[arch].name if arch in GGUF_FAMILIES else None,
            "tensors": len(infos), "bytes": sum(t.n_bytes for t in infos),
            "types": dict(Counter(t.type_name for t in infos).most_common()),
            "mxfp4_experts": experts, "other_experts": others,
            "expert_layers": sorted({row["layer"] for row in experts}),
            "expert_bytes": sum(row["bytes"] for row in experts)}


def _print_gguf(r):
    files = len(r["files"])
    print(f"{'file':14s} {r['file']} (GGUF v{r['version']}"
          + (f", split into {files} files)" if files > 1 else ")"))
    family = (f"mxfp4x names: {r['family']}" if r["family"] else
              "no mxfp4x entry: llama.cpp's common expert names")
    print(f"{'architecture':14s} {r['architecture']} ({family})")
    print(f"{'tensors':14s} {r['tensors']}, {r['bytes'] / 1e9:.3f} GB: "
          + ", ".join(f"{n} {t}" for t, n in r["types"].items()))
    width = max([len(row["name"]) for row in r["mxfp4_experts"] + r["other_experts"]] + [4])
    if r["mxfp4_experts"]:
        print("MXFP4 expert tensors (n_experts, d_out, d_in):")
        for row in r["mxfp4_experts"]:
            print(f"  {row['name']:{width}s}  {str(row['shape']):22s} {row['experts']:5d} "
                  f"experts {row['bytes']:15,d} bytes")
    if r["other_experts"]:
        print("expert tensors in other types (not run by the kernels):")
        for row in r["other_experts"]:
            print(f"  {row['name']:{width}s}  {row['type']:8s} {row['shape']}")
    n = len(r["mxfp4_experts"])
    print(f"{'summary':14s} {n} MXFP4 expert tensors in {len(r['expert_layers'])} layers, "
          f"{r['expert_bytes'] / 1e9:.3f} GB" if n else
          f"{'summary':14s} no MXFP4 expert tensors")


def run(args):
    if args.opened is not None:
        report = gguf_report(args.opened)
        if args.json:
            print(json.dumps(report))
        else:
            _print_gguf(report)
        return 0
    info = mxfp4x.backend_info()
    if args.json:
        print(json.dumps(info))
    else:
        for k, v in info.items():
            print(f"{k:14s} {v}")
    return 0
