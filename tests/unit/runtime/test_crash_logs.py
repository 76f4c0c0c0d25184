"""Logs and resume that survive kill -9 (pure parts): metrics CSV repair after torn writes, TensorBoard purge on a
restart, the resume default, --restart moving outputs aside, and `dspipe extend`'s arithmetic and refusals."""

import json
import types
from pathlib import Path

import pytest

from dspipe.errors import SpecError
from dspipe.planner.throughput import STEP_COLUMNS
from dspipe.runtime import checkpoint as ckpt
from dspipe.runtime import ckpt_tags, restart
from dspipe.runtime import metrics_log as ml
from dspipe.runtime.metrics_log import repair_rows
from tests.helpers import dspipe

COLS = ("step", "loss", "lr")


def row(step, loss=None):
    return f"{step},{loss if loss is not None else 10 - step / 10},0.001\n"


# ---- metrics CSVs ---------------------------------------------------------------------------------------------


def test_torn_last_line_and_rows_after_the_resumed_step_are_dropped(tmp_path):
    m = tmp_path / "metrics.csv"
    m.write_text("step,loss,lr\n" + "".join(row(s) for s in range(1, 6)) + "4")  # killed while writing step 45
    assert ml.repair_rows(m, upto=4, columns=COLS) == 4
    assert m.read_text() == "step,loss,lr\n" + "".join(row(s) for s in range(1, 5))


def test_rows_a_resume_replays_are_kept_in_the_rewound_file(tmp_path):
    m, rewound = tmp_path / "metrics.csv", tmp_path / "metrics.rewound.csv"
    m.write_text("step,loss,lr\n" + "".join(row(s) for s in range(1, 7)) + "7,9")  # killed after step 6
    assert ml.repair_rows(m, upto=4, columns=COLS, rewound=rewound) == 4
    assert rewound.read_text() == "step,loss,lr\n" + row(5) + row(6)  # as first written; the torn line left out
    m.write_text(m.read_text() + row(5, 1.0) + row(6, 1.0))  # the replay, then another crash
    ml.repair_rows(m, upto=4, columns=COLS, rewound=rewound)
    assert rewound.read_text() == "step,loss,lr\n" + row(5) + row(6) + row(5, 1.0) + row(6, 1.0)  # appended
    ml.repair_rows(m, upto=4, columns=COLS, rewound=tmp_path / "none.csv")
    assert not (tmp_path / "none.csv").exists()  # nothing after the resumed step: no file


def test_torn_line_followed_by_appended_rows_is_not_glued_into_a_row(tmp_path):
    """The old runner appended after a torn line: '5,9.5,0.0' + '4,...' became one line of 5 fields."""
    m = tmp_path / "metrics.csv"
    m.write_text("step,loss,lr\n" + row(1) + row(2) + "3,9.7" + row(3) + row(4))
    assert ml.repair_rows(m, upto=10, columns=COLS) == 3
    assert [line.split(",")[0] for line in m.read_text().splitlines()] == ["step", "1", "2", "4"]


def test_duplicated_rows_keep_one_per_step_the_last_written(tmp_path):
    m = tmp_path / "metrics.csv"
    m.write_text("step,loss,lr\n" + row(1) + row(2, 5.0) + row(3) + row(2, 6.0) + row(3, 7.0))
    ml.repair_rows(m, upto=3, columns=COLS)
    assert m.read_text() == "step,loss,lr\n" + row(1) + row(2, 6.0) + row(3, 7.0)


@pytest.mark.parametrize("content", [None, "", "step,lo", "1,9.9,0.001\n2,9.8,0.001\n"])
def test_missing_or_torn_header_is_written(tmp_path, content):
    """Killed before the header reached the disk (an empty or cut file), the file deleted, or rows without a
    header: the header comes back, rows of the right shape are kept."""
    m = tmp_path / "metrics.csv"
    if content is not None:
        m.write_text(content)
    kept = ml.repair_rows(m, upto=5, columns=COLS)
    lines = m.read_text().splitlines()
    assert lines[0] == "step,loss,lr"
    assert kept == len(lines) - 1 == (2 if content and content.startswith("1,") else 0)


def test_an_older_header_is_mapped_by_column_name(tmp_path):
    m = tmp_path / "metrics.csv"
    m.write_text("loss,step\n9.9,1\n9.8,2\n")
    ml.repair_rows(m, upto=2, columns=COLS)
    assert m.read_text() == "step,loss,lr\n1,9.9,\n2,9.8,\n"


