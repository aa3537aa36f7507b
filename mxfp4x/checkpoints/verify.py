"""Verify a checkpoint: the sha256 of every expert tensor's byte range, read straight from
its file, against the bytes the loader hands to the kernels and against a manifest.
Safetensors checkpoints (:func:`verify_experts`) and GGUF files (:func:`verify_gguf_experts`)
follow the same rules and report alike."""
import re
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from .families import (
    ExpertNaming,
    _name_pattern,
    expert_names,
    family_of,
    gguf_expert_tensors,
    load_experts,
    load_stacked_experts,
    num_experts,
    open_checkpoint,
    open_gguf,
    read_config,
)
from .gguf import MXFP4, GGUFCheckpoint
from .safetensors import SafeTensorsCheckpoint

_HEX = re.compile("[0-9a-fA-F]{64}")


def check_manifest(manifest: object, what: str = "manifest") -> Dict[str, str]:
    """A manifest, checked: a JSON object of tensor name -> sha256 (64 hex digits).
    Returns it with the digests in lowercase, as ``hashlib`` writes them."""
    if not isinstance(manifest, dict):
        raise ValueError(f"{what}: expected a JSON object of tensor name -> sha256, got a "
                         f"{type(manifest).__name__}")
    for name, digest in manifest.items():
        if not isinstance(digest, str) or not _HEX.fullmatch(digest):
            shown = repr(digest) if len(repr(digest)) <= 80 else repr(digest)[:77] + "..."
            raise ValueError(f"{what}: the entry {name!r} is {shown}, expected a sha256 "
                             f"(64 hex digits)")
    return {name: digest.lower() for name, digest in manifest.items()}


def _file_sha256(path: str, begin: int, end: int) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(begin)
        left = end - begin
        while left:
            chunk = f.read(min(left, 1 << 24))
            if not chunk:
                raise ValueError(f"{path}: ends before byte {end}")
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def _locate(ckpt: Union[SafeTensorsCheckpoint, GGUFCheckpoint],
            name: str) -> Union[Tuple[str, int, int], str]:
    """(file, begin, end) of a tensor, or why it cannot be read (a mismatch to report,
    not an exception that would end the verification)."""
    if name not in ckpt:
        return "missing from the checkpoint"
    try:
        return ckpt.byte_range(name)
    except (KeyError, OSError, ValueError) as exc:  # listed in the index, absent from its file
        return f"unreadable: {exc}"


def _tensor_sha256(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().data).hexdigest()


