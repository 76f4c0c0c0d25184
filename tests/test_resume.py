"""Checkpoints every N steps, keep-K, crash-safe saves and exact resume, with real DeepSpeed launches on 2 CPU
ranks; plus unit tests of the pure checkpoint logic."""
import csv
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from dspipe import checkpoint as ckpt
from dspipe.errors import SpecError
from tests.conftest import ROOT, free_port
from tests.test_distributed import make_run

STEPS, EVERY = 8, 3


def launch(run_dir, *extra, env=None):
    launcher = [shutil.which("deepspeed")] if shutil.which("deepspeed") else [sys.executable, "-m",
                                                                              "deepspeed.launcher.runner"]
    cmd = [*launcher, "--num_gpus", "2", "--master_port", str(free_port()), "run.py", "--run", str(run_dir), *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ, **(env or {})})


def rows(run_dir):
    """(step, loss, lr, grad_norm) per step, as written (losses and norms at full precision)."""
    with open(run_dir / "metrics.csv") as f:
        return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in csv.DictReader(f)]


def tags(run_dir):
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir() or p.name == "latest")


def fp32_run(tmp_path, corpus, name, *flags, steps=STEPS):
    return make_run(tmp_path, corpus, "--precision", "fp32", "--save-interval", str(EVERY), "--keep-checkpoints", "2",
                    *flags, steps=steps, name=name)


def ok(r):
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


# ---- distributed: exactness after kill -9, crash inside a save -------------------------------------------------

EXACT = {"zero1": ["--zero", "1"], "zero3": ["--zero", "3"], "pp2-zero1": ["--zero", "1", "--pp", "2"]}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(EXACT))
def test_kill_and_resume_reproduces_the_uninterrupted_run(tmp_path, corpus, name):
    ref = fp32_run(tmp_path, corpus, "ref", *EXACT[name])
    ok(launch(ref))
    assert len(rows(ref)) == STEPS
    # checkpoints at 3 and 6 and the end (8); keep 2
    assert tags(ref) == ["global_step6", "global_step8", "latest"]
    assert (ref / "checkpoints" / "latest").read_text() == "global_step8"

    run = fp32_run(tmp_path, corpus, "run", *EXACT[name])
    r = launch(run, env={ckpt.TEST_KILL_AT_STEP: "5"})
    assert r.returncode != 0  # killed with SIGKILL after step 5, checkpoint at 3
    assert [s for s, *_ in rows(run)][-1] in ("4", "5")
    assert (run / "checkpoints" / "latest").read_text() == "global_step3"
    r = launch(run, "--resume", "auto")
    ok(r)
    assert "resumed from" in r.stdout and "at step 3" in r.stdout
    assert rows(run) == rows(ref)  # every step: loss, lr and grad norm bitwise equal (fp32 on CPU)
    assert tags(run) == ["global_step6", "global_step8", "latest"]


@pytest.mark.distributed
def test_crash_inside_a_save_keeps_the_previous_checkpoint(tmp_path, corpus):
    run = fp32_run(tmp_path, corpus, "run", "--zero", "1")
    r = launch(run, env={ckpt.TEST_KILL_IN_SAVE: "6"})  # killed after DeepSpeed wrote step 6, before `latest`
    assert r.returncode != 0
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text() == "global_step3" and ckpt.is_complete(ckpts / "global_step3")
    assert (ckpts / ".partial-global_step6").is_dir() and not (ckpts / "global_step6").exists()
    assert any(p.name.endswith("optim_states.pt") for p in (ckpts / ".partial-global_step6").iterdir())

    r = launch(run, "--resume", ".partial-global_step6")  # the partial one, by name: refused, nothing touched
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert [line for line in r.stderr.splitlines() if "dspipe: error:" in line] == [
        f"dspipe: error: checkpoint {ckpts / '.partial-global_step6'} is incomplete (no dspipe.json: its save was "
        f"interrupted); resume from a complete one, e.g. --resume auto"]  # one line, from rank 0 only
    assert (ckpts / "latest").read_text() == "global_step3"

    r = launch(run, "--resume", "auto")
    ok(r)
    assert "at step 3" in r.stdout
    assert tags(run) == ["global_step6", "global_step8", "latest"]  # the partial dir was cleaned up
    assert [int(s) for s, *_ in rows(run)] == list(range(1, STEPS + 1))