def test_a_file_without_a_step_column_is_refused_not_rewritten(tmp_path):
    m = tmp_path / "metrics.csv"
    m.write_text("when,loss\nx,1\n")
    with pytest.raises(SpecError, match="no 'step' column"):
        ml.repair_rows(m, upto=3, columns=COLS)
    assert m.read_text() == "when,loss\nx,1\n"


def test_own_header_mode_leaves_headerless_files_alone(tmp_path):
    f = tmp_path / "Train_loss.csv"
    f.write_text("1,9.9\n")
    assert ml.repair_rows(f, upto=0) is None and f.read_text() == "1,9.9\n"
    assert ml.repair_rows(tmp_path / "absent.csv", upto=3) is None and not (tmp_path / "absent.csv").exists()


def test_csv_writer_has_its_header_on_disk_before_any_row_and_writes_whole_lines(tmp_path):
    m = tmp_path / "metrics.csv"
    m.write_text("step,loss,lr\n" + row(1) + row(2) + row(3))  # a killed run without a checkpoint
    log = ml._Csv(m, COLS, resumed_at=0)  # a fresh start: its rows are replayed
    assert m.read_text() == "step,loss,lr\n"  # before any write
    log.write({"step": 1, "loss": 9.5, "lr": None})
    assert m.read_text() == "step,loss,lr\n1,9.5,\n"
    log.close()
    log = ml._Csv(m, COLS, resumed_at=1)
    log.write({"step": 2, "loss": 9.25, "lr": 0.5})
    log.close()
    assert m.read_text() == "step,loss,lr\n1,9.5,\n2,9.25,0.5\n"


def test_repair_rows_keeps_the_rows_up_to_the_step(tmp_path):
    m = tmp_path / "metrics.csv"
    m.write_text("step,loss\n1,9.0\n2,8.0\n3,7.0\n4,6.")
    repair_rows(m, upto=2)
    assert m.read_text() == "step,loss\n1,9.0\n2,8.0\n"


def test_report_reads_a_repaired_file(tmp_path):
    """After the repair, `dspipe report`'s reader sees one row per step."""
    from dspipe.tools.report import read_csv

    m = tmp_path / "metrics.csv"
    full = {c: "1" for c in STEP_COLUMNS}
    lines = [",".join(STEP_COLUMNS)] + [
        ",".join(str(s) if c == "step" else full[c] for c in STEP_COLUMNS) for s in (1, 2, 3, 2, 3)
    ]
    m.write_text("\n".join(lines) + "\n3,1,")
    ml.repair_rows(m, upto=3, columns=STEP_COLUMNS)
    assert [r["step"] for r in read_csv(m, columns=STEP_COLUMNS, required=("step", "loss"))] == [1, 2, 3]


# ---- TensorBoard and DeepSpeed's csv monitor -----------------------------------------------------------------


def test_purge_event_makes_tensorboard_drop_the_replayed_steps(tmp_path):
    """Steps 1-5 written, killed, resumed at 3: the new writer's purge event at 4 leaves one value per step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    first = SummaryWriter(log_dir=str(tmp_path))
    for s in range(1, 6):
        first.add_scalar("Train/loss", 10.0 + s, s)
    first.close()
    monitor = types.SimpleNamespace(
        enabled=True,
        csv_monitor=None,
        tb_monitor=types.SimpleNamespace(summary_writer=SummaryWriter(log_dir=str(tmp_path))),
    )
    ml.prepare_monitor(monitor, resumed_at=3)
    second = monitor.tb_monitor.summary_writer
    for s in range(4, 7):
        second.add_scalar("Train/loss", 20.0 + s, s)
    second.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("Train/loss")] == [
        (1, 11.0),
        (2, 12.0),
        (3, 13.0),
        (4, 24.0),
        (5, 25.0),
        (6, 26.0),
    ]


def test_without_the_purge_tensorboard_shows_replayed_steps_twice(tmp_path):
    """The failure the purge fixes (so the test above can fail)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    for start, stop in ((1, 6), (4, 7)):
        w = SummaryWriter(log_dir=str(tmp_path))
        for s in range(start, stop):
            w.add_scalar("Train/loss", float(s), s)
        w.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [e.step for e in acc.Scalars("Train/loss")] == [1, 2, 3, 4, 5, 4, 5, 6]


