"""The families registry of MXFP4 MoE checkpoints: where a model family keeps its expert
tensors, its router and its config keys, and reading them as the kernels want them
(memory-mapped, never copied).  The loaders (``mxfp4x.models``), ``verify``, ``info`` and
the ``layer`` command all read ``FAMILIES``.

A family is a :class:`ExpertNaming`: the name of one expert matrix's packed bytes and
scale bytes for (layer, expert, projection), or, for a family that stacks a layer's
experts, of each projection's stack; which projection is gate, up, down; its router and
the config keys of its expert counts.  Adding a family (e.g. DeepSeek-V4, whose experts
are ``layers.{L}.ffn.experts.{j}.{w1,w2,w3}.{weight,scale}`` with I8 bytes and F8_E8M0
scales) is one more entry in ``FAMILIES`` plus its block module.

gpt-oss (``GPT_OSS``), as released (openai/gpt-oss-20b and -120b, and transformers'
``GptOssConfig`` / ``modeling_gpt_oss``): layer L's experts stacked,
``model.layers.{L}.mlp.experts.{gate_up_proj,down_proj}_{blocks,scales}`` (blocks uint8
(E, out, in/32, 16), scales uint8 (E, out, in/32); gate and up rows interleaved, gate
rows even) and ``..._bias`` (E, out); the router ``model.layers.{L}.mlp.router.weight``
and ``.bias``; config.json's ``num_local_experts`` (alias ``num_experts``) and
``num_experts_per_tok`` (the release also states ``experts_per_token``).

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

GGUF files (llama.cpp) name tensors per architecture (``general.architecture``), all
MoE architectures alike (the ``gguf`` package's ``TENSOR_NAMES`` and ``MODEL_TENSORS``;
the converters in llama.cpp's ``conversion/``).  :class:`GGUFExpertNaming` holds them,
``GGUF_FAMILIES`` by architecture:

* routed experts of layer L, stacked: ``blk.{L}.ffn_gate_exps.weight``,
  ``blk.{L}.ffn_up_exps.weight``, ``blk.{L}.ffn_down_exps.weight``, each GGUF ``ne =
  [d_in, d_out, n_experts]`` (our ``(n_experts, d_out, d_in)``); some architectures
  fuse gate and up as ``blk.{L}.ffn_gate_up_exps.weight``; the router
  ``blk.{L}.ffn_gate_inp.weight``.
* gpt-oss (``"gpt-oss"``; ``GptOssModel`` in ``conversion/gpt_oss.py``): the released
  ``gate_up_proj_blocks``/``_scales`` interleave gate and up rows (gate rows even, up
  rows odd); the converter splits them, rows ``0::2`` to ``ffn_gate_exps`` and ``1::2``
  to ``ffn_up_exps``, and the bias likewise (``ffn_gate_exps.bias``,
  ``ffn_up_exps.bias``; ``down_proj_bias`` to ``ffn_down_exps.bias``).  Its
  ``repack_mxfp4`` puts each group's scale byte before its 16 bytes and
  ``transform_nibble_layout`` moves element j to the low nibble of byte j and element
  j + 16 to its high nibble, losslessly: the same codes and scales, re-arranged.  The
  router is ``blk.{L}.ffn_gate_inp.weight`` and ``.bias``; the attention sinks
  ``blk.{L}.attn_sinks.weight``.
* Kimi K3 (``"kimi-k3"``; ``KimiK3Model`` in ``conversion/kimi_k3.py``): w1 to
  ``ffn_gate_exps``, w3 to ``ffn_up_exps``, w2 to ``ffn_down_exps``, the experts'
  compressed-tensors bytes repacked losslessly into ggml MXFP4 blocks
  (``repack_mxfp4_blocks``); shared experts ``blk.{L}.ffn_{gate,up,down}_shexp.weight``;
  the router ``blk.{L}.ffn_gate_inp.weight`` and its score-correction bias
  ``blk.{L}.exp_probs_b.bias``; the latent projections around the routed experts
  ``blk.{L}.ffn_routed_down``, ``ffn_routed_up``, ``ffn_routed_norm``.  (The ``gguf``
  package on PyPI, 0.19, predates the architecture: its names are llama.cpp's.)
* DeepSeek-V2/V3 and Kimi K2 (``"deepseek2"``), Kimi Linear (``"kimi-linear"``): the
  same routed, shared and router names as Kimi K3, without the latent projections.
"""
import os
import re
import string
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from .._core.arguments import check_range_within, parse_expert_range
from .._core.coerce import bytes_by_view as as_bytes
from .._core.format import GROUP_BYTES
from .._core.progress import Progress
from ._header import read_json
from .safetensors import SafeTensorsCheckpoint


