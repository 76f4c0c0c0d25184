#!/usr/bin/env bash
# Packaging smoke test: dspipe works installed from its wheel, non-editable, away from this checkout.
#   1. build the wheel from a clean copy of the source (no stale build/ or egg-info of the checkout leaks in);
#      it must hold every module and the shipped templates (*.j2) and DeepSpeed presets (*.json)
#   2. install only that wheel (--no-deps: torch, deepspeed, ... come from the system site) into a fresh
#      `venv --system-site-packages`, then work from a temp directory outside the repository
#   3. prove that the venv's python -- and the DeepSpeed ranks it launches -- import dspipe from the venv's
#      site-packages, not from the checkout (the system site may hold an editable install of it)
#   4. dspipe prepare-data (small offline corpus), dspipe gen-config (tiny GPT, 2 CPU ranks), then the exact
#      launch command gen-config printed: exit 0, metrics.csv with every step, a checkpoint
# Nothing is downloaded; the temp dir is removed on exit (WHEEL_SMOKE_KEEP=1 keeps it, logs included).
# Usage: bash scripts/wheel_smoke.sh   (PYTHON=python3.X to test another interpreter)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd -P)
PY=${PYTHON:-python3}
STEPS=6
START=$SECONDS
TMP=$(mktemp -d "${TMPDIR:-/tmp}/dspipe-wheel-smoke.XXXXXX")
if [ -n "${WHEEL_SMOKE_KEEP:-}" ]; then trap 'echo "wheel smoke: kept $TMP" >&2' EXIT; else trap 'rm -rf "$TMP"' EXIT; fi
fail() { echo "wheel smoke: FAIL: $*" >&2; exit 1; }
step() { echo "wheel smoke: [$((SECONDS - START))s] $*"; }

# 1. The wheel, built from a copy of what setup.py packages.
step "building the wheel"
mkdir -p "$TMP/src" "$TMP/wheel" "$TMP/work"
for f in setup.py setup.cfg pyproject.toml MANIFEST.in README.md LICENSE; do
  if [ -e "$REPO/$f" ]; then cp "$REPO/$f" "$TMP/src/"; fi
done
tar -C "$REPO" --exclude=__pycache__ --exclude='*.pyc' -cf - dspipe | tar -C "$TMP/src" -xf -
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$TMP/wheel" "$TMP/src" >/dev/null
WHEEL=$(ls "$TMP"/wheel/dspipe-*.whl)
"$PY" - "$WHEEL" "$TMP/src" <<'EOF' || fail "the wheel lacks package files"
import sys, zipfile
from pathlib import Path
wheel, src = sys.argv[1], Path(sys.argv[2])
have = set(zipfile.ZipFile(wheel).namelist())
want = {p.relative_to(src).as_posix() for p in (src / "dspipe").rglob("*") if p.suffix in (".py", ".j2", ".json")}
assert any(w.startswith("dspipe/resources/templates/") and w.endswith(".j2") for w in want), "no templates in source"
assert any(w.startswith("dspipe/resources/ds_configs/") and w.endswith(".json") for w in want), "no presets in source"
missing = sorted(want - have)
if missing:
    sys.exit(f"missing from {wheel}: {missing}")
ep = next(n for n in have if n.endswith(".dist-info/entry_points.txt"))
assert "dspipe = dspipe.cli.app:main" in zipfile.ZipFile(wheel).read(ep).decode(), "console script dspipe missing"
print(f"wheel smoke: {Path(wheel).name}: {len(want)} package files incl. templates and presets")
EOF