def test_csv_monitor_files_are_trimmed_and_get_no_second_header(tmp_path):
    (tmp_path / "Train_loss.csv").write_text("step,loss\n1,9\n2,8\n3,7\n4,6\n5,")
    (tmp_path / "Train_Samples_lr.csv").write_text("step,lr\n16,0.1\n32,0.2\n")  # keyed by samples: left alone
    cm = types.SimpleNamespace(log_dir=str(tmp_path), filenames=[])
    ml.prepare_monitor(types.SimpleNamespace(enabled=True, tb_monitor=None, csv_monitor=cm), resumed_at=2)
    assert (tmp_path / "Train_loss.csv").read_text() == "step,loss\n1,9\n2,8\n"
    assert (tmp_path / "Train_Samples_lr.csv").read_text() == "step,lr\n16,0.1\n32,0.2\n"
    assert cm.filenames == ["Train_loss"]


def test_runlog_switches_off_deepspeeds_sample_keyed_events(tmp_path):
    monitor = types.SimpleNamespace(enabled=True, tb_monitor=None, csv_monitor=None)
    ml.RunLog(tmp_path, monitor=monitor, enabled=False, resumed_at=0, log_interval=1, steps=3, validating=False)
    assert monitor.enabled is False


# ---- resume default and --restart ------------------------------------------------------------------------------


def _run(tmp_path, with_ckpt=True):
    d = tmp_path / "run"
    (d / "checkpoints").mkdir(parents=True)
    if with_ckpt:
        c = d / "checkpoints" / "global_step3"
        c.mkdir()
        (c / ckpt_tags.META_FILE).write_text(json.dumps({"step": 3}))
    return types.SimpleNamespace(path=d, checkpoint_dir=d / "checkpoints")


def test_resume_point_defaults_to_auto(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt, "check_compatible", lambda meta, run, path: None)
    monkeypatch.setattr(ckpt, "read_meta", lambda path: {})
    monkeypatch.setattr(ckpt, "check_checkpoint", lambda path, meta: None)  # no files in these stand-ins
    assert ckpt.resume_point(_run(tmp_path)).name == "global_step3"  # no refusal over existing checkpoints
    assert ckpt.resume_point(_run(tmp_path / "b", with_ckpt=False)) is None  # none: a fresh start


def test_restart_moves_every_output_and_deletes_nothing(tmp_path):
    run = _run(tmp_path)
    d = run.path
    for name, text in (("metrics.csv", "step\n1\n"), ("val_metrics.csv", "step\n"), ("engine.json", "{}")):
        (d / name).write_text(text)
    (d / "monitor" / "tensorboard").mkdir(parents=True)
    (d / "dspipe.json").write_text("{}")
    (d / "report").mkdir()
    slot, moved = restart.move_to_previous(d, now="20261123T093012Z")
    assert slot == d / "previous" / "20261123T093012Z"
    assert moved == ["checkpoints", "metrics.csv", "val_metrics.csv", "engine.json", "monitor"]
    assert sorted(p.name for p in slot.iterdir()) == sorted(moved)
    assert (slot / "checkpoints" / "global_step3" / ckpt_tags.META_FILE).is_file()
    assert (slot / "metrics.csv").read_text() == "step\n1\n"
    assert sorted(p.name for p in d.iterdir()) == ["dspipe.json", "previous", "report"]
    (d / "metrics.csv").write_text("x")  # a second restart in the same second gets its own directory
    slot2, moved2 = restart.move_to_previous(d, now="20261123T093012Z")
    assert slot2.name == "20261123T093012Z-2" and moved2 == ["metrics.csv"]
    assert restart.move_to_previous(d, now="20261123T093013Z") == (None, [])


