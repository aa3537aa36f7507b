"""Per-expert MXFP4 checkpoints: where a model family keeps its expert tensors, its
config, and reading them as the kernels want them (memory-mapped, never copied).

A family is a :class:`ExpertLayout`: the name of one expert matrix's packed bytes and
scale bytes for (layer, expert, projection), and which projection is gate, up, down.
Adding a family (e.g. DeepSeek-V4, whose experts are
``layers.{L}.ffn.experts.{j}.{w1,w2,w3}.{weight,scale}`` with I8 bytes and F8_E8M0
scales) is one more entry in ``FAMILIES`` plus its block module.

Kimi K3 (``KIMI_K3``), as released (moonshotai/Kimi-K3; read through the public ports:
llama.cpp ``conversion/kimi_k3.py``, vLLM, SGLang, MaxText, and Moonshot's
``modeling_kimi_linear.py``):

* ``config.json``: the text model under ``text_config`` (``model_type`` "kimi_linear");
  ``quantization_config``: ``quant_method`` "compressed-tensors", ``format``
  "mxfp4-pack-quantized" under ``config_groups.group_0`` (4 bits, float, group 32,
  ``scale_dtype`` uint8); only the routed experts carry ``weight_packed`` tensors.
* expert j of layer L: ``[language_model.]model.layers.{L}.block_sparse_moe.experts.{j}
  .{w1,w2,w3}.weight_packed`` uint8 (out, in/2), the low nibble the even input column
  (compressed-tensors packs ``codes[2j] | codes[2j+1] << 4``: the gpt-oss order), and
  ``.weight_scale`` uint8 (out, in/32), E8M0 (2^(s-127)).  w1 = gate, w3 = up, w2 = down.
"""
import json
import os
import re
import string
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from ._format import GROUP_BYTES
from ._safetensors import SafeTensorsCheckpoint

_E8M0 = getattr(torch, "float8_e8m0fnu", None)


@dataclass(frozen=True)
class ExpertLayout:
    """How a family names its per-expert MXFP4 tensors."""

    name: str
    expert: str                      # "...{layer}...{expert}...{proj}.{kind}" (no prefix)
    packed: str                      # kind of the packed bytes
    scale: str                       # kind of the scale bytes
    roles: Dict[str, str]            # role (gate, up, down) -> projection name
    prefixes: Tuple[str, ...] = ("",)
    block: str = ""                  # "...{layer}..." of the block's other tensors
    extra: Dict[str, str] = field(default_factory=dict)

    def tensor(self, prefix: str, layer: int, expert: int, role: str, kind: str) -> str:
        return prefix + self.expert.format(layer=layer, expert=expert, proj=self.roles[role],
                                           kind=kind)


KIMI_K3 = ExpertLayout(
    name="kimi-k3",
    expert="model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.{kind}",
    packed="weight_packed", scale="weight_scale",
    roles={"gate": "w1", "up": "w3", "down": "w2"},
    prefixes=("language_model.", ""),
    block="model.layers.{layer}.block_sparse_moe.",
)

FAMILIES = {KIMI_K3.name: KIMI_K3}


