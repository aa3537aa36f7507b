"""Attention with the query heads grouped by their key/value head (:func:`grouped_attention`),
registered on import in transformers' attention interface as ``"mxfp4x_grouped"``."""
from typing import Optional

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from mxfp4x._core.attention import decode_attention

ATTENTION = "mxfp4x_grouped"  # its name in transformers' attention interface

# The products of a decoding step (at most this many query rows per key/value head, at
# most this many keys) run in float32 on the 16-bit operands widened: see _product.
_WIDEN_MAX_ROWS, _WIDEN_MAX_KEYS = 64, 1024


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in the operands' dtype.  For 16-bit operands on a CPU with few rows and
    keys it is computed in float32 and rounded once, as torch's own bfloat16 product
    accumulates: on a Xeon torch hands a bfloat16 product to oneDNN, which builds a kernel
    for every new shape, and a decoding step's keys grow by one each step (two products
    of 8 rows by 140 keys: 1.25 ms in bfloat16, 0.15 ms widened; level at 1024 keys)."""
    if (a.device.type == "cpu" and a.dtype in (torch.bfloat16, torch.float16)
            and a.shape[-2] <= _WIDEN_MAX_ROWS
            and max(a.shape[-1], b.shape[-1]) <= _WIDEN_MAX_KEYS):
        return torch.matmul(a.float(), b.float()).to(a.dtype)
    return torch.matmul(a, b)


# From this many queries on (a prompt), without autograd and dropout, on a CPU: _flash
_FLASH_MIN_QUERIES = 64


def _flash(query, key, value, attention_mask, scaling, s_aux, g):
    """The attention of a prompt without its score matrix: torch's flash attention on the
    CPU (queries in blocks, an online softmax in float32, memory in proportion to the
    tokens, not their square), the key/value heads repeated for their query heads, the
    mask as given; gpt-oss's sinks folded in afterwards: a sink logit s takes its share of
    each row's softmax, which scales the row's output by 1 / (1 + exp(s - lse)), lse the
    log-sum-exp of the row's masked, scaled scores (which the kernel returns)."""
    tk = key.shape[2]
    if g > 1:
        key, value = key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1)
    mask = None if attention_mask is None else attention_mask[..., :tk].to(query.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, False, attn_mask=mask, scale=scaling)
    if s_aux is not None:
        share = torch.sigmoid(lse - s_aux.float().reshape(1, -1, 1))
        out = (out.float() * share.unsqueeze(-1)).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def grouped_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                      scaling: float, dropout: float = 0.0,
                      s_aux: Optional[torch.Tensor] = None, **kwargs):
    """transformers' eager attention, its query heads grouped by the key/value head they
    share instead of the keys and values copied once per query head (``repeat_kv``).

    With ``s_aux`` (gpt-oss's sinks: one more logit per head) it computes what gpt-oss's
    ``eager_attention_forward`` computes, step for step: the scores times ``scaling``, the
    additive mask, the sink logit appended, the row's maximum subtracted, the softmax in the
    scores' dtype, the sink dropped, dropout, the weights in the values' dtype times the
    values; without, Llama's (softmax in float32, back to the query's dtype).  Query head
    h reads key/value head h // (heads / key-value heads), as ``repeat_kv`` arranges them;
    the grouping changes the batch of each product, not what a head's scores add up.

    gpt-oss cannot take ``sdpa`` (its sinks), so on a CPU transformers runs it eager, and
    the eager form copies every layer's keys and values eight times per step: one
    full-attention layer's attention at one token with 4096 tokens cached took 27 ms in
    bfloat16 there and 0.9 ms here (2 cores of an AMD EPYC Zen 4; 0.28 against 0.16 ms
    with 128).  :func:`from_pretrained` picks it for gpt-oss models unless an attention is
    asked for.

    On a CPU, without autograd or dropout, that is the path of other devices and of
    attention masks the kernel cannot read (not float).  There a decoding step (fewer
    than ``_FLASH_MIN_QUERIES`` queries) takes mxfp4x's compiled attention
    (:func:`mxfp4x._core.attention.decode_attention`: each cached key and value read
    once, the scores and the softmax in float32, the result rounded once;
    docs/performance.md), and a prompt :func:`_flash`, which never holds the (heads,
    queries, keys) scores: eager's took 2 GiB a layer in bfloat16 for 4096 tokens of
    gpt-oss-20b and most of a 2048-token prefill's time.  Both compute the softmax in
    float32 rather than the scores' dtype and return no attention weights (as
    transformers' ``sdpa``)."""
    b, hq, tq, d = query.shape
    hkv, tk = key.shape[1], key.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query: {hq} heads, not a multiple of the {hkv} key/value heads")
    g = hq // hkv
    if (query.device.type == "cpu" and not (dropout and module.training)
            and not (torch.is_grad_enabled() and any(
                t.requires_grad for t in (query, key, value)))):
        if tq >= _FLASH_MIN_QUERIES:
            return _flash(query, key, value, attention_mask, scaling, s_aux, g)
        out = decode_attention(query, key, value, attention_mask, s_aux, scaling)
        if out is not None:
            return out, None
    scores = _product(query.reshape(b, hkv, g * tq, d), key.transpose(2, 3))
    scores = scores.view(b, hq, tq, tk) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[..., :tk]
    if s_aux is not None:
        logits = torch.cat([scores, s_aux.reshape(1, -1, 1, 1).expand(b, -1, tq, -1)], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.nn.functional.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
        weights = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
        weights = weights.to(value.dtype)
    else:
        weights = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    out = _product(weights.reshape(b, hkv, g * tq, tk), value).view(b, hq, tq, d)
    return out.transpose(1, 2).contiguous(), weights


AttentionInterface.register(ATTENTION, grouped_attention)
AttentionMaskInterface.register(ATTENTION, eager_mask)  # its masks are eager's