def test_restart_and_resume_together_are_one_line_error(capsys):
    from dspipe.runtime.entry import main

    assert main(["--run", "runs/none", "--restart", "--resume", "auto"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "dspipe: error: --restart (start over from step 0) and --resume auto (continue a checkpoint) "
        "contradict each other: pass one of them"
    ]


# ---- dspipe extend ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """One 6-step run directory written by gen-config (tests copy it)."""
    base = tmp_path_factory.mktemp("gen")
    out = base / "run"
    r = dspipe(
        "gen-config",
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
        6,
        "--warmup",
        "2",
        "--data",
        base / "nodata",
        "--out",
        out,
        "--precision",
        "fp32",
        "--zero",
        "1",
        "--pp",
        "1",
    )
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture
def gen(tmp_path, generated):
    import shutil

    return lambda: Path(shutil.copytree(generated, tmp_path / "run"))


def test_extend_changes_only_the_step_count_and_the_schedule(gen, tmp_path):
    from dspipe.cli.extend import changed_keys, steps_for

    assert steps_for(steps=None, tokens="20000", tokens_per_step=1024) == 20  # rounded up to whole steps
    assert steps_for(steps=None, tokens="20.48K", tokens_per_step=1024) == 20  # exactly 20 x 1024: not 21
    assert steps_for(steps=None, tokens="1e30", tokens_per_step=512) == 1953125 * 10**21  # exact, not a float's
    assert steps_for(steps=12, tokens=None, tokens_per_step=1024) == 12
    with pytest.raises(SpecError, match="exactly one"):
        steps_for(steps=12, tokens="5", tokens_per_step=1024)
    run = gen()
    (run / "metrics.csv").write_text("step\n1\n")
    spec_before, ds_before = (json.loads((run / f).read_text()) for f in ("dspipe.json", "ds_config.json"))
    r = dspipe("extend", run, "--steps", 10)
    assert r.returncode == 0, r.stderr
    assert "6 -> 10 steps" in r.stdout and "total_num_steps 6 -> 10" in r.stdout and "stretched" in r.stdout
    spec_after, ds_after = (json.loads((run / f).read_text()) for f in ("dspipe.json", "ds_config.json"))
    assert changed_keys(ds_before, ds_after) == {"scheduler.params.total_num_steps": (6, 10)}
    assert changed_keys(spec_before, spec_after) == {"train.steps": (6, 10)}
    assert (run / "metrics.csv").read_text() == "step\n1\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (("--steps", "6"), "--steps 6 must be more than the run's 6 steps (6,144 tokens)"),
        (("--steps", "3"), "--steps 3 must be more than the run's 6 steps"),
        (("--tokens", "4K"), "--tokens 4K (4 steps x 1,024 tokens) must be more than the run's 6 steps"),
        ((), "give exactly one of --steps N and --tokens T"),
        (("--steps", "9", "--tokens", "20K"), "give exactly one of --steps N and --tokens T"),
        (("--steps", "-5"), "must be more than the run's 6 steps"),
        (("--tokens", "lots"), "--tokens 'lots' does not parse as a token count"),
        (("--tokens", "inf"), "does not parse as a token count"),
    ],
)
def test_extend_refusals_change_nothing(gen, tmp_path, args, message):
    run = gen()
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    r = dspipe("extend", run, *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert [line for line in r.stderr.splitlines() if line.startswith("dspipe:")] == [
        line for line in r.stderr.splitlines() if message in line
    ]
    assert message in r.stderr
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_extend_refuses_a_hand_edited_schedule(gen, tmp_path):
    run = gen()
    ds = json.loads((run / "ds_config.json").read_text())
    ds["scheduler"]["params"]["total_num_steps"] = 7
    (run / "ds_config.json").write_text(json.dumps(ds, indent=2) + "\n")
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    r = dspipe("extend", run, "--steps", 10)
    assert r.returncode == 2 and "scheduler.params.total_num_steps is 7, not the 6" in r.stderr
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_extend_interrupted_between_the_two_files_completes_on_a_rerun(gen, tmp_path):
    run = gen()
    ds = json.loads((run / "ds_config.json").read_text())
    ds["scheduler"]["params"]["total_num_steps"] = 10  # ds_config.json written, dspipe.json not yet
    (run / "ds_config.json").write_text(json.dumps(ds, indent=2) + "\n")
    r = dspipe("extend", run, "--steps", 10)
    assert r.returncode == 0, r.stderr
    assert json.loads((run / "dspipe.json").read_text())["train"]["steps"] == 10
    assert json.loads((run / "ds_config.json").read_text())["scheduler"]["params"]["total_num_steps"] == 10


def test_extend_of_a_missing_run_is_one_line(tmp_path):
    r = dspipe("extend", tmp_path / "nope", "--steps", 10)
    assert r.returncode == 2 and "is not a run directory" in r.stderr and "Traceback" not in r.stderr
