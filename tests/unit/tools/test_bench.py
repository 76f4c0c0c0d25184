"""dspipe bench: the arithmetic and report (fast), the input checks, and one real run beside the reference."""

import re

import pytest

from dspipe.tools import bench
from tests.helpers import dspipe


def _rank(seconds, *, loss=8.3, phases=(1.0, 2.0, 0.5), rss=2**30, allocated=None):
    return {
        "seconds": seconds,
        "first_loss": loss,
        "phases": dict(zip(bench.PHASES, phases, strict=True)),
        "peak_rss": rss,
        "peak_allocated": allocated,
        "peak_reserved": allocated,
        "threads": 1,
        "engine": {"wrapper_optimizer": "W", "base_optimizer": "B", "backend": "gloo"},
    }


def test_summary_takes_the_slowest_rank_and_the_largest_memory():
    ranks = [_rank(4.0, phases=(1.0, 2.0, 0.5), rss=2**30), _rank(5.0, phases=(1.5, 1.0, 0.5), rss=3 * 2**30)]
    s = bench.summarize(
        ranks, tokens_per_step=1000, samples_per_step=4, steps=10, flops_per_token=6e9, world_size=2, peak_tflops=1.5
    )
    assert s["tokens_per_s"] == pytest.approx(10 * 1000 / 5.0)
    assert s["samples_per_s"] == pytest.approx(8.0)
    assert s["tflops_per_gpu"] == pytest.approx(2000 * 6e9 / 2 / 1e12)  # 6 TFLOP/s each
    assert s["mfu"] == pytest.approx(6.0 / 1.5)
    assert s["step_time_s"] == pytest.approx(0.5)
    assert s["phases_s"] == pytest.approx({"forward": 0.15, "backward": 0.2, "step": 0.05})
    assert s["peak_rss"] == 3 * 2**30 and s["peak_allocated"] is None
    no_peak = bench.summarize(
        ranks, tokens_per_step=1000, samples_per_step=4, steps=10, flops_per_token=6e9, world_size=2, peak_tflops=None
    )
    assert no_peak["mfu"] is None


def test_table_and_markdown_show_the_figures_ratio_and_command(tmp_path):
    common = dict(samples_per_step=4, steps=2, flops_per_token=1e6, world_size=2, peak_tflops=None)
    sides = {
        "dspipe": bench.summarize([_rank(1.0, loss=8.25)], tokens_per_step=900, **common),
        "reference": bench.summarize(
            [_rank(2.0, loss=8.2500001, phases=(2.0, 1.5, 0.5), allocated=3 * 2**29)], tokens_per_step=900, **common
        ),
    }
    table = bench.format_table(sides, header="device: X")
    assert re.search(r"tokens/s\s+1,800\s+900\b", table)
    assert re.search(r"MFU\s+n/a\s+n/a", table)
    assert re.search(r"forward \(ms\)\s+500\.0\s+1,000\.0", table)  # 1.0 s and 2.0 s over 2 steps
    assert re.search(r"peak allocated \(GiB\)\s+n/a\s+1\.50", table)
    assert "dspipe / reference tokens/s: 2.000" in table
    assert "dspipe 8.25000000, reference 8.25000010, difference 1.00e-07" in table
    assert bench.ratio(sides["dspipe"], sides["reference"]) == pytest.approx(2.0)

    doc = tmp_path / "bench.md"
    doc.write_text("# Benchmarks\n\nintro\n")
    section = bench.markdown_section(
        sides, date="2026-01-02", device="CPU Y", versions="python 3", command="dspipe bench", setup="tiny"
    )
    bench.append_section(doc, section)
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nintro\n\n### 2026-01-02: CPU Y\n")
    assert "- command: `dspipe bench`" in text and "| tokens/s | 1,800 | 900 |" in text
    assert "dspipe / reference tokens/s: 2.000" in text
    only = bench.format_table({"dspipe": sides["dspipe"]}, header="h")
    assert "reference" not in only and "1,800" in only
    # --reference both: the eager reference is a third column with its own ratio and loss line
    three = {**sides, "eager": bench.summarize([_rank(4.0, loss=8.25)], tokens_per_step=900, **common)}
    table = bench.format_table(three, header="h")
    assert re.search(r"^\s+dspipe\s+reference\s+eager reference$", table, re.M)
    assert re.search(r"tokens/s\s+1,800\s+900\s+450\b", table)
    assert "dspipe / reference tokens/s: 2.000" in table and "dspipe / eager reference tokens/s: 4.000" in table
    assert "| | dspipe | reference | eager reference |" in bench.markdown_section(
        three, date="d", device="D", versions="v", command="c", setup="s"
    )


