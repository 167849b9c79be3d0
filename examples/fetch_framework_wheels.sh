#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with what the GPU image lacks to run examples/deepspeed_zero3.py and
# examples/megatron_distopt.py, for that image's Python 3.12 on x86-64. Run it on a machine that reaches PyPI;
# examples/install_framework_wheels.sh then installs offline from .whl/ on the GPU machine.
#
# What goes in, and why only that: the image already has torch, numpy, packaging, psutil, py-cpuinfo, tqdm,
# einops, msgpack, ninja and nvidia-ml-py. Of DeepSpeed's requirements it lacks hjson and pydantic (with
# pydantic's own closure); typing-extensions comes along as a fallback that pip only uses if the image's copy
# is too old. megatron-core needs only torch, numpy and packaging (>= 24.2) besides itself.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEEPSPEED_VERSION=0.19.8    # newest on PyPI when written; declares torch>=2.0 and runs on torch 2.11
MEGATRON_VERSION=0.19.2     # cp312 wheel; needs Python >= 3.12, torch >= 2.6
PYDANTIC_VERSION=2.14.3
HJSON_VERSION=3.1.0
rm -rf .whl && mkdir -p .whl
# Binary wheels for the GPU image's interpreter (CPython 3.12, glibc x86-64), whatever this machine runs.
target=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform any)
"$PY" -m pip download -q "${target[@]}" -d .whl "pydantic==$PYDANTIC_VERSION" "hjson==$HJSON_VERSION"
"$PY" -m pip download -q --no-deps "${target[@]}" -d .whl "megatron-core==$MEGATRON_VERSION"
# DeepSpeed ships only an sdist. Built in pip's isolated environment (no torch there), it pre-compiles no ops
# (DS_BUILD_OPS=0 says so explicitly) and gives a py3-none-any wheel; ops it needs later are JIT-built, and the
# examples use torch's AdamW so none is.
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-binary deepspeed -w .whl "deepspeed==$DEEPSPEED_VERSION"
ls -l .whl
du -sh .whl
