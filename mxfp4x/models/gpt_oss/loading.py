"""gpt-oss from the release's safetensors checkpoint (a file or a folder, the tensors named
as the family's registry entry names them, ``mxfp4x.checkpoints.families.GPT_OSS``): one
layer's experts (:func:`experts_from_safetensors`) and block (:func:`from_safetensors`),
which the classes' ``from_checkpoint`` call, and every layer's experts
(:func:`load_gpt_oss_experts`)."""
import functools
from typing import TYPE_CHECKING, List, Optional, Sequence

from ..._core.arguments import ExpertRange, num_threads_arg, parse_expert_range
from ..._core.progress import Progress
from ...checkpoints import families as ck
from ...checkpoints.families import GPT_OSS
from ...checkpoints.safetensors import SafeTensorsCheckpoint
from .._common import check_dims, config_integer
from .config import activation, checkpoint_config
from .experts import GptOssExperts
from .router import GptOssRouter
from .tensors import check_experts, check_router, tensor_names

if TYPE_CHECKING:
    from .block import GptOssMoE


def experts_from_safetensors(cls, path, layer: int, prefix: Optional[str] = None, *,
                             limit: Optional[float] = None, alpha: Optional[float] = None,
                             num_threads: Optional[int] = None,
                             expert_range: Optional[ExpertRange] = None,
                             group=None) -> GptOssExperts:
    """:meth:`GptOssExperts.from_checkpoint` of a safetensors checkpoint (``cls`` the
    experts' class; ``expert_range`` parsed and ``num_threads`` checked already)."""
    ckpt = path if isinstance(path, SafeTensorsCheckpoint) else SafeTensorsCheckpoint(path)
    if limit is None or alpha is None:
        limit, alpha = activation(*checkpoint_config(ckpt.root), limit, alpha)
    p = ck.find_prefix(ckpt, GPT_OSS, layer) if prefix is None else prefix
    names = tensor_names(p, layer)
    # the bytes (typed U8, I8 or F8_E8M0, read by view) as verify hashes them
    stacks = ck.load_stacked_experts(ckpt, GPT_OSS, layer, p, expert_range)
    t = {f"{role}_{kind}": stacks[role][i] for role in ("gate_up", "down")
         for i, kind in enumerate(("blocks", "scales"))}
    t.update({arg: ckpt.get(names[arg]) for arg in ("gate_up_bias", "down_bias")})
    check_experts(t, expert_range, {arg: _where(ckpt, name) for arg, name in names.items()})
    return cls(t["gate_up_blocks"], t["gate_up_scales"], t["gate_up_bias"],
               t["down_blocks"], t["down_scales"], t["down_bias"], limit=limit,
               alpha=alpha, num_threads=num_threads, expert_range=expert_range, group=group)


def from_safetensors(cls, path, layer: int, top_k: Optional[int] = None,
                     expert_range: Optional[ExpertRange] = None,
                     num_threads: Optional[int] = None, group=None) -> "GptOssMoE":
    """:meth:`GptOssMoE.from_checkpoint` of a safetensors checkpoint (``cls`` the block's
    class; ``expert_range`` parsed and ``num_threads`` checked already): the experts, the
    router, ``top_k`` and the activation from its config.json, the sizes it states
    compared with the tensors'."""
    ckpt = path if isinstance(path, SafeTensorsCheckpoint) else SafeTensorsCheckpoint(path)
    # top_k given, a file without its config.json: gpt-oss's activation
    config, source = checkpoint_config(ckpt.root, required=top_k is None)
    if top_k is None:
        key = GPT_OSS.top_k_key
        if key not in config:
            known = [key] + [a for a, k in GPT_OSS.config_aliases.items() if k == key]
            raise ValueError(f"{source}: " + " or ".join(map(repr, known)) +
                             " is missing; pass top_k=")
        top_k = config[key]
    limit, alpha = activation(config, source)
    prefix = ck.find_prefix(ckpt, GPT_OSS, layer)
    experts = GptOssExperts.from_checkpoint(ckpt, layer, prefix, expert_range=expert_range,
                                            num_threads=num_threads, group=group,
                                            limit=limit, alpha=alpha)
    stated = functools.partial(config_integer, config, source)
    check_dims(source, {
        GPT_OSS.n_experts_key: (stated(GPT_OSS.n_experts_key), experts.n_experts,
                                "the experts' biases hold"),
        "hidden_size": (stated("hidden_size"), experts.hidden_size,
                        "the experts' blocks are"),
        "intermediate_size": (stated("intermediate_size"), experts.intermediate_size,
                              "the experts' blocks are")})
    router = [prefix + pattern.format(layer=layer)
              for pattern in (GPT_OSS.router, str(GPT_OSS.router_bias))]
    weight, bias = (ckpt.get(name) for name in router)
    check_router(weight, bias, experts, [_where(ckpt, name) for name in router])
    return cls(GptOssRouter(weight, bias, top_k), experts)


def load_gpt_oss_experts(path: str, layers: Optional[Sequence[int]] = None,
                         progress: bool = True, *, limit: Optional[float] = None,
                         alpha: Optional[float] = None, num_threads: Optional[int] = None,
                         expert_range=None, group=None) -> List[GptOssExperts]:
    """Every (or the given) layer's experts of a gpt-oss checkpoint, memory-mapped, with a
    progress bar on stderr (plain lines when it is not a terminal); the other arguments
    as :meth:`GptOssExperts.from_checkpoint`'s, the same for every layer."""
    num_threads_arg(num_threads)  # what is given, checked before any file is read
    rng = None if expert_range is None else parse_expert_range(expert_range)
    ckpt = SafeTensorsCheckpoint(path)
    if limit is None or alpha is None:  # config.json read once for every layer
        limit, alpha = activation(*checkpoint_config(ckpt.root), limit, alpha)
    if layers is None:  # found by name: every layer whose experts the files hold
        layers = ck.moe_layers(ckpt, GPT_OSS)
    out = []
    bar = Progress(len(layers), "loading experts") if progress else None
    for i, layer in enumerate(layers):
        out.append(GptOssExperts.from_checkpoint(ckpt, layer, limit=limit, alpha=alpha,
                                                 num_threads=num_threads, expert_range=rng,
                                                 group=group))
        if bar is not None:
            bar.update(i + 1)
    return out


def _where(ckpt: SafeTensorsCheckpoint, name: str) -> str:
    """A checkpoint tensor named as errors name it: its file and its name."""
    return f"{ckpt.byte_range(name)[0] if name in ckpt else ckpt.root}: tensor {name!r}"
