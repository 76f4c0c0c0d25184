"""benchmarks/gpu_suite.py's plumbing on CPU: --only picks and orders steps, an unknown step is a usage error, and
the dspipe-only bench tables of one step parse into one figure per run."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "benchmarks" / "gpu_suite.py")
gpu_suite = importlib.util.module_from_spec(_spec)
sys.modules["gpu_suite"] = gpu_suite
_spec.loader.exec_module(gpu_suite)

TABLES = """\
bench: tiny-llama+custom 478.82M params (L4 h1024 a16 kv4 s2048 V32000 rmsnorm swiglu rope no-bias moe32x1024-top4) \
| world 1 = dp 1 x pp 1 | ZeRO-0 offload none | bf16 | recompute none | batch 4 x ga 4 x dp 1 = 16 seq (32,768 \
tokens/step) | 2 warm-up + 5 measured steps
bench: dspipe on 1 rank(s) ...
                                        dspipe
tokens/s                                47,801
step time (ms)                           685.5
  backward + grad reduction (ms)         335.6
  optimizer step (ms)                     59.2
peak allocated (GiB)                     12.56
plan: step time 680.0 ms, measured 685.5 ms (plan / measured 0.99)
plan: memory 12.86 GiB, peak allocated 12.56 GiB (plan / measured 1.02)
bench: tiny-llama+custom 478.82M params (L4 h1024 a16 kv4 s2048 V32000 rmsnorm swiglu rope no-bias moe32x1024-top4) \
| world 1 = dp 1 x pp 1 | ZeRO-2 offload none | bf16 | recompute none | batch 16 x ga 1 x dp 1 = 16 seq (32,768 \
tokens/step) | 2 warm-up + 5 measured steps
bench: dspipe on 1 rank(s) ...
                                        dspipe
tokens/s                                22,376
step time (ms)                         1,464.4
  backward + grad reduction (ms)       1,100.4
  optimizer step (ms)                     77.1
peak allocated (GiB)                     13.39
plan: step time 196.0 ms, measured 1,464.4 ms (plan / measured 0.13)
plan: memory 22.90 GiB, peak allocated 13.39 GiB (plan / measured 1.71)
"""


def test_tables_of_one_step_parse_run_by_run():
    figures = gpu_suite.parse_benches(TABLES)
    assert figures["runs"] == ["ZeRO-0 micro 4 x ga 4", "ZeRO-2 micro 16 x ga 1"]
    assert figures["step time (ms)"] == ["685.5", "1,464.4"]
    assert figures["backward + grad reduction (ms)"] == ["335.6", "1,100.4"]
    assert figures["peak allocated (GiB)"] == ["12.56", "13.39"]
    assert figures["plan / measured step"] == ["0.99", "0.13"]
    assert figures["plan / measured memory"] == ["1.02", "1.71"]


def test_only_runs_the_named_steps_in_its_order(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(gpu_suite, "detected_gpu", lambda: None)
    monkeypatch.setattr(
        gpu_suite, "run_with_fallbacks", lambda step, **_: ran.append(step.name) or {"status": "ok", "seconds": 0.0}
    )
    assert gpu_suite.main(["--out", str(tmp_path), "--only", "window", "fused-adam", "window"]) == 0
    assert ran == ["window", "fused-adam"]
    text = (tmp_path / "suite.md").read_text()
    assert text.index("| window:") < text.index("| fused-adam:")


def test_an_unknown_step_is_a_usage_error_naming_the_steps(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_suite.main(["--out", str(tmp_path / "suite"), "--only", "bench-gtp"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no step bench-gtp" in err and "bench-gpt" in err
    assert not list(tmp_path.iterdir())
