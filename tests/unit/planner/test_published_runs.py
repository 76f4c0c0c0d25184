"""benchmarks/published_runs.py: the planner against published training runs (docs/published-runs.md)."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("published_runs", ROOT / "benchmarks" / "published_runs.py")
published_runs = importlib.util.module_from_spec(_spec)
sys.modules["published_runs"] = published_runs  # dataclasses look their module up while the file executes
_spec.loader.exec_module(published_runs)


@pytest.fixture(scope="module")
def rows():
    return published_runs.rows()


def test_doc_is_current(rows):
    """The doc is what the script writes now (regenerate with --write after a planner or catalog change)."""
    assert published_runs.DOC.read_text() == published_runs.document(rows)
    assert published_runs.main(["--check"]) == 0


def test_every_ratio_within_the_band(rows):
    low, high = published_runs.BAND
    off = {r.run.name: round(r.ratio, 2) for r in rows if not low <= r.ratio <= high}
    assert not off, f"planner / published tokens/s per GPU outside {low}-{high}: {off}"
    assert len(rows) >= 8 and {r.run.gpu.split("-")[0] for r in rows} >= {"a100", "h100"}
    assert any(r.run.tp > 1 for r in rows) and any(r.run.tp == 1 for r in rows)


def test_large_dp_zero3_pair_falls_per_gpu(rows):
    by_name = {r.run.name: r for r in rows}
    small, large = (by_name[n] for n in published_runs.DP_PAIR)
    assert small.run.zero == large.run.zero == 3 and large.run.gpus >= 4 * small.run.gpus
    assert large.run.tokens_per_s_per_gpu < small.run.tokens_per_s_per_gpu  # the published figures
    assert large.tokens_per_s_per_gpu < small.tokens_per_s_per_gpu  # the planner's


def test_inter_node_collectives_use_the_nodes_nic_total():
    """A ZeRO-3 group across nodes is charged the node's NIC sum (8 x 46 GB/s on H100), not one GPU's share: the
    64-GPU MPT-13B H100 run would be communication-bound at 46 GB/s."""
    r = published_runs.evaluate(next(r for r in published_runs.RUNS if r.name == "MPT-13B, 64x H100"))
    assert r.ratio > 0.67


def test_the_megatron_tp_rows_pin_sequence_parallelism_off(rows):
    """Megatron-LM's Table 1 ran without sequence parallelism (Korthikanti et al. 2022 came later): its tp rows pin
    tp_sp off, whereas the planner's default (on) re-gathers each column-parallel input in backward, synchronous in
    dspipe, and would predict a lower throughput for the same layout (its micro-batch free to grow: SP's activations
    are smaller)."""
    from dataclasses import replace

    tp_rows = [r for r in rows if r.run.tp > 1]
    assert tp_rows and not any(r.run.tp_sp for r in tp_rows)
    for r in tp_rows:
        on = published_runs.evaluate(replace(r.run, tp_sp=True))
        assert on.plan.split(", micro")[0] == r.plan.split(", micro")[0], r.run.name  # the pinned layout
        assert on.tokens_per_s_per_gpu < r.tokens_per_s_per_gpu, r.run.name


def test_zero3_at_scale_is_bandwidth_bound_and_loses_to_tp_pp(rows):
    """Megatron-LM's Table 2: at the same global batch, twice the GPUs halve ZeRO-3's micro-batch and its step time
    stays (each GPU still gathers the whole model per pass); at 1,536 GPUs tp 8 x pp 12 trains ~3x the tokens per
    GPU. The planner reproduces both (one NIC per GPU beyond 32 nodes, half the gathers hidden)."""
    by_name = {r.run.name: r for r in rows}
    a, b = (by_name[n] for n in published_runs.ZERO3_AT_SCALE)
    assert a.run.zero == b.run.zero == 3 and b.run.gpus == 2 * a.run.gpus and a.run.micro_batch == 2 * b.run.micro_batch
    published = [published_runs.published_step_s(r.run) for r in (a, b)]
    planned = [s / r.ratio for s, r in zip(published, (a, b), strict=True)]
    assert published[1] == pytest.approx(published[0], rel=0.02)
    assert planned[1] == pytest.approx(planned[0], rel=0.05), planned
    ptdp = next(r for r in rows if r.run.model == b.run.model and r.run.pp > 1 and r.run.gpus == b.run.gpus)
    assert ptdp.run.tokens_per_s_per_gpu > 3 * b.run.tokens_per_s_per_gpu
    assert ptdp.tokens_per_s_per_gpu > 3 * b.tokens_per_s_per_gpu


def test_the_nic_total_is_credited_up_to_32_nodes_only():
    """The same ZeRO-3 collective over 32 nodes runs at the node's 8 NICs, over 33 at one: the step of a pinned
    ZeRO-3 plan with the same work per GPU jumps there."""
    from dspipe.planner import timing
    from dspipe.spec.hardware import gpu_type

    gpu = gpu_type("a100-80g")
    assert timing._across_gbps(gpu=gpu, span=256, stride=1, g=8) == min(gpu.intra_node_gbps, 8 * gpu.inter_node_gbps)
    assert timing._across_gbps(gpu=gpu, span=264, stride=1, g=8) == gpu.inter_node_gbps
    assert timing._across_gbps(gpu=gpu, span=256, stride=8, g=8) == gpu.inter_node_gbps  # one rank per node


def test_half_of_zero3s_collectives_hide_behind_compute():
    """timing.ZERO3_OVERLAP: the fitted fraction, and the published ZeRO-3 / FSDP rows it was fitted to stay inside
    0.9-1.15 (hiding them whole, they were 0.97-1.46)."""
    zero3 = [published_runs.evaluate(r) for r in published_runs.RUNS if r.zero == 3]
    assert len(zero3) == 14 and all(0.9 < r.ratio < 1.15 for r in zero3), [round(r.ratio, 2) for r in zero3]


def test_metas_interleaved_405b_runs_fit_and_show_deepspeeds_bubble():
    """Meta's Llama 3 405B layout (tp 8 x pp 16 at 32 and 16 micro-batches per step) fits the planner's memory with
    part of each stage recomputed; what keeps it at about half of Meta's MFU is DeepSpeed's non-interleaved 1F1B
    bubble, (p - 1) / m of the compute: a quarter of the step and more, the larger the fewer micro-batches."""
    meta = [published_runs.evaluate(r) for r in published_runs.INTERLEAVED]
    assert [r.run.gpus for r in meta] == [8192, 16384]
    for r in meta:
        assert r.fits and "pp 16, tp 8" in r.plan and "recompute full (first" in r.plan, r.plan
        assert 0.40 < r.published_mfu < 0.45 and r.ratio < published_runs.BAND[0]
    assert 0.25 < meta[0].bubble_share < meta[1].bubble_share
