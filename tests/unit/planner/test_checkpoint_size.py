"""The checkpoint's size in the plan against the files DeepSpeed really wrote (tests/data/checkpoint_census.json:
one save per layout, ZeRO 0-3 in fp32 and bf16, pp 2, tp 2, on 2 CPU ranks; benchmarks/census/checkpoints.py
retakes it), its lines in gen-config and plan, and the refusal before launch when the checkpoints cannot fit."""

import json
import shutil

import pytest

from dspipe.errors import SpecError
from dspipe.planner.checkpoint_size import CheckpointSize, check_disk, checkpoint_size, disk_bytes, milestones
from dspipe.rundir import load_run
from dspipe.runtime.checkpoint import check_disk_space
from dspipe.runtime.experts import EXPERT_FILE
from tests.helpers import ROOT, run_cli

CENSUS = json.loads((ROOT / "tests" / "data" / "checkpoint_census.json").read_text())
SHAPE = (
    "--model",
    "tiny",
    "--layers",
    "2",
    "--hidden",
    "256",
    "--heads",
    "4",
    "--vocab",
    "4096",
    "--seq-len",
    "64",
    "--gpus-per-node",
    "2",
    "--gpu",
    "cpu",
    "--global-batch",
    "8",
    "--micro-batch",
    "2",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--eval-interval",
    "0",
    "--data",
    "none",
)


def _run(tmp_path, *flags, name="run"):
    out = tmp_path / name
    assert run_cli("gen-config", *SHAPE, "--out", str(out), *flags) == 0
    return load_run(out)


@pytest.mark.parametrize("layout", sorted(CENSUS["layouts"]))
def test_the_planned_size_is_what_deepspeed_wrote(layout, tmp_path):
    case = CENSUS["layouts"][layout]
    pinned = [x for axis in ("--tp", "--pp", "--sp") if axis not in case["flags"] for x in (axis, "1")]
    offload = [] if "--offload" in case["flags"] else ["--offload", "none"]
    run = _run(tmp_path, *case["flags"], *pinned, *offload)  # the census's layout, not the planner's pick
    size = checkpoint_size(model=run.model, plan=run.plan, ranks_per_node=run.cluster.gpus_per_node)
    files = {name: n for name, n in case["files"].items() if not name.startswith("rng-")}
    written = sum(files.values())
    assert size.bytes == pytest.approx(written, rel=0.003), (layout, size, written)
    if run.plan.dp == 2:  # the second data-parallel rank writes its zero_pp_rank_1 partition (and at ep 2 its experts)
        per = run.model.experts // run.plan.ep if run.model.experts else 0

        def seconds(name: str) -> bool:
            expert = EXPERT_FILE.match(name)
            return "zero_pp_rank_1_" in name or bool(expert and run.plan.ep > 1 and int(expert[2]) // per == 1)

        second = sum(n for name, n in files.items() if seconds(name))
        assert size.rank_max_bytes == pytest.approx(written - second, rel=0.003), (layout, size)


def test_retention_bounds_the_disk_and_too_little_space_is_refused():
    size = CheckpointSize(bytes=2 * 2**30, rank_max_bytes=2**30, files_per_rank_max=2)
    assert milestones(steps=10_000, keep_every=1_000) == 10 and milestones(steps=10_000, keep_every=0) == 0
    assert disk_bytes(size=size, keep=3, kept_for_good=2) == 6 * 2 * 2**30
    check_disk(size=size, keep=3, kept_for_good=0, free=6 * 2**30, held=2 * 2**30, where="/ckpt")  # 8 GiB fit
    with pytest.raises(SpecError) as e:
        check_disk(size=size, keep=3, kept_for_good=2, free=6 * 2**30, held=2 * 2**30, where="/ckpt")
    assert str(e.value) == (
        "checkpoints need (keep 3 + 1 being written + 2 milestones) x 2.00 GiB = 12.0 GiB in "
        "/ckpt, which has 6.00 GiB free + 2.00 GiB of checkpoints already = 8.00 GiB: lower "
        "--keep-checkpoints / --keep-every, or free space"
    )


def test_the_runner_refuses_before_building_when_the_checkpoints_cannot_fit(tmp_path, monkeypatch):
    run = _run(tmp_path, "--zero", "1", "--precision", "fp32", "--keep-checkpoints", "3")
    need = 4 * checkpoint_size(model=run.model, plan=run.plan, ranks_per_node=run.cluster.gpus_per_node).bytes
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=need))
    check_disk_space(run)  # exactly enough
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=need - 1))
    with pytest.raises(
        SpecError,
        match=r"checkpoints need \(keep 3 \+ 1 being written\) x .* in .*checkpoints, "
        r"which has .* free \+ 0\.0 MiB of checkpoints already",
    ):
        check_disk_space(run)
    # checkpoints already in the directory rotate out: their bytes count as room
    (run.checkpoint_dir / "global_step1").mkdir(parents=True)
    (run.checkpoint_dir / "global_step1" / "f.pt").write_bytes(b"\0" * 4096)
    check_disk_space(run)


