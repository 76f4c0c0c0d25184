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


def test_a_list_gives_each_elastic_start_its_faults():
    text = '[{"kill_at_step": 5, "kill_rank": 2}, {"hang_at_step": 7, "hang_rank": 1}]'
    assert Faults.from_json(text, attempt=0) == Faults(kill_at_step=5, kill_rank=2)
    assert Faults.from_json(text, attempt=1).hang_step(1) == 7
    assert Faults.from_json(text, attempt=1).hang_step(0) is None
    assert Faults.from_json(text, attempt=2) == NO_FAULTS  # past the list: none
    with pytest.raises(SpecError, match="^--test-faults must be a JSON object"):
        Faults.from_json('[{"kill_at_step": 5}, {"nope": 1}]', attempt=0)  # every item is checked, not just this one


def test_kill_after_step_kills_only_its_rank(monkeypatch):
    killed = []
    monkeypatch.setattr("os.kill", lambda pid, sig: killed.append(pid))
    monkeypatch.setattr("os.getppid", lambda: 4242)
    f = Faults(kill_at_step=5, kill_rank=2, kill_launcher=True)
    f.kill_after_step(5, rank=1)
    f.kill_after_step(4, rank=2)
    assert killed == []
    f.kill_after_step(5, rank=2)
    assert killed[0] == 4242 and len(killed) == 2  # the launcher (the parent), then the rank itself


def test_a_lost_node_is_its_ranks_killing_their_launcher():
    text = '{"kill_at_step": 5, "kill_node": 1}'
    assert Faults.from_json(text, node=1) == Faults(kill_at_step=5, kill_node=1, kill_launcher=True)
    assert Faults.from_json(text, node=0) == NO_FAULTS  # the other node's ranks carry no kill
    assert Faults.from_json(text) == NO_FAULTS  # nor ranks launched without a node rank
