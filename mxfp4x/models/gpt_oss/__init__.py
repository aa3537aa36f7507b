"""gpt-oss (openai/gpt-oss-20b and -120b): its tensor names, router, experts, block and
``from_checkpoint``, the experts kept in MXFP4.

The checkpoint as released: layer L's experts are stacked tensors
``model.layers.L.mlp.experts.{gate_up,down}_proj_{blocks,scales,bias}`` (blocks uint8
(E, out, in/32, 16), scales uint8 (E, out, in/32), the gate/up rows interleaved: gate
rows even, up rows odd), the router ``model.layers.L.mlp.router.{weight,bias}``.
llama.cpp's GGUF files (architecture ``gpt-oss``) hold the same codes and scales as GGUF
blocks, gate and up split (``blk.L.ffn_{gate,up,down}_exps.{weight,bias}``, the router
``blk.L.ffn_gate_inp.{weight,bias}``): read in place too.

One module per job, as every family (``mxfp4x.models.kimi_k3`` has the same files):
``router.py`` the router, ``experts.py`` the experts in MXFP4 and their activation (also
as a function), ``block.py`` the layer, ``config.py`` the hyperparameters read from the
config and the release's sizes, ``tensors.py`` the tensors' names and the shapes
checked, ``loading.py`` ``from_checkpoint`` of a safetensors checkpoint, ``gguf.py`` of
a GGUF file.
"""
from .block import GptOssMoE
from .config import GPT_OSS_20B, activation, checkpoint_config
from .experts import GateAndUp, GptOssExperts, gpt_oss_experts
from .loading import load_gpt_oss_experts
from .router import GptOssRouter
from .tensors import check_experts, check_router, tensor_names

__all__ = ["GptOssExperts", "GptOssMoE", "GptOssRouter", "GateAndUp", "GPT_OSS_20B",
           "activation", "checkpoint_config", "check_experts", "check_router",
           "gpt_oss_experts", "load_gpt_oss_experts", "tensor_names"]
