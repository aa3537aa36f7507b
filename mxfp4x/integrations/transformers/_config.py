"""The quantization method ``"mxfp4x"``: its name, its config (:class:`Mxfp4xConfig`), and
the name of the format the checkpoints it reads and writes give their bytes."""
from typing import Any, Dict, Optional

from transformers.utils.quantization_config import QuantizationConfigMixin

from ..._core.arguments import num_threads_arg
from ..._core.quantize import SCALE_RULES

QUANT_METHOD = "mxfp4x"  # also the experts implementation's name in transformers
FILE_FORMAT = "mxfp4"  # what the checkpoints we read (and write) call their format


class Mxfp4xConfig(QuantizationConfigMixin):
    """Run a transformers MoE model with its experts in MXFP4 on mxfp4x.

    For a checkpoint already in MXFP4 (gpt-oss as released) the experts' bytes are taken
    as they are. For a checkpoint with dense experts (Qwen3-MoE, Mixtral, DeepSeek-style,
    gpt-oss in bf16: every model whose experts module transformers routes through its
    experts interface) each expert tensor is quantized to MXFP4 as it is loaded.

    ``num_threads``: the threads of each experts call (None: mxfp4x's default).
    ``scale_rule``: how dense weights get their E8M0 scales (``mxfp4x.quantize``:
    ``"floor"``, OCP MX v1.0; ``"ceil"``; ``"even"``).
    ``modules_to_not_convert``: modules left dense (name patterns, as transformers takes
    them): transformers' own modules and forward.  For an MXFP4 checkpoint the list is
    its config's plus this one, written back with it; an experts module it names that the
    file stores in MXFP4 is dequantized from the file's bytes (exactly, in the model's
    dtype) into transformers' module, one the file stores dense keeps those weights.
    ``dense_kernels``: the model's bfloat16 ``nn.Linear`` layers (attention projections,
    the head) run on mxfp4x's dense kernel at up to 4 tokens (decode), and at 5 to 16
    bfloat16 tokens on the bf16 unit where the CPU's default ISA has one (several
    sequences decoding together; see :class:`DenseLinear`), and gpt-oss's routers and RMS
    norms on mxfp4x's compiled passes (:class:`DenseRouter`, :class:`CompiledRMSNorm`),
    and gpt-oss's attention layers run a decoding step as one compiled call
    (:class:`DecodeAttention`: the same bits as those pieces one by one); ``False``
    leaves them all to torch and transformers.
    ``growing_cache``: ``generate`` keeps keys and values in a cache that grows in place
    (:class:`GrowingCache`) where it would make transformers' ``DynamicCache``: the same
    tokens, no copy of the whole cache each step; ``False`` leaves transformers' own.
    ``float32_intermediate``: the experts' activation output (gpt-oss's clamped SwiGLU, a
    gated model's ``act_fn(gate) * up``) is computed in float32 and, as transformers
    computes it in the model's dtype, rounded once to that dtype (bfloat16 for a bfloat16
    model) before the down projection; ``True`` keeps it in float32 (the down projection
    then runs on float32 latents: a little closer to the float64 reference, slower on
    the bf16 units).

    An MXFP4 checkpoint's config is written back (``to_dict``, hence ``config.json``) as
    the checkpoint format, ``quant_method: "mxfp4"``: the bytes saved are the released
    layout, readable by any MXFP4 loader; mxfp4x is how they run, not a format.
    """

    def __init__(self, modules_to_not_convert: Optional[list] = None,
                 num_threads: Optional[int] = None, scale_rule: str = "floor",
                 dense_kernels: bool = True, float32_intermediate: bool = False,
                 growing_cache: bool = True, **kwargs):
        if scale_rule not in SCALE_RULES:
            raise ValueError(f"scale_rule: expected one of {SCALE_RULES}, got {scale_rule!r}")
        self.quant_method = QUANT_METHOD  # type: ignore[assignment]  # not in their enum
        self.modules_to_not_convert = modules_to_not_convert
        self.num_threads = num_threads_arg(num_threads)  # the op's rule, before any loading
        self.scale_rule = scale_rule
        self.dense_kernels = bool(dense_kernels)
        self.float32_intermediate = bool(float32_intermediate)
        self.growing_cache = bool(growing_cache)

    def to_dict(self) -> Dict[str, Any]:
        return {"quant_method": FILE_FORMAT,
                "modules_to_not_convert": self.modules_to_not_convert}

    def __repr__(self) -> str:
        return (f"Mxfp4xConfig(num_threads={self.num_threads}, scale_rule={self.scale_rule!r}, "
                f"modules_to_not_convert={self.modules_to_not_convert}, "
                f"float32_intermediate={self.float32_intermediate}, "
                f"growing_cache={self.growing_cache})")
