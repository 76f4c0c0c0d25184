"""Every file dspipe reads, damaged one way at a time, through the real commands that read it (report, slurm-script,
launch --dry-run, export-hf, generate, gen-config --data/--hostfile, plan --hostfile) and through the readers the
runner uses (load_run, read_meta, checkpoint.read_meta, resume_point). Each damage is exit 2 with one
`dspipe: error:` line naming the damaged file, no traceback, and nothing on disk changed or created."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest

from dspipe.errors import SpecError
from tests.helpers import make_run, run_cli

GEN = [
    "--model",
    "tiny",
    "--gpu",
    "cpu",
    "--gpus-per-node",
    "2",
    "--global-batch",
    "16",
    "--micro-batch",
    "4",
    "--steps",
    "20",
    "--warmup",
    "2",
]
METRICS = "step,tokens,loss,lr,tokens_per_s\n1,1024,8.0,0.001,500.0\n2,2048,7.5,0.002,510.0\n"


@pytest.fixture(scope="module")
def template(tmp_path_factory, corpus):
    """root/run (a gen-config run with metrics and one checkpoint's metadata), root/data (a copy of the corpus),
    root/hosts, root/hf (an exported-model directory's config.json)."""
    root = tmp_path_factory.mktemp("read")
    shutil.copytree(corpus, root / "data")
    run_dir = make_run(root, root / "data", "--zero", "1", "--eval-interval", "0", name="run")
    from dspipe.rundir import load_run

    run = load_run(run_dir)
    (run_dir / "metrics.csv").write_text(METRICS)
    (run_dir / "val_metrics.csv").write_text("step,tokens,val_loss,val_ppl\n2,2048,7.6,2000.0\n")
    ckpt = run_dir / "checkpoints" / "global_step2"
    ckpt.mkdir(parents=True)
    meta = {
        "step": 2,
        "consumed_samples": 32,
        "data": {
            "consumed_samples": 32,
            "epoch": 0,
            "seed": run.train.seed,
            "num_samples": 100,
            "seq_len": run.model.seq_len,
            "split": "train",
            "fingerprint": "ab" * 32,
        },
        "model": asdict(run.model),
        "pp": 1,
        "zero_stage": 1,
        "dp": 2,
        "world_size": 2,
        "run_spec": json.loads((run_dir / "dspipe.json").read_text()),
    }
    (ckpt / "dspipe.json").write_text(json.dumps(meta, indent=2))
    (run_dir / "checkpoints" / "latest").write_text("global_step2")
    (root / "hosts").write_text("node1 slots=2\nnode2 slots=2\n")
    (root / "hf").mkdir()
    (root / "hf" / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 64}))
    return root


@pytest.fixture
def root(template, tmp_path):
    out = tmp_path / "root"
    shutil.copytree(template, out, symlinks=True)
    run = json.loads((out / "run" / "dspipe.json").read_text())
    run["data"] = str(out / "data")  # the copy's own data directory
    (out / "run" / "dspipe.json").write_text(json.dumps(run, indent=2))
    return out


def snapshot(root: Path) -> dict:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


# ---- damage: each takes the JSON object (or None for raw bytes) and returns what to write -------------------------


def edit(path: str, change):
    def apply(root: Path) -> None:
        f = root / path
        d = json.loads(f.read_text())
        change(d)
        f.write_text(json.dumps(d, indent=2))

    return apply


def raw(path: str, data):
    def apply(root: Path) -> None:
        f = root / path
        f.write_bytes(data(f.read_bytes()) if callable(data) else data)

    return apply


def put(keys: str, value):
    """Set d[k1][k2]... = value."""

    def change(d):
        *head, last = keys.split(".")
        for k in head:
            d = d[k]
        d[last] = value

    return change


def drop(keys: str):
    def change(d):
        *head, last = keys.split(".")
        for k in head:
            d = d[k]
        del d[last]

    return change


def as_dir(path: str):
    def apply(root: Path) -> None:
        (root / path).unlink()
        (root / path).mkdir()

    return apply


def loop(path: str):
    def apply(root: Path) -> None:
        (root / path).unlink()
        os.symlink((root / path).name, root / path)

    return apply


def text_edit(path: str, old: str, new: str):
    return raw(path, lambda b: b.decode().replace(old, new, 1).encode())


SPEC = "run/dspipe.json"
DS = "run/ds_config.json"
META = "data/meta.json"
CKPT = "run/checkpoints/global_step2/dspipe.json"

