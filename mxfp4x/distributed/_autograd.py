"""The local checks of a call, the owners' products, and the autograd function that
carries a call (and its gradient) across the all-to-alls."""

import torch

from .._core import cpu as _cpu
from .._core import cpu_impl as _cpu_impl
from .._core import threads as _threads
from .._core.arguments import parse_expert_range
from .._core.coerce import as_tensor
from .._core.format import GGUF_BLOCK_BYTES, GROUP_BYTES, accumulation_dtype
from .._core.ops import (
    mxfp4_experts_grad_latents_list_op,
    mxfp4_experts_grad_latents_op,
    runs_direct,
    slots_op_for,
)
from .._core.validation import SKIP, check_inputs, is_expert_list
from ._agreement import _BACKWARD, _GRADIENTS, _PRODUCTS
from ._routing import ExpertRouting


def _validate(latent_tokens, packed_local, scales_local, selected_experts, mixture_weights,
              shared_output, expert_range, per_slot_outputs):
    """Local checks (no communication); returns the checked tensors and (e0, e1)."""
    e0, e1 = parse_expert_range(expert_range)
    if isinstance(packed_local, (list, tuple)) and len(packed_local) == 0:
        # a rank holding no experts: an empty stacked placeholder (d_out from the shared
        # output when there is one, else agreed with the other ranks), in the arrangement
        # of its scales (None: GGUF blocks)
        d_in = as_tensor("latent_tokens", latent_tokens).shape[-1]
        d_out = as_tensor("shared_output", shared_output).shape[-1] \
            if shared_output is not None and not per_slot_outputs else 0
        packed_local, scales_local = empty_experts(d_out, d_in // 32, scales_local is None)
    n_local = len(packed_local) if is_expert_list(packed_local) else None
    x, packed, scales, sel, mix, shared = check_inputs(
        latent_tokens, packed_local, scales_local, selected_experts,
        SKIP if per_slot_outputs else mixture_weights,
        SKIP if per_slot_outputs else shared_output)
    n_local = len(packed) if n_local is None else n_local
    if n_local != e1 - e0:
        raise ValueError(f"packed_local: holds {n_local} experts, but expert_range "
                         f"{(e0, e1)} names {e1 - e0}")
    return x, packed, scales, sel, mix, shared, (e0, e1)


def empty_experts(d_out: int, n_groups: int, gguf: bool):
    """(packed, scales) of no experts: split bytes and scales, or GGUF blocks and None."""
    if gguf:
        return torch.empty((0, d_out, n_groups, GGUF_BLOCK_BYTES), dtype=torch.uint8), None
    return (torch.empty((0, d_out, n_groups, GROUP_BYTES), dtype=torch.uint8),
            torch.empty((0, d_out, n_groups), dtype=torch.uint8))


def _local_products(routing: ExpertRouting, recv_x: torch.Tensor, packed, scales, threads,
                    isa, dtype):
    """W_e x per received pair, in the compute dtype, with the local kernels."""
    compute = accumulation_dtype(dtype)
    x_pairs = recv_x[routing.recv_row_of_pair]
    if x_pairs.dtype != compute:
        x_pairs = x_pairs.to(compute)  # exact: the kernels upcast 16-bit latents anyway
    sel = routing.recv_expert.view(-1, 1).to(x_pairs.device)
    if sel.shape[0] == 0:
        return torch.empty((0, routing.plan.d_out), dtype=compute, device=x_pairs.device)
    if runs_direct((x_pairs, sel), (packed, scales)):
        # the kernels the op would run, without torch's dispatcher: a first custom-op call
        # imports torch._dynamo, and imported after init_process_group it keeps the
        # process group alive past destroy_process_group() (gloo's group then destroyed
        # at exit aborted the process)
        return _cpu_impl.experts(x_pairs, packed, scales, sel, None, None, threads,
                                 per_slot_outputs=True, isa=isa or None).reshape(
            sel.shape[0], -1)
    return slots_op_for(packed)(x_pairs, packed, scales, sel, threads, isa or "").reshape(
        sel.shape[0], -1)


def _grad_latents_direct(grad, packed, scales, sel, mix, x, threads, isa):
    """The grad_latents op's CPU kernel, without torch's dispatcher (_local_products)."""
    return _cpu_impl.grad_latents(grad, packed, scales, sel, mix, x, threads, isa=isa or None)


def _d_out(packed):
    return packed.shape[1] if isinstance(packed, torch.Tensor) else packed[0].shape[0]


class _EPFunction(torch.autograd.Function):
    """Forward and backward of the expert-parallel products (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, mix, shared, packed, scales, sel, plan, group, threads, isa,
                per_slot_outputs):
        slot_x = x.dim() == 3
        routing = ExpertRouting(plan, sel, slot_x, group)
        rows = x.reshape(-1, x.shape[-1]).detach()
        recv_x = routing.send_rows_of(rows.cpu() if not rows.is_cuda else rows)
        local, error = None, None
        try:
            local = _local_products(routing, recv_x, packed, scales, threads, isa, x.dtype)
        except BaseException as exc:  # re-raised by agree(), on this rank and as an error
            error = exc               # on every other
        routing.agree(_PRODUCTS, error, "failed computing its experts' products")
        dots = routing.pairs_back(local.cpu() if not local.is_cuda else local)
        dots = dots.to(x.device)
        n_tokens, top_k = sel.shape
        d_out = plan.d_out
        ctx.d_out = d_out
        ctx.routing, ctx.packed, ctx.scales = routing, packed, scales
        ctx.threads, ctx.isa, ctx.per_slot_outputs = threads, isa, per_slot_outputs
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        if per_slot_outputs:
            ctx.save_for_backward()
            return dots.view(n_tokens, top_k, d_out).to(x.dtype)
        compute = accumulation_dtype(x.dtype)
        out = shared.detach().to(compute, copy=True).contiguous()
        w = mix.detach().to(compute).contiguous()
        if out.device.type == "cpu":
            _cpu.combine(out.numpy(), dots.numpy(), sel.to(torch.int64).contiguous().numpy(),
                         w.numpy(), n_threads=_threads.resolve(threads))
        else:  # the PyTorch implementation's order: slot by slot
            contrib = (dots.view(n_tokens, top_k, d_out) * w.unsqueeze(-1))
            for k in range(top_k):
                out += contrib[:, k]
        ctx.save_for_backward(dots, mix)
        ctx.shared_dtype = shared.dtype
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        routing = ctx.routing
        compute = accumulation_dtype(ctx.x_dtype)
        n_tokens, top_k = routing.n_tokens, routing.top_k
        d_in = ctx.x_shape[-1]
        d_x = d_mix = d_shared = None
        error = None
        # every rank takes part in every exchange, whether or not it needs d_x: a failure
        # travels as its verdict, below
        try:
            g = grad.to(compute)
            if ctx.per_slot_outputs:
                per_pair = g.reshape(n_tokens * top_k, ctx.d_out)
            else:
                dots, mix = ctx.saved_tensors
                if ctx.needs_input_grad[1]:
                    acc = accumulation_dtype(ctx.x_dtype, mix.dtype)
                    d_mix = (dots.view(n_tokens, top_k, ctx.d_out).to(acc) *
                             g.to(acc).unsqueeze(1)).sum(-1).to(mix.dtype)
                if ctx.needs_input_grad[2]:
                    d_shared = grad.to(ctx.shared_dtype)
                per_pair = (g.unsqueeze(1) * mix.detach().to(compute).unsqueeze(-1)).reshape(
                    n_tokens * top_k, ctx.d_out)
            per_pair = per_pair.cpu() if not per_pair.is_cuda else per_pair
        except BaseException as exc:  # re-raised by agree() below
            error = exc
        # every rank is in this backward with its gradient ready before any data moves: a
        # rank whose backward failed before it got here (in a module's dense parts) posts
        # its failure in an agreement, never into an all-to-all
        routing.agree(_BACKWARD, error, "failed before its gradient exchange")
        # W^T (p g) per pair, on the owners, back home
        sent = routing.pairs_out(per_pair)
        n = sent.shape[0]
        local = torch.empty((0, d_in), dtype=compute)
        if error is None and n:
            op = mxfp4_experts_grad_latents_op if isinstance(ctx.packed, torch.Tensor) \
                else mxfp4_experts_grad_latents_list_op
            ids = routing.recv_expert.view(-1, 1)
            if runs_direct((sent, ids), (ctx.packed, ctx.scales)):  # as _local_products
                op = _grad_latents_direct
            try:
                local = op(sent.view(n, 1, ctx.d_out), ctx.packed, ctx.scales, ids, None,
                           torch.empty((n, 1, d_in), dtype=compute), ctx.threads,
                           ctx.isa or "").reshape(n, d_in)
            except BaseException as exc:  # re-raised by agree() below
                error = exc
        routing.agree(_GRADIENTS, error, "failed computing its experts' gradient products")
        back = routing.pairs_back(local).to(grad.device)
        if ctx.needs_input_grad[0]:
            if len(ctx.x_shape) == 3:
                d_x = back.view(ctx.x_shape)
            else:
                d_x = back.view(n_tokens, top_k, d_in).sum(1)
            d_x = d_x.to(ctx.x_dtype)
        return d_x, d_mix, d_shared, None, None, None, None, None, None, None, None
