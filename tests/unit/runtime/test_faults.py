"""The tests' fault injection (dspipe.runtime.faults): one object, built from the rank's hidden --test-faults option
only; no production module reads a test variable from the environment."""
import pytest

from dspipe.errors import SpecError
from dspipe.runtime.faults import NO_FAULTS, Faults
from tests.helpers import ROOT


def test_test_faults_json_gives_the_faults():
    f = Faults.from_json('{"nan_at_steps": [3, 5], "kill_at_step": 4, "fail_write_at": 6, "fail_write_rank": 0}')
    assert f == Faults(nan_at_steps=frozenset({3, 5}), kill_at_step=4, fail_write_at=6, fail_write_rank=0)
    assert Faults.from_json("{}") == NO_FAULTS


@pytest.mark.parametrize("text", ["[1]", "nope", '{"kill_at": 5}'])
def test_anything_else_is_one_line(text):
    with pytest.raises(SpecError, match="^--test-faults") as e:
        Faults.from_json(text)
    assert "\n" not in str(e.value)


def test_no_production_module_reads_a_test_variable():
    readers = [str(p.relative_to(ROOT)) for p in (ROOT / "dspipe").rglob("*.py") if "DSPIPE_TEST_" in p.read_text()]
    assert readers == []
