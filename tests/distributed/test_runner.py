"""The runner's stability handling on 2 real CPU ranks: non-finite steps are skipped and counted (dspipe's guard for
fp32 without ZeRO, DeepSpeed's own checks for the BF16 pipeline path), K in a row save and stop, resume goes on."""

import math

import pytest

from dspipe.runtime import ckpt_tags
from tests.helpers import csv_rows, launch, make_run

pytestmark = pytest.mark.distributed


def rows(run_dir):
    return {int(r["step"]): r for r in csv_rows(run_dir / "metrics.csv")}


@pytest.mark.parametrize(
    "flags",
    [["--zero", "0", "--precision", "fp32"], ["--zero", "1", "--pp", "2"]],
    ids=["fp32-zero0-guard", "bf16-pp2-deepspeed"],
)
def test_non_finite_steps_are_skipped_then_k_in_a_row_save_and_stop(tmp_path, corpus, flags):
    run = make_run(tmp_path, corpus, *flags, "--max-skipped-steps", "3", "--eval-interval", "0", steps=10)
    r = launch(run, "--test-faults", '{"nan_at_steps": [3, 5, 6, 7]}')
    assert r.returncode == 3, r.stdout[-3000:] + r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if "dspipe: error:" in line]
    assert errors == [
        f"dspipe: error: 3 consecutive steps skipped (non-finite loss or gradient norm), the last at "
        f"step 7; saved {run / 'checkpoints' / 'global_step7'} (weights from before the first skipped "
        f"step); lower the lr or check the data, then relaunch to resume"
    ]
    assert "step 3 skipped: non-finite loss or gradient norm" in r.stderr  # the dspipe logger's
    m = rows(run)
    assert sorted(m) == list(range(1, 8))
    assert [s for s in m if m[s]["skipped"] == "1"] == [3, 5, 6, 7]
    # the lr column is the lr each step applied: DeepSpeed's warmup starts at 0 (steps 1 and 2: iterations -1 and 0),
    # step 3 applies 1/2 of 3e-3 (warmup 2, linear); a skipped step does not advance the schedule, so the step after
    # it applies the same lr
    lr = {s: float(m[s]["lr"]) for s in m}
    assert lr[1] == lr[2] == 0.0 and math.isclose(lr[3], 1.5e-3, rel_tol=1e-6), lr
    assert lr[4] == lr[3] and lr[5] != lr[4] and lr[7] == lr[6] == lr[5], lr
    assert math.isfinite(float(m[4]["loss"])) and math.isfinite(float(m[4]["grad_norm"]))  # the weights stayed finite
    assert (run / "checkpoints" / "latest").read_text() == "global_step7"
    assert ckpt_tags.is_complete(run / "checkpoints" / "global_step7")
    if flags[1] != "0":
        return  # one resume is enough to show the saved weights are finite
    r = launch(run, "--resume", "auto")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = rows(run)
    assert sorted(m) == list(range(1, 11)) and all(m[s]["skipped"] == "0" for s in (8, 9, 10))
    assert float(m[10]["loss"]) < float(m[4]["loss"])
