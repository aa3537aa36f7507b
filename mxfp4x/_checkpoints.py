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
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

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
    """The text model's config from ``config.json`` in a checkpoint folder (the
    ``text_config`` of a multimodal config, as Kimi K3's)."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    return config.get("text_config", config)


def open_checkpoint(path) -> SafeTensorsCheckpoint:
    return path if isinstance(path, SafeTensorsCheckpoint) else SafeTensorsCheckpoint(path)


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
    otherwise (no carriage-return noise in logs)."""

    def __init__(self, total: int, label: str, stream=None):
        import sys

        self.total, self.label = max(1, total), label
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last = -1

    def update(self, done: int):
        frac = done / self.total
        if self.tty:
            bar = "#" * int(30 * frac)
            self.stream.write(f"\r{self.label} [{bar:30s}] {done}/{self.total}")
            if done >= self.total:
                self.stream.write("\n")
        else:
            step = int(4 * frac)  # 0%, 25%, 50%, 75%, 100%
            if step == self._last:
                return
            self._last = step
            self.stream.write(f"{self.label}: {done}/{self.total}\n")
        self.stream.flush()


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


def moe_layers(ckpt: SafeTensorsCheckpoint, layout: ExpertLayout, config: dict) -> List[int]:
    """The layers whose experts this checkpoint holds."""
    found = []
    for layer in range(int(config.get("num_hidden_layers", 0))):
        if any(layout.tensor(p, layer, 0, "down", layout.packed) in ckpt
               for p in layout.prefixes):
            found.append(layer)
    return found


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


def _tensor_sha256(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().data).hexdigest()


def verify_experts(path: str, layers: Optional[Sequence[int]] = None,
                   manifest: Optional[Dict[str, str]] = None,
                   handed: Optional[Dict[str, torch.Tensor]] = None) -> dict:
    """sha256 of every expert tensor's byte range read straight from its file, against the
    bytes the loader hands to the kernels (``handed``: name -> tensor, default: what
    :func:`load_experts` maps), and against ``manifest`` (name -> sha256) if given.

    Returns ``{"checked", "bytes", "hashes", "mismatches"}``; a mismatch is
    ``(name, what)``."""
    config = read_config(path)
    ckpt = open_checkpoint(path)
    layout = family_of(config)
    n_experts = int(config["num_experts"])
    layers = moe_layers(ckpt, layout, config) if layers is None else list(layers)
    hashes: Dict[str, str] = {}
    mismatches = []
    n_bytes = 0
    for layer in layers:
        prefix = find_prefix(ckpt, layout, layer)
        loaded = handed
        if loaded is None:
            proj = load_experts(ckpt, layout, layer, range(n_experts), prefix)
            loaded = {}
            for role, (packed, scales) in proj.items():
                for e, (p, s) in enumerate(zip(packed, scales, strict=True)):
                    loaded[layout.tensor(prefix, layer, e, role, layout.packed)] = p
                    loaded[layout.tensor(prefix, layer, e, role, layout.scale)] = s
        for name in iter_expert_tensors(ckpt, layout, [layer], n_experts, prefix):
            file_path, begin, end = ckpt.byte_range(name)
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
    return {"checked": len(hashes), "bytes": n_bytes, "hashes": hashes,
            "mismatches": mismatches, "layers": layers}
