#!/usr/bin/env bash
# The checks that read the code without running it, as CI runs them (scripts/test.sh calls this first): ruff's lint
# and format check, mypy (strict on dspipe/spec and dspipe/planner, mypy.ini), and the docs site built strictly.
# Exits non-zero when any of them fails; all of them always run.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
status=0
check() { echo "+ $*"; "$@" || status=1; }
check "$PY" -m ruff check .
check "$PY" -m ruff format --check .
check "$PY" -m mypy dspipe/spec dspipe/planner
site=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 check "$PY" -m mkdocs build --strict --quiet --site-dir "$site"
rm -rf "$site"
exit $status
