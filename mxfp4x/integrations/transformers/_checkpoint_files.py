"""What the checkpoint file holds, read before any weight is: the tensor names in its
safetensors headers (:func:`checkpoint_names`), its experts' MXFP4 tensors
(:func:`mxfp4_tensors`), and how it stores each gpt-oss experts module
(:func:`gpt_oss_stored`: MXFP4 or dense, a ValueError for what it lacks)."""
from typing import Optional

# the tensors of a gpt-oss experts module in a checkpoint: MXFP4 (blocks, scales), or
# dense as transformers holds them; the biases in both
GPT_OSS_MXFP4 = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks",
                 "down_proj_scales")
GPT_OSS_DENSE = ("gate_up_proj", "down_proj")
GPT_OSS_BIASES = ("gate_up_proj_bias", "down_proj_bias")


def checkpoint_names(checkpoint_files) -> Optional[set]:
    """The names of the tensors in the checkpoint's safetensors files (their headers
    only); None where they cannot be known (no files: a ``state_dict``; another format)."""
    if not checkpoint_files:
        return None
    from safetensors import safe_open

    names: set = set()
    for path in checkpoint_files:
        if not str(path).endswith(".safetensors"):
            return None
        with safe_open(str(path), "pt") as f:
            names.update(f.keys())
    return names


def mxfp4_tensors(names: Optional[set]) -> list:
    """The experts' MXFP4 tensors of a checkpoint: each ``*experts*_blocks`` name whose
    ``_scales`` twin is there too."""
    if names is None:
        return []
    return sorted(n for n in names if n.endswith("_blocks") and "experts" in n and
                  n[:-len("_blocks")] + "_scales" in names)


def gpt_oss_stored(name: str, names: set, prefix: str) -> str:
    """How the checkpoint stores the gpt-oss experts module ``name``: ``"mxfp4"``
    (blocks and scales) or ``"dense"`` (transformers' ``gate_up_proj``, ``down_proj``),
    biases in both; a ValueError naming the module and what it lacks (transformers would
    leave those tensors at its random initialisation, and the logits wrong)."""
    held: set = set()
    every = GPT_OSS_MXFP4 + GPT_OSS_DENSE + GPT_OSS_BIASES
    # the file's names may lack the model's prefix ("model."), or carry one it lacks
    for base in dict.fromkeys((name, name.removeprefix(prefix + "."), f"{prefix}.{name}")):
        held = {t for t in every if f"{base}.{t}" in names}
        if held:
            break
    mxfp4 = held & set(GPT_OSS_MXFP4)
    dense = held & set(GPT_OSS_DENSE)
    if mxfp4 and dense:
        raise ValueError(f"{name}: the checkpoint holds its experts both in MXFP4 "
                         f"({', '.join(sorted(mxfp4))}) and dense ({', '.join(sorted(dense))})"
                         f"; expected one or the other")
    if not (mxfp4 or dense):
        raise ValueError(f"{name}: the checkpoint holds no weights of these experts (in "
                         f"MXFP4: {', '.join(name + '.' + t for t in GPT_OSS_MXFP4)}; or "
                         f"dense: {', '.join(GPT_OSS_DENSE)}); transformers would leave them "
                         f"at its random initialisation")
    form, want = ("mxfp4", GPT_OSS_MXFP4) if mxfp4 else ("dense", GPT_OSS_DENSE)
    missing = [t for t in want + GPT_OSS_BIASES if t not in held]
    if missing:
        raise ValueError(f"{name}: the checkpoint stores these experts "
                         f"{'in MXFP4' if mxfp4 else 'dense'} but lacks "
                         f"{', '.join(name + '.' + t for t in missing)}; transformers would "
                         f"leave them at its random initialisation")
    return form
