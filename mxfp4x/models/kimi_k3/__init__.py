"""The Kimi K3 MoE block over the mxfp4x ops (``mxfp4x.nn.KimiK3*``; its float64
reference is ``mxfp4x.testing.kimi_k3``).

The block (Moonshot's ``KimiSparseMoeBlock`` in ``modeling_kimi_linear.py``):

    sel, p = router(x)                          sigmoid scores, biased choice, top-k
    h = down_proj(x)                            latent MoE: hidden -> latent
    y = sum_k p_k w2_e (situ(w1_e h) * clip(w3_e h))   routed experts, in MXFP4
    y = up_proj(rms_norm(y))                    latent -> hidden
    out = y + shared(x)                         shared experts: a dense SiTU MLP

with situ(g) = beta tanh(g / beta) sigmoid(g), clip(u) = beta_lin tanh(u / beta_lin)
(config ``activation_situ_beta`` 4.0, ``activation_situ_linear_beta`` 25.0).

``KimiK3MoE.from_checkpoint`` reads the release's safetensors layout or llama.cpp's GGUF
files (architecture ``kimi-k3``; :func:`from_gguf`): there the experts stay GGUF blocks,
read in place.

One module per job, as every family (``mxfp4x.models.gpt_oss`` has the same files):
``router.py`` the sigmoid router, ``experts.py`` the routed experts in MXFP4 and their
activation, ``block.py`` the layer, ``config.py`` the hyperparameters read from the
config and the release's sizes, ``tensors.py`` the tensors' names and the shapes
checked, ``loading.py`` ``from_checkpoint`` of a safetensors checkpoint, ``gguf.py`` of
a GGUF file.
"""
from .block import KimiK3MoE
from .config import K3_SIZES, block_config, situ_betas
from .experts import KimiK3Experts, clip, situ
from .gguf import GGUF_GATING_FUNC_KEY, GGUF_GATING_SIGMOID, GGUF_KEYS, from_gguf, gguf_config
from .router import KimiK3Router
from .tensors import DENSE_PARTS, check_block, dense_shapes, expert_tensors

__all__ = ["KimiK3Experts", "KimiK3MoE", "KimiK3Router", "K3_SIZES", "block_config",
           "situ_betas", "situ", "clip", "GGUF_KEYS", "GGUF_GATING_FUNC_KEY",
           "GGUF_GATING_SIGMOID", "from_gguf", "gguf_config", "DENSE_PARTS", "check_block",
           "dense_shapes", "expert_tensors"]