class _Tally:
    """What a verify run found: each expert tensor's file digest against the bytes
    handed to the kernels and the manifest, then the manifest's other entries."""

    def __init__(self, ckpt, manifest: Optional[Dict[str, str]]):
        self.ckpt, self.manifest = ckpt, manifest
        self.hashes: Dict[str, str] = {}
        self.mismatches: List[Tuple[str, str]] = []
        self.seen: set = set()
        self.n_bytes = 0

    def check(self, name: str, found, loaded: Dict[str, torch.Tensor],
              refused: Optional[str] = None) -> None:
        """``found``: ``_locate``'s answer for ``name``; ``refused``: why the kernels
        cannot run the tensor (then it is not compared with ``loaded``)."""
        self.seen.add(name)
        if not isinstance(found, tuple):
            self.mismatches.append((name, found))
            return
        file_path, begin, end = found
        self.hashes[name] = digest = _file_sha256(file_path, begin, end)
        self.n_bytes += end - begin
        if end == begin:  # hashing it proves nothing: there is nothing the kernels read
            self.mismatches.append((name, "holds 0 bytes: no expert's weights"))
        if refused is not None:
            self.mismatches.append((name, refused))
        elif name not in loaded:
            self.mismatches.append((name, "not handed to the kernels"))
        elif _tensor_sha256(loaded[name]) != digest:
            self.mismatches.append((name, "the bytes handed to the kernels differ from the "
                                          "file's"))
        if self.manifest is not None and self.manifest.get(name) != digest:
            self.mismatches.append((name, "the file's bytes differ from the manifest"
                                    if name in self.manifest else "missing from the manifest"))

    def absent(self, naming: ExpertNaming, prefix: str, layer: int, present: List[int],
               n_experts: int) -> None:
        """The experts below ``n_experts`` (config.json's count) with no tensor at all in
        the checkpoint, one mismatch per run of consecutive ids: a config may claim any
        count, and a name per missing tensor would be as many."""
        start = 0
        for end in present + [n_experts]:
            if end > start:
                many = end - start > 1
                ids = f"{start}..{end - 1}" if many else str(start)
                name = prefix + naming.expert.format(layer=layer, expert=ids, proj="*",
                                                     kind="*")
                self.mismatches.append((name, (
                    f"missing from the checkpoint: experts {start} to {end - 1} "
                    f"({end - start} experts)" if many else
                    f"missing from the checkpoint: expert {start}")
                    + f" of config.json's {naming.n_experts_key} {n_experts}, no tensor of "
                    + ("any of them" if many else "it")))
            start = end + 1

    def result(self, layers: List[int]) -> dict:
        """The manifest's entries not checked yet (hashed from the file), then the report;
        nothing verified at all is a ``ValueError``."""
        other = 0
        for name, digest in sorted((self.manifest or {}).items()):
            if name in self.seen:
                continue
            found = _locate(self.ckpt, name)
            if not isinstance(found, tuple):
                self.mismatches.append((name, "in the manifest but " + found))
                continue
            file_path, begin, end = found
            other += 1
            self.n_bytes += end - begin
            if _file_sha256(file_path, begin, end) != digest:
                self.mismatches.append((name, "the file's bytes differ from the manifest"))
        if not self.hashes and not other:
            raise ValueError(f"{self.ckpt.root}: no expert tensor of layers {layers} could be "
                             f"read: nothing verified")
        return {"checked": len(self.hashes), "bytes": self.n_bytes, "hashes": self.hashes,
                "mismatches": self.mismatches, "layers": layers, "manifest_other": other}


def _expert_ids(naming: ExpertNaming, names: Sequence[str]) -> List[int]:
    """The expert ids of expert tensor names (``expert_names``'), sorted."""
    pattern = _name_pattern(naming)
    ids = set()
    for name in names:
        m = pattern.fullmatch(name)
        if m is not None:  # expert_names found each name by this pattern
            ids.add(int(m["expert"]))
    return sorted(ids)


def _chosen_layers(layers: Optional[Sequence[int]], available: List[int], root: str,
                   what: str) -> List[int]:
    """The layers a verify checks: ``layers`` as ints (None: every layer in ``available``,
    those the file holds ``what`` for); a ValueError naming the ones it does not hold."""
    if layers is None:
        return available
    chosen = [int(layer) for layer in layers]
    absent = [layer for layer in chosen if layer not in available]
    if absent:
        raise ValueError(f"layers: {root} holds no {what} for layer(s) {absent} (its expert "
                         f"layers: {available})")
    return chosen


