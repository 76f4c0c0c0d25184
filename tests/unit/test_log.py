"""dspipe.log: diagnostics on stderr, one line per job (rank 0) unless DSPIPE_LOG_ALL_RANKS=1 or the record asks."""

import logging

import pytest

from dspipe.log import get_logger, setup_logging


@pytest.fixture(autouse=True)
def _restore():
    yield
    setup_logging(rank=0, env={})  # the default the rest of the suite (and the CLI) runs under


def test_rank0_logs_and_a_warning_reaches_stderr(capsys):
    setup_logging(rank=0, env={})
    get_logger("dspipe.test").warning("dspipe: the disk is nearly full")
    get_logger("dspipe.test").info("note: a note")
    captured = capsys.readouterr()
    assert captured.err == "dspipe: the disk is nearly full\nnote: a note\n" and captured.out == ""


def test_other_ranks_are_silent(capsys):
    setup_logging(rank=1, env={})
    log = get_logger("dspipe.test")
    log.info("note: said once")
    log.error("dspipe: error: said once")
    assert capsys.readouterr().err == ""


def test_all_ranks_env_prefixes_every_rank(capsys):
    setup_logging(rank=1, env={"DSPIPE_LOG_ALL_RANKS": "1"})
    get_logger("dspipe.test").warning("dspipe: slow step")
    assert capsys.readouterr().err == "[rank 1] dspipe: slow step\n"
    setup_logging(rank=0, env={"DSPIPE_LOG_ALL_RANKS": "1"})
    get_logger("dspipe.test").warning("dspipe: slow step")
    assert capsys.readouterr().err == "[rank 0] dspipe: slow step\n"


def test_a_record_may_ask_for_its_own_rank(capsys):
    setup_logging(rank=3, env={})
    get_logger("dspipe.test").warning("dspipe: could not record the hang", extra={"all_ranks": True})
    assert capsys.readouterr().err == "[rank 3] dspipe: could not record the hang\n"


def test_rank_comes_from_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.delenv("DSPIPE_LOG_ALL_RANKS", raising=False)
    setup_logging()
    get_logger("dspipe.test").warning("dspipe: hidden")
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    setup_logging()
    get_logger("dspipe.test").warning("dspipe: shown")
    assert capsys.readouterr().err == "dspipe: shown\n"


def test_setup_twice_is_still_one_line_and_names_stay_under_dspipe(capsys):
    setup_logging(rank=0, env={})
    setup_logging(rank=0, env={}, level=logging.WARNING)
    get_logger("dspipe.test").info("note: below the level")
    get_logger("dspipe.test").warning("dspipe: once")
    assert capsys.readouterr().err == "dspipe: once\n"
    assert get_logger("other").name == "dspipe.other" and get_logger().name == "dspipe"
    assert get_logger("dspipe.cli.app").name == "dspipe.cli.app"