RUN_CASES = [  # (id, file named in the message, damage, words the message holds)
    ("spec-truncated", SPEC, raw(SPEC, lambda b: b[: len(b) // 2]), "ends early"),
    ("spec-not-utf8", SPEC, raw(SPEC, lambda b: b"\xff\xfe" + b), "not UTF-8"),
    ("spec-list", SPEC, raw(SPEC, b"[1, 2]"), "JSON object"),
    ("spec-nan-lr", SPEC, text_edit(SPEC, '"lr": 0.003', '"lr": NaN'), "NaN"),
    ("spec-1e999", SPEC, text_edit(SPEC, '"lr": 0.003', '"lr": 1e999'), "beyond the range"),
    ("spec-no-plan", SPEC, edit(SPEC, drop("plan")), "missing key plan"),
    ("spec-version", SPEC, edit(SPEC, put("format_version", 7)), "format_version"),
    ("spec-dp", SPEC, edit(SPEC, put("plan.dp", 3)), "plan.dp 3 disagrees with its layout: world 2 = dp 2 x pp 1"),
    ("spec-world", SPEC, edit(SPEC, put("plan.world_size", 4)), "world"),
    ("spec-world-text", SPEC, edit(SPEC, put("plan.world_size", "x")), "plan.world_size must be a positive integer"),
    ("spec-tp-zero", SPEC, edit(SPEC, put("plan.tp", 0)), "plan.tp must be a positive integer, got 0"),
    (
        "spec-command-equals-form",
        SPEC,
        edit(SPEC, put("command", "deepspeed --num_gpus=4 --module dspipe.runtime.entry")),
        "command launches 1 node(s) x 4 rank(s) but cluster is 1 node(s) x 2 GPU(s)",
    ),
    ("spec-dp-text", SPEC, edit(SPEC, put("plan.dp", "x")), "plan.dp must be a positive integer, got 'x'"),
    ("spec-plan-zero", SPEC, edit(SPEC, put("plan.zero_stage", 2)), "plan.zero_stage 2 disagrees"),
    ("spec-zero-5", SPEC, edit(SPEC, put("strategy.zero", 5)), "strategy.zero 5 is not one of: 0, 1, 2, 3"),
    ("spec-zero-true", SPEC, edit(SPEC, put("strategy.zero", True)), "strategy.zero True"),
    ("spec-layers-str", SPEC, edit(SPEC, put("model.layers", "2")), "model.layers must be a positive integer"),
    ("spec-hidden-huge", SPEC, edit(SPEC, put("model.hidden", 10**30)), "allowed range"),
    ("spec-seed", SPEC, edit(SPEC, put("train.seed", -1)), "train.seed"),
    ("spec-dropout-str", SPEC, edit(SPEC, put("model.dropout", "0.1")), "model.dropout"),
    ("spec-gpu-list", SPEC, edit(SPEC, put("cluster.gpu", ["cpu"])), "cluster.gpu"),
    ("spec-unknown-key", SPEC, edit(SPEC, put("train.bogus", 1)), "unknown TrainSpec keys: bogus"),
    ("spec-missing-field", SPEC, edit(SPEC, drop("model.hidden")), "missing ModelSpec keys: hidden"),
    ("spec-data-int", SPEC, edit(SPEC, put("data", 5)), "data must be"),
    ("spec-estimate", SPEC, edit(SPEC, put("estimate", "fast")), "estimate must be an object"),
    ("spec-pp-vs-plan", SPEC, edit(SPEC, put("strategy.pp", 2)), "plan.pp 1 disagrees with strategy.pp 2"),
    ("spec-dir", SPEC, as_dir(SPEC), "run/dspipe.json is a directory, not a file: a run directory holds"),
    ("ds-loop", DS, loop(DS), "run/ds_config.json is a symlink loop"),
    ("ds-truncated", DS, raw(DS, lambda b: b[:100]), "ends early"),
    ("ds-batch", DS, edit(DS, put("train_batch_size", 32)), "train_batch_size is 32 but the plan"),
    ("ds-micro", DS, edit(DS, put("train_micro_batch_size_per_gpu", 8)), "train_micro_batch_size_per_gpu"),
    ("ds-no-ga", DS, edit(DS, drop("gradient_accumulation_steps")), "missing gradient_accumulation_steps"),
    ("ds-zero-3", DS, edit(DS, put("zero_optimization.stage", 3)), "zero_optimization.stage is 3"),
    ("ds-zero-str", DS, edit(DS, put("zero_optimization", "stage 1")), "zero_optimization must be an object"),
    ("ds-bf16-auto", DS, edit(DS, put("bf16.enabled", "auto")), "bf16.enabled is 'auto'"),
    ("ds-fp16-on", DS, edit(DS, put("fp16.enabled", True)), "fp16.enabled is True"),
    ("ds-pipeline", DS, edit(DS, put("pipeline.stages", 2)), "pipeline.stages"),
    ("ds-offload", DS, edit(DS, put("zero_optimization.offload_optimizer.device", "cpu")), "offload_optimizer"),
    ("ds-infinity", DS, text_edit(DS, '"train_batch_size": 16', '"train_batch_size": Infinity'), "Infinity"),
    ("ds-number", DS, raw(DS, b"16\n"), "JSON object"),
    ("ds-lr-negative", DS, edit(DS, put("optimizer.params.lr", -1)), "optimizer.params.lr is -1 but dspipe.json's"),
    ("ds-lr-str", DS, edit(DS, put("optimizer.params.lr", "3e-3")), "optimizer.params.lr is '3e-3'"),
    ("ds-clip", DS, edit(DS, put("gradient_clipping", -5)), "gradient_clipping is -5 but dspipe.json's train.grad"),
    ("ds-decay", DS, edit(DS, put("optimizer.params.weight_decay", 0.5)), "train.weight_decay is 0.1"),
    ("ds-total", DS, edit(DS, put("scheduler.params.total_num_steps", 7)), "total_num_steps is 7"),
    ("ds-warmup", DS, edit(DS, put("scheduler.params.warmup_num_steps", 99)), "(its --warmup sets both)"),
    ("ds-warmup-float", DS, edit(DS, put("scheduler.params.warmup_num_steps", 2.0)), "warmup_num_steps is 2.0"),
    ("ds-cos", DS, edit(DS, put("scheduler.params.cos_min_ratio", -1)), "cos_min_ratio is -1"),
    ("ds-betas", DS, edit(DS, put("optimizer.params.betas", [0.9, 1.5])), "betas must be two numbers in [0, 1)"),
    ("ds-eps", DS, edit(DS, put("optimizer.params.eps", 0)), "eps must be a number in (0, 1), got 0"),
    # a key deleted would be DeepSpeed's default, not the run's value (clipping off, Adam's lr 1e-3, no scheduler)
    ("ds-no-clip", DS, edit(DS, drop("gradient_clipping")), "missing gradient_clipping (dspipe.json's train.grad_clip"),
    ("ds-no-lr", DS, edit(DS, drop("optimizer.params.lr")), "missing optimizer.params.lr (dspipe.json's train.lr"),
    ("ds-no-warmup", DS, edit(DS, drop("scheduler.params.warmup_num_steps")), "missing scheduler.params.warmup_num"),
    ("ds-no-scheduler", DS, edit(DS, drop("scheduler")), "scheduler must be an object with params"),
    # every other key through the checks a --preset gets: types, ranges, keys DeepSpeed ignores, "auto"
    ("ds-overlap-str", DS, edit(DS, put("zero_optimization.overlap_comm", "x")), 'overlap_comm "x" must be true or'),
    ("ds-print", DS, edit(DS, put("steps_per_print", -1)), "steps_per_print -1 must be an integer >= 1"),
    ("ds-typo", DS, edit(DS, put("gradient_clippin", 1.0)), "(did you mean gradient_clipping?)"),
    ("ds-ac-unknown", DS, edit(DS, put("activation_checkpointing.zz", 1)), "activation_checkpointing.zz is not a"),
    ("ds-zero-unknown", DS, edit(DS, put("zero_optimization.zz", 1)), "zero_optimization.zz 1 is not a key of"),
    ("ds-bucket-auto", DS, edit(DS, put("zero_optimization.reduce_bucket_size", "auto")), 'size is "auto", which'),
    ("ds-removed", DS, edit(DS, put("curriculum_learning", {})), "was removed from DeepSpeed 0.19"),
    # gen-config writes every key: none may be missing, and those the plan alone derives must be its values
    ("ds-no-betas", DS, edit(DS, drop("optimizer.params.betas")), "missing optimizer.params.betas"),
    ("ds-no-bucket", DS, edit(DS, drop("zero_optimization.reduce_bucket_size")), "missing zero_optimization.reduce"),
    ("ds-no-warmup-type", DS, edit(DS, drop("scheduler.params.warmup_type")), "missing scheduler.params.warmup_type"),
    ("ds-no-aio-key", DS, edit(DS, drop("aio.queue_depth")), "missing aio.queue_depth"),  # a run before aio: whole
    ("ds-sp", DS, edit(DS, put("sequence_parallel_size", 2)), "sequence_parallel_size is 2 but the plan"),
    ("ds-accum", DS, edit(DS, put("data_types.grad_accum_dtype", "bf16")), "grad_accum_dtype is 'bf16' but the plan"),
    ("ds-offload-null", DS, edit(DS, put("zero_optimization.offload_optimizer.device", None)), "device is None but"),
    ("ds-planned", DS, edit(DS, put("pipeline.seed_layers", True)), "seed_layers is True, but dspipe renders False"),
    # an option's value the plan holds (a flag's or a preset's): the file must carry it, in its type
    ("ds-bucket-huge", DS, edit(DS, put("zero_optimization.reduce_bucket_size", 10**30)), "reduce_bucket_size is 1"),
    ("ds-bucket-float", DS, edit(DS, put("zero_optimization.reduce_bucket_size", 1048576.0)), "is 1048576.0, but"),
    ("ds-live", DS, edit(DS, put("zero_optimization.stage3_max_live_parameters", 7)), "max_live_parameters is 7, but"),
    ("ds-scheduler-obj", DS, edit(DS, put("scheduler.type", {"a": 1})), "scheduler.type"),
    # the estimate's figures report and calibrate read
    ("spec-ckpt-bytes", SPEC, edit(SPEC, put("estimate.checkpoint.bytes", "x")), "checkpoint.bytes must be a number"),
    ("spec-mfu", SPEC, edit(SPEC, put("estimate.mfu", 1e30)), "estimate.mfu must be a number in 0..1, got 1e+30"),
    ("spec-first-step", SPEC, edit(SPEC, put("estimate.first_step.seconds", "x")), "first_step.seconds must be a"),
    ("spec-startup-mode", SPEC, edit(SPEC, put("estimate.startup.mode", 3)), "estimate.startup.mode must be text"),
]

RUN_COMMANDS = [
    ["report", "@/run"],
    ["slurm-script", "@/run"],
    ["launch", "@/run", "--dry-run"],
    ["export-hf", "@/run", "--out", "@/out"],
    ["generate", "@/run", "--prompt", "x"],
]


def check(root: Path, capsys, command: list, named: str, words: str) -> None:
    args = [str(root) + a[1:] if isinstance(a, str) and a.startswith("@/") else a for a in command]
    code = run_cli(*args)
    err = capsys.readouterr().err
    assert code == 2, (command, err)
    assert err.startswith("dspipe: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert Path(named).name in err and words in err, (named, words, err)


@pytest.mark.parametrize("case", RUN_CASES, ids=[c[0] for c in RUN_CASES])
def test_a_damaged_run_directory_is_one_line_in_every_command(case, root, capsys):
    from dspipe.rundir import load_run

    _, named, damage, words = case
    damage(root)
    before = snapshot(root)
    for command in RUN_COMMANDS:
        check(root, capsys, command, named, words)
    with pytest.raises(SpecError, match=Path(named).name):  # the runner's reader
        load_run(root / "run")
    assert snapshot(root) == before


def test_an_empty_run_path_or_one_inside_a_run_is_named(root, capsys):
    for command in (["extend", "", "--steps", "9"], ["launch", "", "--dry-run"], ["slurm-script", ""], ["report", ""]):
        assert run_cli(*command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "'' is empty" in err, (command, err)  # not '.', this directory
    for command in (["extend", "@/run/checkpoints", "--steps", "9"], ["launch", "@/run/checkpoints", "--dry-run"]):
        check(root, capsys, command, "checkpoints", f"is inside the run directory {root / 'run'}: pass {root / 'run'}")


def test_a_field_the_run_lacks_takes_its_default_with_a_note(root, capsys):
    """A run directory from before a field existed reads with the field's default; the note names it and the value
    (a deleted key too: nothing is filled in silently)."""
    edit(SPEC, drop("train.seed"))(root)
    edit(SPEC, drop("model.rope_theta"))(root)
    assert run_cli("launch", str(root / "run"), "--dry-run") == 0
    err = capsys.readouterr().err
    assert "dspipe.json lacks model.rope_theta 10000.0 (default used: a run written before the field existed" in err
    assert "dspipe.json lacks train.seed 1234 (default used" in err


def test_a_missing_init_from_directory_is_refused_before_any_rank_starts(root, capsys):
    edit(SPEC, put("train.init_from", str(root / "gone")))(root)
    check(root, capsys, ["launch", "@/run", "--dry-run"], "gone", "gone/config.json does not exist; the ranks read")


@pytest.mark.parametrize(
    "data,damage,words",
    [
        ("gone", None, "data @/gone: does not exist (no meta.json, no Megatron .idx/.bin); the ranks read it"),
        ("empty", "mkdir", "data @/empty: is not prepared data (no meta.json"),
        ("loop", "loop", "data @/loop: is a symlink loop (no meta.json"),
        ("data:0.5,gone:0.5", None, "data @/gone: does not exist"),
        ("data", "meta", "meta.json"),
    ],
)
def test_launch_checks_the_runs_data_before_any_rank_starts(root, capsys, data, damage, words):
    """gen-config only notes unprepared data; the ranks would each refuse it after their start-up."""
    value = ",".join(f"{root}/{part}" for part in data.split(","))
    edit(SPEC, put("data", value))(root)
    if damage == "mkdir":
        (root / "empty").mkdir()
    elif damage == "loop":
        (root / "loop").symlink_to(root / "loop")
    elif damage == "meta":
        (root / "data" / "meta.json").write_text("{")
    named = "meta.json" if damage == "meta" else data.split(",")[-1].split(":")[0]
    check(root, capsys, ["launch", "@/run", "--dry-run"], named, words.replace("@", str(root)))


def test_the_launchers_equals_form_of_the_rank_count_reads_as_the_spaced_one(root):
    from dspipe.rundir import load_run

    edit(SPEC, put("command", "deepspeed --num_nodes=1 --num_gpus=2 --module dspipe.runtime.entry"))(root)
    assert load_run(root / "run").cluster.gpus_per_node == 2


def test_the_undamaged_run_reads_back(root):
    from dspipe.rundir import load_engine, load_run

    run = load_run(root / "run")
    assert run.plan.dp * run.plan.pp == run.plan.world_size == 2 and run.estimate.tokens_per_s > 0
    assert run.ds_config["train_batch_size"] == 16 and load_engine(run) is None


@pytest.mark.parametrize(
    "content,words",
    [
        (b'{"zero_stage": 1', "ends early at line 1 column 17"),
        (b"", "ends early at line 1 column 1"),
        (b"[1]", "JSON object"),
        (b'{"dp": NaN}', "NaN"),
        (b"\xff", "not UTF-8"),
    ],
)
def test_engine_json(root, capsys, content, words):
    """engine.json that is not a whole JSON object is damage, named with the parser's position (the runner writes
    it whole, once per launch)."""
    (root / "run" / "engine.json").write_bytes(content)
    check(root, capsys, ["report", "@/run"], "engine.json", words)


CSV_CASES = [
    ("unicode-step", "metrics.csv", METRICS.replace("\n2,", "\n\u0663,"), "step '\u0663' is not a whole number"),
    ("fullwidth", "metrics.csv", METRICS.replace("\n2,", "\n\uff12,"), "is not a whole number"),
    ("negative-step", "metrics.csv", METRICS.replace("\n2,", "\n-2,"), "is not a whole number"),
    ("float-tokens", "metrics.csv", METRICS.replace("2048", "2e3"), "tokens '2e3'"),
    ("nan-lr", "metrics.csv", METRICS.replace("0.002", "nan"), "lr 'nan' must be a finite number >= 0"),
    ("inf-tps", "metrics.csv", METRICS.replace("510.0", "inf"), "tokens_per_s 'inf'"),
    ("huge-int", "metrics.csv", METRICS.replace("2048", "9" * 5000), "is not a whole number"),
    ("extra-fields", "metrics.csv", METRICS.replace("8.0,", "8.0,1,2,3,"), "fields, the header has 5"),
    ("not-utf8", "metrics.csv", METRICS.encode() + b"\xff\xfe\n", "not a readable CSV"),
    ("nul", "metrics.csv", METRICS.replace("8.0", "8\x000"), "metrics.csv"),
    ("val-text", "val_metrics.csv", "step,tokens,val_loss,val_ppl\n2,2048,low,1\n", "val_loss 'low' is not a number"),
    ("val-no-loss", "val_metrics.csv", "step,tokens\n2,2048\n", "no column val_loss"),
    ("huge-loss", "metrics.csv", METRICS.replace("7.5", "1e308"), "loss '1e308' must be in 0..3.403e+38"),
    ("negative-loss", "metrics.csv", METRICS.replace("7.5", "-1"), "loss '-1' must be in 0..3.403e+38 (the runner"),
    ("huge-lr", "metrics.csv", METRICS.replace("0.002", "1e308"), "lr '1e308' must be in 0..3.403e+38"),
    ("val-negative", "val_metrics.csv", "step,tokens,val_loss,val_ppl\n2,2048,-1,1\n", "val_loss '-1' must be in"),
]


@pytest.mark.parametrize("case", CSV_CASES, ids=[c[0] for c in CSV_CASES])
def test_a_damaged_metrics_csv_is_one_line(case, root, capsys):
    _, name, content, words = case
    (root / "run" / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    before = snapshot(root)
    check(root, capsys, ["report", "@/run"], name, words)
    assert snapshot(root) == before


def test_non_finite_loss_is_a_measurement_not_damage(root):
    (root / "run" / "metrics.csv").write_text(METRICS.replace("7.5", "nan"))
    assert run_cli("report", root / "run") == 0


META_CASES = [
    ("truncated", raw(META, lambda b: b[:50]), "is not valid JSON"),
    ("list", raw(META, b"[]"), "JSON object"),
    ("format", edit(META, put("format", "other")), "was not prepared by this dspipe"),
    ("version-true", edit(META, put("format_version", True)), "version True, want 'dspipe-tokens' 1"),
    ("vocab-str", edit(META, put("vocab_size", "1024")), "vocab_size must be an integer"),
    ("vocab-huge", edit(META, put("vocab_size", 2**40)), "vocab_size must be an integer in 1..4294967296"),
    ("eos", edit(META, put("eos_id", 5000)), "eos_id must be an integer in 0..1023"),
    ("dtype", edit(META, put("dtype", "uint32")), "dtype 'uint32' does not hold vocab_size 1024"),
    (
        "shard-path",
        edit(META, put("splits.train.shards", [{"name": "../../etc/passwd", "num_tokens": 1, "num_documents": 1}])),
        "shards[0].name must be",
    ),
    ("no-train", edit(META, drop("splits.train")), "splits must be an object with 'train'"),
    ("sum", edit(META, put("num_tokens", 5)), "the sum over the splits"),
    ("val-fraction", text_edit(META, '"val_fraction": 0.01', '"val_fraction": NaN'), "NaN"),
    ("fingerprint", edit(META, put("fingerprint", "zz")), "fingerprint must be a hex digest"),
    ("missing", edit(META, drop("eos_id")), "missing key eos_id"),
]


@pytest.mark.parametrize("case", META_CASES, ids=[c[0] for c in META_CASES])
def test_a_damaged_meta_json_is_one_line(case, root, capsys):
    from dspipe.data import read_meta

    _, damage, words = case
    damage(root)
    before = snapshot(root)
    for extra in ([], ["--pad-vocab"]):
        check(root, capsys, ["gen-config", *GEN, "--data", "@/data", "--out", "@/out", *extra], "meta.json", words)
    with pytest.raises(SpecError, match="meta.json|not prepared by this dspipe"):  # the loader's reader
        read_meta(root / "data")
    assert snapshot(root) == before


CKPT_CASES = [
    ("truncated", raw(CKPT, lambda b: b[:40]), "ends early"),
    ("no-step", edit(CKPT, drop("step")), "missing key step"),
    ("step-str", edit(CKPT, put("step", "2")), "step must be an integer >= 0"),
    ("dp-pp", edit(CKPT, put("dp", 3)), "dp 3 x pp 1 x tp 1 x sp 1 = 3 != world_size 2"),
    ("zero-7", edit(CKPT, put("zero_stage", 7)), "zero_stage 7 is not one of"),
    ("layers-0", edit(CKPT, put("model.layers", 0)), "model.layers must be a positive integer"),
    ("data-list", edit(CKPT, put("data", [])), "data must be an object"),
    ("data-seed", edit(CKPT, drop("data.seed")), "missing data.seed"),
    ("nan", text_edit(CKPT, '"step": 2', '"step": NaN'), "NaN"),
    ("position", edit(CKPT, put("consumed_samples", 48)), "data.consumed_samples 32 != consumed_samples 48"),
    # the same weight shapes, split into 8 heads where 4 were trained: not its run's model
    ("heads-edited", edit(CKPT, put("model.heads", 8)), "heads 8 -> 4"),
]


@pytest.mark.parametrize("case", CKPT_CASES, ids=[c[0] for c in CKPT_CASES])
def test_a_damaged_checkpoint_meta_is_one_line(case, root, capsys):
    from dspipe.rundir import load_run
    from dspipe.runtime import checkpoint as ckpt

    _, damage, words = case
    damage(root)
    before = snapshot(root)
    tag = "@/run/checkpoints/global_step2"
    for command in (
        ["export-hf", tag, "--out", "@/out"],
        ["generate", tag, "--prompt", "x"],
        ["export-hf", "@/run", "--out", "@/out"],
    ):
        check(root, capsys, command, "global_step2", words)
    with pytest.raises(SpecError, match=words.split("(")[0][:20]):  # the runner's resume check
        ckpt.resume_point(load_run(root / "run"), "auto")
    assert snapshot(root) == before


@pytest.mark.parametrize(
    "content,words",
    [
        (b"../../etc", "not a checkpoint tag"),
        (b"\xff\xfe", "not UTF-8"),
        (b"global_step2\x00", "not a checkpoint tag"),
        (b"global_step\xd9\xa3", "not a checkpoint tag"),
    ],
)
def test_a_damaged_latest_is_one_line(root, capsys, content, words):
    from dspipe.runtime import ckpt_tags

    (root / "run" / "checkpoints" / "latest").write_bytes(content)
    before = snapshot(root)
    check(root, capsys, ["export-hf", "@/run", "--out", "@/out"], "latest", words)
    with pytest.raises(SpecError, match="latest"):
        ckpt_tags.find_checkpoint(root / "run" / "checkpoints", "auto")
    assert snapshot(root) == before


HOSTS = [
    ("arabic-digit", "node1 slots=\u0663\n".encode(), "character '\u0663' (U+0663) at column 13"),
    ("fullwidth", "node1 slots=\uff18\n".encode(), "(U+FF18)"),
    ("superscript", "node1 slots=\u00b2\n".encode(), "(U+00B2)"),
    ("huge", b"node1 slots=99999\n", "allowed range 1..1024"),
    ("digits-5000", b"node1 slots=" + b"9" * 5000 + b"\n", "allowed range 1..1024"),
    ("float", b"node1 slots=2.0\n", "got '2.0'"),
    ("nul", b"node1 slots=2\x00\n", "NUL byte at offset 13"),
    ("latin1", b"n\xe9ud slots=2\n", "not UTF-8 text (byte 0xe9 at offset 1)"),
    ("line-separator", "node1 slots=2\u2028node2 slots=2\n".encode(), "U+2028"),
    ("nbsp", "node1\u00a0slots=2\n".encode(), "U+00A0"),
    ("form-feed", b"node1 slots=2\x0c\n", "U+000C"),
]


@pytest.mark.parametrize("case", HOSTS, ids=[c[0] for c in HOSTS])
def test_a_damaged_hostfile_is_one_line(case, root, capsys):
    from dspipe.cluster.hostfile import read_hostfile

    _, content, words = case
    (root / "hosts").write_bytes(content)
    before = snapshot(root)
    for command in (
        ["gen-config", "--model", "tiny", "--gpu", "cpu", "--hostfile", "@/hosts", "--out", "@/out"],
        ["plan", "--model", "tiny", "--gpu", "cpu", "--hostfile", "@/hosts"],
        ["launch", "@/run", "--dry-run", "--hostfile", "@/hosts"],
    ):
        check(root, capsys, command, "hosts", words)
    with pytest.raises(SpecError, match="hosts"):
        read_hostfile(root / "hosts")
    assert snapshot(root) == before


def test_include_slots_take_ascii_digits_only(root):
    from dspipe.cluster.hostfile import read_hostfile, select

    hostfile = read_hostfile(root / "hosts")
    assert select(hostfile, include="node1:1") == {"node1": [1]}
    for spec in ("node1:\u00b2", "node1:\u0661", "node1:" + "9" * 5000):
        with pytest.raises(SpecError, match="has slots 0..1"):
            select(hostfile, include=spec)


def full(model_type: str, **changes) -> bytes:
    """A tiny model's whole config.json as transformers writes it (vocabulary 300, context 64), with `changes`."""
    from transformers import GPT2Config, LlamaConfig

    shape = dict(vocab_size=300, num_hidden_layers=1, hidden_size=16, num_attention_heads=2)
    config = (
        GPT2Config(n_positions=64, **shape)
        if model_type == "gpt2"
        else LlamaConfig(max_position_embeddings=64, intermediate_size=32, **shape)
    )
    ids = dict(bos_token_id=0, eos_token_id=0, pad_token_id=None)  # GPT-2's 50256 is past this vocabulary
    return json.dumps({**config.to_dict(), **ids, **changes}).encode()


HF_CASES = [
    ("not-json", b"{model_type: gpt2", "not valid JSON"),
    ("list", b"[]", "JSON object"),
    ("no-type", b'{"n_positions": 64}', "model_type must name"),
    ("positions-str", b'{"model_type": "gpt2", "n_positions": "64"}', "n_positions must be a context length"),
    ("positions-nan", b'{"model_type": "gpt2", "n_positions": NaN}', "NaN"),
    ("positions-huge", b'{"model_type": "gpt2", "n_positions": 1e400}', "beyond the range"),
    ("layers-negative", b'{"model_type": "gpt2", "n_positions": 64, "n_layer": -1}', "n_layer must be an integer in"),
    (
        "layers-huge",
        b'{"model_type": "llama", "max_position_embeddings": 64, "num_hidden_layers": 1000000000000000000000000000000}',
        "num_hidden_layers must be an integer in 1..4,096, got 1000000000000000000000000000000",
    ),
    ("layers-null", b'{"model_type": "gpt2", "n_positions": 64, "n_layer": null}', "n_layer must be an integer"),
    ("layers-str", b'{"model_type": "gpt2", "n_positions": 64, "n_layer": "x"}', "n_layer must be an integer"),
    ("archs-str", b'{"model_type": "gpt2", "n_positions": 64, "architectures": "x"}', "architectures must be a list"),
    ("eos-huge", b'{"model_type": "gpt2", "n_positions": 64, "vocab_size": 50, "eos_token_id": 50}', "0..49, got 50"),
    ("bos-negative", full("gpt2", bos_token_id=-1), "bos_token_id must be a token id in 0..299, got -1"),
    ("pad-str", full("gpt2", pad_token_id="x"), "pad_token_id must be a token id"),
    ("dropout", full("gpt2", attn_pdrop=-1), "attn_pdrop must be a probability in [0, 1), got -1"),
    ("tp", full("llama", pretraining_tp=0), "pretraining_tp must be an integer in 1..131,072, got 0"),
    ("eps-huge", full("llama", rms_norm_eps=1e30), "model.norm_eps must be in (0, 1), got 1e+30"),  # --init-from's
    ("rope-type", full("llama", rope_parameters={"rope_type": "x"}), "rope_type x is not supported"),
    (  # transformers' own field checks, named for config.json (not for the tokenizer that reads it too)
        "cache-str",
        full("gpt2", use_cache="x"),
        "config.json: transformers cannot read it: Validation error for field 'use_cache'",
    ),
]


@pytest.mark.parametrize("case", HF_CASES, ids=[c[0] for c in HF_CASES])
def test_a_damaged_exported_model_is_one_line(case, root, capsys):
    _, content, words = case
    (root / "hf" / "config.json").write_bytes(content)
    before = snapshot(root)
    check(root, capsys, ["generate", "@/hf", "--prompt", "x"], "config.json", words)
    assert snapshot(root) == before


@pytest.mark.parametrize(
    "setting, words",
    [
        (dict(model_max_length="x"), "tokenizer_config.json: model_max_length must be a positive number of tokens"),
        (dict(model_max_length=-1), "model_max_length must be a positive number of tokens, got -1"),
        (dict(eos_token="zzz_not_a_token"), "eos_token 'zzz_not_a_token' is id 2"),  # (2xx,) past the vocabulary
    ],
)
def test_a_damaged_exported_tokenizer_is_one_line(root, capsys, setting, words):
    """generate on an HF directory: tokenizer_config.json's model_max_length (a string there was a TypeError inside
    encode) and an eos_token outside the model's vocabulary (generation never stops), before the weights load."""
    from dspipe.data.tokenizer import train_bpe

    hf = root / "hf"
    tokenizer = train_bpe(iter(["def add(a, b):\n    return a + b\n" * 200]), vocab_size=300)
    tokenizer.save_pretrained(str(hf))
    (hf / "config.json").write_bytes(full("gpt2", vocab_size=len(tokenizer)))  # every id of it a model's
    config = json.loads((hf / "tokenizer_config.json").read_text())
    (hf / "tokenizer_config.json").write_text(json.dumps({**config, **setting}))
    before = snapshot(root)
    check(root, capsys, ["generate", "@/hf", "--prompt", "x"], "hf", words)
    assert snapshot(root) == before


@pytest.mark.parametrize(
    "content, words",
    [
        (b"garbage {not json", "generation_config.json is not valid JSON"),
        (b'{"eos_token_id": "x"}', "generation_config.json: eos_token_id must be a token id in 0..299, got 'x'"),
        (b'{"bos_token_id": 300}', "bos_token_id must be a token id in 0..299, got 300"),
        (b'{"top_k": -1}', "generation_config.json: top_k must be an integer >= 0, got -1"),
        (b'{"temperature": "x"}', "temperature must be a number >= 0, got 'x'"),
        (b'{"do_sample": "x"}', "do_sample must be true or false, got 'x'"),
    ],
)
def test_a_damaged_generation_config_is_one_line(root, capsys, content, words):
    (root / "hf" / "config.json").write_bytes(full("gpt2"))
    (root / "hf" / "generation_config.json").write_bytes(content)
    before = snapshot(root)
    check(root, capsys, ["generate", "@/hf", "--prompt", "x"], "generation_config.json", words)
    assert snapshot(root) == before


def test_a_tokenizer_json_file_loads_offline_without_the_hub(tmp_path, monkeypatch, capsys):
    """--tokenizer path/to/tokenizer.json: loaded from the file (no AutoTokenizer, no hub): with the hub endpoint
    pointing at a closed port, preparation succeeds and the shards use that tokenizer's ids."""
    from dspipe.data import read_meta
    from dspipe.data.tokenizer import train_bpe

    doc = tmp_path / "doc.txt"
    doc.write_text("def add(a, b):\n    return a + b\n" * 200)
    hf = train_bpe(iter([doc.read_text()]), vocab_size=300)
    hf.backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    code = run_cli(
        "prepare-data", doc, "--tokenizer", tmp_path / "tokenizer.json", "--out", tmp_path / "out", "--workers", 1
    )
    assert code == 0, capsys.readouterr().err
    meta = read_meta(tmp_path / "out")
    assert meta["vocab_size"] == len(hf) and meta["eos_id"] == 0 and meta["tokenizer_source"].endswith(".json")
    # a changed file is a different preparation (identified by content, not by name)
    hf2 = train_bpe(iter([doc.read_text()]), vocab_size=260)
    assert len(hf2) != len(hf)
    hf2.backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert (
        run_cli(
            "prepare-data", doc, "--tokenizer", tmp_path / "tokenizer.json", "--out", tmp_path / "out", "--workers", 1
        )
        == 0
    )
    assert read_meta(tmp_path / "out")["vocab_size"] == len(hf2)


def test_a_tokenizer_file_without_eos_or_not_a_tokenizer_is_one_line(tmp_path, capsys):
    from tokenizers import Tokenizer, models

    doc = tmp_path / "doc.txt"
    doc.write_text("hello world\n")
    Tokenizer(models.WordLevel({"hello": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "noeos.json"))
    (tmp_path / "junk.json").write_text('{"not": "a tokenizer"}')
    for name, words in (("noeos.json", "has no EOS token"), ("junk.json", "cannot load tokenizer file")):
        assert run_cli("prepare-data", doc, "--tokenizer", tmp_path / name, "--out", tmp_path / "out") == 2
        err = capsys.readouterr().err
        assert err.startswith("dspipe: error: ") and err.count("\n") == 1 and words in err and name in err, err
    assert not (tmp_path / "out").exists()


def test_one_long_word_trains_in_seconds(tmp_path):
    """A 1 MiB document without whitespace: the BPE trainer sees it cut into 256-character pieces. Uncut, training
    a 4096-token BPE on it ran for more than 5 minutes; cut, a few seconds."""
    import random
    import string
    import time

    from dspipe.data.tokenizer import MAX_WORD_CHARS, train_bpe

    rng = random.Random(0)
    word = "".join(rng.choices(string.ascii_letters, k=1 << 20))
    t0 = time.perf_counter()
    tok = train_bpe(iter([word, "a normal document with words"]), vocab_size=1024)
    seconds = time.perf_counter() - t0
    assert seconds < 60, seconds
    assert len(tok) == 1024
    ids = tok.backend_tokenizer.encode(word[: 4 * MAX_WORD_CHARS]).ids
    assert tok.decode(ids) == word[: 4 * MAX_WORD_CHARS]  # cutting loses nothing: the pieces decode back
    pieces = tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(word[:1000])
    assert max(len(p) for p, _ in pieces) == MAX_WORD_CHARS


def test_written_meta_and_specs_hold_no_non_finite_number(tmp_path):
    from dspipe.data.shards import write_meta
    from dspipe.jsonio import dumps

    with pytest.raises(SpecError, match=r"refusing to write x.json: a.b\[1\] is not a finite number"):
        dumps({"a": {"b": [1.0, float("nan")]}}, what="x.json")
    with pytest.raises(SpecError, match="val_fraction"):
        write_meta(
            tmp_path,
            {
                "format": "dspipe-tokens",
                "format_version": 1,
                "fingerprint": "ab" * 32,
                "vocab_size": 300,
                "eos_id": 0,
                "dtype": "uint16",
                "num_documents": 0,
                "num_tokens": 0,
                "val_fraction": float("inf"),
                "splits": {"train": {"num_tokens": 0, "num_documents": 0, "shards": []}},
            },
        )
    assert not (tmp_path / "meta.json").exists()


@pytest.mark.parametrize("damage", [as_dir("run/config.yaml"), loop("run/config.yaml")], ids=["dir", "loop"])
def test_extend_names_a_config_yaml_that_is_no_file(root, capsys, damage):
    """A config.yaml that is a directory or a looping link was skipped without a word (the run's --config copy
    then kept the old length); now nothing is changed and the file is named."""
    damage(root)
    before = snapshot(root)
    check(root, capsys, ["extend", "@/run", "--steps", "30"], "run/config.yaml", "extend rewrites the config file")
    assert snapshot(root) == before


def test_a_run_written_before_the_aio_section_reads_back_with_deepspeeds_defaults(root):
    """ds_config.json has carried aio since 2026-12: a run directory written before lacks the whole section, which
    DeepSpeed reads as its defaults, the values dspipe renders without a preset; a part of it missing is refused."""
    from dspipe.rundir import load_run

    edit(DS, drop("aio"))(root)
    assert load_run(root / "run").ds_config.get("aio") is None
