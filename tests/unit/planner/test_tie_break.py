"""The search's tie-break among plans within 2% of the fastest: a plan near the edge of the GPU's memory loses to a
roomier one, whatever the recipe's order says, and `plan` says so."""

import pytest

from dspipe.planner.enumerate import TIE
from dspipe.planner.rank import ROOMY, preference
from dspipe.planner.search import search
from dspipe.spec.cluster import ClusterSpec
from dspipe.spec.core import StrategyRequest
from dspipe.spec.presets import model_preset
from dspipe.spec.train import TrainSpec

CASES = [
    ("gpt3-1.3b", 1, 8, "a100-40g", 256),
    ("gpt2-1.5b", 1, 8, "a100-40g", 256),
    ("gpt3-6.7b", 1, 8, "h100-80g", 256),
    ("gpt3-13b", 2, 8, "a100-80g", 256),
    ("gpt3-2.7b", 1, 8, "a100-40g", 256),
    ("llama2-7b", 2, 8, "h100-80g", 1024),
]


def _share(c):
    return c.est.memory.total / c.est.gpu_memory_bytes


@pytest.fixture(scope="module")
def results():
    return [
        search(
            model=model_preset(name),
            cluster=ClusterSpec(nodes, gpus, gpu),
            request=StrategyRequest(),
            train=TrainSpec(global_batch=gbs, micro_batch=1, steps=100, warmup_steps=10),
        )
        for name, nodes, gpus, gpu, gbs in CASES
    ]


def _ties(r):
    fastest = min(c.est.step_time_s for c in r.ranked)
    return [c for c in r.ranked if c.est.step_time_s <= fastest * TIE]


def test_a_plan_over_the_roomy_share_never_wins_a_tie_against_one_under_it(results):
    decided = 0
    for r in results:
        ties = _ties(r)
        if any(_share(c) <= ROOMY for c in ties):
            assert _share(r.best) <= ROOMY, (r.best.describe(), _share(r.best))
        recipe = min(ties, key=lambda c: preference(c)[1:])
        decided += _share(recipe) > ROOMY >= _share(r.best)
    assert decided >= 2  # the rule changed the choice: the recipe alone would have picked a plan over ROOMY


def test_the_tie_line_names_the_rule_and_both_shares_when_it_decides(results):
    for r in results:
        recipe = min(_ties(r), key=lambda c: preference(c)[1:])
        if recipe is not r.best and _share(recipe) > ROOMY:
            assert (
                f"the roomier plan ({_share(r.best):.0%} vs {_share(recipe):.0%} of GPU memory; over {ROOMY:.0%} "
                f"loses ties) over {recipe.describe()}"
            ) in r.tie
        if r.tie:
            assert f"under {ROOMY:.0%} of GPU memory first" in r.tie
