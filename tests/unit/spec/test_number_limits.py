"""Numbers on the command line: NaN, +-inf, values beyond every sane size and negatives, for every numeric flag of
gen-config, plan, bench and prepare-data, through the real command handler. Each is exit 2 with one
`dspipe: error:` line that shows the allowed range, and nothing is written."""

from __future__ import annotations

import re

import pytest

from dspipe.spec.core import LIMITS
from tests.helpers import run_cli

HUGE = "9" * 30
CPU2 = [
    "--model",
    "tiny",
    "--gpu",
    "cpu",
    "--gpus-per-node",
    "2",
    "--global-batch",
    "16",
    "--micro-batch",
    "4",
    "--steps",
    "20",
]
RANGE = re.compile(r"allowed[^)]*(\d\.\.\d|[\[(]-?[\d.e+]+, [\d.,e+]+[\])])|must be in [\[(]")

# flag -> values (each must be refused with its allowed range). Integer flags: click refuses 'nan'/'inf' itself
# (not integers); the spec refuses negatives and sizes beyond LIMITS.
INT_FLAGS = {
    "--layers": ["-1", HUGE, str(LIMITS["layers"] + 1)],
    "--hidden": ["-64", HUGE],
    "--heads": ["-4", HUGE],
    "--vocab": ["-1", HUGE, str(LIMITS["vocab"] + 1)],
    "--seq-len": ["-1", HUGE, str(LIMITS["seq_len"] + 1)],
    "--ffn": ["-1", HUGE],
    "--nodes": ["-1", HUGE],
    "--gpus-per-node": ["-2", HUGE],
    "--global-batch": ["-16", HUGE],
    "--micro-batch": ["-4", HUGE],
    "--steps": ["-5", HUGE],
    "--warmup": ["-1", HUGE],
    "--seed": ["-1", str(2**32), HUGE],
    "--log-interval": ["-1", HUGE],
    "--save-interval": ["-1", HUGE],
    "--keep-checkpoints": ["-1", HUGE],
    "--eval-interval": ["-1", HUGE],
    "--eval-batches": ["-1", HUGE],
    "--max-skipped-steps": ["-1", HUGE],
    "--spike-window": ["-1", HUGE],
    "--pp": ["-1", HUGE],
    "--reduce-bucket-size": ["-1", HUGE],
    "--prefetch-bucket-size": ["-1", HUGE],
    "--param-persistence-threshold": ["-1", HUGE],
    "--max-live-parameters": ["-1", HUGE],
    "--max-reuse-distance": ["-1", HUGE],
}
FLOAT_FLAGS = {
    "--lr": ["nan", "inf", "-inf", "-1", "1e309", "2"],
    "--min-lr-ratio": ["nan", "inf", "-0.5", "1.5"],
    "--weight-decay": ["nan", "inf", "-0.1", "1e300"],
    "--grad-clip": ["nan", "inf", "-1", "1e300"],
    "--spike-sigma": ["nan", "inf", "-1", "0"],
    "--dropout": ["nan", "inf", "-0.1", "1"],
    "--host-memory-gib": ["nan", "inf", "-1", "1e300"],
}
SPEC_CASES = [(flag, v) for flags in (INT_FLAGS, FLOAT_FLAGS) for flag, values in flags.items() for v in values]


def assert_one_line_with_range(code, err, flag):
    assert code == 2, (flag, err)
    assert err.startswith("dspipe: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert RANGE.search(err), err


@pytest.mark.parametrize("flag,value", SPEC_CASES, ids=[f"{f}={v[:12]}" for f, v in SPEC_CASES])
def test_plan_and_gen_config_refuse_with_the_range(flag, value, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for command in (["plan", "--json"], ["gen-config", "--out", tmp_path / "run"]):
        code = run_cli(*command, *CPU2, flag, value)
        assert_one_line_with_range(code, capsys.readouterr().err, flag)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--lr", "nan"),
        ("--seed", HUGE),
        ("--layers", HUGE),
        ("--host-memory-gib", "inf"),
        ("--spike-sigma", "inf"),
        ("--global-batch", "-16"),
        ("--steps", HUGE),
        ("--warmup", "-1"),
    ],
)
def test_bench_refuses_with_the_range_before_starting_ranks(flag, value, tmp_path, capsys, monkeypatch):
    from dspipe.tools import bench

    def no_launch(**kwargs):
        raise AssertionError("bench started ranks for an invalid flag")

    monkeypatch.setattr(bench, "run_side", no_launch)
    monkeypatch.chdir(tmp_path)
    code = run_cli(
        "bench", "--model", "tiny", "--gpu", "cpu", "--global-batch", "16", "--micro-batch", "4", flag, value
    )
    err = capsys.readouterr().err
    if flag in ("--steps", "--warmup") and value.startswith("-"):  # bench's own step counts
        assert code == 2 and "must be at least 1" in err and err.count("\n") == 1, err
    else:
        assert_one_line_with_range(code, err, flag)
    assert list(tmp_path.iterdir()) == []


