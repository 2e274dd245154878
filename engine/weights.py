"""Turning a model spec (`default`, a GGUF file, an HF directory, or `dummy:<shape>`) into a ready
model.

All sources yield tensors under HF `LlamaForCausalLM` names; `build_model` fuses q/k/v and gate/up,
casts to the serving dtype and loads them with `assign=True` (no second copy of the weights).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import chain
from typing import Callable, Iterable, Optional

import torch

from engine import disk_cache
from engine.config import NAMED_SHAPES, ModelConfig
from engine.cpu_packing import (
    PackedLinear,
    TransposedLinear,
    decode_panels_shape,
    linear_slots,
    load_bf16_decode_linear,
    load_decode_linear,
    pack_linears,
    packing_supported,
    transposing_supported,
)
from engine.default_model import DEFAULT_MODEL_NAME, ModelNotFoundError, resolve_model_path
from engine.deterministic import require as deterministic_linear
from engine.dtypes import resolve_device
from engine.model import LlamaModel, rope_inv_freq
from engine.paged_attention import decode_kernel_for
from engine.tokenizer import Tokenizer

DUMMY_PREFIX = "dummy:"
log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    config: ModelConfig
    model: LlamaModel
    tokenizer: Optional[Tokenizer]  # None for random-weights models
    source: str


def load_model(
    spec: str = DEFAULT_MODEL_NAME,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    deterministic: bool = False,
) -> LoadedModel:
    """`deterministic`: batch-invariant kernels only (engine/deterministic.py; raises
    `DeterminismUnavailable` where this machine has none)."""
    device = resolve_device(device)
    if deterministic:
        deterministic_linear(dtype, device)  # fails before any weight is read
    if spec.startswith(DUMMY_PREFIX):
        return load_dummy(spec[len(DUMMY_PREFIX) :], dtype, device, seed, deterministic)
    path = resolve_model_path(spec)
    if path.is_dir():
        from engine import hf_loader

        config, generation_eos = hf_loader.read_config(path)
        tokenizer = Tokenizer.from_hf_dir(path, generation_eos)
        model = build_model(config, hf_loader.iter_hf_tensors(path), dtype, device, deterministic)
        return LoadedModel(config, model, tokenizer, str(path))
    from engine import gguf_loader

    fields, tensor_names = gguf_loader.read_metadata(path)
    config = gguf_loader.config_from_fields(fields, "output.weight" in tensor_names, name=path.stem)
    tokenizer = Tokenizer.from_gguf_fields(fields)

    def dequantized() -> Iterable[tuple[str, torch.Tensor]]:
        tensors = gguf_loader.iter_hf_tensors(
            gguf_loader.open_gguf(path), config, fields["general.architecture"]
        )
        # rope_freqs stays fp32: it scales the rotary frequencies, computed in float64.
        return ((name, t if name == "rope_freqs" else t.to(dtype)) for name, t in tensors)

    # the layout it serves in is plain tensors: cache those
    if transposing_supported(dtype, device):
        model = _served_from_cache(
            path,
            config,
            dtype,
            device,
            lambda: build_model(config, dequantized(), dtype, device, deterministic),
            deterministic,
        )
    else:
        model = build_model(
            config,
            disk_cache.gguf_weights(path, dtype, dequantized),
            dtype,
            device,
            deterministic,
        )
    return LoadedModel(config, model, tokenizer, str(path))


def _served_from_cache(
    source,
    config: ModelConfig,
    dtype: torch.dtype,
    device: str,
    build: Callable[[], LlamaModel],
    deterministic: bool = False,
) -> LlamaModel:
    """The model over its serving tensors (fused, transposed, and the decode kernel's panels where
    it serves) memory-mapped from the disk cache, else built and cached. A worker then makes no copy
    of the weights: building the layout afresh wrote 1.4 GB of new memory, 5-15 s of page faults per
    worker on this VM when two start at once."""
    # an entry of either kind holds all a worker maps
    panels = "-panels" if deterministic or load_decode_linear() is not None else ""
    kind = f"serving-{str(dtype).removeprefix('torch.')}-transposed{panels}"
    cached = disk_cache.tensors(source, kind)
    if cached is not None:
        try:
            return model_over(config, cached, device, deterministic)
        except ValueError as error:
            log.warning(
                "the cached serving weights of %s do not fit the model (%s); reading the model "
                "file",
                source,
                error,
            )
    model = build()
    disk_cache.save_tensors(source, kind, serving_tensors(model))
    return model


def serving_tensors(model: LlamaModel) -> dict[str, torch.Tensor]:
    """Every tensor of a model laid out by `prepare_for_inference`, by name, but bf16's
    oneDNN-packed copies (opaque to anything but oneDNN)."""
    return {
        name: tensor
        for name, tensor in chain(model.named_parameters(), model.named_buffers())
        if not name.endswith(".packed_weight")
    }


def model_over(
    config: ModelConfig,
    tensors: dict[str, torch.Tensor],
    device: str,
    deterministic: bool = False,
) -> LlamaModel:
    """The model whose linears are `TransposedLinear`s over `tensors` (as `serving_tensors` names
    them), used in place; ValueError when they do not fit `config`."""
    state = dict(tensors)
    invariant = deterministic_linear(torch.float32, device) if deterministic else None
    with torch.device("meta"):
        model = LlamaModel(config)
    try:
        model.rotary.inv_freq = state.pop("rotary.inv_freq")
        for parent, name, qualified in linear_slots(model):
            child, weight_t = getattr(parent, name), state[f"{qualified}.weight_t"]
            shape = (
                (config.hidden_size, config.vocab_size)
                if child is None
                else (child.in_features, child.out_features)
            )
            if tuple(weight_t.shape) != shape:
                raise ValueError(
                    f"{qualified}.weight_t is {tuple(weight_t.shape)}, the model needs {shape}"
                )
            # not in state_dict(): a non-persistent buffer
            bias = state.pop(f"{qualified}.bias", None)
            panels = state.pop(f"{qualified}.weight_panels", None)
            if panels is not None and panels.shape != decode_panels_shape(weight_t):
                raise ValueError(
                    f"{qualified}.weight_panels is {tuple(panels.shape)}, the model needs "
                    f"{decode_panels_shape(weight_t)}"
                )
            decode = (invariant or load_decode_linear()) if panels is not None else None
            layer = TransposedLinear.over(weight_t, bias, panels, decode, deterministic)
            setattr(parent, name, layer)
        model.load_state_dict(state, strict=True, assign=True)
    except (KeyError, RuntimeError) as error:
        raise ValueError(f"{type(error).__name__}: {error}") from None
    model.use_decode_kernel(decode_kernel_for(device), for_prefill=deterministic)
    return model.eval()


def load_dummy(
    shape: str, dtype: torch.dtype, device: str, seed: int, deterministic: bool = False
) -> LoadedModel:
    if shape not in NAMED_SHAPES:
        raise ModelNotFoundError(f"unknown dummy shape {shape!r}; known: {', '.join(NAMED_SHAPES)}")
    config = NAMED_SHAPES[shape]
    # Drawn where the model lives: on a GPU, an 8B shape's 8e9 draws would otherwise run on the host
    # and cross the bus.
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        model = LlamaModel(config)
    for name, param in model.named_parameters():
        with torch.no_grad():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                param.fill_(1.0)
            else:  # small normal weights keep activations finite through many layers
                param.copy_(torch.randn(param.shape, generator=generator, device=device) * 0.02)
    return LoadedModel(
        config,
        prepare_for_inference(model.to(dtype).eval(), dtype, device, deterministic),
        None,
        DUMMY_PREFIX + shape,
    )


def build_model(
    config: ModelConfig,
    hf_tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    device: str,
    deterministic: bool = False,
) -> LlamaModel:
    loaded: dict[str, torch.Tensor] = {}
    rope_freqs = None
    for name, tensor in hf_tensors:
        if name == "rope_freqs":
            rope_freqs = tensor
            continue
        if "rotary_emb" in name:
            continue
        loaded[name.removeprefix("model.")] = tensor.to(device=device, dtype=dtype)
    if config.tie_word_embeddings:
        loaded.pop("lm_head.weight", None)
    state: dict[str, torch.Tensor] = {}
    for name in list(loaded):
        if ".self_attn.q_proj." in name:
            kind = name.rsplit(".", 1)[1]  # weight or bias
            prefix = name.split(".self_attn.")[0] + ".self_attn."
            state[f"{prefix}qkv_proj.{kind}"] = torch.cat(
                [loaded.pop(f"{prefix}{p}_proj.{kind}") for p in "qkv"]
            )
        elif ".mlp.gate_proj." in name:
            prefix = name.split(".mlp.")[0] + ".mlp."
            state[f"{prefix}gate_up_proj.weight"] = torch.cat(
                [loaded.pop(f"{prefix}gate_proj.weight"), loaded.pop(f"{prefix}up_proj.weight")]
            )
    state.update(loaded)  # norms, o_proj, down_proj, embeddings: names already match
    with torch.device("meta"):
        model = LlamaModel(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(
            f"weights do not fit the model: missing {sorted(missing)[:5]}, unexpected "
            f"{sorted(unexpected)[:5]}"
        )
    # buffers were left on meta
    model.rotary.inv_freq = rope_inv_freq(config, rope_freqs).to(device)
    return prepare_for_inference(model.eval(), dtype, device, deterministic)


def prepare_for_inference(
    model: LlamaModel, dtype: torch.dtype, device: str, deterministic: bool = False
) -> LlamaModel:
    """`deterministic`: every linear, and prefill attention, through batch-invariant kernels
    (engine/deterministic.py)."""
    if deterministic:
        kernel = deterministic_linear(dtype, device)
        layer = PackedLinear if dtype == torch.bfloat16 else TransposedLinear
        pack_linears(model, lambda weight, bias: layer(weight, bias, kernel, every_batch=True))
    elif packing_supported(dtype, device):
        kernel = load_bf16_decode_linear()  # asked once for every layer
        pack_linears(model, lambda weight, bias: PackedLinear(weight, bias, kernel))
    elif transposing_supported(dtype, device):
        decode = load_decode_linear()  # asked once for every layer
        pack_linears(model, lambda weight, bias: TransposedLinear(weight, bias, decode))
    model.use_decode_kernel(decode_kernel_for(device), for_prefill=deterministic)
    return model