def read_config(path: str) -> dict:
    """The text model's config from ``config.json`` in a checkpoint folder, or beside a
    checkpoint file (the ``text_config`` of a multimodal config, as Kimi K3's)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file or folder")
    # abspath: the folder of a bare file name is the current one, not ""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path}: no config.json in {folder} (a checkpoint is a "
                                f"folder of config.json and .safetensors files)")
    with open(config_path, "rb") as f:
        try:
            config = json.loads(f.read())
        except ValueError as exc:
            raise ValueError(f"{config_path}: not valid JSON ({exc})") from None
    text = config.get("text_config", config) if isinstance(config, dict) else None
    if not isinstance(text, dict):
        raise ValueError(f"{config_path}: expected a JSON object (with an object "
                         f"text_config if any)")
    return text


def num_experts(config: dict) -> int:
    """``num_experts`` of a (text) config, checked: a positive int."""
    n = config.get("num_experts")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"config.json: num_experts is {n!r}, expected a positive int")
    return n


def open_checkpoint(path) -> SafeTensorsCheckpoint:
    return path if isinstance(path, SafeTensorsCheckpoint) else SafeTensorsCheckpoint(path)


def checkpoint_files(ckpt: SafeTensorsCheckpoint) -> List[str]:
    """Every file a checkpoint is read from: config.json, the index, the shards."""
    root = ckpt.root
    folder = root if os.path.isdir(root) else os.path.dirname(os.path.abspath(root))
    files = {os.path.join(folder, "config.json"), *ckpt._where.values()}
    if os.path.isdir(root):
        files.add(os.path.join(root, "model.safetensors.index.json"))
    return sorted(files)


def find_prefix(ckpt: SafeTensorsCheckpoint, layout: ExpertLayout, layer: int) -> str:
    """The name prefix this checkpoint uses (e.g. "language_model." or none)."""
    for prefix in layout.prefixes:
        if layout.tensor(prefix, layer, 0, "down", layout.packed) in ckpt:
            return prefix
    tried = [layout.tensor(p, layer, 0, "down", layout.packed) for p in layout.prefixes]
    raise KeyError(f"{ckpt.root}: no {layout.name} experts for layer {layer} (looked for "
                   f"{tried})")


def as_bytes(name: str, t: torch.Tensor) -> torch.Tensor:
    """Bytes by view, never by value: uint8 as is, int8 and float8_e8m0fnu viewed."""
    if t.dtype == torch.uint8:
        return t
    if t.dtype == torch.int8 or (_E8M0 is not None and t.dtype == _E8M0):
        return t.view(torch.uint8)
    raise TypeError(f"{name}: expected bytes (U8, I8 or F8_E8M0), got {t.dtype}")


def expert_list(experts, n_experts: int) -> List[int]:
    """``experts`` (None: all; a range, a list, or a (start, end) pair) as a sorted list."""
    if experts is None:
        return list(range(n_experts))
    if isinstance(experts, tuple) and len(experts) == 2:
        experts = range(*experts)
    ids = sorted(int(e) for e in experts)
    if not ids or ids[0] < 0 or ids[-1] >= n_experts or len(set(ids)) != len(ids):
        raise ValueError(f"experts: expected distinct ids in [0, {n_experts}), got {ids[:8]}"
                         f"{'...' if len(ids) > 8 else ''}")
    return ids


def load_experts(ckpt: SafeTensorsCheckpoint, layout: ExpertLayout, layer: int,
                 experts: Sequence[int], prefix: str,
                 progress: Optional["Progress"] = None) -> Dict[str, Tuple[list, list]]:
    """role -> (packed list, scales list) of the given experts, views of the mapped files
    (pages are read only when a kernel touches them)."""
    out: Dict[str, Tuple[list, list]] = {role: ([], []) for role in layout.roles}
    names = [layout.tensor(prefix, layer, e, role, kind) for e in experts
             for role in layout.roles for kind in (layout.packed, layout.scale)]
    mapped = ckpt.get_many(names)  # one window per file: about these experts' bytes only
    for i, e in enumerate(experts):
        for role in layout.roles:
            pn = layout.tensor(prefix, layer, e, role, layout.packed)
            sn = layout.tensor(prefix, layer, e, role, layout.scale)
            packed, scales = as_bytes(pn, mapped[pn]), as_bytes(sn, mapped[sn])
            if packed.dim() != 2 or packed.shape[1] % GROUP_BYTES or tuple(scales.shape) != (
                    packed.shape[0], packed.shape[1] // GROUP_BYTES):
                raise ValueError(f"{pn} {tuple(packed.shape)} and {sn} {tuple(scales.shape)}: "
                                 f"expected (out, in/2) bytes and (out, in/32) scales")
            out[role][0].append(packed)
            out[role][1].append(scales)
        if progress is not None:
            progress.update(i + 1)
    return out


class Progress:
    """A progress bar on stderr: redrawn in place on a terminal, a few plain lines
    otherwise (no carriage-return noise in logs).  ``note`` says what the step under way
    is doing; :meth:`clear` makes room on a terminal for a line printed between steps."""

    def __init__(self, total: int, label: str, stream=None):
        import sys

        self.total, self.label = max(1, total), label
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last = -1
        self._width = 0  # of the line drawn last on a terminal

    def update(self, done: int, note: str = ""):
        frac = done / self.total
        note = f" {note}" if note else ""
        if self.tty:
            bar = "#" * int(30 * frac)
            line = f"{self.label} [{bar:30s}] {done}/{self.total}{note}"
            self.stream.write("\r" + line.ljust(self._width))  # over a longer note too
            self._width = len(line)
            if done >= self.total:
                self.stream.write("\n")
                self._width = 0
        else:
            step = int(4 * frac)  # 0%, 25%, 50%, 75%, 100%
            if step == self._last:
                return
            self._last = step
            self.stream.write(f"{self.label}: {done}/{self.total}{note}\n")
        self.stream.flush()

    def clear(self):
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0


def iter_expert_tensors(ckpt: SafeTensorsCheckpoint, layout: ExpertLayout,
                        layers: Iterable[int], n_experts: int, prefix: str):
    """Names of every expert tensor (packed and scale) of these layers."""
    for layer in layers:
        for e in range(n_experts):
            for role in layout.roles:
                for kind in (layout.packed, layout.scale):
                    yield layout.tensor(prefix, layer, e, role, kind)


def family_of(config: dict) -> ExpertLayout:
    """The layout of a checkpoint's family from its (text) config."""
    if config.get("model_type") in ("kimi_linear", "kimi_k3") or "routed_expert_hidden_size" \
            in config:
        return KIMI_K3
    raise ValueError(f"unknown MoE family (model_type {config.get('model_type')!r}); mxfp4x "
                     f"knows {sorted(FAMILIES)}")