def test_gen_config_and_plan_show_the_checkpoint(tmp_path, capsys):
    assert (
        run_cli(
            "gen-config",
            *SHAPE,
            "--zero",
            "1",
            "--precision",
            "fp32",
            "--keep-checkpoints",
            "2",
            "--keep-every",
            "1",
            "--save-interval",
            "1",
            "--out",
            str(tmp_path / "run"),
        )
        == 0
    )
    out, err = capsys.readouterr()
    # 2 ranks x 25.2 MiB bound the node's bytes by the whole 40.4 MiB: 42.3 MB at 2 GB/s
    assert (
        "checkpoint: 40.4 MiB per save, the largest rank writes 25.2 MiB, ~0.0212 s at 2 GB/s per node; on disk "
        "at most (keep 2 + 1 being written + 2 milestones) x 40.4 MiB = 201.8 MiB" in out
    ), out
    # a save every step, each step 0.00935 s: the write outlasts it
    assert (
        "note: a checkpoint takes ~0.0212 s to write (40.4 MiB from the busiest node at 2 GB/s), more than "
        "--save-interval 1 x 0.00935 s/step = 0.00935 s: the next save waits for the last one; --save-interval 3 "
        "or more keeps up"
    ) in err, err
    assert (
        run_cli(
            "gen-config",
            *SHAPE,
            "--zero",
            "1",
            "--precision",
            "fp32",
            "--save-interval",
            "3",
            "--out",
            str(tmp_path / "run3"),
        )
        == 0
    )
    assert "note: a checkpoint takes" not in capsys.readouterr().err
    assert run_cli("plan", *SHAPE[:-2], "--zero", "1", "--precision", "fp32") == 0
    assert (
        "checkpoint: 40.4 MiB per save, the largest rank writes 25.2 MiB, ~0.0212 s at 2 GB/s per node\n"
        in capsys.readouterr().out
    )


def test_auto_save_interval_is_youngs_interval():
    from dspipe.planner.checkpoint_size import ASYNC_DRAG, GPU_MTBF_HOURS, auto_save_interval

    c = CheckpointSize(
        bytes=2 * 10**12, rank_max_bytes=2 * 10**9, files_per_rank_max=2, node_max_bytes=16 * 10**9, write_s=8.0
    )
    mtbf_s = GPU_MTBF_HOURS * 3600 / 1024
    n, line = auto_save_interval(
        checkpoint=c, step_time_s=20.0, world=1024, steps=100_000, async_save=False, host_copy_gbps=25
    )
    assert n == round((2 * 8.0 * mtbf_s) ** 0.5 / 20.0) == 84  # sqrt(2 x 8 s x 49.5 h) = 28m09s
    assert line.startswith(
        "--save-interval auto: 84 steps (28m00s): Young's sqrt(2 x 8 s per save (the write) x "
        "2d01h between failures) = 28m09s; failures at 50,700 GPU-hours per GPU"
    )
    n_async, line = auto_save_interval(
        checkpoint=c, step_time_s=20.0, world=1024, steps=100_000, async_save=True, host_copy_gbps=25
    )
    cost = 2e9 / 25e9 + ASYNC_DRAG * 8.0  # the copy to host memory, and the write's drag on the steps
    assert n_async == round((2 * cost * mtbf_s) ** 0.5 / 20.0) < n  # background writes cost less: save more often
    # never shorter than a background write (the next save would wait), never longer than the run
    slow = CheckpointSize(bytes=1, rank_max_bytes=1, files_per_rank_max=1, node_max_bytes=1, write_s=600.0)
    assert (
        auto_save_interval(checkpoint=slow, step_time_s=1.0, world=8, steps=10**6, async_save=True, host_copy_gbps=25)[
            0
        ]
        >= 600
    )
    n, line = auto_save_interval(
        checkpoint=c, step_time_s=20.0, world=1024, steps=10, async_save=False, host_copy_gbps=25
    )
    assert n == 10 and line.endswith("the run is shorter: checkpoints at the end (and on SIGTERM) only")


