"""Model families over the mxfp4x ops, one module each with the same shape: its tensor
names, router, experts, block and ``from_checkpoint`` (gpt_oss, kimi_k3)."""