def _name_pattern(layout: ExpertLayout) -> "re.Pattern[str]":
    """A regular expression matching exactly the names ``layout.tensor`` makes (numbers
    without leading zeros, as ``str.format`` writes them)."""
    number = "0|[1-9][0-9]*"
    fields = {"layer": f"(?P<layer>{number})", "expert": f"(?P<expert>{number})",
              "proj": "(?P<proj>" + "|".join(map(re.escape, sorted(layout.roles.values())))
                      + ")",
              "kind": f"(?P<kind>{re.escape(layout.packed)}|{re.escape(layout.scale)})"}
    body = "".join(re.escape(text) + (fields[name] if name else "")
                   for text, name, _, _ in string.Formatter().parse(layout.expert))
    prefixes = "|".join(map(re.escape, sorted(layout.prefixes, key=len, reverse=True)))
    return re.compile(f"(?P<prefix>{prefixes}){body}")


def expert_names(ckpt: SafeTensorsCheckpoint,
                 layout: ExpertLayout) -> Dict[Tuple[str, int], List[str]]:
    """(prefix, layer) -> the names of every expert tensor the checkpoint holds, found by
    name: config.json's ``num_hidden_layers`` does not bound what a file holds, and a
    loader reads any layer it is asked for."""
    pattern = _name_pattern(layout)
    found: Dict[Tuple[str, int], List[str]] = {}
    # the checkpoint has no public list of names yet: its name -> file map is that list
    for name in ckpt._where:
        m = pattern.fullmatch(name)
        if m is not None:
            found.setdefault((m["prefix"], int(m["layer"])), []).append(name)
    return found


def moe_layers(ckpt: SafeTensorsCheckpoint, layout: ExpertLayout) -> List[int]:
    """The layers whose expert tensors this checkpoint holds."""
    return sorted({layer for _, layer in expert_names(ckpt, layout)})


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