# 2. A fresh venv on top of the system site (torch, deepspeed, ...), holding only the wheel. The system pip runs
#    inside it (--without-pip saves seeding one) and installs into the venv; it never uninstalls the system
#    site's dspipe (pip leaves packages outside the environment alone).
step "installing it into a fresh venv"
VENV=$TMP/venv
"$PY" -m venv --system-site-packages --without-pip "$VENV"
VPY=$VENV/bin/python
"$VPY" -m pip install -q --no-deps --force-reinstall --no-index "$WHEEL"
SITE=$("$VPY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
SITE=$(cd "$SITE" && pwd -P)
[ -d "$SITE/dspipe/resources/templates" ] || fail "the wheel did not install dspipe/resources into $SITE"
# The venv's own `deepspeed` launcher: the system one runs the system python, whose ranks would import the
# checkout's dspipe through the editable install. DeepSpeed starts the ranks with the launcher's sys.executable.
cat >"$VENV/bin/deepspeed" <<EOF
#!$VPY
import sys
from deepspeed.launcher.runner import main
sys.exit(main())
EOF
chmod +x "$VENV/bin/deepspeed"
# Records where every process of the venv found the package `dspipe` (the spec the import system would use
# anyway, asked of the other finders in order), with the DeepSpeed rank: proof that the ranks used the wheel.
cat >"$SITE/_dspipe_smoke_trace.py" <<'EOF'
import os
import sys


class DspipeTrace:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "dspipe":
            return None
        for finder in sys.meta_path:
            spec = None if finder is cls or not hasattr(finder, "find_spec") else finder.find_spec(name, path, target)
            if spec is not None:
                with open(os.environ["DSPIPE_SMOKE_TRACE"], "a") as f:
                    f.write(f"{os.environ.get('RANK', '-')} {os.path.realpath(spec.origin or '?')}\n")
                return spec
        return None


if os.environ.get("DSPIPE_SMOKE_TRACE"):
    sys.meta_path.insert(0, DspipeTrace)
EOF
echo "import _dspipe_smoke_trace" >"$SITE/_dspipe_smoke_trace.pth"

# 3. Outside the repository, with nothing but the venv in front: which dspipe does the venv import?
cd "$TMP/work"
unset PYTHONPATH PYTHONHOME PYTHONSTARTUP PYTHONSAFEPATH VIRTUAL_ENV
export PATH="$VENV/bin:$PATH" PYTHONNOUSERSITE=1 PYTHONDONTWRITEBYTECODE=1
[ "$(command -v python)" = "$VPY" ] || fail "python on PATH is $(command -v python), not $VPY"
[ "$(command -v dspipe)" = "$VENV/bin/dspipe" ] || fail "dspipe on PATH is $(command -v dspipe), not the venv's"
[ "$(command -v deepspeed)" = "$VENV/bin/deepspeed" ] || fail "deepspeed on PATH is not the venv's"
where() {
  "$VPY" -c 'import os, dspipe, dspipe.planner.render as r
print(os.path.realpath(dspipe.__file__), os.path.realpath(r.RESOURCES))'
}
EDITABLE=$("$VPY" -c 'import sys
print(any("__editable__" in getattr(f, "__module__", "") and "dspipe" in getattr(f, "__module__", "") for f in sys.meta_path))')
WHERE=$(where) || fail "the venv's python cannot import dspipe"
read -r PKG RES <<<"$WHERE"
if [ "$EDITABLE" = True ]; then EDITABLE="present; its finder answers only what sys.path lacks, so the wheel wins"
else EDITABLE=none; fi
if [ "$PKG" != "$SITE/dspipe/__init__.py" ]; then
  # A .pth or finder of the system site put the checkout in front of the venv (e.g. an old-style
  # `setup.py develop` that inserts at sys.path[0]). Neutralise it for this venv only: a sitecustomize (runs
  # after every .pth) that drops editable finders for dspipe and puts the venv's site-packages first.
  echo "wheel smoke: dspipe resolved to $PKG, not the wheel: neutralising the system site's editable install" >&2
  cat >"$SITE/sitecustomize.py" <<EOF
import sys
sys.meta_path[:] = [f for f in sys.meta_path if not ("__editable__" in getattr(f, "__module__", "")
                                                     and "dspipe" in getattr(f, "__module__", ""))]
sys.path[:] = ["$SITE"] + [p for p in sys.path if p != "$SITE"]
EOF
  WHERE=$(where) || fail "the venv's python cannot import dspipe"
  read -r PKG RES <<<"$WHERE"
  EDITABLE="shadowed the wheel; neutralised by $SITE/sitecustomize.py"
fi
case "$PKG" in
  "$SITE/dspipe/__init__.py") ;;
  "$REPO"/*) fail "the venv imports dspipe from the repository ($PKG), not from the wheel in $SITE" ;;
  *) fail "the venv imports dspipe from $PKG, not from the wheel in $SITE" ;;
esac
[ "$RES" = "$SITE/dspipe/resources" ] && [ -f "$RES/templates/slurm.sbatch.j2" ] \
  || fail "templates/presets resolve to $RES, not to the installed package"
step "dspipe imports from $SITE (system-site editable install of dspipe: $EDITABLE)"
export DSPIPE_SMOKE_TRACE=$TMP/trace.txt

# 4. Data, config and the printed launch command, all from the installed package.
step "dspipe prepare-data"
dspipe prepare-data --out "$TMP/work/data" --train-tokenizer 1024 --max-mb 1.5 --workers 2 >"$TMP/prepare.log" 2>&1 \
  || { tail -30 "$TMP/prepare.log" >&2; fail "dspipe prepare-data"; }
step "dspipe gen-config"
dspipe gen-config --model tiny --gpus-per-node 2 --gpu cpu --global-batch 16 --micro-batch 4 --steps $STEPS \
  --warmup 2 --lr 3e-3 --log-interval 2 --precision fp32 --zero 1 --pp 1 --offload none --no-offload-params \
  --checkpointing none --data "$TMP/work/data" --out "$TMP/work/run" >"$TMP/gen.log" 2>&1 \
  || { cat "$TMP/gen.log" >&2; fail "dspipe gen-config"; }
RUN_LINE=$(grep -m1 '^run:  ' "$TMP/gen.log") || { cat "$TMP/gen.log" >&2; fail "gen-config printed no 'run:  ' line"; }
# the printed command, word-split as a shell would, with a free --master_port after the launcher
mapfile -t CMD < <("$VPY" - "${RUN_LINE#run:  }" <<'EOF'
import shlex, sys
from dspipe.cluster.ports import free_port
words = shlex.split(sys.argv[1])
assert words[0] == "deepspeed", words
port = free_port()
print("\n".join([words[0], "--master_port", str(port), *words[1:]]))
EOF
)
[ "${#CMD[@]}" -gt 3 ] || fail "could not parse: $RUN_LINE"
step "launching: ${CMD[*]}"
if ! timeout 600 "${CMD[@]}" >"$TMP/train.log" 2>&1; then
  tail -40 "$TMP/train.log" >&2
  fail "the launch command gen-config printed exited non-zero"
fi

RUN=$TMP/work/run
ROWS=$("$VPY" -c 'import csv, sys; print(len(list(csv.DictReader(open(sys.argv[1])))))' "$RUN/metrics.csv") \
  || fail "no metrics.csv in $RUN"
[ "$ROWS" = "$STEPS" ] || fail "metrics.csv has $ROWS rows, expected $STEPS"
[ -d "$RUN/checkpoints/global_step$STEPS" ] && [ -f "$RUN/checkpoints/latest" ] \
  || fail "no checkpoint global_step$STEPS in $RUN/checkpoints: $(ls "$RUN/checkpoints" 2>&1)"
# every process found dspipe in the wheel, and both ranks are among them
if grep -v " $SITE/dspipe/__init__.py\$" "$TMP/trace.txt" >&2; then fail "a process imported dspipe from elsewhere (above)"; fi
for rank in 0 1; do
  grep -q "^$rank $SITE/dspipe/__init__.py\$" "$TMP/trace.txt" || fail "no trace of rank $rank importing dspipe from the wheel"
done
LOSS=$(grep -o 'done: loss [^ ]*' "$TMP/train.log" | head -1 || true)
echo "wheel smoke: ok ($(basename "$WHEEL") in a fresh venv, outside the checkout: prepare-data, gen-config," \
  "2 CPU ranks x $STEPS steps, ${LOSS:-trained}, checkpoint global_step$STEPS; $((SECONDS - START))s)"
