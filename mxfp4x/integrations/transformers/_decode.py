"""gpt-oss's attention layer at a decoding step as one compiled call
(:class:`DecodeAttention`, :func:`use_decode_attention`).

A decoding step's attention is four products that stream their weights and, between
them, about twenty small torch operations (the rotary embedding's, the cache's, the
views and copies): each cheap alone, but run on the caches the products' streams have just
emptied, they cost as much as a fifth of the layer's reads.  Where the step is one
mxfp4x would run piece by piece anyway (bfloat16, the door's dense kernels, the growing
cache, the ``mxfp4x_grouped`` attention), :class:`DecodeAttention` runs the pieces as
one call of the compiled extension (``mxfp4x._core.cpu.AttentionStep``), with the same
operations in the same order: the same bits.  Anything else is transformers' forward.
:class:`DecodeMLP` does the same for the router and the experts (two calls around torch's
top-k), and :class:`DecodeLayer` runs a decoder layer's norms and residual adds inside
those calls."""
import weakref
from typing import Any, Dict, Optional

import torch
from transformers.cache_utils import Cache
from transformers.models.gpt_oss.modeling_gpt_oss import (
    GptOssAttention,
    GptOssDecoderLayer,
    GptOssMLP,
    GptOssTopKRouter,
)

from ..._core import cpu as _cpu
from ..._core import cpu_impl as _cpu_impl
from ..._core import dense as _dense
from ..._core import threads as _threads
from ..._core.activation import _C_DTYPES, _numpy
from ..._core.ops import _PLAIN as _PLAIN_TENSORS
from ..._core.ops import runs_direct
from ._attention import _FLASH_MIN_QUERIES, ATTENTION
from ._cache import _Growing
from ._dense_linear import CompiledRMSNorm, DenseLinear, DenseRouter
from ._gpt_oss_experts import GptOssMxfp4Experts

# the projections' modules whose forward is F.linear where the step does not run (a
# module of another kind, an adapter's, computes something else)
_PLAIN = (torch.nn.Linear, DenseLinear)


def _hooked(module: torch.nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


# each module's compiled step and the key of the tensors it was made from: beside the
# module, not in it (a copy or a pickle of the model carries none; a module's `.to()`,
# `.half()` and the like drop its step, which holds its CPU weights)
_STEPS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


class _Stepped(torch.nn.Module):
    """What the two classes share: a conversion of the module drops its step."""

    def _apply(self, *args, **kwargs):
        _STEPS.pop(self, None)
        return super()._apply(*args, **kwargs)


class DecodeAttention(_Stepped, GptOssAttention):
    """transformers' ``GptOssAttention`` whose decoding steps run as one compiled call
    where the pieces are mxfp4x's own: CPU tensors without autograd, bfloat16 hidden
    states, weights, rotary tables and cache, at most 16 tokens in all that the door's
    dense kernels take (:class:`DenseLinear`'s rule), the ``mxfp4x_grouped`` attention,
    a growing cache layer (:class:`GrowingCache`) with room for the new tokens, plain
    projection modules without hooks.  The call computes what those pieces compute one
    by one, in the same order (the same bits): the projections (the bias added in
    float32, rounded once), the rotary embedding in transformers' bfloat16 operations,
    the new keys and values written into the cache's buffers, the attention
    (:func:`grouped_attention`'s decoding path: no attention weights returned), the
    output projection.  Anything else is transformers' forward.  Modules become this
    class in place (:func:`use_decode_attention`): same parameters, same state dict."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                cache=None, **kwargs):
        if cache is None:  # transformers' older name for it
            cache = kwargs.pop("past_key_values", None)
        out = _decode_step(self, hidden_states, position_embeddings, attention_mask, cache)
        if out is not None:
            return out, None
        return super().forward(hidden_states, position_embeddings, attention_mask,
                               cache=cache, **kwargs)


def _tensors(module: GptOssAttention) -> tuple:
    """The projection modules, their weights and biases, and the sinks: read from the
    modules' own tables (``nn.Module.__getattr__`` costs microseconds a name on the cold
    caches of a decoding step)."""
    mods: Any = module._modules
    projections = (mods["q_proj"], mods["k_proj"], mods["v_proj"], mods["o_proj"])
    return (projections, tuple(p._parameters["weight"] for p in projections),
            tuple(p._parameters.get("bias") for p in projections),
            module._parameters.get("sinks"))


def _unit(n: int, plan: tuple) -> Optional[bool]:
    """Whether n tokens go to the dense kernels' bf16 unit (True), their exact kernels
    (False) or neither (None): :class:`DenseLinear`'s rule (``dense._kernel``) for the
    plan's bf16 weights on CPU."""
    if 1 <= n <= _dense.MAX_TOKENS:
        return False
    if plan[2] and _dense.UNIT_MIN_TOKENS <= n <= _dense.UNIT_MAX_TOKENS:
        return True
    return None