def _locate(ckpt: SafeTensorsCheckpoint, name: str) -> Union[Tuple[str, int, int], str]:
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
    the config's ``num_experts`` experts (one absent is a mismatch) and every other
    expert tensor it holds.  Every manifest entry is checked: one outside these layers
    against its file's bytes, one the checkpoint lacks is a mismatch.

    Returns ``{"checked", "bytes", "hashes", "mismatches", "layers", "manifest_other"}``
    (``checked``: expert tensors hashed; ``manifest_other``: other manifest entries
    checked); a mismatch is ``(name, what)``."""
    ckpt = open_checkpoint(path)
    config = read_config(ckpt.root)
    layout = family_of(config)
    n_experts = num_experts(config)
    if manifest is not None:
        manifest = check_manifest(manifest)
    held = expert_names(ckpt, layout)
    available = sorted({layer for _, layer in held})
    if layers is None:
        layers = available
    else:
        layers = [int(layer) for layer in layers]
        absent = [layer for layer in layers if layer not in available]
        if absent:
            raise ValueError(f"layers: {ckpt.root} holds no {layout.name} expert tensors for "
                             f"layer(s) {absent} (its expert layers: {available})")
    if not layers:
        example = layout.tensor(layout.prefixes[0], 1, 0, "down", layout.packed)
        raise ValueError(f"{ckpt.root}: no {layout.name} expert tensors (names like "
                         f"{example!r}): nothing to verify")
    hashes: Dict[str, str] = {}
    mismatches: List[Tuple[str, str]] = []
    seen = set()
    n_bytes = 0
    wanted = set(layers)
    for prefix, layer in sorted((k for k in held if k[1] in wanted), key=lambda k: k[::-1]):
        expected = list(iter_expert_tensors(ckpt, layout, [layer], n_experts, prefix))
        names = expected + sorted(set(held[prefix, layer]) - set(expected))
        where = {name: _locate(ckpt, name) for name in names}
        loaded = handed
        if loaded is None:
            # the loader refuses an expert with a tensor missing: load the complete ones
            complete = [e for e in range(n_experts) if all(
                isinstance(where[layout.tensor(prefix, layer, e, role, kind)], tuple)
                for role in layout.roles for kind in (layout.packed, layout.scale))]
            proj = load_experts(ckpt, layout, layer, complete, prefix)
            loaded = {}
            for role, (packed, scales) in proj.items():
                for e, p, s in zip(complete, packed, scales, strict=True):
                    loaded[layout.tensor(prefix, layer, e, role, layout.packed)] = p
                    loaded[layout.tensor(prefix, layer, e, role, layout.scale)] = s
        for name in names:
            seen.add(name)
            found = where[name]
            if not isinstance(found, tuple):
                mismatches.append((name, found))
                continue
            file_path, begin, end = found
            hashes[name] = digest = _file_sha256(file_path, begin, end)
            n_bytes += end - begin
            if name not in loaded:
                mismatches.append((name, "not handed to the kernels"))
            elif _tensor_sha256(loaded[name]) != digest:
                mismatches.append((name, "the bytes handed to the kernels differ from the "
                                         "file's"))
            if manifest is not None and manifest.get(name) != digest:
                mismatches.append((name, "the file's bytes differ from the manifest"
                                   if name in manifest else "missing from the manifest"))
    other = 0
    for name, digest in sorted((manifest or {}).items()):
        if name in seen:
            continue
        found = _locate(ckpt, name)
        if not isinstance(found, tuple):
            mismatches.append((name, "in the manifest but " + found))
            continue
        file_path, begin, end = found
        other += 1
        n_bytes += end - begin
        if _file_sha256(file_path, begin, end) != digest:
            mismatches.append((name, "the file's bytes differ from the manifest"))
    if not hashes and not other:
        raise ValueError(f"{ckpt.root}: no expert tensor of layers {layers} could be read: "
                         f"nothing verified")
    return {"checked": len(hashes), "bytes": n_bytes, "hashes": hashes,
            "mismatches": mismatches, "layers": layers, "manifest_other": other}
