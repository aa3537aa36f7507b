"""Checkpoints: the safetensors reader and writer and the GGUF reader (memory-mapped,
zero-copy, hostile headers refused), how each model family names its expert tensors, and
verification of the bytes the kernels get against the files and a manifest."""
from .families import (
    FAMILIES,
    GGUF_FAMILIES,
    ExpertNaming,
    GGUFExpertNaming,
    family_of,
    load_gguf_experts,
    open_checkpoint,
    read_config,
)
from .gguf import GGUFCheckpoint, GGUFFile, GGUFTensorInfo
from .safetensors import SafeTensorsCheckpoint, SafeTensorsFile, save_file, write_file
from .verify import check_manifest, verify_experts, verify_gguf_experts

__all__ = ["SafeTensorsFile", "SafeTensorsCheckpoint", "save_file", "write_file",
           "GGUFFile", "GGUFCheckpoint", "GGUFTensorInfo",
           "open_checkpoint", "read_config", "ExpertNaming", "FAMILIES", "family_of",
           "GGUFExpertNaming", "GGUF_FAMILIES", "load_gguf_experts",
           "verify_experts", "verify_gguf_experts", "check_manifest"]
