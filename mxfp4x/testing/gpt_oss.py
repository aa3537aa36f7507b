"""gpt-oss checkpoints with random weights and a float64 reference of the experts block,
for the tests: ``mxfp4x._synthetic.gpt_oss``, what ``python -m mxfp4x layer`` writes and
checks with."""
from .._synthetic.gpt_oss import (
    ARCHITECTURES,
    CHUNK,
    GPT_OSS_20B_MODEL,
    HARMONY_TOKENS,
    SPECIAL_TOKENS,
    gpt_oss_reference,
    released_quantization_config,
    write_gpt_oss_layer,
    write_gpt_oss_model,
    write_tokenizer,
)

__all__ = ["ARCHITECTURES", "CHUNK", "GPT_OSS_20B_MODEL", "HARMONY_TOKENS", "SPECIAL_TOKENS",
           "gpt_oss_reference", "released_quantization_config", "write_gpt_oss_layer",
           "write_gpt_oss_model", "write_tokenizer"]
