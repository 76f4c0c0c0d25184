"""Full recomputation of only the first N blocks of each pipeline stage (--recompute-blocks N, Megatron-LM's
--recompute-method block): the strategy's rule, the planner's memory and time, the search choosing the fewest that
fit, and the command line. The runtime's wiring is checked against a census of the real model
(test_activation_census.py) and in tests/unit/runtime/test_recompute_blocks.py."""

import json
from dataclasses import replace

import pytest

from dspipe.errors import SpecError
from dspipe.planner.cost import estimate
from dspipe.planner.memory import MEMORY_HEADROOM, activation_bytes_per_layer, micro_batch_activations
from dspipe.planner.plan import check_plan, make_plan
from dspipe.planner.search import search
from dspipe.planner.timing import recomputed_share, step_time
from dspipe.spec.cluster import ClusterSpec
from dspipe.spec.core import StrategyRequest
from dspipe.spec.presets import MODEL_PRESETS
from dspipe.spec.strategy import StrategySpec
from dspipe.spec.train import TrainSpec
from tests.helpers import dspipe
from tests.unit.planner.test_tp_pp_plans import LLAMA405

LLAMA_405B = MODEL_PRESETS["llama3.1-405b"]
META = ClusterSpec(256, 8, "h100-80g")
"""The 3D-parallelism issue's Llama 3.1 405B case: 2,048 H100, batch 2,048 x 8,192 tokens."""


def _train(gbs=2048):
    return TrainSpec(global_batch=gbs, micro_batch=1, steps=1000, warmup_steps=10)


def test_recompute_blocks_needs_full_recomputation():
    assert StrategySpec(checkpointing="full", recompute_blocks=3).recompute_blocks == 3
    for mode in ("none", "selective"):
        with pytest.raises(SpecError, match=f"recompute_blocks 3 needs checkpointing full \\(got {mode}\\)"):
            StrategySpec(checkpointing=mode, recompute_blocks=3)
    with pytest.raises(SpecError, match="recompute_blocks must be an integer >= 0, got -1"):
        StrategySpec(checkpointing="full", recompute_blocks=-1)


@pytest.mark.parametrize("name", ["gpt3-1.3b", "llama3-8b"])
def test_memory_of_the_first_n_blocks_recomputed(name):
    """A stage of B blocks recomputing its first N holds N blocks' inputs and (B - N) blocks' full activations:
    exactly full's bytes plus (B - N) x (none's per block - full's per block); N = B is full, and the peak's
    working term drops the kept blocks' tensors (they are backpropagated before any block is rebuilt)."""
    model = MODEL_PRESETS[name]
    kw = dict(model=model, micro_batch=1, act_bytes=2, blocks=8, first=False, last=False, tp=2, tp_sp=True)
    per = {
        mode: activation_bytes_per_layer(
            model=model, micro_batch=1, checkpointing=mode, act_bytes=2, tp=2, tp_sp=True, windowed=False
        )
        for mode in ("none", "full")
    }
    full_held, full_working = micro_batch_activations(checkpointing="full", **kw)
    held = [micro_batch_activations(checkpointing="full", recompute_blocks=n, **kw) for n in range(1, 9)]
    for n, (h, w) in enumerate(held, start=1):
        assert h == full_held + (8 - n) * (per["none"] - per["full"])
        assert w == max(0, full_working - (8 - n) * per["none"])
    assert (
        held[-1]
        == (full_held, full_working)
        == micro_batch_activations(checkpointing="full", recompute_blocks=99, **kw)
    )
    assert [h for h, _ in held] == sorted((h for h, _ in held), reverse=True)  # fewer recomputed: more held


def test_step_time_recomputes_only_the_share():
    """The recomputed forward's FLOPs and its tensor-parallel collectives scale by N / the stage's blocks."""
    model = LLAMA_405B
    train = _train()
    times = {}
    for blocks in (0, 4, 8):  # pp 16: 8 blocks on the largest stage (126 over 16)
        strategy = StrategySpec(zero=1, pp=16, tp=8, checkpointing="full", recompute_blocks=blocks)
        plan = make_plan(model=model, cluster=META, train=train, strategy=strategy)
        times[blocks] = (
            step_time(model=model, cluster=META, plan=plan, phi=1),
            recomputed_share(model=model, plan=plan),
        )
    none = make_plan(model=model, cluster=META, train=train, strategy=StrategySpec(zero=1, pp=16, tp=8))
    t_none = step_time(model=model, cluster=META, plan=none, phi=1)
    assert [share for _, share in times.values()] == [1.0, 0.5, 1.0]
    assert times[8][0] == times[0][0]  # every block of the largest stage
    half, whole = times[4][0], times[0][0]
    assert half.hardware_flops_per_token == pytest.approx(
        (whole.hardware_flops_per_token + t_none.hardware_flops_per_token) / 2
    )
    assert half.compute_s == pytest.approx((whole.compute_s + t_none.compute_s) / 2)
    assert half.tp_comm_s == pytest.approx((whole.tp_comm_s + t_none.tp_comm_s) / 2)
    assert t_none.tp_comm_s < half.tp_comm_s < whole.tp_comm_s


