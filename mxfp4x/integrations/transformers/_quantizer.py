"""transformers' quantizer of the ``"mxfp4x"`` method (:class:`Mxfp4xHfQuantizer`), which
decides module by module what each experts module becomes, registered on import with
:class:`Mxfp4xConfig` as the quantization method ``"mxfp4x"``."""
import os
from typing import Dict

import torch
from transformers.quantizers import HfQuantizer
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.quantizers_utils import get_module_from_name, should_convert_module
from transformers.utils import logging

from ..._core import memory as _memory
from ._cache import use_growing_cache
from ._checkpoint_files import checkpoint_names, gpt_oss_stored, mxfp4_tensors
from ._config import QUANT_METHOD, Mxfp4xConfig
from ._decode import use_decode_attention
from ._dense_experts import Mxfp4xQuantize, dense_experts_modules, swap_to_mxfp4, whole_groups
from ._dense_linear import use_dense_kernels
from ._gpt_oss_experts import GptOssMxfp4Experts, dequantized_experts

_LOG = logging.get_logger(__package__)  # the package's name, as users know it


class Mxfp4xHfQuantizer(HfQuantizer):
    """transformers' quantizer of the ``"mxfp4x"`` method.

    An MXFP4 checkpoint (gpt-oss): the experts modules of the meta-device model become
    :class:`GptOssMxfp4Experts` before the weights are read; nothing is converted while
    loading (the modules take the checkpoint's tensors as they are).  What the file holds
    decides, module by module (safetensors files: their headers are read first): experts
    it stores dense stay transformers' modules (and ``modules_to_not_convert`` then lists
    them), experts stored in MXFP4 that ``modules_to_not_convert`` names are read as
    MXFP4 and dequantized into transformers' module after loading, and experts the file
    lacks (a weight, scale or bias) are a ValueError.  A checkpoint whose config names no
    quantization but whose file holds gpt-oss experts in MXFP4 is read as MXFP4.

    A dense checkpoint: every experts module transformers routes through its experts
    interface keeps its class, its biases and its activation; its weights become uint8
    buffers filled by :class:`Mxfp4xQuantize` as the loader hands over each merged
    tensor, and its forward becomes :func:`mxfp4x_experts_forward`."""

    requires_calibration = False
    quantization_config: Mxfp4xConfig

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as HfExperts

        _read_in_huge_folios(model, checkpoint_files)  # before any header is read
        names = checkpoint_names(checkpoint_files)
        every = [(name, m) for name, m in model.named_modules() if isinstance(m, HfExperts)]
        mxfp4 = mxfp4_tensors(names)
        if not self.pre_quantized:
            if not mxfp4:
                return self._dense_before_loading(model)
            if not every:
                raise ValueError(f"mxfp4x: the checkpoint holds MXFP4 expert tensors "
                                 f"({mxfp4[0]}, ...), but {type(model).__name__} has no "
                                 f"gpt-oss experts; mxfp4x reads MXFP4 checkpoints of gpt-oss "
                                 f"models")
            # its config.json names no quantization_config, its tensors say MXFP4: read
            # as the MXFP4 checkpoint it is (transformers' loader asks pre_quantized when
            # it loads, after this)
            self.pre_quantized = True
        if not every:
            raise ValueError(f"mxfp4x: no gpt-oss experts in {type(model).__name__}; an "
                             f"MXFP4 checkpoint loads for gpt-oss models (dense checkpoints "
                             f"of other MoE models are quantized at load)")
        config = model.config.get_text_config()
        qc = self.quantization_config
        skip = list(qc.modules_to_not_convert or [])
        prefix = getattr(model, "base_model_prefix", "") or ""
        self._mxfp4x_dequantize: Dict[str, torch.nn.Module] = {}
        for name, module in every:
            stored = None if names is None else gpt_oss_stored(name, names, prefix)
            listed = not should_convert_module(name, skip)
            if stored == "dense" or (stored is None and listed):
                if not listed:  # the config written back says what the file holds
                    qc.modules_to_not_convert = [*(qc.modules_to_not_convert or []), name]
                continue  # transformers' module takes the file's dense weights
            with torch.device("meta"):
                new = GptOssMxfp4Experts(config, bias_dtype=module.gate_up_proj_bias.dtype,
                                         num_threads=qc.num_threads,
                                         float32_intermediate=qc.float32_intermediate)
            new._mxfp4x_name = name + "."
            if listed:  # stored MXFP4: the bytes load as they are, dequantized after
                self._mxfp4x_dequantize[name] = module
            model.set_submodule(name, new)
        return model

    def get_new_dtype(self, converter, param, dtype):
        """The dtype transformers' loader casts a checkpoint tensor to on its way to the
        model: none for the MXFP4 bytes of an MXFP4 checkpoint.  The loader casts a
        float-typed tensor (F8_E8M0 scales among them) by value to its parameter's dtype,
        which would turn each E8M0 scale byte s into the integer part of 2^(s-127), 0 for
        every scale below 127; the bytes arrive as stored and :class:`GptOssMxfp4Experts`
        views them (or names a dtype that is not bytes)."""
        targets = getattr(converter, "target_patterns", None) or ()
        if any(str(t).rsplit(".", 1)[-1] in GptOssMxfp4Experts._byte_buffers
               for t in targets):
            return None
        return super().get_new_dtype(converter, param, dtype)

    def _dense_before_loading(self, model):
        every = dense_experts_modules(model)
        if not every:
            raise ValueError(f"mxfp4x: no experts module in {type(model).__name__} that "
                             f"transformers routes through its experts interface "
                             f"(@use_experts_implementation); nothing to quantize")
        skip = self.quantization_config.modules_to_not_convert
        found = [f for f in every if should_convert_module(f[0], skip)]
        self._mxfp4x_quantized = len(found)
        if not found:
            _LOG.warning(f"mxfp4x: modules_to_not_convert leaves every experts module of "
                         f"{type(model).__name__} dense ({len(every)}); nothing is quantized "
                         f"and the model is transformers' own")
            return model
        for name, shapes in whole_groups(found).items():
            module = model.get_submodule(name)
            swap_to_mxfp4(module, shapes)
            module._mxfp4x_threads = self.quantization_config.num_threads
            module._mxfp4x_float32_intermediate = self.quantization_config.float32_intermediate
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        for name, module in getattr(self, "_mxfp4x_dequantize", {}).items():
            model.set_submodule(name, dequantized_experts(model.get_submodule(name), module))
        self._mxfp4x_dequantize = {}
        if self.quantization_config.dense_kernels:
            use_dense_kernels(model, self.quantization_config.num_threads)
            use_decode_attention(model)
        if self.quantization_config.growing_cache:
            use_growing_cache(model)
        _ask_huge_pages(model)
        return model

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        if self.pre_quantized:
            return False
        module, name = get_module_from_name(model, param_name)
        return name in getattr(module, "_mxfp4x_weights", ())

    def get_quantize_ops(self):
        return Mxfp4xQuantize(self)

    def is_serializable(self):
        # quantized at load, the experts would have to be written in a layout of our own
        # that no loader reads; an MXFP4 checkpoint is written back as it came
        if not self.pre_quantized and getattr(self, "_mxfp4x_quantized", 1) == 0:
            _LOG.warning("mxfp4x: modules_to_not_convert left every experts module dense, "
                         "but the model carries mxfp4x's quantization_config, which it is not "
                         "saved with; load it without quantization_config to save it")
        elif not self.pre_quantized:
            _LOG.warning("mxfp4x: experts quantized at load are not saved (no MXFP4 layout "
                         "for them is read by other loaders); save the dense checkpoint and "
                         "quantize again at load")
        return self.pre_quantized

    @property
    def is_trainable(self) -> bool:
        return True  # the bytes are frozen; gradients flow through them (LoRA-style)

    @property
    def is_compileable(self) -> bool:
        return True


