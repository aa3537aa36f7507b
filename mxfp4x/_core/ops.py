"""torch.library custom ops: ``torch.ops.mxfp4x.*``.

* ``mxfp4_experts(x, packed, scales, sel, mix, shared, num_threads=0, isa="") -> (T, O)``
* ``mxfp4_experts_slots(x, packed, scales, sel, num_threads=0, isa="") -> (T, K, O)``:
  W x per slot, no weights, no sum (a gate/up projection; the gradient of the mixture
  weights).
* ``mxfp4_experts_grad_latents(grad, packed, scales, sel, mix, x, num_threads=0,
  isa="") -> like x``; ``mix`` is None for a per-slot grad.

Each exists twice: with stacked experts (``packed`` (E, O, G, 16), ``scales`` (E, O, G))
and, with the suffix ``_list``, with one tensor per expert (``Tensor[]``: (O, G, 16) or
(O, G*16), and (O, G)), e.g. ``torch.ops.mxfp4x.mxfp4_experts_list``.  ``scales`` None:
``packed`` holds GGUF block_mxfp4 blocks, (E, O, G, 17) or a list of (O, G, 17) /
(O, G*17), their scale bytes inside, read in place.

x is (T, I), or (T, K, I) with one input row per slot (a down projection); grad is
(T, O), or (T, K, O) for the slots op.  num_threads 0: ``torch.get_num_threads()``;
isa "": the default ISA (``backend_info()["isa"]``); both only matter on CPU.

Each has a fake (meta) implementation, the compiled kernels for CPU tensors and the
device-agnostic PyTorch implementation for every other device (CUDA first).  The first
is differentiable in the latents, the mixture weights and the shared output (the packed
weights and scales are frozen); it works under ``torch.compile(fullgraph=True)``.
Expert ids are checked by the implementation that runs (the CPU driver while it routes,
the PyTorch path before it indexes), so a traced graph checks them too.
"""
import torch

from . import cpu_impl as _cpu_impl
from . import torch_impl as _torch_impl
from . import triton_impl as _triton_impl
from .format import accumulation_dtype
from .validation import check_op_call

_TAIL = 'int num_threads=0, str isa="") -> Tensor'


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # subclasses (FakeTensor, DTensor, ...) take the op


def _mix_grad(x, packed, scales, sel, grad, acc, num_threads, isa):
    """The mixture weights' gradient d/dp_tk = g_t . W_k x_t in ``acc``; W x in the
    accumulation dtype (rounded to 16-bit latents first it would cost ~1e-2 relative; the
    upcast of x is exact).  Eager on plain CPU tensors it runs in the forward's token
    chunks (cpu_impl: at most _CHUNK_BYTES, or 1 / _CHUNK_WEIGHT_SHARE of the experts'
    bytes where that is more, never fewer than _MIN_CHUNK_TOKENS tokens), each chunk's
    arrays in buffers of the longest chunk, reused: the per-slot products (T, K, O) and
    their product with g, whole, took 2 T K O x 4 bytes (1.2 GiB for 100000 tokens of 16
    slots and 96 outputs), and chunk-sized tensors made and freed chunk after chunk let
    glibc's heap grow with T.  Elsewhere (other devices, tracing, a graph of the
    gradient) the same operations run through the ops on all tokens at once: per chunk,
    the torch path would decode every expert again, and a traced graph would unroll."""
    n_tokens, top_k = sel.shape
    d_out = grad.shape[-1]
    x_acc = x.dtype if x.element_size() >= 4 else acc
    if not runs_direct((x, sel, grad), (packed, scales)):
        slots = slots_op_for(packed)(x.to(x_acc), packed, scales, sel, num_threads, isa)
        return (slots.to(acc) * grad.to(acc).unsqueeze(1)).sum(-1)
    per_token = acc.itemsize * (2 * top_k * d_out + x.shape[1:].numel() + d_out)
    chunks = _cpu_impl._chunks(n_tokens, per_token,
                               _cpu_impl._chunk_bound(_cpu_impl._call_experts(packed, scales)))
    longest = max(t1 - t0 for t0, t1 in chunks)
    d_mix = torch.empty(sel.shape, dtype=acc)
    slots_buf = torch.empty((longest, top_k, d_out), dtype=x_acc)
    prod_buf = torch.empty((longest, top_k, d_out), dtype=acc)
    x_buf = torch.empty((longest, *x.shape[1:]), dtype=x_acc) if x_acc != x.dtype else None
    g_buf = torch.empty((longest, d_out), dtype=acc) if grad.dtype != acc else None
    for t0, t1 in chunks:
        n = t1 - t0
        xc = x[t0:t1] if x_buf is None else x_buf[:n].copy_(x[t0:t1])
        gc = grad[t0:t1] if g_buf is None else g_buf[:n].copy_(grad[t0:t1])
        slots = _cpu_impl.experts(xc, packed, scales, sel[t0:t1], None, None, num_threads,
                                  per_slot_outputs=True, isa=isa or None, out=slots_buf[:n])
        torch.mul(slots, gc.unsqueeze(1), out=prod_buf[:n])
        torch.sum(prod_buf[:n], -1, out=d_mix[t0:t1])
    return d_mix


