"""The planner's model-state bytes against the tensors live DeepSpeed engines hold (2 CPU ranks)."""
import pytest

from benchmarks.planner_accuracy import CONFIGS, measure

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("name", list(CONFIGS))
def test_predicted_model_states_within_5_percent_of_the_live_engine(name, tmp_path):
    row = measure(name, tmp_path)
    assert row["num_params"] > 30e6  # model states dominate
    error = abs(row["predicted"] - row["measured"]) / row["measured"]
    assert error < 0.05, row
