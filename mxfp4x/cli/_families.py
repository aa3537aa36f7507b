"""The models the ``layer`` job runs (its ``--model`` choices), one description each:
what the one runner in ``layer.py`` needs to know of a model beyond its family's entry
in the families registry (``mxfp4x.checkpoints.families.FAMILIES``: tensor names, config
keys), which each one names.  A model is a subclass of :class:`Family` and an entry in
``MODELS``; the model code itself lives in the package, imported here as modules."""
import abc
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np
import torch

import mxfp4x
from mxfp4x._core.format import matrix_bytes
from mxfp4x._synthetic import gpt_oss as _gpt_oss
from mxfp4x._synthetic import kimi_k3 as _kimi_k3
from mxfp4x.checkpoints import families as ck
from mxfp4x.models.gpt_oss import GPT_OSS_20B, GptOssMoE
from mxfp4x.models.kimi_k3 import K3_SIZES


class Family(abc.ABC):
    """How to write a random layer of a model to a folder, load it, feed it and check
    it.  ``sizes`` are the released model's, in its config.json's names (``hidden_size``
    among them, and the family's names of the experts' count and top-k); ``block`` is
    whatever :meth:`load` returns."""

    name: str                          # the --model choice
    family: ck.ExpertNaming            # its entry in the families registry
    layer: int                         # the layer index written and loaded
    sizes: Mapping[str, Any]
    shown: Tuple[Tuple[str, str], ...]  # (label, key): the sizes the job reports
    token_dtype: torch.dtype
    # |layer - float64 reference| <= bound * max|reference|, the routing shared; what
    # sets it, in bound_what (the dtype of the parts that round)
    bound: float
    bound_what: str

    def n_experts(self, sizes: Optional[Mapping[str, Any]] = None) -> int:
        return self.family.config(sizes or self.sizes)[self.family.n_experts_key]

    def top_k(self, sizes: Optional[Mapping[str, Any]] = None) -> int:
        return self.family.config(sizes or self.sizes)[self.family.top_k_key]

    @abc.abstractmethod
    def expert_bytes(self, sizes: Optional[Mapping[str, Any]] = None) -> int:
        """Packed and scale bytes of one expert: what a token routed to it streams."""

    @abc.abstractmethod
    def write(self, folder: str, n_experts: int) -> None:
        """A random layer with ``n_experts`` experts, in the release's naming."""

    @abc.abstractmethod
    def load(self, folder: str):
        """The layer written by :meth:`write`, its expert bytes mapped, not read."""

    def tokens(self, rng: np.random.Generator, n_tokens: int) -> torch.Tensor:
        return torch.from_numpy(rng.standard_normal((n_tokens, self.sizes["hidden_size"]))
                                ).to(self.token_dtype)

    @abc.abstractmethod
    def route(self, block, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(selected experts, their weights) of each token."""

    @abc.abstractmethod
    def forward(self, block, x: torch.Tensor) -> torch.Tensor:
        """The whole layer, routing included."""

    @abc.abstractmethod
    def experts_alone(self, block, x, selected, weights):
        """A call of the routed experts alone, its inputs made now (outside the timing)."""

    @abc.abstractmethod
    def set_threads(self, block, n: int) -> None:
        """The kernels' thread count (torch's is set by the runner)."""

    @abc.abstractmethod
    def reference(self, block, x, selected, weights, rows: slice) -> np.ndarray:
        """The layer's output columns ``rows`` in float64, for this routing."""


class KimiK3(Family):
    name, layer = "kimi-k3", 1  # layer 0 of Kimi K3 is dense (first_k_dense_replace)
    family = ck.KIMI_K3
    sizes = K3_SIZES
    shown = (("hidden", "hidden_size"), ("latent", "routed_expert_hidden_size"),
             ("ff", "moe_intermediate_size"))
    token_dtype = torch.bfloat16  # as the released model runs
    # bfloat16 latents and dense matmuls round every cast to 8 bits: the bound
    # tests/models/test_kimi_k3.py holds the block to in bfloat16
    bound, bound_what = 3e-2, "bfloat16"
    # experts per file: the release's shards are a few GB each
    experts_per_shard = 128

    def expert_bytes(self, sizes=None):
        s = sizes or self.sizes
        latent, ff = s["routed_expert_hidden_size"], s["moe_intermediate_size"]
        return 2 * matrix_bytes(ff, latent) + matrix_bytes(latent, ff)  # w1, w3; w2

    def write(self, folder, n_experts):
        config = _kimi_k3.k3_config(num_experts=n_experts, num_hidden_layers=self.layer + 1)
        _kimi_k3.write_k3_checkpoint(folder, config, [self.layer], seed=0,
                                     shards=max(1, n_experts // self.experts_per_shard),
                                     progress=True)

    def load(self, folder):
        return mxfp4x.nn.KimiK3MoE.from_checkpoint(folder, layer=self.layer)

    def route(self, block, x):
        return block.router(x)

    def forward(self, block, x):
        return block(x)

    def experts_alone(self, block, x, selected, weights):
        h = torch.nn.functional.linear(x, block.down_proj)
        return lambda: block.experts(h, selected, weights)

    def set_threads(self, block, n):
        block.experts.num_threads = n

    def reference(self, block, x, selected, weights, rows):
        return _kimi_k3.kimi_k3_reference(block, x, selected, weights, rows=rows)


class GptOss20b(Family):
    name, layer = "gpt-oss-20b", 0
    family = ck.GPT_OSS
    sizes = GPT_OSS_20B
    shown = (("hidden", "hidden_size"), ("ff", "intermediate_size"))
    token_dtype = torch.float32
    # float32 accumulation, activations and biases: the bound tests/models/test_nn.py holds
    # the experts block to in float32
    bound, bound_what = 1e-4, "float32"

    def expert_bytes(self, sizes=None):
        s = sizes or self.sizes
        hidden, ff = s["hidden_size"], s["intermediate_size"]
        return matrix_bytes(2 * ff, hidden) + matrix_bytes(hidden, ff)  # gate/up; down

    def write(self, folder, n_experts):
        _gpt_oss.write_gpt_oss_layer(folder, layer=self.layer, num_local_experts=n_experts)

    def load(self, folder):
        return GptOssMoE.from_checkpoint(folder, self.layer)

    def route(self, block, x):
        return block.router(x)

    def forward(self, block, x):
        return block(x)

    def experts_alone(self, block, x, selected, weights):
        return lambda: block.experts(x, selected, weights)

    def set_threads(self, block, n):
        block.experts.num_threads = n

    def reference(self, block, x, selected, weights, rows):
        return _gpt_oss.gpt_oss_reference(block.experts, x, selected, weights, rows=rows)


MODELS: Dict[str, Family] = {m.name: m for m in (KimiK3(), GptOss20b())}
