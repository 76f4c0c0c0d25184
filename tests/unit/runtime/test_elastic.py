"""A restart on fewer ranks (dspipe.runtime.elastic): same layout and global batch, smaller dp, more gradient
accumulation, in memory only; refused in one line where the ranks left cannot hold the layout or the batch."""

import json

import pytest

from dspipe.errors import SpecError
from dspipe.rundir import load_run
from dspipe.runtime.dscheck import parse_with_deepspeed
from dspipe.runtime.elastic import elastic_restart, resized
from tests.helpers import dspipe


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("elastic")
    for name, flags in {
        "dp8": ["--nodes", "2", "--gpus-per-node", "4", "--global-batch", "32"],
        "tp2": ["--nodes", "2", "--gpus-per-node", "4", "--global-batch", "32", "--tp", "2"],
    }.items():
        r = dspipe(
            "gen-config",
            "--model",
            "tiny",
            "--gpu",
            "cpu",
            "--micro-batch",
            "2",
            "--steps",
            "4",
            "--zero",
            "1",
            "--pp",
            "1",
            *flags,
            "--out",
            f"runs/{name}",
            cwd=d,
        )
        assert r.returncode == 0, r.stderr
    return d


def test_fewer_ranks_keep_the_global_batch(runs):
    run = load_run(runs / "runs/dp8")
    before = json.loads((run.path / "ds_config.json").read_text())
    assert (run.plan.dp, run.plan.grad_accum) == (8, 2)
    small, line = resized(run, world=4, ranks_per_node=4)
    assert (small.plan.world_size, small.plan.dp, small.plan.grad_accum, small.plan.global_batch) == (4, 4, 4, 32)
    assert (small.cluster.nodes, small.cluster.gpus_per_node) == (1, 4)
    assert small.ds_config["gradient_accumulation_steps"] == 4 and small.ds_config["train_batch_size"] == 32
    assert line == (
        "continuing on 4 of 8 ranks (1 of 2 node(s)): dp 8 -> 4, gradient accumulation 2 -> 4, global "
        "batch 32 = 2 x 4 x 4 unchanged"
    )
    parsed = parse_with_deepspeed(small.ds_config, dp=small.plan.dp)  # DeepSpeed's own batch check agrees
    assert (parsed.train_batch_size, parsed.gradient_accumulation_steps) == (32, 4)
    assert json.loads((run.path / "ds_config.json").read_text()) == before  # the run directory is not rewritten
    assert run.ds_config["gradient_accumulation_steps"] == 2
    assert resized(run, world=8, ranks_per_node=4) == (run, None)


def test_tensor_parallel_layout_is_kept(runs):
    run = load_run(runs / "runs/tp2")
    small, _ = resized(run, world=4, ranks_per_node=4)
    assert (small.plan.tp, small.plan.dp, small.plan.grad_accum) == (2, 2, 8)


@pytest.mark.parametrize(
    "name,world,message",
    [
        (
            "tp2",
            5,
            "5 ranks left cannot hold the run's model layout: world size 5 is not divisible by pp 1 x tp 2 x sp 1 = 2",
        ),
        ("dp8", 3, "3 ranks left give dp 3: global batch 32 is not divisible by micro_batch 2 x dp 3 = 6"),
        ("dp8", 16, "was planned for 8 ranks but 16 started"),
    ],
)
def test_refusals_show_the_numbers(runs, name, world, message):
    with pytest.raises(SpecError) as e:
        resized(load_run(runs / f"runs/{name}"), world=world, ranks_per_node=max(1, world // 2))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_restart_count_comes_from_torchs_agent():
    assert elastic_restart({}) is None  # DeepSpeed's launcher
    assert elastic_restart({"TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_RESTART_COUNT": "2"}) == 2
    assert elastic_restart({"TORCHELASTIC_RUN_ID": "x"}) == 0