@dataclass(frozen=True)
class ExpertNaming:
    """How a family names its MXFP4 expert tensors, its router and its config keys (the
    checkpoint's naming; the kernels' element order is another matter, the ``layout`` of
    include/mxfp4x): the one description the loaders, ``verify``, ``info`` and the
    ``layer`` command read.

    ``expert`` names one tensor for (layer, expert, projection, kind); without an
    ``{expert}`` field the family stacks a layer's experts in one tensor per projection
    and kind, experts first (``stacked``).  ``config_aliases``: other names of the
    config keys the family reads, as the model's own transformers config class takes
    them (its ``attribute_map``, and the release's own names), mapped to the name used
    here (:meth:`config`)."""

    name: str
    model_types: Tuple[str, ...]     # config.json model_type values of the family
    expert: str                      # "...{layer}...[{expert}...]{proj}...{kind}" (no prefix)
    packed: str                      # kind of the packed bytes
    scale: str                       # kind of the scale bytes
    roles: Dict[str, str]            # role (gate, up, down; gate_up) -> projection name
    prefixes: Tuple[str, ...] = ("",)
    block: str = ""                  # "...{layer}..." of the block's other tensors
    bias: Optional[str] = None       # kind of the experts' biases, where they have them
    router: str = ""                 # "...{layer}..." the router's weight (no prefix)
    router_bias: Optional[str] = None
    n_experts_key: str = "num_experts"     # config.json's names of the experts' count
    top_k_key: str = "num_experts_per_token"  # and of the experts each token goes to
    config_aliases: Mapping[str, str] = field(default_factory=dict)

    @property
    def stacked(self) -> bool:
        """Whether a tensor holds every expert of a layer (n_experts first)."""
        return "{expert}" not in self.expert

    def tensor(self, prefix: str, layer: int, expert: Optional[int], role: str,
               kind: str) -> str:
        """The name of one expert tensor (``expert`` unused by a stacked family)."""
        return prefix + self.expert.format(layer=layer, expert=expert, proj=self.roles[role],
                                           kind=kind)

    def config(self, config: Mapping[str, Any], source: str = "config.json") -> dict:
        """``config`` with every alias of :attr:`config_aliases` under the name used here,
        as the family's transformers config class reads it; an alias whose value differs
        from its name's, both present, is a ValueError naming ``source`` and both keys."""
        out = dict(config)
        for alias, key in self.config_aliases.items():
            if alias not in out:
                continue
            value = out.pop(alias)
            if key in out and out[key] != value:
                raise ValueError(f"{source}: {alias!r} is {value!r} but {key!r} is "
                                 f"{out[key]!r} (two names of one {self.name} setting)")
            out[key] = value
        return out


KIMI_K3 = ExpertNaming(
    name="kimi-k3", model_types=("kimi_k3", "kimi_linear"),
    expert="model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.{kind}",
    packed="weight_packed", scale="weight_scale",
    roles={"gate": "w1", "up": "w3", "down": "w2"},
    prefixes=("language_model.", ""),
    block="model.layers.{layer}.block_sparse_moe.",
    router="model.layers.{layer}.block_sparse_moe.gate.weight",
    router_bias="model.layers.{layer}.block_sparse_moe.gate.e_score_correction_bias",
    # transformers' KimiLinearConfig.attribute_map
    config_aliases={"num_local_experts": "num_experts",
                    "num_experts_per_tok": "num_experts_per_token",
                    "n_group": "num_expert_group", "norm_topk_prob": "moe_renormalize",
                    "n_shared_experts": "num_shared_experts"},
)