@pytest.mark.distributed
def test_sigterm_finishes_the_step_saves_and_exits_0(tmp_path, corpus):
    run = fp32_run(tmp_path, corpus, "run", "--zero", "1", steps=400)
    cmd = [shutil.which("deepspeed") or "deepspeed", "--num_gpus", "2", "--master_port", str(free_port()),
           "run.py", "--run", str(run)]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not ((run / "metrics.csv").is_file() and len(rows(run)) >= 2):
        time.sleep(0.5)
    # the rank processes (DeepSpeed's launcher starts them as 'python -u run.py --local_rank=R --run DIR')
    ranks = subprocess.run(["pgrep", "-f", f"run.py --local_rank=.* --run {run}"], capture_output=True, text=True)
    pids = [int(x) for x in ranks.stdout.split()]
    assert len(pids) == 2, pids
    os.kill(pids[0], 15)  # one rank is enough: the flag is all-reduced
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-3000:]
    assert "stopped by a signal" in out
    done = ckpt.complete_checkpoints(run / "checkpoints")
    assert done and done[-1][0] == len(rows(run)) < 400


@pytest.mark.distributed
def test_resume_refusals(tmp_path, corpus):
    run = fp32_run(tmp_path, corpus, "run", "--zero", "1", steps=3)
    ok(launch(run))
    before = sorted(str(p) for p in run.rglob("*")), rows(run)
    r = launch(run)  # no --resume over existing checkpoints
    assert r.returncode == 2 and "pass --resume auto" in r.stderr
    r = launch(run, "--resume", "global_step99")
    assert r.returncode == 2 and "checkpoint global_step99 not found" in r.stderr
    other = fp32_run(tmp_path, corpus, "other", "--zero", "1", "--hidden", "128", steps=3)
    shutil.copytree(run / "checkpoints", other / "checkpoints")
    r = launch(other, "--resume", "auto")
    assert r.returncode == 2 and "different model shape: hidden 64 -> 128" in r.stderr
    assert tags(other) == ["global_step3", "latest"]
    assert (sorted(str(p) for p in run.rglob("*")), rows(run)) == before  # no data lost
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()[-1]) < 300


# ---- unit: pure logic ------------------------------------------------------------------------------------------

def _fake(ckpt_dir, step, complete=True):
    d = ckpt_dir / ckpt.tag_for(step)
    d.mkdir(parents=True)
    if complete:
        (d / ckpt.META_FILE).write_text(json.dumps({"step": step}))
    return d


def test_keep_k_and_partial_leftovers(tmp_path):
    for s in (3, 6, 9, 12):
        _fake(tmp_path, s)
    _fake(tmp_path, 15, complete=False)
    (tmp_path / ".partial-global_step15").mkdir()
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path)] == [3, 6, 9, 12]
    assert [p.name for p in ckpt.to_delete(tmp_path, 2)] == ["global_step3", "global_step6", ".partial-global_step15"]


def test_find_checkpoint(tmp_path):
    assert ckpt.find_checkpoint(tmp_path / "none", "auto") is None
    _fake(tmp_path, 3)
    _fake(tmp_path, 6, complete=False)
    assert ckpt.find_checkpoint(tmp_path, "auto").name == "global_step3"
    assert ckpt.find_checkpoint(tmp_path, "global_step3").name == "global_step3"
    with pytest.raises(SpecError, match="is incomplete"):
        ckpt.find_checkpoint(tmp_path, "global_step6")
    with pytest.raises(SpecError, match="not found"):
        ckpt.find_checkpoint(tmp_path, "global_step7")
    (tmp_path / "latest").write_text("global_step6")
    with pytest.raises(SpecError, match="missing or incomplete"):
        ckpt.find_checkpoint(tmp_path, "auto")


def test_trim_metrics_and_atomic_write(tmp_path):
    m = tmp_path / "metrics.csv"
    m.write_text("step,loss\n1,9.0\n2,8.0\n3,7.0\n4,6.5\n")
    ckpt.trim_metrics(m, 2)
    assert m.read_text() == "step,loss\n1,9.0\n2,8.0\n"
    ckpt.write_atomic(tmp_path / "latest", "global_step2")
    assert (tmp_path / "latest").read_text() == "global_step2" and [p.name for p in tmp_path.iterdir()
                                                                     if p.name.startswith(".")] == []


def test_save_interval_and_keep_are_validated():
    from dspipe.spec import TrainSpec
    with pytest.raises(SpecError, match="save_interval"):
        TrainSpec(global_batch=8, micro_batch=1, steps=10, save_interval=-1)
    with pytest.raises(SpecError, match="keep_checkpoints"):
        TrainSpec(global_batch=8, micro_batch=1, steps=10, keep_checkpoints=0)
