"""benchmarks/pipeline_schedules.py: DeepSpeed 0.19.8's DualPipeV schedule replayed from its own instruction streams
(docs/howto/parallelism.md's figures): its bubble follows ((p - 1) b + (p - 2) f / 2) / (m (f + b)), below 1F1B's
(p - 1) / m that the planner prices, and every rank holds p + 1/2 micro-batches of activations at its peak."""

import pytest

from benchmarks.pipeline_schedules import closed_form, replay


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("extra", [0, 1, 5])
@pytest.mark.parametrize("b", [2.0, 3.0])
def test_the_replay_follows_the_closed_form_below_1f1b(p, extra, b):
    m = 2 * p + extra  # DualPipeV needs at least 2p micro-batches
    makespan, peak = replay(p=p, m=m, f=1.0, b=b)
    bubble = makespan / (m * (1.0 + b)) - 1
    assert bubble == pytest.approx(closed_form(p=p, m=m, f=1.0, b=b), rel=1e-12)
    assert bubble < (p - 1) / m  # 1F1B's
    assert peak == p + 0.5
