#!/usr/bin/env bash
# Wheels of what scripts/gpu_check.sh needs beyond torch, transformers, safetensors and numpy,
# for a GPU machine with Python 3.12 and no package index: downloaded here into .whl/
# (git-ignored), carried with the working tree, installed by gpu_check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
for spec in pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
            typing-extensions==4.16.0 msgspec==0.23.0 pyzmq==27.3.0; do
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl "$spec"
done
ls -la .whl
