#!/usr/bin/env bash
# Installs DeepSpeed and megatron-core on the GPU machine, which has no network, from the wheels in .whl/
# (git-ignored; carry it along). examples/fetch_framework_wheels.sh fills .whl/ on a machine that reaches PyPI:
#
#   PYTHON=python3 examples/fetch_framework_wheels.sh
#     = pip download --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
#         --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
#         --platform manylinux2014_x86_64 --platform any -d .whl pydantic==2.14.3 hjson==3.1.0
#       pip download --no-deps <same target flags> -d .whl megatron-core==0.19.2
#       DS_BUILD_OPS=0 pip wheel --no-deps --no-binary deepspeed -w .whl deepspeed==0.19.8
#
# --no-index --find-links resolves against what is installed first: requirements the image already satisfies
# (torch, numpy, packaging, psutil, tqdm, ...) are kept as they are, and only the missing ones come from .whl/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -d .whl ]; then
    echo "no .whl/ here: run examples/fetch_framework_wheels.sh where PyPI is reachable, then carry .whl" >&2
    exit 1
fi
"$PY" -m pip install --no-index --find-links .whl --no-cache-dir --disable-pip-version-check \
    deepspeed==0.19.8 megatron-core==0.19.2 2>&1 | grep -vi "^Looking in links" || true
# pip's own exit status is lost in the pipe above: judge the install by importing what it was for.
"$PY" - <<'PY'
import importlib.metadata as md
for name in ("deepspeed", "megatron-core", "pydantic", "pydantic-core", "hjson", "typing-extensions"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        raise SystemExit(f"{name} is not installed")
import deepspeed, megatron.core  # noqa: E401,F401  (fails loudly if a dependency is still missing)
print("deepspeed and megatron.core import")
PY
