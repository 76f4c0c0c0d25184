#!/usr/bin/env bash
# Wheels for a GPU machine that has torch but no network and no DeepSpeed (an air-gapped node, a lent benchmark
# machine): DeepSpeed and what it and dspipe need beyond torch, transformers and the usual scientific stack, for
# CPython 3.12 on x86-64 Linux by default, into DIR (default .whl). There, without a network:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site:$PWD
#   python3 benchmarks/gpu_suite.py --out /tmp/suite --append docs/benchmarks.md
# (2026-11-29 on the H200: 6.4 MB of wheels, the image already holding torch, transformers, tokenizers, triton.)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PYV=${PYTHON_VERSION:-3.12}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
# the versions this checkout runs with here, so the two machines agree
pins=$("$PY" - <<'PYEOF'
from importlib.metadata import version
names = ["deepspeed", "hjson", "pydantic", "pydantic_core", "annotated-types", "typing-inspection", "datasets", "dill",
         "multiprocess"]
print(" ".join(f"{n}=={version(n)}" for n in names))
PYEOF
)
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  plat+=(--platform "$p")
done
# DeepSpeed publishes a source distribution only: build its (pure-Python, ops JIT-compiled) wheel here
"$PY" -m pip wheel --quiet --no-deps -w "$DIR" "$(tr ' ' '\n' <<<"$pins" | grep '^deepspeed==')"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp "${plat[@]}" \
  -d "$DIR" $(tr ' ' '\n' <<<"$pins" | grep -v '^deepspeed==') liger-kernel
ls -la "$DIR"
