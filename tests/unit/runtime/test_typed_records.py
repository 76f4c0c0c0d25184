"""Issue 39: engine.json's start-up block (StartupRecord) and dspipe.json's estimate (RunEstimate) are typed, read
and written in one place each, in the format they have always had."""

import json

import pytest

from dspipe.errors import SpecError
from dspipe.jsonio import dumps
from dspipe.run_estimate import RunEstimate
from dspipe.runtime.engine_file import StartupRecord, engine_text

SETTINGS = {
    "zero_stage": 1,
    "dp": 2,
    "pp": 1,
    "backend": "gloo",
    "wrapper_optimizer": "DeepSpeedZeroOptimizer",
    "base_optimizer": "AdamW",
    "world_size": 2,
}
BLOCK = {
    "mode": "device",
    "rss_before_build_mib": [700.0, 720.3],
    "build_rss_mib": [800.0, 830.0],
    "peak_rss_mib": [900.0, 1000.5],
    "seconds_build": [1.25, 1.5],
    "seconds_to_first_step": [12.5, 11.0],
    "built_params": [152, 153],
}


def test_an_engine_json_in_the_current_format_round_trips_byte_identical(tmp_path):
    written = dumps({**SETTINGS, "nonfinite_guard": True, "startup": BLOCK}, what="engine.json")  # as runners did
    record = StartupRecord.from_engine(json.loads(written), source="engine.json")
    assert record.mode == "device" and record.worst_rank == 1 and record.ranks == 2
    assert record.built_params == (152, 153)
    assert engine_text(SETTINGS, guarded=True, startup=record, what="engine.json") == written


def test_a_block_without_built_params_reads_and_writes_without_them():
    old = {k: v for k, v in BLOCK.items() if k != "built_params"}
    record = StartupRecord.from_dict(old, source="engine.json")
    assert record.built_params is None and json.dumps(record.to_dict()) == json.dumps(old)


def test_an_engine_json_without_the_block_has_none():
    assert StartupRecord.from_engine(SETTINGS, source="engine.json") is None


@pytest.mark.parametrize(
    "edit, words",
    [
        (
            lambda b: b.pop("peak_rss_mib"),
            "startup.peak_rss_mib is damaged: one number in 0..1e9 per rank expected, got None",
        ),
        (lambda b: b.update(mode=3), "startup.mode is damaged: one of device, partitioned, stage expected, got 3"),
        (lambda b: b.update(mode="x"), "startup.mode is damaged: one of device, partitioned, stage expected, got 'x'"),
        (lambda b: b.update(peak_rss_mib=[0, 1.0]), "startup.peak_rss_mib is damaged: a process's RSS is above 0"),
        (lambda b: b.update(built_params=[0, 2]), "startup.built_params is damaged: one integer >= 1 per rank"),
        (lambda b: b.update(seconds_build=[1.0]), "startup.seconds_build is damaged"),
        (lambda b: b.update(build_rss_mib=[1.0, "x"]), "startup.build_rss_mib is damaged"),
        (lambda b: b.update(built_params=[1.5, 2]), "startup.built_params is damaged"),
    ],
)
def test_a_missing_or_mistyped_key_is_one_line_naming_file_and_key(tmp_path, edit, words):
    block = json.loads(json.dumps(BLOCK))
    edit(block)
    source = tmp_path / "engine.json"
    with pytest.raises(SpecError) as e:
        StartupRecord.from_engine({**SETTINGS, "startup": block}, source=source)
    assert str(e.value).startswith(f"{source}'s startup.") and words in str(e.value) and "\n" not in str(e.value)


ESTIMATE = {
    "num_params": 100,
    "zero_stage": 1,
    "offload": "none",
    "precision": "bf16",
    "memory_per_gpu_bytes": {"params": 1, "total": 10},
    "step_time_s": 0.5,
    "tokens_per_s": 2000.0,
    "mfu": None,
    "startup": {"mode": "device", "ranks_per_node": 2},
    "checkpoint": {"bytes": 5},
    "fits": True,
}


def test_the_estimate_round_trips_and_types_what_readers_use():
    est = RunEstimate.from_dict(json.loads(json.dumps(ESTIMATE)), source="dspipe.json")
    assert json.dumps(est.to_dict()) == json.dumps(ESTIMATE)
    assert (est.tokens_per_s, est.mfu, est.step_time_s, est.memory_total_bytes) == (2000.0, None, 0.5, 10.0)
    assert est.checkpoint == {"bytes": 5} and est.startup["mode"] == "device" and not est.save_interval_auto
    assert est.layout() == {"num_params": 100, "zero_stage": 1, "offload": "none", "precision": "bf16"}
    auto = RunEstimate.written(ESTIMATE, auto_interval=True)
    assert auto.save_interval_auto and list(auto.to_dict())[-1] == "save_interval_auto"
    assert RunEstimate.written(ESTIMATE).to_dict() == ESTIMATE


@pytest.mark.parametrize(
    "estimate, words",
    [
        ("fast", "estimate must be an object, got str"),
        ({**ESTIMATE, "mfu": "high"}, "estimate.mfu must be a number >= 0 or null, got 'high'"),
        ({**ESTIMATE, "memory_per_gpu_bytes": []}, "estimate.memory_per_gpu_bytes must be an object"),
        ({**ESTIMATE, "save_interval_auto": "yes"}, "estimate.save_interval_auto must be true when present"),
        # figures the planner never predicts as 0 (report showed a 0 prediction as "ok", calibrate folded it)
        ({**ESTIMATE, "tokens_per_s": 0}, "estimate.tokens_per_s must be more than 0 (the planner never predicts 0)"),
        ({**ESTIMATE, "step_time_breakdown_s": {"compute": 0.0}}, "estimate.step_time_breakdown_s.compute must be"),
        ({**ESTIMATE, "first_step": {"seconds": 0}}, "estimate.first_step.seconds must be more than 0"),
    ],
)
def test_a_damaged_estimate_is_one_line_naming_file_and_key(estimate, words):
    with pytest.raises(SpecError, match="^dspipe.json: ") as e:
        RunEstimate.from_dict(estimate, source="dspipe.json")
    assert words in str(e.value)
