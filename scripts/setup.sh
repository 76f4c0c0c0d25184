#!/usr/bin/env bash
# Install dspipe and its dependencies. Keeps an existing torch (e.g. a CUDA build on a GPU machine);
# otherwise installs torch 2.13.0, which on the CPU machines resolves to the local CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install --quiet torch==2.13.0
fi
"$PY" -m pip install --quiet -e ".[test]"
# DeepSpeed's compiled ops that runs load here (FusedAdam, DeepSpeedCPUAdam, the CPU collectives), built once now
# rather than before a launch's first step (1-2 minutes each on 2 cores; nothing to do when built). A failure is
# one line, and the launch builds them as it would without this.
"$PY" -m dspipe build-ops || true
