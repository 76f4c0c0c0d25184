"""The parallel layout: the one place the world is divided, checked against DeepSpeed's own topology classes."""

import pytest

from dspipe.errors import SpecError
from dspipe.spec.layout import ParallelLayout


@pytest.mark.parametrize(
    "world, pp, tp, sp, dp", [(1, 1, 1, 1, 1), (8, 2, 1, 1, 4), (8, 1, 2, 1, 4), (16, 2, 2, 2, 2), (1024, 8, 8, 1, 16)]
)
def test_dp_is_what_the_model_ranks_leave(world, pp, tp, sp, dp):
    layout = ParallelLayout(world=world, pp=pp, tp=tp, sp=sp)
    assert layout.dp == dp and layout.dp * layout.model_ranks == world
    for axis, size in layout.sizes.items():
        groups = layout.groups(axis)
        assert len(groups) == world // size and all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(world))  # a partition of the world


def test_bad_layouts_name_the_equation():
    with pytest.raises(SpecError, match=r"world size 8 is not divisible by pp 3 x tp 1 x sp 1 = 3"):
        ParallelLayout(world=8, pp=3)
    with pytest.raises(SpecError, match="layout.tp must be a positive integer, got 0"):
        ParallelLayout(world=8, tp=0)


@pytest.mark.parametrize("pp, dp, tp", [(2, 2, 1), (2, 1, 2), (2, 2, 2), (4, 2, 1), (1, 4, 2)])
def test_rank_order_matches_deepspeeds_topology(pp, dp, tp):
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    layout = ParallelLayout(world=pp * dp * tp, pp=pp, tp=tp)
    for rank in range(layout.world):
        c = topo.get_coord(rank)
        assert (c.pipe, c.data, c.model) == tuple(layout.coords(rank)[a] for a in ("pipe", "data", "tensor"))
    assert sorted(map(sorted, layout.groups("data"))) == sorted(map(sorted, topo.get_axis_comm_lists("data")))
    assert sorted(map(sorted, layout.groups("pipe"))) == sorted(map(sorted, topo.get_axis_comm_lists("pipe")))


def test_pipeline_only_layout_matches_the_pipeline_modules_topology():
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    topo = PipeDataParallelTopology(num_pp=2, num_dp=3)
    layout = ParallelLayout(world=6, pp=2)
    assert [layout.dp_rank(r) for r in range(6)] == [topo.get_coord(r).data for r in range(6)]
    assert [layout.stage(r) for r in range(6)] == [topo.get_coord(r).pipe for r in range(6)]
    assert layout.describe() == "world 6 = dp 3 x pp 2"


def test_the_plan_carries_the_layout():
    from dspipe.planner.plan import make_plan
    from dspipe.spec.cluster import ClusterSpec
    from dspipe.spec.presets import model_preset
    from dspipe.spec.strategy import StrategySpec
    from dspipe.spec.train import TrainSpec

    plan = make_plan(
        model=model_preset("tiny"),
        cluster=ClusterSpec(2, 4, "cpu"),
        train=TrainSpec(global_batch=16, micro_batch=2, steps=10, warmup_steps=1, precision="fp32"),
        strategy=StrategySpec(zero=1, pp=2),
    )
    assert plan.layout == ParallelLayout(world=8, pp=2) and plan.dp == plan.layout.dp == 4
    assert plan.grad_accum == 16 // (2 * 4)


def test_no_other_code_divides_the_world():
    """dp and every rank's coordinates come from the layout only: no module computes world // pp, rank // tp (or
    world_size / ...) itself. (Tensor shapes divided by tp, a shard's rows, are the tensor-parallel layers' own.)"""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[3] / "dspipe"
    pattern = re.compile(r"\bworld(_size)?\s*//|\b(rank|world)\s*//\s*\(?\s*(pp|plan\.pp|tp|sp)\b")
    offenders = [
        f"{p.relative_to(root)}:{i}: {line.strip()}"
        for p in root.rglob("*.py")
        if p.name != "layout.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []
