"""One Kimi K3 MoE layer (:class:`KimiK3MoE`): the router, the latent projections and
norm, the routed experts and the shared experts (the formula: the package's docstring);
``from_checkpoint`` reads either file format (loading.py, gguf.py)."""
import os
from typing import Optional

import torch

from ..._core import dense as _dense
from ..._core.activation import situ_glu
from ..._core.arguments import num_threads_arg
from ..._core.format import accumulation_dtype
from ...checkpoints.gguf import GGUFCheckpoint, is_gguf
from .experts import KimiK3Experts
from .gguf import from_gguf
from .loading import from_safetensors
from .router import KimiK3Router
from .tensors import check_block


def _rms_norm(y, weight, eps):
    """Moonshot's KimiRMSNorm: normalise in float32 (float64 for float64), then weight."""
    z = y.to(accumulation_dtype(y.dtype))
    z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(y.dtype) * z.to(y.dtype)


def _linear(x, w, num_threads):
    """F.linear with the weight in x's dtype; bf16 weights at a few tokens through the
    compiled kernels on ``num_threads`` threads (mxfp4x._core.dense: torch's bf16
    matrix-vector product reads them at about half the memory's rate; 5 to 16 bf16
    tokens on the bf16 unit where the CPU's default entry has one)."""
    return _dense.linear(x, w, num_threads=num_threads, unit=True)


class KimiK3MoE(torch.nn.Module):
    """One Kimi K3 MoE layer: ``forward(x (T, hidden)) -> (T, hidden)`` (see the package's
    docstring).  The dense parts (router, latent projections, norm, shared experts) are
    plain torch in the input's dtype with the checkpoint's weights (bf16 as released; a
    float32 input upcasts them each call); the routed experts are
    :class:`KimiK3Experts`.  ``experts.num_threads`` (``num_threads`` of
    :meth:`from_checkpoint`) is the thread count of every compiled product of the block:
    the routed experts, and at a few tokens the router, latent projections and shared
    experts (torch's own ops keep torch's threads)."""

    def __init__(self, router: KimiK3Router, down_proj: torch.Tensor,
                 experts: KimiK3Experts, norm_weight: Optional[torch.Tensor],
                 up_proj: torch.Tensor, shared_gate: torch.Tensor, shared_up: torch.Tensor,
                 shared_down: torch.Tensor, norm_eps: float = 1e-5):
        super().__init__()
        check_block(router.weight, experts, dict(
            down_proj=down_proj, norm_weight=norm_weight, up_proj=up_proj,
            shared_gate=shared_gate, shared_up=shared_up, shared_down=shared_down))
        self.router, self.experts = router, experts
        frozen = dict(requires_grad=False)
        self.down_proj = torch.nn.Parameter(down_proj.detach(), **frozen)
        self.up_proj = torch.nn.Parameter(up_proj.detach(), **frozen)
        self.norm_weight = None if norm_weight is None else torch.nn.Parameter(
            norm_weight.detach(), **frozen)
        self.shared_gate = torch.nn.Parameter(shared_gate.detach(), **frozen)
        self.shared_up = torch.nn.Parameter(shared_up.detach(), **frozen)
        self.shared_down = torch.nn.Parameter(shared_down.detach(), **frozen)
        self.norm_eps = float(norm_eps)

    def shared(self, x):
        n = self.experts.num_threads
        g, u = _linear(x, self.shared_gate, n), _linear(x, self.shared_up, n)
        act = situ_glu(g, u, self.experts.beta, self.experts.linear_beta, num_threads=n,
                       isa=self.experts.isa)
        return _linear(act.to(x.dtype), self.shared_down, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.experts.group is not None:
            # the router, projections, norm and shared experts inside the ranks'
            # agreement too: a failure in any of them on one rank reaches every rank
            from ...distributed import _scope
            return _scope.run(self.experts.group, self, self._forward, x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.experts.num_threads  # the whole block's compiled products
        selected, weights = self.router(x, num_threads=n)
        h = _linear(x, self.down_proj, n)
        y = self.experts(h, selected, weights)
        if self.norm_weight is not None:
            y = _rms_norm(y, self.norm_weight, self.norm_eps)
        return _linear(y, self.up_proj, n) + self.shared(x)

    @classmethod
    def from_checkpoint(cls, path, layer: int, expert_range=None,
                        num_threads: Optional[int] = None, progress: bool = True,
                        group=None, config: Optional[dict] = None) -> "KimiK3MoE":
        """Layer ``layer`` of a Kimi K3 checkpoint folder (``config.json`` and one or
        sharded ``.safetensors`` files), or of a GGUF file of llama.cpp's converter
        (architecture ``kimi-k3``; one ``.gguf`` file or any file of a split set
        ``-0000i-of-0000N.gguf``; see :func:`from_gguf`).  ``expert_range`` ((e0, e1) or
        a range) maps only those experts' bytes; the bytes stay views of the files'
        mappings.  ``group``: expert-parallel over this torch.distributed group
        (``expert_range`` then this rank's range; see :class:`KimiK3Experts`).
        ``config``: for a GGUF file only, hyperparameters its metadata lacks, by their
        ``config.json`` names (a safetensors checkpoint has its config.json)."""
        num_threads_arg(num_threads)  # before any file is read
        if isinstance(path, GGUFCheckpoint) or is_gguf(os.fspath(path) if isinstance(
                path, (str, os.PathLike)) else ""):
            return from_gguf(cls, path, layer, expert_range=expert_range,
                             num_threads=num_threads, group=group, config=config)
        if config is not None:
            raise TypeError("config: only for GGUF files (a safetensors checkpoint's "
                            "hyperparameters come from its config.json)")
        return from_safetensors(cls, path, layer, expert_range=expert_range,
                                num_threads=num_threads, progress=progress, group=group)
