#!/usr/bin/env bash
# The whole suite, as CI runs it: the unit tests on every core (pytest-xdist, one worker per core), then the
# distributed tests one at a time (each launches ranks that use every core themselves). Arguments go to both runs
# (e.g. -x, -k EXPR). Exits non-zero when either run fails; both always run.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pytest tests -q -n auto -m "not distributed" --durations=15 "$@"
unit=$?
"$PY" -m pytest tests -v -m distributed --durations=40 "$@"  # -v: each test's result as it ends
distributed=$?
# pytest's 5: nothing selected (e.g. -k matched only one kind) is not a failure of the other run
[ "$unit" = 5 ] && unit=0
[ "$distributed" = 5 ] && distributed=0
[ "$unit" = 0 ] && [ "$distributed" = 0 ]
