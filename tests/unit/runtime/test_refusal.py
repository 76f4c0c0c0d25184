"""A start refused under torch's elastic agent is kept (dspipe.runtime.elastic.record_refusal) so that the agent's
restarts of the same job at the same world size say it again at once (earlier_refusal); another job, another world
size or a damaged record tries again."""

from dspipe.runtime.elastic import REFUSED_FILE, earlier_refusal, record_refusal

JOB = {"TORCHELASTIC_RUN_ID": "dspipe-run-1234", "WORLD_SIZE": "4"}


def test_a_refusal_is_said_again_only_by_the_same_job_at_the_same_world_size(tmp_path):
    assert earlier_refusal(tmp_path, env=JOB) is None
    record_refusal(tmp_path, env=JOB, error="data/x: no such directory")
    assert earlier_refusal(tmp_path, env=JOB) == "data/x: no such directory"
    assert earlier_refusal(tmp_path, env={**JOB, "WORLD_SIZE": "2"}) is None  # a node lost: try again
    assert earlier_refusal(tmp_path, env={**JOB, "TORCHELASTIC_RUN_ID": "other"}) is None


def test_a_damaged_or_unwritable_record_is_no_refusal(tmp_path):
    (tmp_path / REFUSED_FILE).write_text("{not json")
    assert earlier_refusal(tmp_path, env=JOB) is None
    (tmp_path / REFUSED_FILE).write_text('{"run_id": "dspipe-run-1234", "world": "4", "error": 7}')
    assert earlier_refusal(tmp_path, env=JOB) is None
    record_refusal(tmp_path / "missing", env=JOB, error="x")  # no directory: nothing kept, no exception
    assert not (tmp_path / "missing").exists()
