"""dspipe bench: the arithmetic and report (fast), the input checks, and one real run beside the reference."""

import re
import shlex

import pytest

from tests.helpers import ROOT, documented, run_documented


@pytest.mark.distributed
def test_bench_with_compare_on_2_cpu_ranks(tmp_path):
    """The benchmark how-to's CPU line, as written, in a fresh directory: a short `--compare --compile` run of the tiny
    GPT on 2 CPU ranks, appending its section to a file there."""
    command = documented(ROOT / "docs" / "howto" / "benchmark.md", "dspipe bench")
    argv = shlex.split(command, comments=True)
    doc = tmp_path / argv[argv.index("--append") + 1]
    r = run_documented(command, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert "world 2 = dp 2 x pp 1 | ZeRO-1 offload none | fp32" in out and "batch 2 x ga 2 x dp 2 = 8 seq" in out
    # dspipe's blocks compiled (check_engine refuses a run whose compiled_blocks disagree), the reference compiled too
    assert "| blocks compiled\n" in out
    tokens = re.search(r"^tokens/s\s+([\d,]+)\s+([\d,]+)$", out, re.M)
    assert tokens, out
    d_tps, r_tps = (float(t.replace(",", "")) for t in tokens.groups())
    assert d_tps > 0 and r_tps > 0
    assert re.search(r"MFU\s+n/a\s+n/a", out)  # no peak for a CPU
    for label in ("forward", "backward \\+ grad reduction", "optimizer step", "peak RSS per rank \\(GiB\\)"):
        assert re.search(label + r".*\s+[\d,.]+\s+[\d,.]+$", out, re.M), label
    ratio = float(re.search(r"dspipe / reference tokens/s: ([\d.]+)", out).group(1))
    assert ratio == pytest.approx(d_tps / r_tps, rel=0.01)
    # same seed, same weights, same batches, fp32, both compiled: the first step's loss (before any update) is the
    # same function
    d_loss, r_loss = map(float, re.search(r"first-step loss: dspipe ([\d.]+), reference ([\d.]+)", out).groups())
    assert abs(d_loss - r_loss) < 1e-4 and abs(d_loss - 8.318) < 0.05, (d_loss, r_loss)  # ln(4096) = 8.318
    # the plan's word beside the measurement: the step time it predicts against the one in the table, and its
    # resident bytes per rank against the peak RSS
    step_ms = re.search(r"^step time \(ms\)\s+([\d,.]+)\s", out, re.M).group(1)
    word = re.search(r"^plan: step time ([\d,.]+) ms, measured ([\d,.]+) ms \(plan / measured ([\d.]+)\)$", out, re.M)
    assert word and word.group(2) == step_ms, out[-2000:]
    planned, measured = (float(g.replace(",", "")) for g in word.groups()[:2])
    assert planned > 0 and float(word.group(3)) == pytest.approx(planned / measured, abs=0.01)
    assert re.search(r"^plan: memory [\d.]+ GiB, peak RSS per rank [\d.]+ GiB \(plan / measured [\d.]+\)$", out, re.M)
    text = doc.read_text()
    assert word.group(0) + "  " in text
    assert f"- command: `{shlex.join(argv)}`" in text  # the command as run
    assert f"| tokens/s | {tokens.group(1)} | {tokens.group(2)} |" in text
    assert "torch 2" in text and "deepspeed" in text and re.search(r"\| \d+ torch thread\(s\) per rank", text)
