"""Checkpoints: the safetensors reader and writer (memory-mapped, zero-copy, hostile
headers refused), how each model family names its expert tensors, and verification of
the bytes the kernels get against the files and a manifest."""
from .families import FAMILIES, ExpertNaming, family_of, open_checkpoint, read_config
from .safetensors import SafeTensorsCheckpoint, SafeTensorsFile, save_file, write_file
from .verify import check_manifest, verify_experts

__all__ = ["SafeTensorsFile", "SafeTensorsCheckpoint", "save_file", "write_file",
           "open_checkpoint", "read_config", "ExpertNaming", "FAMILIES", "family_of",
           "verify_experts", "check_manifest"]