def verify_experts(path: Union[str, SafeTensorsCheckpoint],
                   layers: Optional[Sequence[int]] = None,
                   manifest: Optional[Dict[str, str]] = None,
                   handed: Optional[Dict[str, torch.Tensor]] = None) -> dict:
    """sha256 of every expert tensor's byte range read straight from its file, against the
    bytes the loader hands to the kernels (``handed``: name -> tensor, default: what
    :func:`load_experts` maps), and against ``manifest`` (name -> sha256) if given.

    ``layers``: default every layer whose expert tensors the checkpoint holds; a layer
    given that holds none is a ``ValueError``, and so is a checkpoint without experts:
    a verification that checked nothing must not pass.  A layer's tensors are those of
    the config's ``num_experts`` experts (one absent is a mismatch; experts with no
    tensor at all, one mismatch per run of their ids, so that a config's count costs
    nothing beyond the experts the files hold) and every other expert tensor it holds;
    an expert tensor of 0 bytes is a mismatch (it holds no expert's weights).  A family
    whose tensors stack a layer's experts (gpt-oss: ``gate_up_proj_blocks`` /
    ``_scales``, ``down_proj_blocks`` / ``_scales``) is checked per tensor: one missing,
    or holding another number of experts than the config's count
    (``num_local_experts``), is a mismatch.  Every
    manifest entry is checked: one outside these layers against its file's bytes, one
    the checkpoint lacks is a mismatch.

    Returns ``{"checked", "bytes", "hashes", "mismatches", "layers", "manifest_other"}``
    (``checked``: expert tensors hashed; ``bytes``: the bytes hashed, 0 when nothing
    was verified; ``manifest_other``: other manifest entries checked); a mismatch is
    ``(name, what)``."""
    ckpt = open_checkpoint(path)
    config = read_config(ckpt.root)
    naming = family_of(config)
    n_experts = num_experts(config, naming)
    if manifest is not None:
        manifest = check_manifest(manifest)
    held = expert_names(ckpt, naming)
    layers = _chosen_layers(layers, sorted({layer for _, layer in held}), ckpt.root,
                            f"{naming.name} expert tensors")
    if not layers:
        example = naming.tensor(naming.prefixes[0], 1, 0, "down", naming.packed)
        raise ValueError(f"{ckpt.root}: no {naming.name} expert tensors (names like "
                         f"{example!r}): nothing to verify")
    tally = _Tally(ckpt, manifest)
    wanted = set(layers)
    kinds = (naming.packed, naming.scale)
    for prefix, layer in sorted((k for k in held if k[1] in wanted), key=lambda k: k[::-1]):
        if naming.stacked:
            _check_stacked(tally, ckpt, naming, prefix, layer, held[prefix, layer],
                           n_experts, handed)
            continue
        # the config's experts the files hold (some of their tensors at least), found by
        # name: lists of the config's num_experts experts would be as long as it claims
        present = [e for e in _expert_ids(naming, held[prefix, layer]) if e < n_experts]
        expected = [naming.tensor(prefix, layer, e, role, kind) for e in present
                    for role in naming.roles for kind in kinds]
        names = expected + sorted(set(held[prefix, layer]) - set(expected))
        where = {name: _locate(ckpt, name) for name in names}
        loaded = handed
        if loaded is None:
            # the loader refuses an expert with a tensor missing: load the complete ones
            complete = [e for e in present if all(
                isinstance(where[naming.tensor(prefix, layer, e, role, kind)], tuple)
                for role in naming.roles for kind in kinds)]
            proj = load_experts(ckpt, naming, layer, complete, prefix)
            loaded = {}
            for role, (packed, scales) in proj.items():
                for e, p, s in zip(complete, packed, scales, strict=True):
                    loaded[naming.tensor(prefix, layer, e, role, naming.packed)] = p
                    loaded[naming.tensor(prefix, layer, e, role, naming.scale)] = s
        for name in names:
            tally.check(name, where[name], loaded)
        tally.absent(naming, prefix, layer, present, n_experts)
    return tally.result(layers)


