"""The torch modules over the mxfp4x ops (public as ``mxfp4x.nn``): the generic expert
bank (``experts``: MXFP4Experts), and the model families, one package each with the same
modules: router, experts, block (and its ``from_checkpoint``), config, tensors (names and
shapes), loading (safetensors) and gguf (gpt_oss, kimi_k3)."""