def test_gen_config_resolves_save_interval_auto(tmp_path, capsys):
    assert (
        run_cli(
            "gen-config",
            *SHAPE,
            "--zero",
            "1",
            "--save-interval",
            "auto",
            "--steps",
            "100000",
            "--out",
            str(tmp_path / "run"),
        )
        == 0
    )
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("note: --save-interval auto: ")]
    run = load_run(tmp_path / "run")
    assert line.startswith(f"note: --save-interval auto: {run.train.save_interval:,} steps")
    assert 1 < run.train.save_interval < 100_000  # a number in dspipe.json: the runner reads no 'auto'
    assert "save_interval: auto" in (tmp_path / "run" / "config.yaml").read_text()  # --config reproduces the choice
    assert (
        run_cli("gen-config", "--config", str(tmp_path / "run" / "config.yaml"), "--out", str(tmp_path / "again")) == 0
    )
    assert load_run(tmp_path / "again").train.save_interval == run.train.save_interval
    assert run.estimate.save_interval_auto is True
    assert run.cluster.gpu_mtbf_hours == 50_700  # the estimate's key: the runner re-plans it
    assert line.endswith("; the run re-plans it from each save's measured time")
    # a less reliable cluster (--gpu-mtbf-hours): failures 100x as often, checkpoints sqrt(100) = 10x as often
    assert (
        run_cli(
            "gen-config",
            *SHAPE,
            "--zero",
            "1",
            "--save-interval",
            "auto",
            "--steps",
            "100000",
            "--gpu-mtbf-hours",
            "507",
            "--out",
            str(tmp_path / "flaky"),
        )
        == 0
    )
    flaky = load_run(tmp_path / "flaky")
    assert (
        flaky.cluster.gpu_mtbf_hours == 507
        and "gpu_mtbf_hours: 507" in (tmp_path / "flaky" / "config.yaml").read_text()
    )
    assert flaky.train.save_interval == pytest.approx(run.train.save_interval / 10, abs=1)
    assert "failures at 507 GPU-hours per GPU over" in capsys.readouterr().err
    assert load_run(tmp_path / "again").estimate.save_interval_auto  # --config: auto again
    assert run_cli("plan", *SHAPE[:-2], "--zero", "1", "--save-interval", "auto", "--steps", "100000") == 0
    assert capsys.readouterr().err.strip().splitlines()[-1] == line  # plan says what gen-config writes
    assert run_cli("gen-config", *SHAPE, "--zero", "1", "--save-interval", "500", "--out", str(tmp_path / "fixed")) == 0
    assert not load_run(tmp_path / "fixed").estimate.save_interval_auto  # a given interval is not re-planned
    spec = json.loads((tmp_path / "flaky" / "dspipe.json").read_text())
    spec["estimate"]["save_interval_auto"] = "yes"
    (tmp_path / "flaky" / "dspipe.json").write_text(json.dumps(spec))
    with pytest.raises(
        SpecError,
        match=r"dspipe.json: estimate.save_interval_auto must be true when present, got "
        r"'yes'",
    ):
        load_run(tmp_path / "flaky")
    assert (
        run_cli("gen-config", *SHAPE, "--save-interval", "auto", "--keep-every", "10", "--out", str(tmp_path / "no"))
        == 2
    )
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            "--save-interval auto with --keep-every 10: milestones need a "
            "fixed interval (they are kept at multiples of it); give "
            "--save-interval N"
        )
    )
