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
from tests.helpers import ROOT, run_cli

CENSUS = json.loads((ROOT / "tests" / "data" / "checkpoint_census.json").read_text())
SHAPE = ("--model", "tiny", "--layers", "2", "--hidden", "256", "--heads", "4", "--vocab", "4096", "--seq-len", "64",
         "--gpus-per-node", "2", "--gpu", "cpu", "--global-batch", "8", "--micro-batch", "2", "--steps", "2",
         "--warmup", "1", "--eval-interval", "0", "--data", "none")


def _run(tmp_path, *flags, name="run"):
    out = tmp_path / name
    assert run_cli("gen-config", *SHAPE, "--out", str(out), *flags) == 0
    return load_run(out)


@pytest.mark.parametrize("layout", sorted(CENSUS["layouts"]))
def test_the_planned_size_is_what_deepspeed_wrote(layout, tmp_path):
    case = CENSUS["layouts"][layout]
    run = _run(tmp_path, *case["flags"])
    size = checkpoint_size(model=run.model, plan=run.plan, ranks_per_node=run.cluster.gpus_per_node)
    files = {name: n for name, n in case["files"].items() if not name.startswith("rng-")}
    written = sum(files.values())
    assert size.bytes == pytest.approx(written, rel=0.003), (layout, size, written)
    if run.plan.dp == 2:  # the second data-parallel rank writes only its zero_pp_rank_1 partition
        second = sum(n for name, n in files.items() if "zero_pp_rank_1_" in name)
        assert size.rank_max_bytes == pytest.approx(written - second, rel=0.003), (layout, size)


def test_retention_bounds_the_disk_and_too_little_space_is_refused():
    size = CheckpointSize(bytes=2 * 2**30, rank_max_bytes=2**30, files_per_rank_max=2)
    assert milestones(steps=10_000, keep_every=1_000) == 10 and milestones(steps=10_000, keep_every=0) == 0
    assert disk_bytes(size=size, keep=3, kept_for_good=2) == 6 * 2 * 2**30
    check_disk(size=size, keep=3, kept_for_good=0, free=6 * 2**30, held=2 * 2**30, where="/ckpt")  # 8 GiB fit
    with pytest.raises(SpecError) as e:
        check_disk(size=size, keep=3, kept_for_good=2, free=6 * 2**30, held=2 * 2**30, where="/ckpt")
    assert str(e.value) == ("checkpoints need (keep 3 + 1 being written + 2 milestones) x 2.00 GiB = 12.0 GiB in "
                            "/ckpt, which has 6.00 GiB free + 2.00 GiB of checkpoints already = 8.00 GiB: lower "
                            "--keep-checkpoints / --keep-every, or free space")


def test_the_runner_refuses_before_building_when_the_checkpoints_cannot_fit(tmp_path, monkeypatch):
    run = _run(tmp_path, "--zero", "1", "--precision", "fp32", "--keep-checkpoints", "3")
    need = 4 * checkpoint_size(model=run.model, plan=run.plan, ranks_per_node=run.cluster.gpus_per_node).bytes
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=need))
    check_disk_space(run)  # exactly enough
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=need - 1))
    with pytest.raises(SpecError, match=r"checkpoints need \(keep 3 \+ 1 being written\) x .* in .*checkpoints, "
                                        r"which has .* free \+ 0\.0 MiB of checkpoints already"):
        check_disk_space(run)
    # checkpoints already in the directory rotate out: their bytes count as room
    (run.checkpoint_dir / "global_step1").mkdir(parents=True)
    (run.checkpoint_dir / "global_step1" / "f.pt").write_bytes(b"\0" * 4096)
    check_disk_space(run)


def test_gen_config_and_plan_show_the_checkpoint(tmp_path, capsys):
    assert run_cli("gen-config", *SHAPE, "--zero", "1", "--precision", "fp32", "--keep-checkpoints", "2",
                   "--keep-every", "1", "--save-interval", "1", "--out", str(tmp_path / "run")) == 0
    out, err = capsys.readouterr()
    # 2 ranks x 25.2 MiB bound the node's bytes by the whole 40.4 MiB: 42.3 MB at 2 GB/s
    assert "checkpoint: 40.4 MiB per save, the largest rank writes 25.2 MiB, ~0.0212 s at 2 GB/s per node; on disk " \
           "at most (keep 2 + 1 being written + 2 milestones) x 40.4 MiB = 201.8 MiB" in out, out
    # a save every step, each step 0.00935 s: the write outlasts it
    assert ("note: a checkpoint takes ~0.0212 s to write (40.4 MiB from the busiest node at 2 GB/s), more than "
            "--save-interval 1 x 0.00935 s/step = 0.00935 s: the next save waits for the last one; --save-interval 3 "
            "or more keeps up") in err, err
    assert run_cli("gen-config", *SHAPE, "--zero", "1", "--precision", "fp32", "--save-interval", "3", "--out",
                   str(tmp_path / "run3")) == 0
    assert "note: a checkpoint takes" not in capsys.readouterr().err
    assert run_cli("plan", *SHAPE[:-2], "--zero", "1", "--precision", "fp32") == 0
    assert "checkpoint: 40.4 MiB per save, the largest rank writes 25.2 MiB, ~0.0212 s at 2 GB/s per node\n" in \
        capsys.readouterr().out