def test_llama_405b_recomputes_the_fewest_blocks_that_fit():
    """Llama 3.1 405B on 256 x 8 H100 at 8,192 tokens: nothing fits without recomputation, every plan with full
    recomputation of every block loses to one that recomputes only part of each stage (the fewest that fit: one
    fewer does not); ~690 days against the 787 of recomputing every block."""
    request = StrategyRequest()
    result = search(model=LLAMA_405B, cluster=META, train=_train(), request=request)
    best = result.best
    assert best is not None and best.plan.checkpointing == "full" and best.plan.recompute_blocks > 0
    assert (best.plan.zero_stage, best.plan.tp, best.plan.pp) == (1, 8, 16)
    assert "recompute full (first 4 blocks of each stage)" in best.describe()
    assert best.est.fits
    fewer = replace(best.plan, recompute_blocks=best.plan.recompute_blocks - 1)
    assert not estimate(model=LLAMA_405B, cluster=META, plan=fewer, headroom=MEMORY_HEADROOM, import_bytes=None).fits
    check_plan(best.plan, model=LLAMA_405B, cluster=META, train=best.train, strategy=best.strategy)  # make_plan's
    whole = search(model=LLAMA_405B, cluster=META, train=_train(), request=replace(request, recompute_blocks=0)).best
    assert whole is not None and whole.plan.recompute_blocks == 0
    days = {c: 15e12 / c.tokens_per_s / 86400 for c in (best, whole)}
    assert 650 < days[best] < 720 and 770 < days[whole] < 800, days


def test_a_pinned_count_plans_full_recomputation():
    """--recompute-blocks 2 alone leaves only full recomputation to the search; a stage with fewer blocks
    recomputes all of its own."""
    result = search(
        model=MODEL_PRESETS["gpt3-1.3b"],
        cluster=ClusterSpec(1, 8, "a100-80g"),
        train=_train(gbs=512),
        request=StrategyRequest(recompute_blocks=2, pp=4, zero=1),
    )
    assert result.best is not None
    plan = result.best.plan
    assert plan.checkpointing == "full" and plan.recompute_blocks == 2
    assert plan.recomputed(6) == 2 and plan.recomputed(1) == 1


def test_the_command_line(tmp_path):
    base = ["plan", "--model", "tiny", "--gpus-per-node", "2", "--gpu", "cpu", "--global-batch", "8"]
    r = dspipe(*base, "--checkpointing", "none", "--recompute-blocks", "1")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "recompute_blocks 1 needs checkpointing full (got none)" in r.stderr
    r = dspipe(*base, "--recompute-blocks", "-1")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "-1" in r.stderr, r.stderr
    r = dspipe(*base, "--recompute-blocks", "1", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["checkpointing"] == "full" and out["recompute_blocks"] == 1


def test_a_pinned_full_recomputation_recomputes_every_block():
    """--checkpointing full as the user gives it is Megatron's --recompute-granularity full: every block (the fewest
    that fit are the planner's choice only where it chooses the recomputation too)."""
    request = StrategyRequest(checkpointing="full")
    best = search(model=LLAMA_405B, cluster=META, train=_train(), request=request).best
    assert best is not None and best.plan.checkpointing == "full" and best.plan.recompute_blocks == 0
    assert best.plan.recomputation == "full"


def test_nothing_fits_under_a_pinned_recomputation_names_the_searchs_own():
    """Llama 3.1 405B at 8,192 tokens does not fit 256 x 8 H100 without recomputation: the one line says the
    search's own recomputation (here: the first 4 of each stage's 8 blocks) would fit."""
    r = dspipe(*LLAMA405, "--checkpointing", "none")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "recompute none, which needs 90.9 GiB per GPU" in r.stderr
    assert "would fit with: --checkpointing auto (ZeRO-1), or 4096 nodes x 8 (ZeRO-1)" in r.stderr
