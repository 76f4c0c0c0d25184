"""`dspipe report`: plots and report.md from synthetic metrics in a real gen-config run directory (no launches)."""

import csv
import json
import math
import shutil

import pytest

from dspipe.errors import SpecError
from dspipe.planner.throughput import STEP_COLUMNS, VAL_COLUMNS
from dspipe.spec.hardware import GIB
from dspipe.tools.report import write_report
from tests.helpers import dspipe

CPU2 = [
    "--model",
    "tiny",
    "--gpus-per-node",
    "2",
    "--gpu",
    "cpu",
    "--global-batch",
    "16",
    "--micro-batch",
    "4",
    "--steps",
    "20",
    "--zero",
    "1",
]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("gen")
    r = dspipe("gen-config", *CPU2, "--out", "runs/t", cwd=cwd)
    assert r.returncode == 0, r.stderr
    return cwd / "runs/t"


@pytest.fixture
def run(template, tmp_path):
    """A fresh copy of the gen-config run directory, at tmp_path/runs/t."""
    path = tmp_path / "runs/t"
    shutil.copytree(template, path)
    return path


def write_csv(path, columns, rows):
    """The rows under `columns`, each padded with empty fields (a GPU run leaves the phase columns empty)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        w.writerows([*row, *[""] * (len(columns) - len(row))] for row in rows)


def gpu_like_rows(steps=20):
    """Steps 1-3 slow (warm-up); after them tokens/s = 10000 + 10 s, so the median of steps 4-20 is 10120 (s = 12);
    loss = 10 - s/4 (mean of steps 11-20: 6.125); peak allocated 1.20 GiB at step 20; steps 7 and 13 skipped."""
    rows = []
    for s in range(1, steps + 1):
        tps = 1000.0 if s <= 3 else 10000.0 + 10 * s
        rows.append(
            [
                s,
                s * 1024,
                10 - s / 4,
                6e-4 * min(1, s / 5),
                1.5,
                tps,
                tps / 64,
                0.3,
                0.30 + 0.001 * s,
                1.0 + 0.01 * s,
                1.5,
                1024 / tps,
                int(s in (7, 13)),
            ]
        )
    return rows


VAL_ROWS = [
    [5, 5120, 7.0, math.exp(7.0)],
    [10, 10240, 6.5, math.exp(6.5)],
    [15, 15360, 6.6, math.exp(6.6)],
    [20, 20480, 6.8, math.exp(6.8)],
]


def assert_png(path):
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000
    image = matplotlib.image.imread(path)
    assert image.shape[:2] == (495, 880) and image.std() > 0.01  # 8 x 4.5 in at 110 dpi, not a blank canvas


def test_report_plots_and_plan_vs_measured(run):
    write_csv(run / "metrics.csv", STEP_COLUMNS, gpu_like_rows())
    write_csv(run / "val_metrics.csv", VAL_COLUMNS, VAL_ROWS)
    (run / "engine.json").write_text(
        json.dumps(
            {
                "zero_stage": 1,
                "dp": 2,
                "pp": 1,
                "backend": "gloo",
                "wrapper_optimizer": "DeepSpeedZeroOptimizer",
                "base_optimizer": "AdamW",
                "world_size": 2,
            }
        )
    )
    r = dspipe("report", "runs/t", cwd=run.parent.parent)
    assert r.returncode == 0, r.stderr
    assert "wrote runs/t/report/report.md and loss.png, throughput.png, lr.png" in r.stdout
    assert "steps 1-20: train loss 6.1250, val loss 6.8000, 10,120 tokens/s (median), 2 skipped" in r.stdout
    out = run / "report"
    assert sorted(p.name for p in out.iterdir()) == [
        ".dspipe-output",
        "loss.png",
        "lr.png",
        "report.md",
        "throughput.png",
    ]  # the marker: dspipe wrote this report
    for name in ("loss.png", "throughput.png", "lr.png"):
        assert_png(out / name)

    est = json.loads((run / "dspipe.json").read_text())["estimate"]
    mem = est["rank_resident_bytes"] / GIB  # a CPU rank: its RSS, predicted (GpuType.resident_bytes)
    md = (out / "report.md").read_text()
    assert "| model | tiny: 0.37M params (L2 h64 a4 s64 V4096) |" in md
    assert "| world | 2 = dp 2 x pp 1 (1 node(s) x 2 cpu) |" in md
    assert "| ZeRO | stage 1, offload none |" in md
    assert "| precision | fp32 (gradient accumulation in fp32) |" in md
    assert "| recomputation | none |" in md
    assert "| batch | global 16 = micro 4 x GA 2 x dp 2 (1,024 tokens/step) |" in md
    assert "| live engine | ZeRO-1, dp 2 x pp 1, gloo, DeepSpeedZeroOptimizer / AdamW, world 2 (engine.json) |" in md
    assert f"| peak RSS per rank (GiB) | {mem:.3f} | max RSS of rank 0 1.200 (reserved 1.500) | {1.2 / mem:.2f} |" in md
    assert (
        f"| tokens/s (job) | {est['tokens_per_s']:,.0f} | 10,120 (median of steps 4-20) | "
        f"{10120 / est['tokens_per_s']:.2f} |"
    ) in md
    assert f"| MFU | {est['mfu'] * 100:.1f}% | 31.2% | {0.312 / est['mfu']:.2f} |" in md
    assert f"| step time (s) | {est['step_time_s']:.4g} | 0.1012 |" in md  # 1024 / 10120
    assert f"- final train loss: 6.1250 (mean of the last 10 steps, ppl {math.exp(6.125):.2f})" in md
    assert "- best validation loss: 6.5000 (ppl 665.14) at step 10, 10,240 tokens" in md
    assert "- final validation loss: 6.8000 (ppl 897.85) at step 20" in md
    assert "e.g. fp16 overflow): 2" in md
    for name in ("loss.png", "throughput.png", "lr.png"):
        assert f"]({name})" in md


def test_cpu_run_without_validation_and_few_steps(run, tmp_path):
    """CPU: mfu and memory columns empty (n/a); no val_metrics.csv; 3 steps are too few to drop a warm-up."""
    rows = [
        [s, s * 1024, 8.0 - s, 1e-4 * s, "", tps, tps / 64, 0.001, "", "", "", 1024 / tps, 0]
        for s, tps in ((1, 2000.0), (2, 4000.0), (3, 3000.0))
    ]
    write_csv(run / "metrics.csv", STEP_COLUMNS, rows)
    out, m = write_report(run, out=tmp_path / "elsewhere")
    assert (m.tokens_per_s, m.final_loss, m.final_val, m.mfu, m.mem_allocated_gib) == (3000.0, 6.0, None, None, None)
    md = (out / "report.md").read_text()
    assert "- validation: none (val_metrics.csv absent or empty)" in md
    assert "| 3,000 (median of all 3 steps (too few to drop a warm-up)) |" in md
    assert "| n/a (no peak FLOP/s for this device) | n/a |" in md
    assert "| max RSS of rank 0 n/a | n/a | n/a |" in md
    assert "- final train loss: 6.0000 (mean of the last 3 steps" in md
    assert "| live engine | not written yet" in md
    assert "the measured memory is the RSS of rank 0" in md
    for name in ("loss.png", "throughput.png", "lr.png"):
        assert_png(out / name)
    assert not (run / "report").exists()


def test_a_torn_last_line_and_an_older_runner_format(run):
    """Rows in step order as the runner writes them (a resume rewrites the file first), a last line cut short (no
    newline: the runner is writing it) left out; a metrics.csv without tokens (the runner before this column) gets
    tokens = step x tokens per step."""
    lines = [
        "step,loss,lr,grad_norm,tokens_per_s,step_time_s",
        *(f"{s},{9.0},1e-4,1.0,{1000 + s},0.5" for s in (1, 2, 3, 4)),
        *(f"{s},{5.0},1e-4,1.0,{2000 + s},0.5" for s in (5, 6)),
        "7,4.0,1e-4,1.0,2007,0.5",
    ]
    (run / "metrics.csv").write_text("\n".join(lines) + "\n8,3.9")  # step 8 is being written
    out, m = write_report(run)
    assert (m.first_step, m.last_step, m.rows, m.tokens) == (1, 7, 7, 7 * 1024)
    assert m.tokens_per_s == 2005.5  # median of steps 4-7: 1004, 2005, 2006, 2007
    assert m.final_loss == pytest.approx((9.0 * 4 + 5.0 * 2 + 4.0) / 7)
    assert out == run / "report" and "7 steps (1-7), 7,168 tokens" in (out / "report.md").read_text()


@pytest.mark.parametrize(
    "tail,words",
    [
        ("5,5.0,1e-4,1.0,2005,0.5\n", "metrics.csv:9: step 5 after step 7 (line 8)"),  # a step again
        ("8,3.9\n", "metrics.csv:9: 2 field(s), the header has 6"),  # a short line that is complete
    ],
)
def test_rows_the_runner_never_writes_are_refused(run, tail, words):
    lines = ["step,loss,lr,grad_norm,tokens_per_s,step_time_s", *(f"{s},9.0,1e-4,1.0,1000,0.5" for s in range(1, 8))]
    (run / "metrics.csv").write_text("\n".join(lines) + "\n" + tail)
    with pytest.raises(SpecError, match=words.replace("(", "\\(").replace(")", "\\)")):
        write_report(run)
    assert not (run / "report").exists()


def test_an_existing_report_is_replaced_and_nothing_else(run):
    write_csv(run / "metrics.csv", STEP_COLUMNS, gpu_like_rows(steps=10))
    write_report(run)
    write_csv(run / "metrics.csv", STEP_COLUMNS, gpu_like_rows(steps=20))
    out, m = write_report(run)
    assert m.last_step == 20 and "20 steps (1-20)" in (out / "report.md").read_text()
    assert sorted(p.name for p in run.iterdir()) == [
        "config.yaml",
        "ds_config.json",
        "dspipe.json",
        "metrics.csv",
        "report",
    ]

    (run / "report" / "mine.txt").write_text("notes")  # a file the report did not write: the report is kept
    r = dspipe("report", "runs/t", cwd=run.parent.parent)
    assert r.returncode == 2 and r.stderr.strip() == (
        "dspipe: error: --out runs/t/report holds files dspipe did not "
        "write there (mine.txt); move them out or choose another --out"
    )
    assert (run / "report" / "mine.txt").read_text() == "notes" and (out / "report.md").is_file()

    (run.parent / "notes").mkdir()
    (run.parent / "notes" / "keep.txt").write_text("mine")
    r = dspipe("report", "runs/t", "--out", "runs/notes", cwd=run.parent.parent)
    assert r.returncode == 2 and r.stderr.strip() == (
        "dspipe: error: --out runs/notes exists and is not a report directory written by dspipe (no .dspipe-output); "
        "dspipe replaces only its own output: choose another --out"
    )
    assert (run.parent / "notes" / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "setup, message",
    [
        ("not-a-run", "runs/t is not a run directory (no dspipe.json / ds_config.json)"),
        ("no-metrics", "runs/t/metrics.csv does not exist: no step of runs/t has finished yet"),
        ("empty", "runs/t/metrics.csv has no rows: no step of runs/t has finished yet"),
        ("header-only", "runs/t/metrics.csv has no rows"),
        ("bad-number", "runs/t/metrics.csv:3: loss 'abc' is not a number"),
        ("no-loss-column", "runs/t/metrics.csv: no column loss in the header"),
        ("not-utf8", "runs/t/metrics.csv is not a readable CSV file: 'utf-8' codec can't decode byte 0xff"),
    ],
)
def test_bad_inputs_are_one_line_exit_2(run, setup, message):
    metrics = run / "metrics.csv"
    if setup == "not-a-run":
        (run / "dspipe.json").unlink()
    elif setup == "empty":
        metrics.write_text("")
    elif setup == "header-only":
        metrics.write_text(",".join(STEP_COLUMNS) + "\n")
    elif setup == "bad-number":
        metrics.write_text("step,loss\n1,2.0\n2,abc\n3,1.0\n")
    elif setup == "no-loss-column":
        metrics.write_text("step,tokens\n1,1024\n")
    elif setup == "not-utf8":
        metrics.write_bytes(b"step,loss\n1,\xff\n")
    r = dspipe("report", "runs/t", cwd=run.parent.parent)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dspipe: error: ") and message in lines[0], r.stderr
    assert not (run / "report").exists()
    assert [p.name for p in run.parent.iterdir()] == ["t"]  # no temp directory left behind


def test_checkpoint_rows_compare_the_plan_with_the_latest_save(run):
    write_csv(run / "metrics.csv", STEP_COLUMNS, gpu_like_rows())
    planned = json.loads((run / "dspipe.json").read_text())["estimate"]["checkpoint"]
    mib = planned["bytes"] / 2**20
    out, _ = write_report(run)
    md = (out / "report.md").read_text()
    assert f"| checkpoint per save (MiB) | {mib:,.1f} | n/a | n/a |" in md  # no checkpoint yet
    tag = run / "checkpoints" / "global_step20"
    tag.mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("global_step20")
    save = {
        "mode": "async",
        "completed_after_step": 20,
        "blocking_s": 0.5,
        "write_s": 3.0,
        "writer_cpu_s": 1.0,
        "rank_max_bytes": planned["rank_max_bytes"],
        "bytes": int(planned["bytes"] * 1.01),
    }
    (tag / "dspipe.json").write_text(json.dumps({"global_step": 20, "save": save}))
    md = (write_report(run)[0] / "report.md").read_text()
    assert f"| checkpoint per save (MiB) | {mib:,.1f} | {save['bytes'] / 2**20:,.1f} | 1.01 |" in md
    assert (
        f"| checkpoint, largest rank (MiB) | {planned['rank_max_bytes'] / 2**20:,.1f} | "
        f"{planned['rank_max_bytes'] / 2**20:,.1f} | 1.00 |"
    ) in md
    (tag / "dspipe.json").write_text(json.dumps({"save": {**save, "mode": "sync", "rank_max_bytes": 0}}))
    md = (write_report(run)[0] / "report.md").read_text()
    assert f"| checkpoint, largest rank (MiB) | {planned['rank_max_bytes'] / 2**20:,.1f} | n/a | n/a |" in md


@pytest.mark.parametrize("latest", [b"\x80\xff garbage", b"../../etc", b"global_step20\x00", b""])
def test_a_damaged_latest_file_leaves_the_checkpoint_rows_unmeasured(run, latest):
    write_csv(run / "metrics.csv", STEP_COLUMNS, gpu_like_rows())
    (run / "checkpoints").mkdir(exist_ok=True)
    (run / "checkpoints" / "latest").write_bytes(latest)
    r = dspipe("report", "runs/t", cwd=run.parent.parent)
    assert r.returncode == 0, r.stderr
    md = (run / "report" / "report.md").read_text()
    assert "| checkpoint per save (MiB) |" in md and "Traceback" not in r.stderr
    assert next(line for line in md.splitlines() if line.startswith("| checkpoint per save")).endswith("| n/a | n/a |")


def test_the_jobs_events_are_reported_with_the_lines_left_out(run):
    """events.jsonl (hangs, restarts, the save interval re-planned) in report.md's results and the command's output:
    a hang waited in by 2 of 4 ranks names the other two; a line torn by a kill, one that is not an object and a
    hang whose step is a list (damage) are told, not a traceback."""
    write_csv(run / "metrics.csv", STEP_COLUMNS, gpu_like_rows())
    events = [
        {"time": "2026-11-30T10:00:00Z", "event": "hang", "rank": 0, "world": 4, "op": "all_reduce", "step": 7},
        {"time": "2026-11-30T10:00:00Z", "event": "hang", "rank": 2, "world": 4, "op": "all_reduce", "step": 7},
        {"time": "2026-11-30T10:01:00Z", "event": "restart", "attempt": 1, "world": 4, "step": 5},
        {"time": "2026-11-30T10:02:00Z", "event": "hang", "rank": 1, "world": 4, "op": "broadcast", "step": [9]},
    ]
    lines = [json.dumps(e) for e in events] + ["[1, 2]", "", '{"time": "2026-11-30T10:03:00Z", "ev']
    (run / "events.jsonl").write_text("\n".join(lines))
    r = dspipe("report", "runs/t", cwd=run.parent.parent)
    assert r.returncode == 0, r.stderr
    told = (
        "hang at step 7: rank(s) 0, 2 waited inside all_reduce (not rank(s) 1, 3); hang at step [9]: rank(s) 1 "
        "waited inside broadcast (not rank(s) 0, 2, 3); restart 1 resumed at step 5 on 4 ranks (2 line(s) of "
        "events.jsonl unreadable: torn by a kill, or not a JSON object)"
    )
    assert f"events: {told}" in r.stdout
    md = (run / "report" / "report.md").read_text()
    assert f"- job events (events.jsonl: hangs, restarts, the save interval re-planned): {told}" in md
    (run / "events.jsonl").unlink()
    r = dspipe("report", "runs/t", cwd=run.parent.parent)
    assert r.returncode == 0 and "events:" not in r.stdout
    assert "the save interval re-planned): no events" in (run / "report" / "report.md").read_text()
