"""The planner's model-state bytes against the tensors live DeepSpeed engines hold (2 CPU ranks): device and host,
between steps and at the in-step peak, every row of benchmarks/planner_accuracy.CONFIGS (one launch per LAUNCHES
entry, several engines per launch)."""
import pytest

from benchmarks.planner_accuracy import CONFIGS, KNOWN_MISSES, LAUNCHES, METRICS, error, measure_launch

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("names", LAUNCHES, ids=[names[0] if len(names) == 1 else "plain" for names in LAUNCHES])
def test_predicted_model_states_within_5_percent_of_the_live_engine(names, tmp_path):
    rows = measure_launch(names, tmp_path)
    assert [r["name"] for r in rows] == names
    misses = []
    for row in rows:
        assert row["num_params"] > 30e6, row["name"]  # model states dominate
        for metric in METRICS:
            if metric in KNOWN_MISSES.get(row["name"], {}):
                misses.append(f"{row['name']} {metric}: {error(row, metric):+.1%}")
                continue
            assert abs(error(row, metric)) < 0.05, (row["name"], metric, row["predicted"], row["measured"])
        offload = "offload" in row["name"]
        assert (row["measured"]["host_steady"] > 0) == offload, row  # the census found the offloaded state
        if row["gathered_allowed"]:  # ZeRO-3: the rendered knobs bound what is gathered at once
            assert 0 < row["gathered"] <= row["gathered_allowed"] * 1.05, row
    assert set(CONFIGS) == {n for launch in LAUNCHES for n in launch}
    if misses:
        pytest.xfail("known misses (benchmarks/planner_accuracy.KNOWN_MISSES): " + "; ".join(misses))
