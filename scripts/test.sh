#!/usr/bin/env bash
# The whole suite, as CI runs it: the static checks (scripts/lint.sh: ruff, mypy, the docs site); the unit tests on
# every core (pytest-xdist, a worker per core); then the distributed tests two at a time (a launch leaves a core idle
# much of its time: interpreter start-up, the launcher, the test's own checks; a test file's tests stay on one worker,
# so its module-scoped runs are trained once); then those marked `solo` (4+ ranks, or a time they measure) one at a
# time. Arguments go to every run (e.g. -x, -k EXPR). Exits non-zero when any run fails; all of them always run.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
status=0
run() {
  "$PY" -m pytest tests "$@"
  local rc=$?
  [ "$rc" = 5 ] && rc=0  # nothing selected (e.g. -k matched only one kind): not a failure
  [ "$rc" = 0 ] || status=1
}
bash scripts/lint.sh || status=1  # ruff, mypy, the docs site (seconds)
run -q -n auto --dist loadgroup -m "not distributed" --durations=15 "$@"  # loadgroup: a docs page's commands in order
run -v -n 2 --dist loadscope -m "distributed and not solo" --durations=40 "$@"  # -v: each test's result as it ends
run -v -m "solo" --durations=20 "$@"
exit $status
