"""HF transformers' own reading of a GGUF file, the reference the tests and the device check compare
with, converted once and kept in the disk cache.

`from_pretrained(..., gguf_file=...)` parses and dequantizes the file in Python: 30 s for the default
model on this repo's 2-core machines, in every process that wants the reference. What it makes of the
file is saved once with `save_pretrained` (keyed by the file's content, like every cache entry, and by the
transformers version) and loads from there in about a second; the reference is still transformers'
conversion, not ours. Not used in serving: transformers is a test dependency.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from engine import disk_cache

log = logging.getLogger(__name__)


def hf_directory(gguf: Path) -> Path:
    """An HF model directory (fp32 weights, config, tokenizer) holding transformers' conversion of `gguf`."""
    import torch
    import transformers

    entry = disk_cache.entry_path(gguf, f"hf-transformers-{transformers.__version__}", "")
    if (entry / "config.json").exists():
        disk_cache.mark_used(entry)
        return entry
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=entry.name + ".", suffix=".partial", dir=entry.parent))
    except OSError as error:
        log.warning("could not cache transformers' conversion of %s: %s", gguf, error)
        entry, partial = None, Path(tempfile.mkdtemp(prefix="pdserve-hf-"))
    # Loaded from GGUF, transformers marks the (dequantized, dense) model as quantized, which it will not save.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    if entry is None:
        return partial
    try:
        os.rename(partial, entry)  # whole or not at all
    except OSError:
        if not (entry / "config.json").exists():
            return partial
        shutil.rmtree(partial, ignore_errors=True)  # a process converting at the same time got there first
    disk_cache.prune(keep=entry)
    return entry


def hf_model(gguf: Path, dtype):
    """transformers' `AutoModelForCausalLM` of `gguf` in `dtype`, in eval mode."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(hf_directory(gguf)), dtype=dtype).eval()


def hf_tokenizer(gguf: Path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(hf_directory(gguf)))