def test_the_plan_is_shown_beside_the_measurement(tmp_path):
    common = dict(samples_per_step=4, steps=2, tokens_per_step=900, flops_per_token=1e6, world_size=1)
    gpu = {"dspipe": bench.summarize([_rank(3.0, allocated=13 * 2**30)], peak_tflops=989.0, **common)}
    word = {"step_s": 0.75, "memory_bytes": 13 * 2**30 + 2**29, "on_host": False}  # measured: 1.5 s a step, 13 GiB
    table = bench.format_table(gpu, header="h", plan=word)
    assert "plan: step time 750.0 ms, measured 1,500.0 ms (plan / measured 0.50)" in table
    assert "plan: memory 13.50 GiB, peak allocated 13.00 GiB (plan / measured 1.04)" in table
    section = bench.markdown_section(gpu, date="d", device="D", versions="v", command="c", setup="s", plan=word)
    assert "plan: step time 750.0 ms, measured 1,500.0 ms (plan / measured 0.50)  " in section
    # CPU ranks: the plan's resident bytes per rank against the peak RSS
    cpu = {"dspipe": bench.summarize([_rank(1.0, rss=2**30)], peak_tflops=None, **common)}
    table = bench.format_table(cpu, header="h", plan={"step_s": 0.5, "memory_bytes": 2**29, "on_host": True})
    assert "plan / measured 1.00)" in table and "plan: memory 0.50 GiB, peak RSS per rank 1.00 GiB" in table
    assert "plan:" not in bench.format_table(cpu, header="h")  # no plan given, no line


def test_the_plans_word_is_its_predicted_peak_not_the_gpus_capacity():
    from dspipe.planner.search import StrategyRequest, search
    from dspipe.spec.cluster import ClusterSpec
    from dspipe.spec.presets import MODEL_PRESETS
    from dspipe.spec.train import TrainSpec

    def best(gpu):
        return search(
            model=MODEL_PRESETS["gpt2-124m"],
            cluster=ClusterSpec(1, 1 if gpu != "cpu" else 2, gpu),
            train=TrainSpec(global_batch=16, micro_batch=2, steps=10, warmup_steps=2),
            request=StrategyRequest(),
        ).best.est

    est = best("h200")
    word = bench.plan_word(est, on_host=False)
    assert word["memory_bytes"] == est.memory.total < est.gpu_memory_bytes  # the prediction, not the 141 GiB
    assert word["step_s"] == est.step_time_s > 0 and word["on_host"] is False
    est = best("cpu")
    assert bench.plan_word(est, on_host=True)["memory_bytes"] == est.resident_bytes > est.memory.total


def test_cpu_ranks_share_the_cores():
    assert bench.cpu_threads(ranks=2, cpus=2, env={}) == 1
    assert bench.cpu_threads(ranks=2, cpus=16, env={}) == 8
    assert bench.cpu_threads(ranks=4, cpus=2, env={}) == 1
    assert bench.cpu_threads(ranks=2, cpus=16, env={"OMP_NUM_THREADS": "3"}) is None  # the user's choice stands


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--global-batch", "10", "--micro-batch", "3"],
            "global batch 10 is not divisible by micro_batch 3 x dp 2 = 6",
        ),
        (["--nodes", "2"], "dspipe bench runs on this machine only (--nodes 2)"),
        (["--steps", "0"], "--warmup 3 --steps 0: both must be at least 1"),
    ],
)
def test_bad_input_is_one_line_exit_2(flags, message):
    r = dspipe("bench", "--model", "tiny", "--gpu", "cpu", *flags)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
