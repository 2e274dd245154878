"""Model and engine configuration: frozen dataclasses, resolved once at start-up. No torch, so the
router can build the workers' configs without importing it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from engine.dtypes import parse_dtype  # torch-free until called


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.1-style frequency-dependent RoPE scaling (HF `rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_context_tokens: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[Llama3RopeScaling] = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype) -> int:
        """KV bytes one token occupies across all layers, for a torch dtype (anything with
        `itemsize`)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype.itemsize

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# Shapes for random-weights models (like vLLM's `--load-format dummy`): tests and benchmarks of
# big models on machines that cannot hold or download their weights.
NAMED_SHAPES: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        name="smollm2-135m",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        max_context_tokens=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    "llama-3.2-1b": ModelConfig(
        name="llama-3.2-1b",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        max_context_tokens=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        rope_scaling=Llama3RopeScaling(32.0, 1.0, 4.0, 8192),
    ),
    "llama-3-8b": ModelConfig(
        name="llama-3-8b",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_context_tokens=8192,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
    ),
    "qwen2-0.5b": ModelConfig(
        name="qwen2-0.5b",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        max_context_tokens=32768,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        attention_bias=True,
    ),
    # A few layers of SmolLM2's shape: fast unit tests of the engine's plumbing.
    "tiny": ModelConfig(
        name="tiny",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_context_tokens=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    ),
}


def config_from_hf(hf: dict, name: str) -> ModelConfig:
    """A `ModelConfig` from a Hugging Face `config.json` of a Llama-family model."""
    architectures = hf.get("architectures") or []
    supported = {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"}
    if architectures and not set(architectures) & supported:
        raise ValueError(
            f"unsupported architecture {architectures}; supported: {sorted(supported)}"
        )
    num_heads = hf["num_attention_heads"]
    # transformers 5 writes `rope_parameters` (theta inside it); older configs `rope_scaling` +
    # `rope_theta`.
    scaling = hf.get("rope_parameters") or hf.get("rope_scaling") or None
    rope_theta = float((scaling or {}).get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_scaling = None
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "llama3":
            rope_scaling = Llama3RopeScaling(
                float(scaling["factor"]),
                float(scaling["low_freq_factor"]),
                float(scaling["high_freq_factor"]),
                int(scaling["original_max_position_embeddings"]),
            )
        elif kind not in (None, "default"):
            raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: llama3")
    is_qwen2 = "Qwen2ForCausalLM" in architectures
    return ModelConfig(
        name=name,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        max_context_tokens=hf.get("max_position_embeddings", 4096),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", is_qwen2)),
    )


@dataclass(frozen=True)
class EngineConfig:
    model: str = "default"
    # or "bfloat16", or "auto": bf16 where the hardware has it natively, else fp32
    dtype: str = "float32"
    # "cuda", "cuda:N", or "auto" (cuda where torch sees one), resolved by
    # engine.dtypes.resolve_device
    device: str = "cpu"
    block_size_tokens: int = 16
    # None: sized from the node's free memory (engine.kv_cache)
    kv_cache_bytes: Optional[int] = 512 * 2**20
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    decode_interleave_tokens: Optional[int] = None  # engine.scheduler.SchedulerConfig
    # On a CPU, engine.scheduler.SchedulerConfig.prefill_batch_tokens; a GPU batches every waiting
    # prompt the budget holds (a batch of prompts costs it little more than one)
    cpu_prefill_batch_tokens: Optional[int] = None
    enable_prefix_caching: bool = True
    num_threads: Optional[int] = None  # torch intra-op threads; None leaves torch's default
    # decode steps replayed from CUDA graphs on CUDA (engine.cuda_graphs); no effect elsewhere
    cuda_graphs: bool = True
    # Batch-invariant kernels only (engine/deterministic.py): a row's result depends neither on the
    # batch it shares nor on prefill against decode, so greedy output is token-identical across
    # batching, chunking, migration and where a prompt prefills; CPU only, at a cost in speed.
    deterministic: bool = False
    # Produce output text. Workers turn it off: the router detokenizes, and the engine then decodes
    # text only for requests with stop strings, which it must see to stop at the right token.
    detokenize: bool = True

    @property
    def torch_dtype(self):
        return parse_dtype(self.dtype, self.device)

    def scheduler(self, device_type: str):
        """The scheduler's config on a device of `device_type` ("cpu", "cuda")."""
        from engine.scheduler import SchedulerConfig

        return SchedulerConfig(
            self.max_num_seqs,
            self.max_num_batched_tokens,
            self.decode_interleave_tokens,
            self.cpu_prefill_batch_tokens if device_type == "cpu" else None,
        )
