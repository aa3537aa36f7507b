"""version, ISA in use, ISAs, OpenMP, threads; or what a checkpoint holds

Without a file: this build and this CPU (mxfp4x.backend_info()). With a GGUF file (a
llama.cpp / Ollama / LM Studio model; any file of a split set name-0000N-of-0000M.gguf
opens the whole set): its architecture, its expert tensors in MXFP4 (the kernels' GGUF
blocks, mapped in place: name, shape (n_experts, d_out, d_in), experts, bytes), the
expert tensors in other types, and a summary of all its tensors by GGML type. With a
safetensors checkpoint (a folder, or a .safetensors file beside its config.json): its
model family (from config.json's model_type, gpt-oss or Kimi K3), the experts per layer
and per token its config states, the layers holding expert tensors and those tensors'
count and bytes. --json prints the same as one JSON object."""
import json
import os
from collections import Counter
from typing import List

import mxfp4x
from mxfp4x.checkpoints import families as ck
from mxfp4x.checkpoints.families import GGUF_FAMILIES, gguf_expert_tensors
from mxfp4x.checkpoints.gguf import MXFP4, GGUFCheckpoint, is_gguf

from ._args import (
    CHECKPOINT_ERRORS,
    checkpoint_inputs,
    existing_file,
    message,
    regular_inputs,
)


def add_arguments(parser):
    parser.add_argument("file", nargs="?", metavar="CHECKPOINT",
                        help="a GGUF model (one file, or any file of a split set) or a "
                             "safetensors checkpoint (a folder, or a file beside its "
                             "config.json): list its family and expert tensors instead")
    parser.add_argument("--json", action="store_true", help="one JSON object")


def _gguf_path(path) -> bool:
    """A GGUF file by its name, or by its first bytes (a folder is a safetensors one)."""
    if os.path.isdir(path):
        return False
    return path.endswith(".gguf") or (os.path.isfile(path) and is_gguf(path))


def check(args, error):
    """Opens the GGUF file or the safetensors checkpoint (headers and config.json only):
    ``args.opened``, or ``args.safetensors`` (checkpoint, family, config)."""
    args.opened = args.safetensors = None
    if args.file is None:
        return
    if not _gguf_path(args.file):
        checkpoint_inputs(args.file, "argument file", error)
        try:
            config = ck.read_config(args.file)
            family = ck.family_of(config)
            ckpt = ck.open_checkpoint(args.file)
        except CHECKPOINT_ERRORS as exc:
            error(f"argument file: {message(exc)}")
        regular_inputs(ck.checkpoint_files(ckpt), "argument file", error)
        args.safetensors = (ckpt, family, family.config(config))
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


def safetensors_report(ckpt, family: ck.ExpertNaming, config: dict) -> dict:
    """What ``info CHECKPOINT`` prints for a safetensors checkpoint, as a dict: its family
    (the families registry's entry its config.json's model_type names), the counts its
    config states under the family's names, its expert tensors found by the family's
    names (packed and scale bytes, what the kernels read)."""
    held = ck.expert_names(ckpt, family)
    names = sorted({name for found in held.values() for name in found})
    n_bytes = 0
    for name in names:
        try:
            _, begin, end = ckpt.byte_range(name)
        except CHECKPOINT_ERRORS:  # listed in the index, absent from its file: verify says
            continue
        n_bytes += end - begin
    return {"checkpoint": ckpt.root, "files": ck.checkpoint_files(ckpt),
            "family": family.name, "model_type": config.get("model_type"),
            "n_experts": config.get(family.n_experts_key),
            "top_k": config.get(family.top_k_key),
            "expert_layers": sorted({layer for _, layer in held}),
            "expert_tensors": len(names), "expert_bytes": n_bytes}


def _print_safetensors(r):
    print(f"{'checkpoint':14s} {r['checkpoint']} (safetensors: {len(r['files'])} files, "
          f"config.json included)")
    print(f"{'family':14s} {r['family']} (model_type {r['model_type']})")
    print(f"{'experts':14s} {r['n_experts']} per layer, {r['top_k']} per token")
    print(f"{'expert layers':14s} {r['expert_layers']}")
    print(f"{'summary':14s} {r['expert_tensors']} expert tensors (packed and scale bytes), "
          f"{r['expert_bytes'] / 1e9:.3f} GB")


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
    if args.safetensors is not None:
        report = safetensors_report(*args.safetensors)
        if args.json:
            print(json.dumps(report))
        else:
            _print_safetensors(report)
        return 0
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
