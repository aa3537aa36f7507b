"""Kimi K3 for the tests: a float64 reference of the block and random checkpoints in the
release's layout: ``mxfp4x._synthetic.kimi_k3``, what ``python -m mxfp4x layer`` writes
and checks with."""
from .._synthetic.kimi_k3 import (
    decode_gguf_expert,
    k3_config,
    kimi_k3_reference,
    write_k3_checkpoint,
)

__all__ = ["decode_gguf_expert", "k3_config", "kimi_k3_reference", "write_k3_checkpoint"]