if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:  # not twice on a module reload
    register_quantization_config(QUANT_METHOD)(Mxfp4xConfig)
if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
    register_quantizer(QUANT_METHOD)(Mxfp4xHfQuantizer)


def _read_in_huge_folios(model, checkpoint_files) -> int:
    """Before transformers' loader touches the checkpoint (safetensors files), read it into
    the page cache in 2 MiB folios (``mxfp4x._core.memory.read_in_huge_folios``), but the
    input embeddings' bytes (unless the head shares them; a token reads one row): a
    decoding step streams the rest, and the loader's first touches of small tensors would
    otherwise read the weights around them ahead in small folios, which every mapping of
    them then maps in 4 KiB pages.  The first forward would read the same bytes; read here
    in order, they arrive sooner.  Returns the bytes read."""
    if not _memory.huge_pages_asked() or not checkpoint_files or \
            not all(str(p).endswith(".safetensors") for p in checkpoint_files):
        return 0
    from ...checkpoints._files import open_regular_file
    from ...checkpoints._header import read_header

    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") \
        else None
    weight = getattr(embeddings, "weight", None)
    tied = getattr(model.config.get_text_config(), "tie_word_embeddings", False)
    name = None if weight is None or tied else \
        next((n for n, p in model.named_parameters() if p is weight), None)
    skip = []
    if name is not None:
        try:
            for path in checkpoint_files:
                with open_regular_file(str(path)) as fh:
                    # no read-ahead past the header: it would read the first weights in
                    # small folios
                    if hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
                    _, _, entries, base = read_header(fh, str(path), os.fstat(fh.fileno()).st_size)
                if name in entries:
                    skip.append((str(path), base + entries[name].begin, base + entries[name].end))
        except (OSError, ValueError):  # the loader reports what is wrong with the file
            return 0
    return _memory.read_in_huge_folios([str(p) for p in checkpoint_files], skip)


def _ask_huge_pages(model) -> int:
    """Huge pages asked on the model's weights (``mxfp4x._core.memory.ask_huge_pages_of``):
    those viewing the checkpoint's mapping, every page of each, small ones too; others
    where large.  A decoding step streams the experts, the projections and the head, and
    where the page cache then reads the file in 2 MiB folios they are mapped in 2 MiB pages
    (a one-token read from 4 KiB pages runs slower, docs/performance.md).  Not the input
    embeddings (unless the head shares them): a token reads one row of them, and a 2 MiB
    read per new token would cost more than it saves."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") \
        else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") \
        else None
    skip = set()
    if embeddings is not None and getattr(embeddings, "weight", None) is not None:
        skip.add(embeddings.weight.untyped_storage().data_ptr())
    if head is not None and getattr(head, "weight", None) is not None:
        skip.discard(head.weight.untyped_storage().data_ptr())
    tensors = [t for t in list(model.parameters()) + list(model.buffers())
               if t.untyped_storage().data_ptr() not in skip]
    return _memory.ask_huge_pages_of(tensors)
