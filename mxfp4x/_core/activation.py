"""What runs between an MoE layer's two expert products, as torch ops:
````torch.ops.mxfp4x.gpt_oss_swiglu``, ``mix_rows`` and ``situ_glu``.

* ``gpt_oss_swiglu(gate_up (..., 2F), bias (E, 2F) or None, ids (...), limit, alpha,
  out_dtype=None) -> (..., F)``: gpt-oss's clamped SwiGLU of the gate/up product plus its
  bias rows ``bias[ids]``, the gate in the even columns and the up in the odd ones::

      g = min(gate + b_g, limit); u = clamp(up + b_u, -limit, limit)
      a = (u + 1) * (g * sigmoid(g * alpha))

  in the accumulation dtype (float32; float64 for float64 ``gate_up``), rounded once to
  ``out_dtype`` (None: the accumulation dtype).
* ``mix_rows(weights (T, K), rows (R, D), ids (T, K)) -> (T, D)``: the sum over k, in
  order, of ``weights[t, k] * rows[ids[t, k]]`` in the weights' dtype (gpt-oss's down
  bias, weighted as the down products are).
* ``gpt_oss_rms_norm(x (..., D), weight (D,), eps)``: gpt-oss's RMS norm on the compiled
  pass where it takes the call (CPU, no gradient, float32 / 16-bit tensors), else None.
* ``situ_glu(gate (..., F), up (..., F), beta, beta_lin=None, out_dtype=None) ->
  (..., F)``: Kimi K3's ``(beta tanh(g / beta)) sigmoid(g) clip(u)``, ``clip(u) = beta_lin
  tanh(u / beta_lin)`` (None: ``u``), in the accumulation dtype, rounded once to
  ``out_dtype``.

On CPU tensors with float32 accumulation each is one pass of compiled C
(include/mxfp4x/activation.h) over rows, in tasks on the call's threads: the formula's
float32 operations in its order, e^x within 1 ulp, so the same bits whatever the ISA,
the thread count, a row's batch, or whether a gradient is recorded (torch's own ops made
about ten passes over (T, K, 2F) float32 tensors, each freshly allocated:
docs/performance.md).  Elsewhere (other devices, float64, under a functorch gradient
transform) the formula runs as torch ops (the ``*_formula`` functions), which may differ
from the kernel by ulps of float32 (torch's sigmoid and tanh are its own).  The gradient
is always the formula's, recomputed in torch ops."""
from typing import Optional

import torch

from . import cpu as _cpu
from . import threads as _threads
from .format import accumulation_dtype
from .ops import functorch_grad_in_use, runs_direct

_C_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _numpy(t: torch.Tensor):
    """A CPU tensor as the numpy array (a view, its strides kept) that the kernels read:
    16-bit floats as their uint16 bits."""
    return (t if t.dtype == torch.float32 else t.view(torch.uint16)).numpy()


def _bits(t: torch.Tensor):
    """:func:`_numpy` of ``t`` made contiguous."""
    return _numpy(t.contiguous())


