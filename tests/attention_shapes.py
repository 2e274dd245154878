"""An `Attention` layer of a given head shape, for the attention kernels' tests (no weights
used)."""

from engine.config import ModelConfig
from engine.model import Attention


def attention_layer(num_heads: int, num_kv_heads: int, head_dim: int) -> Attention:
    return Attention(
        ModelConfig(
            name="t",
            vocab_size=8,
            hidden_size=num_heads * head_dim,
            intermediate_size=8,
            num_layers=1,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_context_tokens=4096,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
        )
    )