def _plan(module: DecodeAttention, weights, biases, sinks) -> Optional[tuple]:
    """The module's compiled step (made once, made again where its tensors changed) as
    (key, step, the CPU's bf16 unit), or None where they are not what it takes.  The step
    holds the arrays of the tensors it was made from, so their memory outlives it and
    their addresses alone tell whether they are still the module's."""
    key = tuple(None if t is None else t.data_ptr() for t in (*weights, *biases, sinks))
    held = _STEPS.get(module)
    if held is not None and held[0] == key:
        return held
    if _cpu.default_isa() == "scalar" or sinks is None or sinks.dtype not in _C_DTYPES \
            or any(type(t) not in _PLAIN_TENSORS or not t.is_cpu
                   for t in (*weights, *(b for b in biases if b is not None), sinks)) \
            or any(t.dtype != torch.bfloat16 or not t.is_contiguous() for t in weights) \
            or any(b is not None and b.dtype != torch.bfloat16 for b in biases):
        return None
    try:
        step = _cpu.AttentionStep(
            [_numpy(w.detach()) for w in weights],
            [None if b is None else _numpy(b.detach().contiguous()) for b in biases],
            _numpy(sinks.detach().contiguous()), _C_DTYPES[sinks.dtype],
            module.config.num_attention_heads, module.config.num_key_value_heads,
            module.head_dim, float(module.scaling))
    except ValueError:  # shapes the step does not take: transformers' forward
        return None
    held = (key, step, _cpu.dense_unit())
    _STEPS[module] = held
    return held


def _global_hooks() -> bool:
    m = torch.nn.modules.module
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks)


