"""The generic MXFP4 expert bank, :class:`MXFP4Experts`: E experts of one shape over the
mxfp4x ops, built from packed bytes, float weights or a safetensors file (public as
``mxfp4x.nn.MXFP4Experts``).  The model families' modules are in their own packages
(``gpt_oss``, ``kimi_k3``)."""
from typing import Optional

import numpy as np
import torch

from .._core.api import mxfp4_experts
from .._core.arguments import NumThreads, check_range_within, num_threads_arg, parse_expert_range
from .._core.coerce import as_tensor
from .._core.coerce import bytes_by_view as as_bytes
from .._core.format import GGUF_BLOCK_BYTES, GROUP, GROUP_BYTES
from .._core.quantize import quantize
from .._core.weak_group import WeakGroup
from ..checkpoints.safetensors import SafeTensorsCheckpoint
from ._common import BytesByView, bytes_of, expert_range_of, held_ids

__all__ = ["MXFP4Experts"]


class MXFP4Experts(BytesByView):
    """E experts W_e (d_out x d_in) stored in MXFP4: buffers ``packed_weights``
    (E, d_out, d_in/32, 16) and ``scale_bytes`` (E, d_out, d_in/32), uint8; or, built by
    ``from_packed(blocks, None)``, ``packed_weights`` (E, d_out, d_in/32, 17) holding GGUF
    block_mxfp4 blocks (read in place) and ``scale_bytes`` None.

    ``forward(latent_tokens, selected_experts, mixture_weights, shared_output=None)``
    returns ``shared_output + sum_k p_tk W_{e_tk} x_t`` (zeros for a missing shared output).

    Expert-parallel: built with ``expert_range=(e0, e1)`` (the buffers then hold experts
    e0..e1-1) and ``group`` (torch.distributed), its forward is
    :func:`mxfp4x.distributed.mxfp4_experts` (bit-identical to one process).

    ``load_state_dict`` reads int8 and float8_e8m0fnu entries for the buffers by view
    (the bytes themselves), as the checkpoint readers do.
    """

    group = WeakGroup()  # held weakly: _core/weak_group.py
    num_threads = NumThreads()  # checked whenever it is set
    _byte_buffers = ("packed_weights", "scale_bytes")

    packed_weights: torch.Tensor
    scale_bytes: Optional[torch.Tensor]

    def __init__(self, n_experts: int, d_out: int, d_in: int, num_threads: Optional[int] = None,
                 expert_range=None, group=None):
        super().__init__()
        for name, v in (("n_experts", n_experts), ("d_out", d_out), ("d_in", d_in)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"{name}: expected a non-negative integer, got {v!r}")
        self.expert_range, self.group = expert_range_of(expert_range, n_experts, group), group
        if d_in % GROUP:
            raise ValueError(f"d_in: must be a multiple of {GROUP}, got {d_in}")
        self.num_threads = num_threads
        self.register_buffer("packed_weights",
                             torch.zeros((n_experts, d_out, d_in // GROUP, GROUP_BYTES),
                                         dtype=torch.uint8))
        self.register_buffer("scale_bytes",
                             torch.zeros((n_experts, d_out, d_in // GROUP), dtype=torch.uint8))

    @classmethod
    def from_packed(cls, packed_weights: torch.Tensor, scale_bytes: Optional[torch.Tensor],
                    num_threads: Optional[int] = None, expert_range=None,
                    group=None) -> "MXFP4Experts":
        """Wrap existing bytes (no copy when they are uint8 already).  ``scale_bytes``
        None: ``packed_weights`` (E, d_out, G, 17) holds GGUF block_mxfp4 blocks (e.g. a
        view of a memory-mapped GGUF file), read in place."""
        packed_weights = as_tensor("packed_weights", packed_weights)
        if scale_bytes is not None:
            scale_bytes = as_tensor("scale_bytes", scale_bytes)
        width = GGUF_BLOCK_BYTES if scale_bytes is None else GROUP_BYTES
        if packed_weights.dim() != 4 or packed_weights.shape[-1] != width:
            raise ValueError(f"packed_weights: expected (E, d_out, G, {width})"
                             f"{' GGUF blocks (scale_bytes is None)' if width == 17 else ''}"
                             f", got {tuple(packed_weights.shape)}")
        if scale_bytes is not None and tuple(scale_bytes.shape) != tuple(
                packed_weights.shape[:3]):
            raise ValueError(f"scale_bytes: expected {tuple(packed_weights.shape[:3])}, got "
                             f"{tuple(scale_bytes.shape)}")
        e, o, g, _ = packed_weights.shape
        m = cls.__new__(cls)
        torch.nn.Module.__init__(m)
        m.num_threads = num_threads
        m.expert_range, m.group = expert_range_of(expert_range, e, group), group
        m.register_buffer("packed_weights", bytes_of("packed_weights", packed_weights))
        m.register_buffer("scale_bytes", None if scale_bytes is None else
                          bytes_of("scale_bytes", scale_bytes))
        return m

    @classmethod
    def from_float(cls, weights: torch.Tensor, scale_rule: str = "floor",
                   num_threads: Optional[int] = None) -> "MXFP4Experts":
        """Quantize float weights (E, d_out, d_in) (OCP MX v1.0 rules, see quantize)."""
        num_threads_arg(num_threads)  # before the work
        packed, scales = quantize(weights, scale_rule)
        return cls.from_packed(packed, scales, num_threads)

    @classmethod
    def from_safetensors(cls, path: str, blocks_key: str, scales_key: str,
                         num_threads: Optional[int] = None, expert_range=None,
                         group=None) -> "MXFP4Experts":
        """Load (memory-mapped) from a .safetensors file or checkpoint directory; with
        ``expert_range`` only those experts' bytes are mapped."""
        num_threads_arg(num_threads)  # before any file is read
        rng = None if expert_range is None else parse_expert_range(expert_range)
        ckpt = SafeTensorsCheckpoint(path)
        if rng is None:
            blocks, scales = ckpt.get(blocks_key), ckpt.get(scales_key)
        else:
            for key in (blocks_key, scales_key):
                check_range_within(rng, (ckpt.shape(key) or (0,))[0], f"tensor {key!r}")
            blocks, scales = ckpt.get_rows(blocks_key, *rng), ckpt.get_rows(scales_key, *rng)
        return cls.from_packed(as_bytes(blocks_key, blocks), as_bytes(scales_key, scales),
                               num_threads, expert_range=rng, group=group)

    def forward(self, latent_tokens: torch.Tensor, selected_experts: torch.Tensor,
                mixture_weights: torch.Tensor,
                shared_output: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.group is not None:  # the whole forward inside the ranks' agreement
            from ..distributed import _scope
            return _scope.run(self.group, self, self._forward, latent_tokens,
                              selected_experts, mixture_weights, shared_output)
        return self._forward(latent_tokens, selected_experts, mixture_weights, shared_output)

    def _forward(self, latent_tokens, selected_experts, mixture_weights, shared_output):
        if shared_output is None:
            x = as_tensor("latent_tokens", latent_tokens)
            if x.dim() not in (2, 3):
                raise ValueError(f"latent_tokens: expected a 2-D tensor (n_tokens, d_in) "
                                 f"or a 3-D tensor (n_tokens, top_k, d_in), got shape "
                                 f"{tuple(x.shape)}")
            dtype = x.dtype if x.is_floating_point() else torch.get_default_dtype()
            shared_output = torch.zeros((x.shape[0], self.packed_weights.shape[1]),
                                        dtype=dtype, device=x.device)
        if self.group is not None:
            from .. import distributed
            return distributed.mxfp4_experts(latent_tokens, self.packed_weights,
                                             self.scale_bytes, selected_experts,
                                             mixture_weights, shared_output,
                                             expert_range=self.expert_range, group=self.group,
                                             num_threads=self.num_threads)
        if self.expert_range[0]:  # some of the experts, no group: the ids it holds
            selected_experts = held_ids(selected_experts, self.expert_range)
        return mxfp4_experts(latent_tokens, self.packed_weights, self.scale_bytes,
                             selected_experts, mixture_weights, shared_output,
                             num_threads=self.num_threads)

    def extra_repr(self) -> str:
        e, o, g, _ = self.packed_weights.shape
        return f"n_experts={e}, d_out={o}, d_in={GROUP * g}"