GPT_OSS = ExpertNaming(
    name="gpt-oss", model_types=("gpt_oss",),
    expert="model.layers.{layer}.mlp.experts.{proj}_{kind}",
    packed="blocks", scale="scales", bias="bias",
    roles={"gate_up": "gate_up_proj", "down": "down_proj"},
    block="model.layers.{layer}.mlp.",
    router="model.layers.{layer}.mlp.router.weight",
    router_bias="model.layers.{layer}.mlp.router.bias",
    n_experts_key="num_local_experts", top_k_key="num_experts_per_tok",
    # transformers' GptOssConfig.attribute_map; the release's config.json also states
    # experts_per_token (openai's own name) beside num_experts_per_tok
    config_aliases={"num_experts": "num_local_experts",
                    "experts_per_token": "num_experts_per_tok"},
)

FAMILIES = {f.name: f for f in (GPT_OSS, KIMI_K3)}


def config_path(path: str) -> str:
    """Where a checkpoint's ``config.json`` is: in the folder ``path``, or beside the
    checkpoint file ``path``."""
    # abspath: the folder of a bare file name is the current one, not ""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    return os.path.join(folder, "config.json")


def read_config(path: str) -> dict:
    """The text model's config from ``config.json`` in a checkpoint folder, or beside a
    checkpoint file (the ``text_config`` of a multimodal config, as Kimi K3's)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file or folder")
    where = config_path(path)
    folder = os.path.dirname(where)
    if not os.path.exists(where):
        raise FileNotFoundError(f"{path}: no config.json in {folder} (a checkpoint is a "
                                f"folder of config.json and .safetensors files)")
    config = read_json(where, "config.json")  # capped; a named pipe is refused
    text = config.get("text_config", config) if isinstance(config, dict) else None
    if not isinstance(text, dict):
        raise ValueError(f"{where}: expected a JSON object (with an object "
                         f"text_config if any)")
    return text


def num_experts(config: dict, naming: Optional[ExpertNaming] = None) -> int:
    """The experts' count of a (text) config, under the family's name of it (Kimi K3's
    ``num_experts`` when no family is given; its aliases taken), checked: a positive
    int."""
    naming = naming or KIMI_K3
    key = naming.n_experts_key
    n = naming.config(config).get(key)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"config.json: {key} is {n!r}, expected a positive int")
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


def find_prefix(ckpt: SafeTensorsCheckpoint, naming: ExpertNaming, layer: int,
                expert: int = 0) -> str:
    """The name prefix this checkpoint uses (e.g. "language_model." or none), found by
    expert ``expert``'s tensors (a file set holding only some experts, as an
    expert-parallel rank's may, is probed by one of its own)."""
    for prefix in naming.prefixes:
        if naming.tensor(prefix, layer, expert, "down", naming.packed) in ckpt:
            return prefix
    tried = [naming.tensor(p, layer, expert, "down", naming.packed) for p in naming.prefixes]
    raise KeyError(f"{ckpt.root}: no {naming.name} experts for layer {layer} (looked for "
                   f"{tried})")


def load_experts(ckpt: SafeTensorsCheckpoint, naming: ExpertNaming, layer: int,
                 experts: Sequence[int], prefix: str,
                 progress: Optional[Progress] = None) -> Dict[str, Tuple[list, list]]:
    """role -> (packed list, scales list) of the given experts, views of the mapped files
    (pages are read only when a kernel touches them)."""
    out: Dict[str, Tuple[list, list]] = {role: ([], []) for role in naming.roles}
    names = [naming.tensor(prefix, layer, e, role, kind) for e in experts
             for role in naming.roles for kind in (naming.packed, naming.scale)]
    mapped = ckpt.get_many(names)  # one window per file: about these experts' bytes only
    for i, e in enumerate(experts):
        for role in naming.roles:
            pn = naming.tensor(prefix, layer, e, role, naming.packed)
            sn = naming.tensor(prefix, layer, e, role, naming.scale)
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


