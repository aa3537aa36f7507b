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

# the smallest gpt-oss that vLLM's CPU attention and a GPU's take (head size 64), for
# write_gpt_oss_model(folder, **TINY_GPT_OSS)
TINY_GPT_OSS = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=96,
                    num_local_experts=4, num_experts_per_tok=2, vocab_size=288,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    max_position_embeddings=256, sliding_window=16)

__all__ = ["ARCHITECTURES", "CHUNK", "GPT_OSS_20B_MODEL", "HARMONY_TOKENS", "SPECIAL_TOKENS",
           "TINY_GPT_OSS",
           "gpt_oss_reference", "released_quantization_config", "write_gpt_oss_layer",
           "write_gpt_oss_model", "write_tokenizer"]
