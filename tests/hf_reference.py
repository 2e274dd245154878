"""HF transformers' own reading of a GGUF file, the reference the tests and the device check compare
with, converted once and kept in the disk cache.

`from_pretrained(..., gguf_file=...)` parses and dequantizes the file in Python: 30 s for the
default model on this repo's 2-core machines, in every process that wants the reference. What it
makes of the file is saved once with `save_pretrained` (keyed by the file's content, like every
cache entry, and by the transformers version) and loads from there in about a second; the reference
is still transformers' conversion, not ours. Not used in serving: transformers is a test dependency,
so this lives with the tests; scripts/gpu_check.py and benchmarks/engine_bench.py import it from
here too.
"""

from __future__ import annotations

from pathlib import Path

from engine import disk_cache


def hf_directory(gguf: Path) -> Path:
    """An HF model directory (fp32 weights, config, tokenizer) holding transformers' conversion of
    `gguf`."""
    import torch
    import transformers

    def convert(folder: Path) -> None:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name
        )
        # Loaded from GGUF, transformers marks the (dequantized, dense) model as quantized, which it
        # will not save.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    return disk_cache.directory(gguf, f"hf-transformers-{transformers.__version__}", convert)


def hf_model(gguf: Path, dtype):
    """transformers' `AutoModelForCausalLM` of `gguf` in `dtype`, in eval mode."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(hf_directory(gguf)), dtype=dtype
    ).eval()


def hf_tokenizer(gguf: Path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(hf_directory(gguf)))
