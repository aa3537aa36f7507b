"""gpt-oss's hyperparameters read from its config (transformers' GptOssConfig names, each
alias taken) and the released gpt-oss-20b's sizes."""
from typing import Optional, Tuple

from ...checkpoints import families as ck
from ...checkpoints.families import GPT_OSS
from .._common import _positive, _real

# the released gpt-oss-20b's sizes, under transformers' GptOssConfig names
GPT_OSS_20B = dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                   num_experts_per_tok=4, num_hidden_layers=24, swiglu_limit=7.0)


def checkpoint_config(root: str, required: bool = False) -> Tuple[dict, str]:
    """(config, where it is) of a gpt-oss checkpoint (a folder, or beside a file): the
    keys under the names the family reads (``GPT_OSS.config``: transformers'
    ``GptOssConfig`` names, each alias taken, one naming another value a ValueError);
    ({}, where) when there is none and it is not ``required``."""
    source = ck.config_path(root)
    try:
        raw = ck.read_config(root)
    except FileNotFoundError:
        if required:
            raise
        return {}, source
    return GPT_OSS.config(raw, source), source


def activation(config: dict, source: str, limit: Optional[float] = None,
               alpha: Optional[float] = None) -> Tuple[float, float]:
    """(limit, alpha) of the clamped SwiGLU: as given, else the config's ``swiglu_limit``
    and ``swiglu_alpha`` (transformers' GptOssConfig reads both), else their defaults
    there, gpt-oss's 7.0 and 1.702; each checked, a ValueError naming ``source``."""
    if limit is None:
        limit = _positive(f"{source}: swiglu_limit", config.get("swiglu_limit", 7.0))
    if alpha is None:
        alpha = _real(f"{source}: swiglu_alpha", config.get("swiglu_alpha", 1.702))
    return float(limit), float(alpha)
