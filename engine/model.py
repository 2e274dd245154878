"""A Llama-family decoder as one plain `nn.Module`, reading and writing a paged KV cache.

Covers Llama 2/3 (RoPE with `rope_theta` and Llama-3 scaling), SmolLM2, Mistral-style GQA and
Qwen2 (q/k/v bias). q/k/v and gate/up are fused into one matmul each: on CPU a decode step is
bound by weight reads and per-op overhead, so fewer, bigger ops win.

A forward pass takes the tokens of several sequences flattened into one row (no padding in the
matmuls) plus a `ForwardBatch` that says where each token sits and where its K/V goes in the cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.fused_ops import fused_ops_for
from engine.kernels import KernelFailed, is_disabled
from engine.prefill_attention import load_prefill_kernel

if TYPE_CHECKING:
    from engine.paged_attention import PagedDecodeAttention


@dataclass
class PrefillSlice:
    """One sequence's part of a prefill batch: its new tokens and the context they extend."""

    query_start: int  # offset of this sequence's first new token in the flattened batch
    num_query_tokens: int
    num_context_tokens: int  # cached tokens before this chunk + this chunk's tokens
    block_table: torch.Tensor  # long [num_blocks] covering num_context_tokens


@dataclass
class ForwardBatch:
    positions: torch.Tensor  # long [num_tokens]
    slot_mapping: torch.Tensor  # long [num_tokens]: block_id * block_size + offset in block
    # Exactly one of the two forms is set.
    prefill_slices: Optional[list[PrefillSlice]] = None
    decode_block_tables: Optional[torch.Tensor] = None  # long [batch, max_blocks]
    decode_context_lens: Optional[torch.Tensor] = None  # long [batch], including the new token
    # Rows of the flattened batch whose logits are wanted (None: every row).
    logits_indices: Optional[torch.Tensor] = None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = fused_ops_for(x)
        if fused is not None:
            return fused.rms_norm(x.contiguous(), self.weight, self.eps)
        # One fused op; it accumulates in fp32 for bf16 inputs, like the reference's upcast.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_inv_freq(config: ModelConfig, freq_factors: Optional[torch.Tensor] = None) -> torch.Tensor:
    half = config.head_dim // 2
    # Always on the CPU, also while a model is built on the meta device (where arange imports
    # torch._dynamo).
    positions = torch.arange(0, half, dtype=torch.float64, device="cpu")
    inv_freq = 1.0 / (config.rope_theta ** (positions * 2 / config.head_dim))
    scaling = config.rope_scaling
    if scaling is not None:
        # Llama 3.1: long wavelengths slow down by `factor`, short ones stay, a smooth ramp between.
        low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
        high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, inv_freq)
    if freq_factors is not None:  # GGUF stores Llama-3 scaling precomputed as divisors
        inv_freq = inv_freq / freq_factors.double()
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self._cos_sin: Optional[torch.Tensor] = None

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._cos_sin
        if table is None or table.dtype != dtype or table.device != positions.device:
            t = torch.arange(
                self.config.max_context_tokens, dtype=torch.float32, device=positions.device
            )
            freqs = torch.outer(t, self.inv_freq.to(positions.device))
            emb = torch.cat((freqs, freqs), dim=-1)
            # sin with rotate_half's sign folded in:
            # rotate_half(x) * sin == swap_halves(x) * signed_sin, exactly
            signed_sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
            table = torch.stack((emb.cos(), signed_sin)).to(dtype)
            self._cos_sin = table
        cos_sin = table[:, positions]  # [2, tokens, head_dim]
        return cos_sin[0].unsqueeze(1), cos_sin[1].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's `x * cos + rotate_half(x) * sin`, bit for bit, in four ops (`signed_sin` from
    `cos_sin`)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * signed_sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.qkv_proj = nn.Linear(
            config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.scale = config.head_dim**-0.5
        # set by LlamaModel.use_decode_kernel
        self.decode_kernel: Optional["PagedDecodeAttention"] = None
        self.prefill_by_decode_kernel = False

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        c = self.config
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k side by side in each row: one rotation for both
        fused = fused_ops_for(qkv)
        if fused is not None:
            qk = fused.rope(qkv, c.num_heads + c.num_kv_heads, c.head_dim, cos, sin)
        else:
            qk = apply_rope(
                qkv[:, : c.q_size + c.kv_size].view(
                    num_tokens, c.num_heads + c.num_kv_heads, c.head_dim
                ),
                cos,
                sin,
            )
        q, k = qk.split((c.num_heads, c.num_kv_heads), dim=1)
        v = qkv[:, c.q_size + c.kv_size :].view(num_tokens, c.num_kv_heads, c.head_dim)
        # k/v caches: [num_blocks, block_size, kv_heads, head_dim]; write this batch's tokens.
        k_cache.view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, batch.slot_mapping, k)
        v_cache.view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, batch.slot_mapping, v)
        if batch.decode_block_tables is not None:
            out = self._decode_attention(q, k_cache, v_cache, batch)
        else:
            out = self._prefill_attention(q, k, v, k_cache, v_cache, batch)
        return self.o_proj(out)

    def _decode_attention(self, q, k_cache, v_cache, batch: ForwardBatch) -> torch.Tensor:
        # One query token per sequence. Group the query heads that share a kv head into the
        # "query length" axis, so SDPA reads each kv head once without repeating it.
        c = self.config
        batch_size = q.shape[0]
        block_tables = batch.decode_block_tables
        if self.decode_kernel is not None and self.decode_kernel.supports(k_cache):
            try:
                out = self.decode_kernel(
                    q, k_cache, v_cache, block_tables, batch.decode_context_lens, self.scale
                )
                return out.reshape(batch_size, c.q_size)
            except KernelFailed:  # it returned an error: torch from now on (engine/kernels.py)
                if self.prefill_by_decode_kernel:
                    raise  # --deterministic: torch's path is not batch-invariant
                self.decode_kernel = None
        # index_select, not k_cache[block_tables]: the same copy, several times faster on CPU
        # [B, kv_heads, T, head_dim]
        keys = _gather_blocks(k_cache, block_tables).flatten(1, 2).transpose(1, 2)
        values = _gather_blocks(v_cache, block_tables).flatten(1, 2).transpose(1, 2)
        span = torch.arange(keys.shape[2], device=q.device)
        mask = (span.unsqueeze(0) < batch.decode_context_lens.unsqueeze(1)).view(
            batch_size, 1, 1, -1
        )
        grouped_q = q.view(batch_size, c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim)
        out = F.scaled_dot_product_attention(
            grouped_q, keys, values, attn_mask=mask, scale=self.scale
        )
        return out.reshape(batch_size, c.q_size)

    def _prefill_attention(self, q, k, v, k_cache, v_cache, batch: ForwardBatch) -> torch.Tensor:
        if self.prefill_by_decode_kernel:
            return self._prefill_by_decode_kernel(q, k_cache, v_cache, batch)
        c = self.config
        outputs = []
        for part in batch.prefill_slices:
            rows = slice(part.query_start, part.query_start + part.num_query_tokens)
            num_cached = part.num_context_tokens - part.num_query_tokens
            if num_cached == 0:
                keys, values = k[rows], v[rows]
            else:  # a later chunk, or a cached prefix: attend to what the cache holds
                keys = _gather_blocks(k_cache, part.block_table).flatten(0, 1)[
                    : part.num_context_tokens
                ]
                values = _gather_blocks(v_cache, part.block_table).flatten(0, 1)[
                    : part.num_context_tokens
                ]
            kernel = _prefill_kernel(q, num_cached)
            if kernel is not None:
                try:
                    outputs.append(kernel(self, q[rows], keys, values))
                    continue
                except KernelFailed:  # it returned an error: torch from now on
                    pass
            # SDPA takes its fused CPU (flash) kernel only for 4-D inputs: [1, heads, n, head_dim].
            q_part = q[rows].transpose(0, 1).unsqueeze(0)
            mask = None
            if num_cached:
                query_pos = torch.arange(num_cached, part.num_context_tokens, device=q.device)
                key_pos = torch.arange(part.num_context_tokens, device=q.device)
                mask = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)
            out = F.scaled_dot_product_attention(
                q_part,
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scale,
                enable_gqa=c.num_heads != c.num_kv_heads,
            )
            outputs.append(out[0].transpose(0, 1).reshape(part.num_query_tokens, c.q_size))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _prefill_by_decode_kernel(self, q, k_cache, v_cache, batch: ForwardBatch) -> torch.Tensor:
        """Prefill attention that gives each row exactly what a decode step would (--deterministic,
        engine/deterministic.py): the chunk's K/V are already in the cache, so prompt row i is one
        sequence of the paged decode kernel over its prompt's blocks up to itself (context
        `num_cached + i + 1`)."""
        tables, context_lens = [], []
        for part in batch.prefill_slices:
            num_cached = part.num_context_tokens - part.num_query_tokens
            tables.append(part.block_table.expand(part.num_query_tokens, -1))
            context_lens.append(torch.arange(num_cached + 1, part.num_context_tokens + 1))
        width = max(table.shape[1] for table in tables)
        # padding entries point at block 0, as a decode batch's do; the context lengths hide them
        block_tables = torch.cat([F.pad(table, (0, width - table.shape[1])) for table in tables])
        out = self.decode_kernel(
            q, k_cache, v_cache, block_tables, torch.cat(context_lens), self.scale
        )
        return out.reshape(q.shape[0], self.config.q_size)

    def _blocked_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of a prompt's `n` new tokens `q` over `k`/`v`: the context before them
        (a cached prefix, earlier chunks; all visible) followed by their own keys. `_PREFILL_BLOCK`
        queries at a time, as two batched matmuls per block over only the keys before it (oneDNN's
        bf16 GEMM) and an fp32 softmax."""
        c = self.config
        n, group = q.shape[0], c.num_heads // c.num_kv_heads
        num_cached = k.shape[0] - n
        # query heads by kv head
        grouped_q = q.transpose(0, 1).reshape(c.num_kv_heads, group, n, c.head_dim)
        # [kv_heads, head_dim, n], [kv_heads, n, head_dim]
        keys_t, values = k.permute(1, 2, 0), v.transpose(0, 1)
        out = torch.empty(c.num_kv_heads, group, n, c.head_dim, dtype=q.dtype, device=q.device)
        future = torch.full((_PREFILL_BLOCK, _PREFILL_BLOCK), float("-inf")).triu(1)
        for start in range(0, n, _PREFILL_BLOCK):
            end = min(n, start + _PREFILL_BLOCK)
            rows = grouped_q[:, :, start:end].reshape(
                c.num_kv_heads, group * (end - start), c.head_dim
            )
            visible = num_cached + end  # the context and every new token up to this block's last
            scores = (
                torch.bmm(rows, keys_t[:, :, :visible])
                .float()
                .view(c.num_kv_heads, group, end - start, visible)
            )
            scores.mul_(self.scale)
            # the context and earlier blocks are all visible; within the block, each query sees
            # those before it
            scores[..., num_cached + start : visible] += future[: end - start, : end - start]
            probs = (
                scores.softmax(-1).to(q.dtype).view(c.num_kv_heads, group * (end - start), visible)
            )
            out[:, :, start:end] = torch.bmm(probs, values[:, :visible]).view(
                c.num_kv_heads, group, end - start, c.head_dim
            )
        return out.view(c.num_heads, n, c.head_dim).transpose(0, 1).reshape(n, c.q_size)

    def _flash_after_context_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """The same as `_blocked_attention`, in two parts merged by their log-sum-exp: the new
        tokens over their own keys through SDPA's causal CPU flash kernel (with AMX the fastest, and
        it takes no mask that would let it see the context), and over the context, all visible, as
        two batched matmuls (the context is short next to the prompt: a cached chat template, a
        chunk)."""
        c = self.config
        n, group = q.shape[0], c.num_heads // c.num_kv_heads
        num_cached = k.shape[0] - n
        own, own_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(0, 1).unsqueeze(0),
            k[num_cached:].transpose(0, 1).unsqueeze(0),
            v[num_cached:].transpose(0, 1).unsqueeze(0),
            0.0,
            True,
            scale=self.scale,
        )
        # [kv_heads, group * n, ...]: query head h = kv head h // group, as SDPA's GQA groups them
        grouped_q = q.transpose(0, 1).reshape(c.num_kv_heads, group * n, c.head_dim)
        scores = torch.bmm(grouped_q, k[:num_cached].permute(1, 2, 0)).float().mul_(self.scale)
        context_lse = scores.logsumexp(-1)
        probs = scores.sub_(context_lse.unsqueeze(-1)).exp_().to(q.dtype)
        context = torch.bmm(probs, v[:num_cached].transpose(0, 1))
        # merged where the flash kernel left its output, [n, heads, head_dim]: the context's share
        # of each query's softmax mass is sigmoid(context_lse - own_lse)
        context = context.view(c.num_heads, n, c.head_dim).transpose(0, 1)
        context_share = torch.sigmoid(
            context_lse.view(c.num_heads, n).transpose(0, 1) - own_lse[0].transpose(0, 1)
        )
        out = torch.lerp(own[0].transpose(0, 1), context, context_share.to(q.dtype).unsqueeze(-1))
        return out.reshape(n, c.q_size)

    def _kernel_flash_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """The same as `_blocked_attention`, in one call of the flash-attention C kernel for this
        CPU (AMX or AVX512-BF16: engine/prefill_attention.py), context or none."""
        return load_prefill_kernel()(q, k, v, self.scale)


# bf16 prompts on CPUs without AMX run attention as blocked matmuls instead of SDPA's CPU flash
# kernel: on an AVX512-BF16 AMD EPYC a whole 512-token prefill is 15% faster on one core (1024: 17%,
# 2000: 11%; equal at 128). With AMX (Intel Xeon) SDPA's flash kernel is the faster: 512 tokens'
# attention over 30 layers 57 against 106 ms on one core, 31 against 78 on two; 1024 tokens 178
# against 471 ms.
# A prompt with context before it (a cached prefix, a later chunk) needs a mask SDPA's flash kernel
# does not take, and SDPA's masked path cost a 542-token prompt with a 16-token cached prefix
# 569-592 ms on one core of that EPYC, against 368-376 ms for the same prompt uncached. Such a
# prompt takes the blocked matmuls without AMX, and with AMX the flash kernel over its own tokens
# merged with the context: 512 tokens after 16, 30 layers, 84-88 ms against 159-218 blocked on one
# core, 55 against 85 on two.
# fp32 keeps SDPA, the path held token-identical to HF.
# With AMX and head_dim 64, bf16 prompts take the AMX flash-attention C kernel instead, context or
# none (engine/prefill_attention.py), and the paths above are what runs without a kernel.
# Intel Xeon (AMX_BF16, get_cpu_capability AVX512), torch 2.13,
# 9/3 heads, 30 layers, median of 30, ms, SDPA flash (after 16 cached: flash after context) / AMX
# kernel, `python -m benchmarks.prefill_attention_bench --tokens 128 512 1024 2048`:
#   1 thread:  512 after 0: 46.1 / 16.1, after 16: 71.1 / 17.5; 1024: 135 / 58; 2048: 446 / 226
#   2 threads: 512 after 0: 25.0 / 9.9, after 16: 41.7 / 10.9; 1024: 70.8 / 33.7; 2048: 230 / 119
#   128 after 512 cached: 56.8 / 9.1 (1 thread), 31.5 / 5.8 (2)
# A whole 542-token prefill, 16 of them cached (`... --engine --tokens 526 --cached 16`, median of
# 6, two runs): 261-264 -> 197-198 ms on one thread, 170 -> 135-136 ms on two. docs/benchmarks.md.
# Without AMX but with AVX512-BF16 (AMD EPYC), bf16 prompts take the AVX512-BF16 flash kernel (the
# same file). 526 tokens, 30 layers, median of 30, ms, blocked / kernel: after 0 cached 233.9 / 59.0
# on one thread, 131.6 / 31.5 on two; after 16: 244.1 / 62.3 and 140.9 / 33.1. The whole prefill
# (`--engine --tokens 526 --cached 16`): 765 -> 664 ms on one thread, 509 -> 411 on two.
_PREFILL_BLOCK = 128
_AMX = torch.cpu._is_amx_tile_supported()


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """`cache[block_ids]` for a 1-D or 2-D table of block ids, through `index_select` (advanced
    indexing takes 5x as long on CPU for the same copy: 0.21 against 0.04 ms for 44 blocks here)."""
    return cache.index_select(0, block_ids.reshape(-1)).view(*block_ids.shape, *cache.shape[1:])


def _prefill_kernel(q: torch.Tensor, num_cached_tokens: int) -> Optional[Callable]:
    """The attention method for a bf16 prompt on CPU after `num_cached_tokens` of context
    (None: SDPA)."""
    if q.dtype != torch.bfloat16 or q.device.type != "cpu":
        return None
    kernel = load_prefill_kernel()
    if kernel is not None and kernel.supports(q) and not is_disabled("prefill_attention"):
        return Attention._kernel_flash_attention
    if not _AMX:
        return Attention._blocked_attention
    return Attention._flash_after_context_attention if num_cached_tokens else None


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        fused = fused_ops_for(gate_up)
        if fused is not None:
            return self.down_proj(fused.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, k_cache, v_cache, batch):
        fused = fused_ops_for(x)
        if fused is None:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, batch)
            return x + self.mlp(self.post_attention_layernorm(x))
        # on CPU: the residual stream is updated in place, its add fused into the norm after it
        norm = self.post_attention_layernorm
        attn = self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, batch)
        return fused.add_(x, self.mlp(fused.rms_norm(x, norm.weight, norm.eps, residual=attn)))


class LlamaModel(nn.Module):
    """Parameter names follow HF's `LlamaForCausalLM` except the fused `qkv_proj` and
    `gate_up_proj`."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # Weights are always loaded over the initial values, so the embedding skips its random init:
        # on the meta device `normal_` imports torch._dynamo, a second of every worker's start.
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.rotary = RotaryEmbedding(config)
        # Called after each layer while set (a serving worker handing borrowed cores back mid-step,
        # runtime/cores.py); torch ops read the thread count afresh each time.
        self.between_layers: Optional[Callable[[], None]] = None

    def use_decode_kernel(
        self, kernel: Optional["PagedDecodeAttention"], for_prefill: bool = False
    ) -> None:
        """Decode attention reads the paged cache in place through `kernel` (None: gather + SDPA);
        `for_prefill`: prefill attention too, each prompt row as a decode step computes it
        (--deterministic)."""
        if for_prefill and kernel is None:
            raise ValueError("prefill attention through the decode kernel needs a kernel")
        for layer in self.layers:
            layer.self_attn.decode_kernel = kernel
            layer.self_attn.prefill_by_decode_kernel = for_prefill

    @property
    def batch_invariant(self) -> bool:
        """Whether a row's result depends neither on its batch nor on prefill against decode
        (--deterministic: engine/deterministic.py)."""
        return all(layer.self_attn.prefill_by_decode_kernel for layer in self.layers)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        batch: ForwardBatch,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """Logits (fp32) for `batch.logits_indices` rows, after writing every token's K/V to the
        cache."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(batch.positions, x.dtype)
        for layer, k_cache, v_cache in zip(self.layers, k_caches, v_caches):
            x = layer(x, cos, sin, k_cache, v_cache, batch)
            if self.between_layers is not None:
                self.between_layers()
        if batch.logits_indices is not None:
            x = x[batch.logits_indices]
        x = self.norm(x)
        if self.lm_head is None:  # tied embeddings
            return F.linear(x, self.embed_tokens.weight).float()
        return self.lm_head(x).float()