PREPARE_CASES = [
    ("--workers", "0", "--workers must be at least 1, got 0 (allowed range 1..128)"),
    ("--workers", "-3", "--workers must be at least 1, got -3"),
    ("--workers", "100000", "allowed range 1..128"),
    ("--train-tokenizer", "-1", "allowed range 257..262144"),
    ("--train-tokenizer", HUGE, "allowed range 257..262144"),
    ("--train-tokenizer", "100", "at least 257 tokens"),
    ("--tokenizer-sample-mb", "nan", "--tokenizer-sample-mb must be a positive number of MiB, got nan"),
    ("--tokenizer-sample-mb", "inf", "(allowed: finite, (0, 16,384])"),
    ("--tokenizer-sample-mb", "-1", "got -1.0"),
    ("--tokenizer-sample-mb", "1e300", "allowed: finite"),
    ("--max-mb", "nan", "--max-mb must be a positive number of MiB, got nan"),
    ("--max-mb", "inf", "allowed: finite, (0, 16,777,216]"),
    ("--max-mb", "-inf", "allowed: finite"),
    ("--max-mb", "0", "got 0.0"),
    ("--val-fraction", "nan", "--val-fraction nan must be in [0, 1)"),
    ("--val-fraction", "inf", "must be in [0, 1)"),
    ("--val-fraction", "-0.5", "must be in [0, 1)"),
    ("--shard-tokens", "0", "allowed range 1..1,099,511,627,776"),
    ("--shard-tokens", HUGE, "allowed range 1..1,099,511,627,776"),
]


@pytest.mark.parametrize("flag,value,message", PREPARE_CASES, ids=[f"{f}={v[:12]}" for f, v, _ in PREPARE_CASES])
def test_prepare_data_refuses_with_the_range(flag, value, message, tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text("def f(x):\n    return x + 1\n" * 50)
    before = sorted(p.name for p in tmp_path.iterdir())
    code = run_cli("prepare-data", doc, "--out", tmp_path / "out", flag, value)
    err = capsys.readouterr().err
    assert_one_line_with_range(code, err, flag)
    assert message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_workers_help_states_the_range():
    from dspipe.cli.data import prepare_data

    workers = next(p for p in prepare_data.params if p.name == "workers")
    assert "1-128" in workers.help


GENERATE_CASES = [
    ("--max-tokens", "0", "allowed range 1..100,000"),
    ("--max-tokens", HUGE, "is too large"),
    ("--temperature", "nan", "allowed: finite, [0, 100]"),
    ("--temperature", "inf", "got inf"),
    ("--temperature", "-1", "--temperature must be >= 0"),
    ("--top-k", "-1", "allowed range 0.."),
    ("--seed", "-1", "--seed must be >= 0"),
    ("--seed", str(2**63), "is too large"),
]


@pytest.mark.parametrize("flag,value,message", GENERATE_CASES, ids=[f"{f}={v[:12]}" for f, v, _ in GENERATE_CASES])
def test_generate_refuses_sampling_numbers_before_loading_anything(flag, value, message, tmp_path, capsys):
    code = run_cli("generate", tmp_path / "nothing-here", "--prompt", "x", flag, value)
    err = capsys.readouterr().err
    assert_one_line_with_range(code, err, flag)
    assert message in err, err


@pytest.mark.parametrize("value", ["", "  "])
def test_bench_refuses_an_empty_append_path_before_starting_ranks(value, tmp_path, capsys, monkeypatch):
    from dspipe.tools import bench

    def no_launch(**kwargs):
        raise AssertionError("bench started ranks for an empty --append")

    monkeypatch.setattr(bench, "run_side", no_launch)
    monkeypatch.chdir(tmp_path)
    code = run_cli("bench", "--model", "tiny", "--gpu", "cpu", "--global-batch", "16", "--append", value)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--append needs a markdown file's path" in err, err
    assert list(tmp_path.iterdir()) == []