def _check_stacked(tally: _Tally, ckpt: SafeTensorsCheckpoint, naming: ExpertNaming,
                   prefix: str, layer: int, held: Sequence[str], n_experts: int,
                   handed: Optional[Dict[str, torch.Tensor]]) -> None:
    """One layer of a family whose tensors stack the layer's experts (gpt-oss): each
    projection's packed and scale tensors against what :func:`load_stacked_experts` (the
    family's loader) hands to the kernels; a tensor missing, or holding another number
    of experts than config.json's count, is a mismatch."""
    kinds = (naming.packed, naming.scale)
    expected = [naming.tensor(prefix, layer, None, role, kind) for role in naming.roles
                for kind in kinds]
    names = expected + sorted(set(held) - set(expected))
    where = {name: _locate(ckpt, name) for name in names}
    loaded = handed
    if loaded is None:
        loaded = {}
        for role in naming.roles:  # each alone: one refused must not hide the others
            pair = [naming.tensor(prefix, layer, None, role, kind) for kind in kinds]
            if all(isinstance(where[name], tuple) for name in pair):
                try:
                    got = load_stacked_experts(ckpt, naming, layer, prefix, roles=[role])
                except (KeyError, OSError, ValueError):
                    continue
                loaded.update(zip(pair, got[role], strict=True))
    for name in names:
        tally.check(name, where[name], loaded)
        if name in loaded and loaded[name].dim() and loaded[name].shape[0] != n_experts:
            tally.mismatches.append((name, f"holds {loaded[name].shape[0]} experts, "
                                           f"config.json's {naming.n_experts_key} is "
                                           f"{n_experts}"))


def _mxfp4_stack(ckpt: GGUFCheckpoint, name: str) -> bool:
    """Whether ``name`` is a stack of MXFP4 matrices, as the kernels take them."""
    if name not in ckpt:
        return False
    info = ckpt.tensor(name)
    return info.ggml_type == MXFP4 and len(info.shape) == 3


def verify_gguf_experts(path: Union[str, GGUFCheckpoint],
                        layers: Optional[Sequence[int]] = None,
                        manifest: Optional[Dict[str, str]] = None,
                        handed: Optional[Dict[str, torch.Tensor]] = None) -> dict:
    """:func:`verify_experts` for a GGUF model (one file or a split set): the sha256 of
    every stacked expert tensor's byte range (``blk.{L}.ffn_{gate,up,down}_exps.weight``,
    and ``ffn_gate_up_exps`` where fused), read straight from its file, against the
    bytes the loader maps for the kernels (``handed``: name -> tensor, default: what
    :func:`~mxfp4x.checkpoints.families.load_gguf_experts` hands out, uint8 MXFP4 blocks)
    and against ``manifest`` if given.

    A layer's experts are gate, up and down (or gate_up and down): one missing is a
    mismatch, and so is an expert tensor that is not MXFP4 (the kernels cannot run it)
    or one of 0 bytes (a stack of no experts).
    ``layers``, the manifest and the result are as for :func:`verify_experts`; a file
    without expert tensors, or layers it does not hold, are a ``ValueError``."""
    from .families import load_gguf_experts

    ckpt = open_gguf(path)
    if manifest is not None:
        manifest = check_manifest(manifest)
    held = gguf_expert_tensors(ckpt)
    layers = _chosen_layers(layers, sorted(held), ckpt.root, "expert tensors")
    if not layers:
        raise ValueError(f"{ckpt.root}: no expert tensors (names like "
                         f"'blk.0.ffn_down_exps.weight'): nothing to verify")
    tally = _Tally(ckpt, manifest)
    for layer in layers:
        roles = held[layer]
        wanted = ["gate_up", "down"] if "gate_up" in roles and not (
            {"gate", "up"} & set(roles)) else ["gate", "up", "down"]
        names = {role: roles.get(role, f"blk.{layer}.ffn_{role}_exps.weight")
                 for role in wanted + sorted(set(roles) - set(wanted))}
        runnable = [role for role, name in names.items() if _mxfp4_stack(ckpt, name)]
        loaded = handed
        if loaded is None:
            loaded = {}
            for role in runnable:  # each alone: one refused tensor must not hide the others
                try:
                    loaded[names[role]] = load_gguf_experts(ckpt, layer, roles=[role])[role]
                except ValueError:
                    pass
        for role, name in names.items():
            found = _locate(ckpt, name)
            refused = None
            if isinstance(found, tuple) and role not in runnable:
                info = ckpt.tensor(name)
                refused = (f"{info.type_name} {list(info.shape)}, not MXFP4 experts: the "
                           f"kernels cannot run it")
            tally.check(name, found, loaded, refused)
    return tally.result(layers)
