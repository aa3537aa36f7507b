"""The one-call load (:func:`from_pretrained`): transformers' ``AutoModelForCausalLM`` given
the config and the quantization config that route its experts to mxfp4x."""
import copy
from typing import Optional

from transformers import AutoConfig, AutoModelForCausalLM

from ..._core.arguments import num_threads_arg
from ._attention import ATTENTION
from ._config import FILE_FORMAT, QUANT_METHOD, Mxfp4xConfig

_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision",
               "subfolder", "token", "trust_remote_code", "code_revision")


def from_pretrained(pretrained_model_name_or_path, *model_args,
                    num_threads: Optional[int] = None, **kwargs):
    """A transformers ``AutoModelForCausalLM`` whose MoE experts are MXFP4 and run on
    mxfp4x, from a folder or a Hub id.

    * an MXFP4 checkpoint (gpt-oss as released, ``quant_method: "mxfp4"``): the expert
      bytes go from the file into uint8 buffers; no dense copy of an expert is ever made;
    * a checkpoint with dense experts (Qwen3-MoE, Mixtral, DeepSeek-style, gpt-oss bf16,
      any model whose experts module transformers routes through its experts interface):
      each layer's experts are quantized to MXFP4 as the loader hands them over
      (``mxfp4x.quantize``, the scale rule of ``Mxfp4xConfig(scale_rule=...)``).

    Each gpt-oss experts module loads as the file stores it (see
    :class:`Mxfp4xHfQuantizer`): MXFP4 bytes are read as MXFP4 also where ``config.json``
    lacks ``quantization_config``; expert tensors the file lacks are a ValueError.

    ``kwargs`` go to transformers' ``from_pretrained`` (``dtype``/``torch_dtype``,
    ``revision``, ``config``, ...); ``num_threads`` (or ``quantization_config=
    Mxfp4xConfig(num_threads=...)``) sets the threads of each experts call.  The model's
    bfloat16 linear layers run on mxfp4x's dense kernel at a few tokens
    (``Mxfp4xConfig(dense_kernels=False)``: torch's).  gpt-oss models take
    :func:`grouped_attention` (``attn_implementation="mxfp4x_grouped"``) unless an
    attention is asked for, here or in ``config`` (``"eager"``: transformers' own).
    """
    num_threads_arg(num_threads)  # before any file is read
    qc = kwargs.pop("quantization_config", None)
    if qc is not None and not isinstance(qc, Mxfp4xConfig):
        raise TypeError(f"quantization_config: expected an Mxfp4xConfig or None, got "
                        f"{type(qc).__name__}")
    config = kwargs.pop("config", None)
    if config is None:
        hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
        config = AutoConfig.from_pretrained(pretrained_model_name_or_path, **hub)
    else:  # the caller's own is left as it was
        config = copy.deepcopy(config)
    threads = num_threads if num_threads is not None else getattr(qc, "num_threads", None)
    if getattr(config, "model_type", None) == "gpt_oss" and \
            getattr(config, "_attn_implementation", None) is None:  # none asked in config=
        kwargs.setdefault("attn_implementation", ATTENTION)
    # what the caller's config asks of the run (not written to the checkpoint)
    run = {k: getattr(qc, k, default) for k, default in
           (("dense_kernels", True), ("float32_intermediate", False),
            ("growing_cache", True))}
    found = getattr(config, "quantization_config", None)
    if found is None:  # dense experts: quantized at load (MXFP4 ones, in a checkpoint
        # whose config says nothing of them: the quantizer reads them as MXFP4)
        dense = Mxfp4xConfig(num_threads=threads,
                             scale_rule=getattr(qc, "scale_rule", "floor"),
                             modules_to_not_convert=getattr(qc, "modules_to_not_convert", None),
                             **run)
        return AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args,
                                                    config=config, quantization_config=dense,
                                                    **kwargs)
    method = found.get("quant_method") if isinstance(found, dict) else found.quant_method
    method = getattr(method, "value", method)
    if method not in (FILE_FORMAT, QUANT_METHOD):
        raise ValueError(f"{pretrained_model_name_or_path}: quant_method {method!r}; mxfp4x "
                         f"loads MXFP4 checkpoints (quant_method 'mxfp4') and checkpoints "
                         f"with dense experts")
    skip = (found.get("modules_to_not_convert") if isinstance(found, dict)
            else getattr(found, "modules_to_not_convert", None))
    # the checkpoint's list (modules it holds dense) and the caller's
    skip = list(dict.fromkeys(list(skip or []) +
                              list(getattr(qc, "modules_to_not_convert", None) or []))) or None
    # a dict, as config.json holds it: transformers dispatches on its quant_method
    config.quantization_config = {"quant_method": QUANT_METHOD, "num_threads": threads,
                                  "modules_to_not_convert": skip, **run}
    return AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args,
                                                config=config, **kwargs)
