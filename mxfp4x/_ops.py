"""torch.library custom ops: ``torch.ops.mxfp4x.*``.

* ``mxfp4_experts(x, packed, scales, sel, mix, shared, num_threads=0, isa=None) -> (T, O)``
* ``mxfp4_experts_slots(x, packed, scales, sel, num_threads=0, isa=None) -> (T, K, O)``:
  W x per slot, no weights, no sum (a gate/up projection; the gradient of the mixture
  weights).
* ``mxfp4_experts_grad_latents(grad, packed, scales, sel, mix, x, num_threads=0,
  isa=None) -> like x``; ``mix`` is None for a per-slot grad.

x is (T, I), or (T, K, I) with one input row per slot (a down projection); grad is
(T, O), or (T, K, O) for the slots op.  num_threads 0: ``torch.get_num_threads()``;
isa None: the default ISA (``backend_info()["isa"]``); both only matter on CPU.

Each has a fake (meta) implementation, the compiled kernels for CPU tensors and the
device-agnostic PyTorch implementation for every other device (CUDA first).  The first
is differentiable in the latents, the mixture weights and the shared output (the packed
weights and scales are frozen); it works under ``torch.compile(fullgraph=True)``.
Expert ids are checked by the implementation that runs (the CPU driver while it routes,
the PyTorch path before it indexes), so a traced graph checks them too.
"""
from typing import Optional

import torch
from torch import Tensor

from . import _cpu_impl, _torch_impl


@torch.library.custom_op("mxfp4x::mxfp4_experts", mutates_args=())
def mxfp4_experts_op(latent_tokens: Tensor, packed_weights: Tensor, scale_bytes: Tensor,
                     selected_experts: Tensor, mixture_weights: Tensor, shared_output: Tensor,
                     num_threads: int = 0, isa: Optional[str] = None) -> Tensor:
    return _torch_impl.mxfp4_experts_torch(latent_tokens, packed_weights, scale_bytes,
                                           selected_experts, mixture_weights, shared_output,
                                           latent_tokens.dtype)


@mxfp4_experts_op.register_kernel("cpu")
def _experts_cpu(latent_tokens, packed_weights, scale_bytes, selected_experts, mixture_weights,
                 shared_output, num_threads=0, isa=None):
    return _cpu_impl.experts(latent_tokens, packed_weights, scale_bytes, selected_experts,
                             mixture_weights, shared_output, num_threads, isa=isa)


@mxfp4_experts_op.register_fake
def _experts_fake(latent_tokens, packed_weights, scale_bytes, selected_experts,
                  mixture_weights, shared_output, num_threads=0, isa=None):
    return latent_tokens.new_empty((latent_tokens.shape[0], packed_weights.shape[1]))


@torch.library.custom_op("mxfp4x::mxfp4_experts_slots", mutates_args=())
def mxfp4_experts_slots_op(latent_tokens: Tensor, packed_weights: Tensor, scale_bytes: Tensor,
                           selected_experts: Tensor, num_threads: int = 0,
                           isa: Optional[str] = None) -> Tensor:
    return _torch_impl.slots_torch(latent_tokens, packed_weights, scale_bytes,
                                   selected_experts)


@mxfp4_experts_slots_op.register_kernel("cpu")
def _slots_cpu(latent_tokens, packed_weights, scale_bytes, selected_experts, num_threads=0,
               isa=None):
    return _cpu_impl.experts(latent_tokens, packed_weights, scale_bytes, selected_experts,
                             None, None, num_threads, per_slot_outputs=True, isa=isa)


@mxfp4_experts_slots_op.register_fake
def _slots_fake(latent_tokens, packed_weights, scale_bytes, selected_experts, num_threads=0,
                isa=None):
    return latent_tokens.new_empty((selected_experts.shape[0], selected_experts.shape[1],
                                    packed_weights.shape[1]))


@torch.library.custom_op("mxfp4x::mxfp4_experts_grad_latents", mutates_args=())
def mxfp4_experts_grad_latents_op(grad: Tensor, packed_weights: Tensor, scale_bytes: Tensor,
                                  selected_experts: Tensor, mixture_weights: Optional[Tensor],
                                  latent_tokens: Tensor, num_threads: int = 0,
                                  isa: Optional[str] = None) -> Tensor:
    return _torch_impl.grad_latents_torch(grad, packed_weights, scale_bytes, selected_experts,
                                          mixture_weights, latent_tokens)


@mxfp4_experts_grad_latents_op.register_kernel("cpu")
def _grad_latents_cpu(grad, packed_weights, scale_bytes, selected_experts, mixture_weights,
                      latent_tokens, num_threads=0, isa=None):
    return _cpu_impl.grad_latents(grad, packed_weights, scale_bytes, selected_experts,
                                  mixture_weights, latent_tokens, num_threads, isa=isa)


@mxfp4_experts_grad_latents_op.register_fake
def _grad_latents_fake(grad, packed_weights, scale_bytes, selected_experts, mixture_weights,
                       latent_tokens, num_threads=0, isa=None):
    return latent_tokens.new_empty(latent_tokens.shape)  # contiguous, as the real op


def _setup_context(ctx, inputs, output):
    x, packed, scales, sel, mix, shared, num_threads, isa = inputs
    ctx.save_for_backward(x, packed, scales, sel, mix)
    ctx.num_threads, ctx.isa = num_threads, isa
    ctx.shared_dtype = shared.dtype


def _backward(ctx, grad):
    """d/dx = sum_k p W^T g (compiled transposed kernel on CPU); d/dp_tk = g_t . W x_t;
    d/dshared = g.  The packed weights and scales get no gradient."""
    x, packed, scales, sel, mix = ctx.saved_tensors
    d_x = d_mix = d_shared = None
    if ctx.needs_input_grad[0]:
        d_x = mxfp4_experts_grad_latents_op(grad, packed, scales, sel, mix, x, ctx.num_threads,
                                            ctx.isa)
    if ctx.needs_input_grad[4]:
        acc = torch.float64 if mix.dtype == torch.float64 or x.dtype == torch.float64 \
            else torch.float32
        # W x in the accumulation dtype: rounding it to a 16-bit latents' dtype first would
        # cost ~1e-2 relative (the upcast of x is exact)
        slots = mxfp4_experts_slots_op(x.to(acc) if x.element_size() < 4 else x, packed,
                                       scales, sel, ctx.num_threads, ctx.isa)
        d_mix = (slots.to(acc) * grad.to(acc).unsqueeze(1)).sum(-1).to(mix.dtype)
    if ctx.needs_input_grad[5]:
        d_shared = grad.to(ctx.shared_dtype)
    return d_x, None, None, None, d_mix, d_shared, None, None


mxfp4_experts_op.register_autograd(_backward, setup_context=_setup_context)


def _slots_setup_context(ctx, inputs, output):
    x, packed, scales, sel, num_threads, isa = inputs
    ctx.save_for_backward(x, packed, scales, sel)
    ctx.num_threads, ctx.isa = num_threads, isa


def _slots_backward(ctx, grad):
    """d/dx = sum_k W^T g_k (per slot for per-slot latents)."""
    x, packed, scales, sel = ctx.saved_tensors
    d_x = None
    if ctx.needs_input_grad[0]:
        d_x = mxfp4_experts_grad_latents_op(grad, packed, scales, sel, None, x,
                                            ctx.num_threads, ctx.isa)
    return d_x, None, None, None, None, None


mxfp4_experts_slots_op.register_autograd(_slots_backward, setup_context=_slots_setup_context)
