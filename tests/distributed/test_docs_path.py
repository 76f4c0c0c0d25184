"""The commands of the README's 5-minute path (also docs/index.md's) and of the export-and-generate how-to, run as
written, in order, by bash in a fresh directory: prepare-data, gen-config, the `deepspeed` launch on 2 CPU ranks,
report, export-hf and generate. Two changes keep it short, each a flag appended to the documented line (a later flag
wins): prepare-data reads 2 MiB of the built-in corpus (`--max-mb 2`), gen-config trains 6 steps (`--steps 6
--warmup 2`). The how-to's placeholder NAME is the README's run (a second name for it, so its export is its own).
tests/unit/test_docs.py runs every page's plan / gen-config / presets commands; what neither runs needs a GPU, the
network, several machines or a measured profile (its docstring says which)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import OFFLINE, ROOT, bash_commands, csv_rows

pytestmark = pytest.mark.distributed

PAGES = [ROOT / "README.md", ROOT / "docs" / "index.md", ROOT / "docs" / "howto" / "export-and-generate.md"]
SHORTER = {"prepare-data": " --max-mb 2", "gen-config": " --steps 6 --warmup 2"}
RUNS = (
    "dspipe prepare-data",
    "dspipe gen-config",
    "deepspeed ",
    "dspipe report",
    "dspipe export-hf",
    "dspipe generate",
)


def path_commands() -> list[str]:
    """The pages' commands of the path, in page order, each once; NAME is `quick2`, the README's run again."""
    commands = []
    for page in PAGES:
        for line in bash_commands(page):
            line = " ".join(line.split("  #")[0].split()).replace("NAME", "quick2")
            if not line.startswith(RUNS) or ("gen-config" in line and "--out runs/quick" not in line):
                continue  # not the path's (gen-config: the planning examples, tests/unit/test_docs.py)
            line += SHORTER.get(line.split()[1], "")
            if line not in commands:
                commands.append(line)
    return commands


def test_the_path_is_what_the_readme_shows():
    got = path_commands()
    verbs = [c.split()[0] if c.startswith("deepspeed") else c.split()[1] for c in got]
    assert verbs[:6] == ["prepare-data", "gen-config", "deepspeed", "report", "export-hf", "generate"], got
    assert any("runs/quick2" in c for c in got), got


def test_the_documented_path_runs_on_2_cpu_ranks(tmp_path):
    bindir = Path(sys.executable).parent
    env = {**os.environ, **OFFLINE, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    env.update(DSPIPE_MEASURE="auto", DSPIPE_CACHE=str(tmp_path / "cache"))  # as a user's gen-config: measures here
    assert shutil.which("dspipe", path=env["PATH"]) and shutil.which("deepspeed", path=env["PATH"])
    outputs = {}
    for command in path_commands():
        if "runs/quick2" in command and not (tmp_path / "runs" / "quick2").exists():
            (tmp_path / "runs" / "quick2").symlink_to(tmp_path / "runs" / "quick", target_is_directory=True)
        r = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"{command}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        outputs[command] = r.stdout
    run = tmp_path / "runs" / "quick"
    losses = [float(row["loss"]) for row in csv_rows(run / "metrics.csv")]
    assert len(losses) == 6 and losses[-1] < losses[0], losses  # the launch trained every step and the loss fell
    assert (run / "report" / "report.md").is_file() and (run / "report" / "loss.png").is_file()
    for name in ("quick", "quick2"):
        assert (tmp_path / "models" / name / "config.json").is_file()
        assert (tmp_path / "models" / name / "model.safetensors").is_file()
    samples = [out for command, out in outputs.items() if command.startswith("dspipe generate")]
    assert len(samples) == 3 and all("def main(" in out for out in samples), samples
    _the_plan_kept_its_word(run, env=env)


def _the_plan_kept_its_word(run: Path, *, env: dict) -> None:
    """Issue 40 on the same launch: the run recorded its start-up terms and its step's phases, the report compares
    the plan (measured on this machine by gen-config) with them, and the run folds into its profile."""
    import json

    startup = json.loads((run / "engine.json").read_text())["startup"]
    assert len(startup["seconds_before_build"]) == 2 and isinstance(startup["ops_built"], list), startup
    assert all(
        0 < b < r for b, r in zip(startup["seconds_before_build"], startup["seconds_to_first_step"], strict=True)
    )
    for row in csv_rows(run / "metrics.csv"):
        phases = [float(row[k]) for k in ("forward_s", "backward_s", "optimizer_s")]
        assert all(p > 0 for p in phases) and sum(phases) <= float(row["step_time_s"]), row
    report = (run / "report" / "report.md").read_text()
    assert "| measured / predicted | verdict |" in report and "&nbsp;&nbsp;forward (s)" in report
    assert "The plan used figures measured by gen-config" in report
    folded = run.parent / "folded.json"
    r = subprocess.run(
        [sys.executable, "-m", "dspipe", "calibrate", "--from-run", str(run), "--out", str(folded)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    profile = json.loads(folded.read_text())
    assert profile["runs"] == 1 and profile["measured_by"] == "gen-config" and "compute" in profile["corrections"]
    if not startup["ops_built"]:  # a launch that compiled ops gives their compile time instead
        assert profile["figures"]["launch_s"] == max(startup["seconds_before_build"])