def gpt_oss_swiglu_formula(gate_up: torch.Tensor, bias: Optional[torch.Tensor],
                           ids: torch.Tensor, limit: float, alpha: float,
                           out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """:func:`gpt_oss_swiglu` as torch ops (any device, differentiable)."""
    acc = accumulation_dtype(gate_up.dtype)
    g = gate_up.to(acc)
    if bias is not None:
        g = g + bias[ids].to(acc)
    gate, up = g[..., 0::2], g[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    act = (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return act if out_dtype is None else act.to(out_dtype)


def mix_rows_formula(weights: torch.Tensor, rows: torch.Tensor,
                     ids: torch.Tensor) -> torch.Tensor:
    """:func:`mix_rows` as torch ops (any device, differentiable)."""
    return (weights.unsqueeze(-1) * rows[ids].to(weights.dtype)).sum(1)


def situ_glu_formula(gate: torch.Tensor, up: torch.Tensor, beta: float,
                     beta_lin: Optional[float] = None,
                     out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """:func:`situ_glu` as torch ops (any device, differentiable)."""
    acc = accumulation_dtype(gate.dtype)
    g, u = gate.to(acc), up.to(acc)
    if beta_lin is not None:
        u = beta_lin * torch.tanh(u / beta_lin)
    act = beta * torch.tanh(g / beta) * torch.sigmoid(g) * u
    return act if out_dtype is None else act.to(out_dtype)


def _rows3(t: torch.Tensor) -> torch.Tensor:
    """t (..., d) as (A, B, d) without a copy where its strides allow (a 2-D or 3-D view)."""
    if t.dim() == 3:
        return t
    return t.unsqueeze(1) if t.dim() == 2 else t.reshape(-1, 1, t.shape[-1])


def _situ_cpu(gate, up, beta, beta_lin, out_dtype, num_threads, isa):
    acc = accumulation_dtype(gate.dtype)
    out_dtype = acc if out_dtype is None else out_dtype
    if acc != torch.float32 or gate.dtype not in _C_DTYPES or up.dtype != gate.dtype \
            or out_dtype not in _C_DTYPES or gate.shape != up.shape or gate.dim() == 0:
        return situ_glu_formula(gate, up, beta, beta_lin, out_dtype)
    if not beta > 0 or (beta_lin is not None and not beta_lin > 0):
        raise ValueError(f"beta, beta_lin: expected positive values (beta_lin None: no clip), "
                         f"got {beta}, {beta_lin}")
    g3, u3 = _rows3(gate), _rows3(up)
    if g3.stride() != u3.stride() or g3.stride(-1) != 1 or min(g3.stride()) < 0:
        g3, u3 = _rows3(gate.contiguous()), _rows3(up.contiguous())
    out = torch.empty(gate.shape, dtype=out_dtype)
    d = gate.shape[-1]
    _cpu.situ_glu(_numpy(g3), _numpy(u3), _C_DTYPES[gate.dtype], _bits(out.view(-1, d)),
                  _C_DTYPES[out_dtype], float(beta), float(beta_lin or 0.0), isa=isa or None,
                  n_threads=_threads.resolve(num_threads))
    return out


def _swiglu_cpu(gate_up, bias, ids, limit, alpha, out_dtype, num_threads, isa):
    acc = accumulation_dtype(gate_up.dtype)
    out_dtype = acc if out_dtype is None else out_dtype
    if acc != torch.float32 or gate_up.dtype not in _C_DTYPES or out_dtype not in _C_DTYPES \
            or (bias is not None and bias.dtype not in _C_DTYPES):
        return gpt_oss_swiglu_formula(gate_up, bias, ids, limit, alpha, out_dtype)
    lead, d2 = gate_up.shape[:-1], gate_up.shape[-1]
    if d2 % 2:
        raise ValueError(f"gate_up: expected an even last dimension (gate and up "
                         f"interleaved), got shape {tuple(gate_up.shape)}")
    if bias is not None and (bias.dim() != 2 or bias.shape[1] != d2):
        raise ValueError(f"bias: expected (E, {d2}), got shape {tuple(bias.shape)}")
    if bias is not None and tuple(ids.shape) != tuple(lead):
        raise ValueError(f"ids: expected shape {tuple(lead)} (gate_up's rows), got "
                         f"{tuple(ids.shape)}")
    out = torch.empty((*lead, d2 // 2), dtype=out_dtype)
    n = lead.numel()
    _cpu.gpt_oss_swiglu(_bits(gate_up.reshape(n, d2)), _C_DTYPES[gate_up.dtype],
                        None if bias is None else _bits(bias),
                        "float32" if bias is None else _C_DTYPES[bias.dtype],
                        None if bias is None else
                        ids.reshape(n).to(torch.int64).contiguous().numpy(),
                        _bits(out.view(n, d2 // 2)), _C_DTYPES[out_dtype], limit, alpha,
                        isa=isa or None, n_threads=_threads.resolve(num_threads))
    return out


def _mix_cpu(weights, rows, ids, num_threads, isa):
    if weights.dtype != torch.float32 or rows.dtype not in _C_DTYPES:
        return mix_rows_formula(weights, rows, ids)
    if weights.dim() != 2 or rows.dim() != 2 or tuple(ids.shape) != tuple(weights.shape):
        raise ValueError(f"mix_rows: expected weights (T, K), rows (R, D) and ids (T, K), got "
                         f"{tuple(weights.shape)}, {tuple(rows.shape)}, {tuple(ids.shape)}")
    out = torch.empty((weights.shape[0], rows.shape[1]), dtype=torch.float32)
    _cpu.mix_rows(weights.contiguous().numpy(), _bits(rows), _C_DTYPES[rows.dtype],
                  ids.to(torch.int64).contiguous().numpy(), out.numpy(), isa=isa or None,
                  n_threads=_threads.resolve(num_threads))
    return out


@torch.library.custom_op("mxfp4x::gpt_oss_swiglu", mutates_args=())
def _swiglu_op(gate_up: torch.Tensor, bias: Optional[torch.Tensor], ids: torch.Tensor,
               limit: float, alpha: float, out_dtype: Optional[torch.dtype] = None,
               num_threads: int = 0, isa: str = "") -> torch.Tensor:
    return gpt_oss_swiglu_formula(gate_up, bias, ids, limit, alpha, out_dtype)


@_swiglu_op.register_kernel("cpu")
def _swiglu_op_cpu(gate_up, bias, ids, limit, alpha, out_dtype=None, num_threads=0, isa=""):
    return _swiglu_cpu(gate_up, bias, ids, limit, alpha, out_dtype, num_threads, isa)


@_swiglu_op.register_fake
def _swiglu_op_fake(gate_up, bias, ids, limit, alpha, out_dtype=None, num_threads=0, isa=""):
    dtype = accumulation_dtype(gate_up.dtype) if out_dtype is None else out_dtype
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2), dtype=dtype)


@torch.library.custom_op("mxfp4x::situ_glu", mutates_args=())
def _situ_op(gate: torch.Tensor, up: torch.Tensor, beta: float,
             beta_lin: Optional[float] = None, out_dtype: Optional[torch.dtype] = None,
             num_threads: int = 0, isa: str = "") -> torch.Tensor:
    return situ_glu_formula(gate, up, beta, beta_lin, out_dtype)


@_situ_op.register_kernel("cpu")
def _situ_op_cpu(gate, up, beta, beta_lin=None, out_dtype=None, num_threads=0, isa=""):
    return _situ_cpu(gate, up, beta, beta_lin, out_dtype, num_threads, isa)


@_situ_op.register_fake
def _situ_op_fake(gate, up, beta, beta_lin=None, out_dtype=None, num_threads=0, isa=""):
    dtype = accumulation_dtype(gate.dtype) if out_dtype is None else out_dtype
    return gate.new_empty(gate.shape, dtype=dtype)


@torch.library.custom_op("mxfp4x::mix_rows", mutates_args=())
def _mix_op(weights: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor,
            num_threads: int = 0, isa: str = "") -> torch.Tensor:
    return mix_rows_formula(weights, rows, ids)


@_mix_op.register_kernel("cpu")
def _mix_op_cpu(weights, rows, ids, num_threads=0, isa=""):
    return _mix_cpu(weights, rows, ids, num_threads, isa)


@_mix_op.register_fake
def _mix_op_fake(weights, rows, ids, num_threads=0, isa=""):
    return weights.new_empty((weights.shape[0], rows.shape[1]))


def _recomputed_grads(formula, inputs, needs, grad):
    """The gradients of ``formula(*inputs)`` for the inputs in ``needs``: the formula run
    again under autograd (a forward's bits are the kernel's, its gradient the formula's;
    with ``create_graph`` the recomputation joins the graph)."""
    wanted = [x for x, n in zip(inputs, needs, strict=True) if n]
    with torch.enable_grad():
        y = formula(*inputs)
        got = iter(torch.autograd.grad(y, wanted, grad, allow_unused=True,
                                       create_graph=torch.is_grad_enabled()))
    return [next(got) if n else None for n in needs]


def _swiglu_setup(ctx, inputs, output):
    ctx.inputs = inputs[:6]


def _swiglu_backward(ctx, grad):
    gate_up, bias, ids, limit, alpha, out_dtype = ctx.inputs
    needs = [ctx.needs_input_grad[0], bias is not None and ctx.needs_input_grad[1]]
    got = _recomputed_grads(lambda g, b: gpt_oss_swiglu_formula(g, b, ids, limit, alpha,
                                                                out_dtype),
                            (gate_up, bias), needs, grad)
    return got[0], got[1], None, None, None, None, None, None


def _mix_setup(ctx, inputs, output):
    ctx.inputs = inputs[:3]


def _mix_backward(ctx, grad):
    weights, rows, ids = ctx.inputs
    got = _recomputed_grads(lambda w, r: mix_rows_formula(w, r, ids), (weights, rows),
                            list(ctx.needs_input_grad[:2]), grad)
    return got[0], got[1], None, None, None


def _situ_setup(ctx, inputs, output):
    ctx.inputs = inputs[:5]


def _situ_backward(ctx, grad):
    gate, up, beta, beta_lin, out_dtype = ctx.inputs
    got = _recomputed_grads(lambda g, u: situ_glu_formula(g, u, beta, beta_lin, out_dtype),
                            (gate, up), list(ctx.needs_input_grad[:2]), grad)
    return got[0], got[1], None, None, None, None, None


_swiglu_op.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)
_situ_op.register_autograd(_situ_backward, setup_context=_situ_setup)
_mix_op.register_autograd(_mix_backward, setup_context=_mix_setup)


def _formula_only(*tensors) -> bool:
    """A functorch gradient transform, which cannot run a registered gradient (ops.py):
    the formula there."""
    return functorch_grad_in_use() and any(t is not None and t.requires_grad
                                           for t in tensors)


def gpt_oss_swiglu(gate_up: torch.Tensor, bias: Optional[torch.Tensor], ids: torch.Tensor,
                   limit: float = 7.0, alpha: float = 1.702,
                   out_dtype: Optional[torch.dtype] = None, *,
                   num_threads: Optional[int] = None, isa: Optional[str] = None) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU (the module docstring); ``isa`` (None: the default) only
    picks the kernel's vector width on CPU, never its bits."""
    if _formula_only(gate_up, bias):
        return gpt_oss_swiglu_formula(gate_up, bias, ids, limit, alpha, out_dtype)
    if runs_direct([t for t in (gate_up, bias, ids) if t is not None], ()):
        return _swiglu_cpu(gate_up, bias, ids, float(limit), float(alpha), out_dtype,
                           num_threads or 0, isa or "")
    return torch.ops.mxfp4x.gpt_oss_swiglu(gate_up, bias, ids, float(limit), float(alpha),
                                           out_dtype, num_threads or 0, isa or "")


def mix_rows(weights: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, *,
             num_threads: Optional[int] = None, isa: Optional[str] = None) -> torch.Tensor:
    """The sum over k, in order, of ``weights[t, k] * rows[ids[t, k]]`` (the module
    docstring)."""
    if _formula_only(weights, rows):
        return mix_rows_formula(weights, rows, ids)
    if runs_direct((weights, rows, ids), ()):
        return _mix_cpu(weights, rows, ids, num_threads or 0, isa or "")
    return torch.ops.mxfp4x.mix_rows(weights, rows, ids, num_threads or 0, isa or "")


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float,
             beta_lin: Optional[float] = None, out_dtype: Optional[torch.dtype] = None, *,
             num_threads: Optional[int] = None, isa: Optional[str] = None) -> torch.Tensor:
    """Kimi K3's SiTU times its clipped up branch (the module docstring)."""
    if _formula_only(gate, up):
        return situ_glu_formula(gate, up, beta, beta_lin, out_dtype)
    if runs_direct((gate, up), ()):
        return _situ_cpu(gate, up, float(beta), None if beta_lin is None else float(beta_lin),
                         out_dtype, num_threads or 0, isa or "")
    return torch.ops.mxfp4x.situ_glu(gate, up, float(beta),
                                     None if beta_lin is None else float(beta_lin), out_dtype,
                                     num_threads or 0, isa or "")


def gpt_oss_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
                     num_threads: Optional[int] = None,
                     isa: Optional[str] = None) -> Optional[torch.Tensor]:
    """transformers' ``GptOssRMSNorm`` of ``x`` (``weight * (x / sqrt(mean(x^2) + eps))``
    in float32, rounded once to x's dtype) on one compiled pass over rows
    (activation.h's ``mxfp4x_rms_norm``: torch's float32 operations in its order, the mean
    of the squares correctly rounded where torch sums them in float32), where it takes the
    call: plain CPU tensors of float32 or 16-bit floats, the weight (D,) for x's last
    dimension, nothing to record for autograd (:func:`runs_direct`).  Otherwise None:
    the caller runs its own formula.  A row's bits depend only on the row."""
    if x.dtype not in _C_DTYPES or weight.dtype not in _C_DTYPES or weight.dim() != 1 \
            or x.dim() == 0 or x.shape[-1] != weight.shape[0] \
            or not runs_direct((x, weight), ()):
        return None
    d = x.shape[-1]
    n = x.numel() // d if d else 0
    out = torch.empty(x.shape, dtype=x.dtype)
    _cpu.rms_norm(_bits(x.reshape(n, d)), _C_DTYPES[x.dtype], _bits(weight.detach()),
                  _C_DTYPES[weight.dtype], _numpy(out.view(n, d)), _C_DTYPES[x.dtype],
                  float(eps), isa=isa or None, n_threads=_threads.resolve(num_threads))
    return out