def load_stacked_experts(ckpt: SafeTensorsCheckpoint, naming: ExpertNaming, layer: int,
                         prefix: str = "", expert_range=None,
                         roles: Optional[Iterable[str]] = None
                         ) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """role -> (packed bytes, scale bytes) of a stacked family's layer ``layer`` (gpt-oss:
    ``gate_up`` and ``down``), experts ``expert_range`` (a pair or a range; None: all):
    views of mappings of just those experts' bytes, typed U8, I8 or F8_E8M0 and read by
    view: what the family's loader hands to the kernels, and what ``verify`` hashes.  A
    tensor missing is a ValueError naming it, and so is a range past its experts (naming
    ``expert_range``); the shapes are the family's module's to check."""
    rng = None if expert_range is None else parse_expert_range(expert_range)
    out: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
    for role in naming.roles if roles is None else roles:
        pair = []
        for kind in (naming.packed, naming.scale):
            name = naming.tensor(prefix, layer, None, role, kind)
            if name not in ckpt:
                raise ValueError(f"{ckpt.root}: no tensor {name!r} (the {role} experts of "
                                 f"layer {layer})")
            if rng is None:
                t = ckpt.get(name)
            else:
                check_range_within(rng, (ckpt.shape(name) or (0,))[0],
                                   f"{ckpt.byte_range(name)[0]}: tensor {name!r}")
                t = ckpt.get_rows(name, *rng)
            pair.append(as_bytes(name, t))
        out[role] = (pair[0], pair[1])
    return out


def iter_expert_tensors(naming: ExpertNaming, layers: Iterable[int], n_experts: int, prefix: str):
    """Names of every expert tensor (packed and scale) of these layers (a stacked family's
    once per layer and projection)."""
    for layer in layers:
        for e in [None] if naming.stacked else range(n_experts):
            for role in naming.roles:
                for kind in (naming.packed, naming.scale):
                    yield naming.tensor(prefix, layer, e, role, kind)


def family_of(config: dict) -> ExpertNaming:
    """The naming of a checkpoint's family from its (text) config."""
    for family in FAMILIES.values():
        if config.get("model_type") in family.model_types:
            return family
    raise ValueError(f"unknown MoE family (model_type {config.get('model_type')!r}); mxfp4x "
                     f"knows {sorted(FAMILIES)}")


def _name_pattern(naming: ExpertNaming) -> "re.Pattern[str]":
    """A regular expression matching exactly the names ``naming.tensor`` makes (numbers
    without leading zeros, as ``str.format`` writes them)."""
    number = "0|[1-9][0-9]*"
    fields = {"layer": f"(?P<layer>{number})", "expert": f"(?P<expert>{number})",
              "proj": "(?P<proj>" + "|".join(map(re.escape, sorted(naming.roles.values())))
                      + ")",
              "kind": f"(?P<kind>{re.escape(naming.packed)}|{re.escape(naming.scale)})"}
    body = "".join(re.escape(text) + (fields[name] if name else "")
                   for text, name, _, _ in string.Formatter().parse(naming.expert))
    prefixes = "|".join(map(re.escape, sorted(naming.prefixes, key=len, reverse=True)))
    return re.compile(f"(?P<prefix>{prefixes}){body}")


def expert_names(ckpt: SafeTensorsCheckpoint,
                 naming: ExpertNaming) -> Dict[Tuple[str, int], List[str]]:
    """(prefix, layer) -> the names of every expert tensor the checkpoint holds, found by
    name: config.json's ``num_hidden_layers`` does not bound what a file holds, and a
    loader reads any layer it is asked for."""
    pattern = _name_pattern(naming)
    found: Dict[Tuple[str, int], List[str]] = {}
    # the checkpoint has no public list of names yet: its name -> file map is that list
    for name in ckpt._where:
        m = pattern.fullmatch(name)
        if m is not None:
            found.setdefault((m["prefix"], int(m["layer"])), []).append(name)
    return found


def moe_layers(ckpt: SafeTensorsCheckpoint, naming: ExpertNaming) -> List[int]:
    """The layers whose expert tensors this checkpoint holds."""
    return sorted({layer for _, layer in expert_names(ckpt, naming)})


# GGUF files (llama.cpp): their half of the registry lives in _gguf_families.py
from ._gguf_families import (  # noqa: E402,F401 (re-exported: the registry's one home)
    GGUF_DEEPSEEK2,
    GGUF_EXPERT_NAME,
    GGUF_FAMILIES,
    GGUF_GPT_OSS,
    GGUF_KIMI_K3,
    GGUFExpertNaming,
    gguf_expert_tensors,
    gguf_naming,
    load_gguf_experts,
    open_gguf,
)
