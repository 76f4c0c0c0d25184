"""A setting the run would not use is refused in one line (exit 2) rather than accepted and ignored: ZeRO-3's
knobs below stage 3 (as flags they restrict the search to ZeRO-3), --nvme-path without NVMe offload,
--gpu-mtbf-hours without --save-interval auto, a launch whose nodes would split a tensor-parallel group. Runs in
this process (run_cli); nothing trains."""

import json

import pytest

from tests.helpers import run_cli

PLAN = ["plan", "--model", "gpt2-124m", "--measure", "never"]


def one_error(capsys, *args) -> str:
    capsys.readouterr()
    code = run_cli(*args)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and "Traceback" not in err and len(lines) == 1, (args, err)
    return lines[0]


@pytest.mark.parametrize(
    "flags,words",
    [
        (
            ["--zero", "0", "--max-live-parameters", "5000000"],
            "--max-live-parameters 5000000 needs ZeRO-3 (got ZeRO-0): only stage 3 gathers and prefetches parameters",
        ),
        (
            ["--zero", "2", "--prefetch-bucket-size", "100", "--max-reuse-distance", "3"],
            "--prefetch-bucket-size 100, --max-reuse-distance 3 needs ZeRO-3 (got ZeRO-2)",
        ),
        (
            ["--offload", "none", "--nvme-path", "/tmp/x"],
            "--nvme-path /tmp/x needs --offload nvme (got --offload none)",
        ),
        (
            ["--zero", "3", "--offload", "cpu", "--nvme-path", "/tmp/x"],
            "--nvme-path /tmp/x needs --offload nvme (got --offload cpu)",
        ),
        (
            ["--gpu-mtbf-hours", "5"],
            "--gpu-mtbf-hours 5 has no effect without --save-interval auto (the failure rate it plans the interval "
            "against)",
        ),
    ],
)
def test_a_setting_the_plan_would_not_use_is_refused(capsys, flags, words):
    assert words in one_error(capsys, *PLAN, *flags)


def test_zero3_knobs_and_an_nvme_path_narrow_the_search(capsys):
    """Left to the planner, a ZeRO-3 knob makes it ZeRO-3 and --nvme-path NVMe offload."""
    capsys.readouterr()
    assert run_cli(*PLAN, "--max-live-parameters", "5000000", "--json") == 0
    out = capsys.readouterr().out
    assert json.loads(out)["zero_stage"] == 3, out[:300]
    assert run_cli(*PLAN, "--nvme-path", "/tmp/x") == 0
    assert "plan: ZeRO-3 + nvme offload" in capsys.readouterr().out
    assert run_cli(*PLAN, "--gpu-mtbf-hours", "5", "--save-interval", "auto") == 0


def test_a_preset_below_stage_3_carries_no_stage3_value(tmp_path, capsys):
    """A stage-2 preset's stage3_* keys (a rendered config writes them all) set nothing; one the plan cannot render
    is named with the reason."""
    preset = json.loads(open("ds_configs/zero2-bf16.json").read())
    preset["zero_optimization"]["stage3_max_live_parameters"] = 123
    path = tmp_path / "z2.json"
    path.write_text(json.dumps(preset))
    args = ["gen-config", "--preset", path, "--model", "tiny", "--gpu", "cpu", "--gpus-per-node", "2"]
    line = one_error(capsys, *args, "--global-batch", "16", "--out", tmp_path / "run")
    assert (
        "zero_optimization.stage3_max_live_parameters 123 cannot be honoured: this plan renders 1310720 (stage 2: "
        "DeepSpeed reads it under stage 3 only" in line
    )
    assert not (tmp_path / "run").exists()


def test_a_launch_that_would_split_a_tensor_parallel_group_is_refused(tmp_path, corpus, capsys, monkeypatch):
    """A tp 2 run planned for 2 nodes x 2: a hostfile of 4 nodes x 1 has its world size, but each tp pair would
    span two nodes; 2 x 2 launches."""
    monkeypatch.chdir(tmp_path)
    args = ["--model", "tiny", "--gpu", "cpu", "--nodes", "2", "--gpus-per-node", "2", "--global-batch", "8"]
    assert run_cli("gen-config", *args, "--tp", "2", "--zero", "1", "--data", corpus, "--out", "run") == 0
    (tmp_path / "h41").write_text("".join(f"a{i} slots=1\n" for i in range(4)))
    (tmp_path / "h22").write_text("a0 slots=2\na1 slots=2\n")
    (tmp_path / "h31").write_text("a0 slots=3\na1 slots=1\n")
    line = one_error(capsys, "launch", "run", "--dry-run", "--hostfile", "h41")
    assert (
        "run runs tp 2: each node's slots must be a multiple of 2, or a tensor-parallel group spans two nodes" in line
    )
    assert "(slots a0 1, a1 1, a2 1, a3 1 of a0:0 + a1:0 + a2:0 + a3:0; the plan has 2 x 2)" in line
    assert "slots a0 3, a1 1 of" in one_error(capsys, "launch", "run", "--dry-run", "--hostfile", "h31")
    capsys.readouterr()
    assert run_cli("launch", "run", "--dry-run", "--hostfile", "h22") == 0
    assert "deepspeed --hostfile h22" in capsys.readouterr().out