def _plain_cpu(t, grad):
    return type(t) in _PLAIN and t.is_cpu and not (grad and t.requires_grad)


def forward_ad_in_use(tensors) -> bool:
    """Whether the call runs under forward-mode AD with a tangent to carry: a
    ``torch.func.jvp`` transform, or a ``torch.autograd.forward_ad`` level with a dual
    tensor among ``tensors``.  The ops have no forward-mode formula (torch would carry a
    zero or no tangent, silently), so the facade refuses such a call."""
    if torch.compiler.is_compiling():
        return False
    functorch = getattr(torch._C, "_functorch", None)
    if functorch is not None:
        try:
            stack = functorch.get_interpreter_stack()
            if stack and any(i.key() == functorch.TransformType.Jvp for i in stack):
                return True
        except AttributeError:  # a torch without these
            pass
    if getattr(torch.autograd.forward_ad, "_current_level", -1) < 0:
        return False
    unpack = torch.autograd.forward_ad.unpack_dual
    return any(isinstance(t, torch.Tensor) and unpack(t).tangent is not None
               for t in tensors)


def functorch_grad_in_use() -> bool:
    """Whether a reverse-mode functorch transform (``torch.func.grad``, ``vjp``,
    ``jacrev``) is active: the ops' gradient is registered for autograd, which these
    transforms cannot run (torch raises an internal error), so the facade refuses the
    call with what to use instead."""
    if torch.compiler.is_compiling():
        return False
    functorch = getattr(torch._C, "_functorch", None)
    if functorch is None:
        return False
    try:
        stack = functorch.get_interpreter_stack()
        return bool(stack) and any(i.key() == functorch.TransformType.Grad for i in stack)
    except AttributeError:  # a torch without these
        return False


