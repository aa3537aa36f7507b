"""torch.library custom ops: ``torch.ops.mxfp4x.*``.

* ``mxfp4_experts(x, packed, scales, sel, mix, shared, num_threads) -> (T, O)``
* ``mxfp4_experts_slots(x, packed, scales, sel, num_threads) -> (T, K, O)``: W x per
  slot, no weights, no sum (a gate/up projection; the gradient of the mixture weights).
* ``mxfp4_experts_grad_latents(grad, packed, scales, sel, mix, x, num_threads) -> like x``

x is (T, I), or (T, K, I) with one input row per slot (a down projection); grad is
(T, O), or (T, K, O) for the slots op (then mix is not read).

Each has a fake (meta) implementation, the compiled kernels for CPU tensors and the
device-agnostic PyTorch implementation for every other device (CUDA first).  The first
is differentiable in the latents, the mixture weights and the shared output (the packed
weights and scales are frozen); it works under ``torch.compile(fullgraph=True)``.
Inputs are expected already checked by the facade (``mxfp4x.mxfp4_experts``); the ops
re-check expert ids at run time, since a traced graph cannot.
"""
import torch
from torch import Tensor

from . import _cpu_impl, _torch_impl
from ._validation import check_expert_ids


@torch.library.custom_op("mxfp4x::mxfp4_experts", mutates_args=())
def mxfp4_experts_op(latent_tokens: Tensor, packed_weights: Tensor, scale_bytes: Tensor,
                     selected_experts: Tensor, mixture_weights: Tensor, shared_output: Tensor,
                     num_threads: int) -> Tensor:
    check_expert_ids(selected_experts, packed_weights.shape[0])
    return _torch_impl.mxfp4_experts_torch(latent_tokens, packed_weights, scale_bytes,
                                           selected_experts, mixture_weights, shared_output,
                                           latent_tokens.dtype)


@mxfp4_experts_op.register_kernel("cpu")
def _experts_cpu(latent_tokens, packed_weights, scale_bytes, selected_experts, mixture_weights,
                 shared_output, num_threads):
    return _cpu_impl.experts(latent_tokens, packed_weights, scale_bytes, selected_experts,
                             mixture_weights, shared_output, num_threads)


@mxfp4_experts_op.register_fake
def _experts_fake(latent_tokens, packed_weights, scale_bytes, selected_experts,
                  mixture_weights, shared_output, num_threads):
    return latent_tokens.new_empty((latent_tokens.shape[0], packed_weights.shape[1]))


@torch.library.custom_op("mxfp4x::mxfp4_experts_slots", mutates_args=())
def mxfp4_experts_slots_op(latent_tokens: Tensor, packed_weights: Tensor, scale_bytes: Tensor,
                           selected_experts: Tensor, num_threads: int) -> Tensor:
    check_expert_ids(selected_experts, packed_weights.shape[0])
    return _torch_impl.slots_torch(latent_tokens, packed_weights, scale_bytes,
                                   selected_experts)


@mxfp4_experts_slots_op.register_kernel("cpu")
def _slots_cpu(latent_tokens, packed_weights, scale_bytes, selected_experts, num_threads):
    return _cpu_impl.experts(latent_tokens, packed_weights, scale_bytes, selected_experts,
                             None, None, num_threads, slot_outputs=True)


@mxfp4_experts_slots_op.register_fake
def _slots_fake(latent_tokens, packed_weights, scale_bytes, selected_experts, num_threads):
    return latent_tokens.new_empty((selected_experts.shape[0], selected_experts.shape[1],
                                    packed_weights.shape[1]))


@torch.library.custom_op("mxfp4x::mxfp4_experts_grad_latents", mutates_args=())
def mxfp4_experts_grad_latents_op(grad: Tensor, packed_weights: Tensor, scale_bytes: Tensor,
                                  selected_experts: Tensor, mixture_weights: Tensor,
                                  latent_tokens: Tensor, num_threads: int) -> Tensor:
    check_expert_ids(selected_experts, packed_weights.shape[0])
    return _torch_impl.grad_latents_torch(grad, packed_weights, scale_bytes, selected_experts,
                                          mixture_weights, latent_tokens)


@mxfp4_experts_grad_latents_op.register_kernel("cpu")
def _grad_latents_cpu(grad, packed_weights, scale_bytes, selected_experts, mixture_weights,
                      latent_tokens, num_threads):
    return _cpu_impl.grad_latents(grad, packed_weights, scale_bytes, selected_experts,
                                  mixture_weights, latent_tokens, num_threads)


@mxfp4_experts_grad_latents_op.register_fake
def _grad_latents_fake(grad, packed_weights, scale_bytes, selected_experts, mixture_weights,
                       latent_tokens, num_threads):
    return latent_tokens.new_empty(latent_tokens.shape)  # contiguous, as the real op


def _setup_context(ctx, inputs, output):
    x, packed, scales, sel, mix, shared, num_threads = inputs
    ctx.save_for_backward(x, packed, scales, sel, mix)
    ctx.num_threads = num_threads
    ctx.shared_dtype = shared.dtype


def _backward(ctx, grad):
    """d/dx = sum_k p W^T g (compiled transposed kernel on CPU); d/dp_tk = g_t . W x_t;
    d/dshared = g.  The packed weights and scales get no gradient."""
    x, packed, scales, sel, mix = ctx.saved_tensors
    d_x = d_mix = d_shared = None
    if ctx.needs_input_grad[0]:
        d_x = mxfp4_experts_grad_latents_op(grad, packed, scales, sel, mix, x, ctx.num_threads)
    if ctx.needs_input_grad[4]:
        acc = torch.float64 if mix.dtype == torch.float64 or x.dtype == torch.float64 \
            else torch.float32
        # W x in the accumulation dtype: rounding it to a 16-bit latents' dtype first would
        # cost ~1e-2 relative (the upcast of x is exact)
        slots = mxfp4_experts_slots_op(x.to(acc) if x.element_size() < 4 else x, packed,
                                       scales, sel, ctx.num_threads)
        d_mix = (slots.to(acc) * grad.to(acc).unsqueeze(1)).sum(-1).to(mix.dtype)
    if ctx.needs_input_grad[5]:
        d_shared = grad.to(ctx.shared_dtype)
    return d_x, None, None, None, d_mix, d_shared, None


mxfp4_experts_op.register_autograd(_backward, setup_context=_setup_context)


def _slots_setup_context(ctx, inputs, output):
    x, packed, scales, sel, num_threads = inputs
    ctx.save_for_backward(x, packed, scales, sel)
    ctx.num_threads = num_threads


def _slots_backward(ctx, grad):
    """d/dx = sum_k W^T g_k (per slot for per-slot latents)."""
    x, packed, scales, sel = ctx.saved_tensors
    d_x = None
    if ctx.needs_input_grad[0]:
        d_x = mxfp4_experts_grad_latents_op(grad, packed, scales, sel, grad.new_empty(0), x,
                                            ctx.num_threads)
    return d_x, None, None, None, None


mxfp4_experts_slots_op.register_autograd(_slots_backward, setup_context=_slots_setup_context)
