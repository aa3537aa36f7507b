"""Model families over the mxfp4x ops, one package each with the same modules: router,
experts, block (and its ``from_checkpoint``), config, tensors (names and shapes), loading
(safetensors) and gguf (gpt_oss, kimi_k3)."""