def runs_direct(tensors, weights) -> bool:
    """Whether calling the CPU kernel directly is exactly what the op would run: eager
    mode (not traced by dynamo or torch.jit), no torch function or dispatch mode, no
    functorch transform and no forward-mode AD level to hand the call to, plain CPU
    tensors (or parameters), and no gradient to record.  The dispatcher's own cost is then
    skipped (tens of microseconds of a small call's 150); in every other case the op
    runs.  ``weights``: packed and scales (tensors or lists of them, uint8: no gradient,
    devices checked by the facade; a list's entries are checked for their type only)."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    if getattr(torch.autograd.forward_ad, "_current_level", 0) >= 0:  # dual tensors
        return False
    c, functorch = torch._C, getattr(torch._C, "_functorch", None)
    try:
        if c._len_torch_dispatch_stack() or c._len_torch_function_stack() or \
                functorch is None or functorch.peek_interpreter_stack() is not None:
            return False
    except AttributeError:  # a torch without these: always the op
        return False
    grad = torch.is_grad_enabled()
    if not all(_plain_cpu(t, grad) for t in tensors):
        return False
    for w in weights:
        if w is not None and not (_plain_cpu(w, grad) if isinstance(w, torch.Tensor) else
                                  all(type(t) in _PLAIN for t in w)):
            return False
    return True


def _weights(ctx, saved, n_fixed):
    """(packed, scales) back from save_for_backward's flat list (either form; scales None
    for GGUF blocks)."""
    flat = saved[n_fixed:]
    if not ctx.listed:
        return flat[0], None if ctx.gguf else flat[1]
    return list(flat[:ctx.n_experts]), None if ctx.gguf else list(flat[ctx.n_experts:])


def _save(ctx, fixed, packed, scales, num_threads, isa):
    # the dispatcher drops trailing arguments equal to their defaults before autograd sees
    # the call, and a Tensor[] op's backward must return exactly one entry per argument
    # passed: count them
    ctx.n_dropped = 2 if (num_threads, isa) == (0, "") else (1 if isa == "" else 0)
    ctx.num_threads, ctx.isa = num_threads, isa
    ctx.listed = not isinstance(packed, torch.Tensor)
    ctx.gguf = scales is None
    ctx.n_experts = len(packed) if ctx.listed else 0
    weights = [*packed] if ctx.listed else [packed]
    if not ctx.gguf:
        weights += [*scales] if ctx.listed else [scales]
    ctx.save_for_backward(*fixed, *weights)


def _no_grad(ctx):
    """The gradient entries of (packed_weights, scale_bytes): frozen, in their form."""
    if not ctx.listed:
        return None, None
    return [None] * ctx.n_experts, None if ctx.gguf else [None] * ctx.n_experts


def _define(suffix, weights):
    """The three ops for one form of the experts (weights: "Tensor" or "Tensor[]")."""
    w = f"{weights} packed_weights, {weights}? scale_bytes"  # None: GGUF blocks

    @torch.library.custom_op(f"mxfp4x::mxfp4_experts{suffix}", mutates_args=(), schema=(
        f"(Tensor latent_tokens, {w}, Tensor selected_experts, Tensor mixture_weights, "
        f"Tensor shared_output, {_TAIL}"))
    def experts_op(latent_tokens, packed_weights, scale_bytes, selected_experts,
                   mixture_weights, shared_output, num_threads=0, isa=""):
        check_op_call(latent_tokens, packed_weights, selected_experts, mixture_weights,
                      shared_output)
        return _torch_impl.mxfp4_experts_torch(latent_tokens, packed_weights, scale_bytes,
                                               selected_experts, mixture_weights,
                                               shared_output, latent_tokens.dtype)

    @experts_op.register_kernel("cpu")
    def _experts_cpu(latent_tokens, packed_weights, scale_bytes, selected_experts,
                     mixture_weights, shared_output, num_threads=0, isa=""):
        check_op_call(latent_tokens, packed_weights, selected_experts, mixture_weights,
                      shared_output)
        return _cpu_impl.experts(latent_tokens, packed_weights, scale_bytes, selected_experts,
                                 mixture_weights, shared_output, num_threads, isa=isa or None)

    @experts_op.register_kernel("cuda")
    def _experts_cuda(latent_tokens, packed_weights, scale_bytes, selected_experts,
                      mixture_weights, shared_output, num_threads=0, isa=""):
        check_op_call(latent_tokens, packed_weights, selected_experts, mixture_weights,
                      shared_output)
        if not _triton_impl.usable(latent_tokens, packed_weights, scale_bytes,
                                   (selected_experts, mixture_weights, shared_output)):
            return _torch_impl.mxfp4_experts_torch(latent_tokens, packed_weights,
                                                   scale_bytes, selected_experts,
                                                   mixture_weights, shared_output,
                                                   latent_tokens.dtype)
        checked = _triton_impl.check_ids(selected_experts, len(packed_weights))
        return _triton_impl.experts(latent_tokens, packed_weights, scale_bytes,
                                    selected_experts, mixture_weights, shared_output,
                                    latent_tokens.dtype, checked)

    @experts_op.register_fake
    def _experts_fake(latent_tokens, packed_weights, scale_bytes, selected_experts,
                      mixture_weights, shared_output, num_threads=0, isa=""):
        check_op_call(latent_tokens, packed_weights, selected_experts, mixture_weights,
                      shared_output)
        return latent_tokens.new_empty((latent_tokens.shape[0],
                                        _torch_impl.d_out_of(packed_weights)))

    @torch.library.custom_op(f"mxfp4x::mxfp4_experts_slots{suffix}", mutates_args=(),
                             schema=f"(Tensor latent_tokens, {w}, Tensor selected_experts, "
                                    f"{_TAIL}")
    def slots_op(latent_tokens, packed_weights, scale_bytes, selected_experts, num_threads=0,
                 isa=""):
        check_op_call(latent_tokens, packed_weights, selected_experts)
        return _torch_impl.slots_torch(latent_tokens, packed_weights, scale_bytes,
                                       selected_experts)

    @slots_op.register_kernel("cpu")
    def _slots_cpu(latent_tokens, packed_weights, scale_bytes, selected_experts,
                   num_threads=0, isa=""):
        check_op_call(latent_tokens, packed_weights, selected_experts)
        return _cpu_impl.experts(latent_tokens, packed_weights, scale_bytes, selected_experts,
                                 None, None, num_threads, per_slot_outputs=True,
                                 isa=isa or None)

    @slots_op.register_kernel("cuda")
    def _slots_cuda(latent_tokens, packed_weights, scale_bytes, selected_experts,
                    num_threads=0, isa=""):
        check_op_call(latent_tokens, packed_weights, selected_experts)
        if not _triton_impl.usable(latent_tokens, packed_weights, scale_bytes,
                                   (selected_experts,)):
            return _torch_impl.slots_torch(latent_tokens, packed_weights, scale_bytes,
                                           selected_experts)
        checked = _triton_impl.check_ids(selected_experts, len(packed_weights))
        return _triton_impl.slots(latent_tokens, packed_weights, scale_bytes,
                                  selected_experts, checked)

    @slots_op.register_fake
    def _slots_fake(latent_tokens, packed_weights, scale_bytes, selected_experts,
                    num_threads=0, isa=""):
        check_op_call(latent_tokens, packed_weights, selected_experts)
        return latent_tokens.new_empty((selected_experts.shape[0], selected_experts.shape[1],
                                        _torch_impl.d_out_of(packed_weights)))

    @torch.library.custom_op(f"mxfp4x::mxfp4_experts_grad_latents{suffix}", mutates_args=(),
                             schema=f"(Tensor grad, {w}, Tensor selected_experts, "
                                    f"Tensor? mixture_weights, Tensor latent_tokens, {_TAIL}")
    def grad_op(grad, packed_weights, scale_bytes, selected_experts, mixture_weights,
                latent_tokens, num_threads=0, isa=""):
        return _torch_impl.grad_latents_torch(grad, packed_weights, scale_bytes,
                                              selected_experts, mixture_weights, latent_tokens)

    @grad_op.register_kernel("cpu")
    def _grad_cpu(grad, packed_weights, scale_bytes, selected_experts, mixture_weights,
                  latent_tokens, num_threads=0, isa=""):
        return _cpu_impl.grad_latents(grad, packed_weights, scale_bytes, selected_experts,
                                      mixture_weights, latent_tokens, num_threads,
                                      isa=isa or None)

    @grad_op.register_fake
    def _grad_fake(grad, packed_weights, scale_bytes, selected_experts, mixture_weights,
                   latent_tokens, num_threads=0, isa=""):
        return latent_tokens.new_empty(latent_tokens.shape)  # contiguous, as the real op

    def setup_context(ctx, inputs, output):
        x, packed, scales, sel, mix, shared, num_threads, isa = inputs
        _save(ctx, (x, sel, mix), packed, scales, num_threads, isa)
        ctx.shared_dtype = shared.dtype

    def backward(ctx, grad):
        """d/dx = sum_k p W^T g (compiled transposed kernel on CPU); d/dp_tk = g_t . W x_t;
        d/dshared = g.  The packed weights and scales get no gradient."""
        saved = ctx.saved_tensors  # once: non-reentrant checkpointing unpacks once only
        x, sel, mix = saved[:3]
        packed, scales = _weights(ctx, saved, 3)
        d_x = d_mix = d_shared = None
        if ctx.needs_input_grad[0]:
            d_x = grad_op(grad, packed, scales, sel, mix, x, ctx.num_threads, ctx.isa)
        if ctx.needs_input_grad[4]:
            acc = accumulation_dtype(x.dtype, mix.dtype)
            d_mix = _mix_grad(x, packed, scales, sel, grad, acc, ctx.num_threads,
                              ctx.isa).to(mix.dtype)
        if ctx.needs_input_grad[5]:
            d_shared = grad.to(ctx.shared_dtype)
        grads = (d_x, *_no_grad(ctx), None, d_mix, d_shared, None, None)
        return grads[:len(grads) - ctx.n_dropped]

    experts_op.register_autograd(backward, setup_context=setup_context)

    def slots_setup_context(ctx, inputs, output):
        x, packed, scales, sel, num_threads, isa = inputs
        _save(ctx, (x, sel), packed, scales, num_threads, isa)

    def slots_backward(ctx, grad):
        """d/dx = sum_k W^T g_k (per slot for per-slot latents)."""
        saved = ctx.saved_tensors  # once, as in backward
        x, sel = saved[:2]
        packed, scales = _weights(ctx, saved, 2)
        d_x = None
        if ctx.needs_input_grad[0]:
            d_x = grad_op(grad, packed, scales, sel, None, x, ctx.num_threads, ctx.isa)
        grads = (d_x, *_no_grad(ctx), None, None, None)
        return grads[:len(grads) - ctx.n_dropped]

    slots_op.register_autograd(slots_backward, setup_context=slots_setup_context)
    return experts_op, slots_op, grad_op


mxfp4_experts_op, mxfp4_experts_slots_op, mxfp4_experts_grad_latents_op = _define("", "Tensor")
(mxfp4_experts_list_op, mxfp4_experts_slots_list_op,
 mxfp4_experts_grad_latents_list_op) = _define("_list", "Tensor[]")


def forward_op_for(packed):
    """The forward op for this form of the experts (a tensor: stacked; a list: one each)."""
    return mxfp4_experts_op if isinstance(packed, torch.Tensor) else mxfp4_experts_list_op


def slots_op_for(packed):
    """The per-slot op for this form of the experts."""
    return mxfp4_experts_slots_op if isinstance(packed, torch.Tensor) \
        else mxfp4_experts_slots_list_op
