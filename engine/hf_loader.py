"""Reading a Hugging Face model directory: config.json, *.safetensors (memory-mapped),
tokenizer.json.

No torch at import: the router reads configs and tokenizers through here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from engine.config import ModelConfig, config_from_hf

if TYPE_CHECKING:  # torch is imported only where tensors are built
    import torch


def read_config(path: Path) -> tuple[ModelConfig, tuple[int, ...]]:
    """The model config and the extra end-of-sequence ids `generation_config.json` names."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json")
    return config_from_hf(json.loads(config_file.read_text()), name=path.name), read_generation_eos(
        path
    )


def read_generation_eos(path: Path) -> tuple[int, ...]:
    """End-of-sequence ids from `generation_config.json` (chat models often list several)."""
    generation_file = path / "generation_config.json"
    if not generation_file.is_file():
        return ()
    value = json.loads(generation_file.read_text()).get("eos_token_id")
    return tuple(value) if isinstance(value, list) else ((value,) if value is not None else ())


def iter_hf_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:  # memory-mapped, read tensor by tensor
            for name in handle.keys():
                yield name, handle.get_tensor(name)