def _called_as_forward(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` is calling its forward: no hook of any kind on it or on
    every module (torch's ``_call_impl`` then calls forward and nothing else)."""
    m = torch.nn.modules.module
    return not (_hooked(module) or _global_hooks()
                or module._backward_hooks or module._backward_pre_hooks
                or m._global_backward_hooks or m._global_backward_pre_hooks)


def _recording(tensors) -> bool:
    """Whether autograd would record a product of these parameters."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in tensors)


def _norm_args(norm: Any, hidden: int) -> Optional[Dict[str, Any]]:
    """The compiled calls' arguments for a :class:`CompiledRMSNorm` of the layer's input
    (its bits where it takes the call: plain CPU weight (hidden,) of a C dtype, nothing to
    record), or None."""
    w = norm._parameters.get("weight")
    if w is None or type(w) not in _PLAIN_TENSORS or not w.is_cpu \
            or w.dtype not in _C_DTYPES or w.shape != (hidden,) or _recording((w,)):
        return None
    return dict(norm=_numpy(w.detach().contiguous()), norm_dtype=_C_DTYPES[w.dtype],
                eps=float(norm.variance_epsilon))


def _decode_step(module: DecodeAttention, x: torch.Tensor, position_embeddings,
                 mask: Optional[torch.Tensor], cache,
                 norm: Optional[torch.nn.Module] = None) -> Optional[torch.Tensor]:
    """The attention's output for a decoding step through the compiled call, or None where
    it does not take the step (transformers' forward then runs it).  With ``norm`` (the
    layer's input norm, a :class:`CompiledRMSNorm`): x is the layer's input, and the
    output is x + the attention of its norm (DecodeLayer's), or None."""
    if not isinstance(cache, Cache) or position_embeddings is None \
            or getattr(cache, "offloading", False) or type(cache).update is not Cache.update \
            or module.layer_idx >= len(cache.layers):
        return None
    held = cache.layers[module.layer_idx]
    if not isinstance(held, _Growing) or module.config._attn_implementation != ATTENTION \
            or (module.training and module.attention_dropout) \
            or x.dtype != torch.bfloat16 or x.dim() != 3:
        return None
    b, t, _ = x.shape
    projections, weights, biases, sinks = _tensors(module)
    for p in projections:
        if type(p) not in _PLAIN or _hooked(p):
            return None
    cos, sin = position_embeddings
    if t >= _FLASH_MIN_QUERIES or _global_hooks() or not runs_direct((x, cos, sin), ()) \
            or _recording((*weights, *biases, sinks)):
        return None
    plan = _plan(module, weights, biases, sinks)
    if plan is None:
        return None
    unit = _unit(b * t, plan)
    step = plan[1]
    if unit is None or x.shape[2] != step.hidden:
        return None
    half = module.head_dim // 2
    for table in (cos, sin):
        if table.dtype != torch.bfloat16 or table.dim() != 3 \
                or table.shape[0] not in (1, b) or table.shape[1:] != (t, half):
            return None
    room = held._mxfp4x_room(b, t, step.hkv, step.d, torch.bfloat16)
    if room is None:
        return None
    bufs, pos, start = room
    tk = pos + t - start
    mask_arr, mask_dtype = None, "float32"
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype not in _C_DTYPES \
                or not mask.is_cpu or mask.dim() != 4 or mask.shape[2] != t \
                or mask.shape[0] not in (1, b) or mask.shape[1] not in (1, step.hq) \
                or mask.shape[3] < tk:
            return None
        mask = mask.detach().narrow(3, 0, tk)
        if (tk > 1 and mask.stride(3) != 1) or min(mask.stride()) < 0:
            mask = mask.contiguous()
        mask_arr, mask_dtype = _numpy(mask), _C_DTYPES[mask.dtype]
    fused: Dict[str, Any] = {}
    if norm is not None:
        args = _norm_args(norm, step.hidden)
        if args is None:
            return None
        fused = {**args, "residual": True}
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    q = projections[0]
    step.run(_numpy(x.detach().contiguous()), _numpy(cos.detach().contiguous()),
             _numpy(sin.detach().contiguous()), _numpy(bufs.k), _numpy(bufs.v), pos, start,
             mask_arr, mask_dtype, _numpy(out),
             n_threads=_threads.resolve(q._mxfp4x_threads if type(q) is DenseLinear
                                        else None),
             unit=unit, **fused)
    held._mxfp4x_commit(bufs, t)
    return out


class DecodeMLP(_Stepped, GptOssMLP):
    """transformers' ``GptOssMLP`` (the router, then the experts) whose decoding steps
    run as two compiled calls and torch's top-k and softmax between them, where the
    pieces are mxfp4x's own: CPU tensors without autograd, bfloat16 hidden states, the
    router's bfloat16 weights at a token count the door's dense kernels take
    (:class:`DenseRouter`'s rule), the experts a :class:`GptOssMxfp4Experts` held in CPU
    memory with a bfloat16 intermediate (not ``float32_intermediate``), router and
    experts plain modules without hooks.  The calls compute what those pieces compute one
    by one (``mxfp4x._core.cpu.ExpertsStep``: the router's logits, then the per-slot
    gate/up product, the SwiGLU with its biases, the weighted down biases, the down
    product from them), the same bits.  Anything else is transformers' forward."""

    def forward(self, hidden_states):
        out = _experts_step(self, hidden_states)
        if out is not None:
            return out
        return super().forward(hidden_states)


def _experts_plan(module: DecodeMLP, ex, router) -> Optional[tuple]:
    """The module's compiled step (made again where its tensors changed) as (key, step,
    the CPU's bf16 unit, the tensors it reads), or None."""
    tensors = (ex._buffers.get("gate_up_proj_blocks"), ex._buffers.get("gate_up_proj_scales"),
               ex._parameters.get("gate_up_proj_bias"), ex._buffers.get("down_proj_blocks"),
               ex._buffers.get("down_proj_scales"), ex._parameters.get("down_proj_bias"),
               router._parameters.get("weight"), router._parameters.get("bias"))
    key = tuple(None if t is None else t.data_ptr() for t in tensors)
    held = _STEPS.get(module)
    if held is not None and held[0] == key:
        return held
    gu, gs, gub, dn, ds, dnb, rw, rb = tensors
    if _cpu.default_isa() == "scalar" \
            or any(t is None or type(t) not in _PLAIN_TENSORS or not t.is_cpu
                   for t in tensors[:7]) or (rb is not None and not rb.is_cpu) \
            or gub.dtype not in _C_DTYPES or dnb.dtype not in _C_DTYPES \
            or rw.dtype != torch.bfloat16 or not rw.is_contiguous() \
            or (rb is not None and rb.dtype != torch.bfloat16):
        return None
    try:
        step = _cpu.ExpertsStep(
            _cpu_impl._call_experts(gu, gs), _cpu_impl._call_experts(dn, ds),
            _numpy(gub.detach().contiguous()), _C_DTYPES[gub.dtype],
            _numpy(dnb.detach().contiguous()), _C_DTYPES[dnb.dtype], _numpy(rw.detach()),
            None if rb is None else _numpy(rb.detach().contiguous()),
            float(ex.limit), float(ex.alpha))
    except ValueError:
        return None
    # the tensors held with the step: the expert tables point into their memory
    held = (key, step, _cpu.dense_unit(), tensors)
    _STEPS[module] = held
    return held


def _experts_step(module: DecodeMLP, x: torch.Tensor,
                  norm: Optional[torch.nn.Module] = None):
    """The MLP's (output, router scores) for a decoding step through the compiled calls,
    or None where they do not take it.  With ``norm`` (the layer's post-attention norm, a
    :class:`CompiledRMSNorm`): x is the MLP's residual stream, and the output is x + the
    MLP of its norm (DecodeLayer's), or None."""
    mods: Any = module._modules
    ex, router = mods["experts"], mods["router"]
    if type(ex) is not GptOssMxfp4Experts or type(router) not in (GptOssTopKRouter,
                                                                   DenseRouter) \
            or _hooked(ex) or _hooked(router) or ex.float32_intermediate or _global_hooks() \
            or x.dtype != torch.bfloat16 or x.dim() != 3 or not runs_direct((x,), ()):
        return None
    plan = _experts_plan(module, ex, router)
    if plan is None or _recording(plan[3]):
        return None
    b, t, h = x.shape
    unit = _unit(b * t, plan)
    step = plan[1]
    if unit is None or step.hidden != h:
        return None
    threads = _threads.resolve(router._mxfp4x_threads if type(router) is DenseRouter
                               else None)
    xs = _numpy(x.detach().reshape(b * t, h).contiguous())
    logits = torch.empty((b * t, step.n_experts), dtype=torch.bfloat16)
    residual = None
    if norm is not None:
        fused = _norm_args(norm, h)
        if fused is None:
            return None
        residual, xs = xs, _numpy(torch.empty((b * t, h), dtype=torch.bfloat16))
        step.route(residual, _numpy(logits), n_threads=threads, unit=unit, normed=xs,
                   **fused)
    else:
        step.route(xs, _numpy(logits), n_threads=threads, unit=unit)
    top_value, indices = torch.topk(logits, router.top_k, dim=-1)
    scores = torch.nn.functional.softmax(top_value, dim=1, dtype=top_value.dtype)
    out = torch.empty((b * t, h), dtype=torch.bfloat16)
    step.run(xs, indices.contiguous().numpy(), _numpy(scores.contiguous()), _numpy(out),
             n_threads=_threads.resolve(ex.num_threads), residual=residual)
    return out.view(b, t, h), scores


class DecodeLayer(GptOssDecoderLayer):
    """transformers' ``GptOssDecoderLayer`` whose forward calls its two norms, its
    attention and its MLP by their forward methods where calling them would do nothing
    else (no hook on them or on every module), and where the norms are
    :class:`CompiledRMSNorm` and the attention's and MLP's compiled steps take the layer,
    runs the norms and residual adds inside those calls (CompiledRMSNorm's pass, torch's
    bf16 add): transformers' operations on the same tensors in the same order, the same
    bits, with less Python between the compiled calls (Python that runs on caches the
    weights' streams have just emptied).  Anything else is transformers' forward.  Layers
    become this class in place (:func:`use_decode_attention`): same parameters, same state
    dict."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None,
                use_cache=False, position_embeddings=None, **kwargs):
        mods = self._modules
        norm, attn, post_norm, mlp = (mods["input_layernorm"], mods["self_attn"],
                                      mods["post_attention_layernorm"], mods["mlp"])
        if "past_key_values" in kwargs or not (
                _called_as_forward(norm) and _called_as_forward(attn)
                and _called_as_forward(post_norm) and _called_as_forward(mlp)):
            return super().forward(hidden_states, attention_mask=attention_mask,
                                   position_ids=position_ids, cache=cache,
                                   use_cache=use_cache,
                                   position_embeddings=position_embeddings, **kwargs)
        fuse = type(norm) is CompiledRMSNorm and type(post_norm) is CompiledRMSNorm
        h = None
        if fuse and type(attn) is DecodeAttention:
            h = _decode_step(attn, hidden_states, position_embeddings, attention_mask, cache,
                             norm)
        if h is None:
            residual = hidden_states
            h, _ = attn.forward(
                hidden_states=norm.forward(hidden_states), attention_mask=attention_mask,
                position_ids=position_ids, cache=cache, use_cache=use_cache,
                position_embeddings=position_embeddings, **kwargs)
            h = residual + h
        if fuse and type(mlp) is DecodeMLP:
            out = _experts_step(mlp, h, post_norm)
            if out is not None:
                return out[0]
        residual = h
        h, _ = mlp.forward(post_norm.forward(h))
        return residual + h


def use_decode_attention(model: torch.nn.Module) -> int:
    """Every gpt-oss attention module of ``model`` becomes a :class:`DecodeAttention`,
    every gpt-oss MLP a :class:`DecodeMLP` and every gpt-oss decoder layer a
    :class:`DecodeLayer` in place (their parameters and state dicts kept); returns how
    many changed."""
    n = 0
    for module in model.modules():
        if type(module) is GptOssAttention:
            module.__class__ = DecodeAttention
        elif type(module) is GptOssMLP:
            module.__class__ = DecodeMLP
        elif type(module) is GptOssDecoderLayer:
            module.__class__ = DecodeLayer
        else:
            continue
        n += 1
    return n
