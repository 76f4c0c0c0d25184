"""The planner against published training runs: for each run its model, GPUs, batch and the parallel layout the
authors used (pinned in the planner), the published tokens/s per GPU, and the planner's estimate and ratio.
Writes docs/published-runs.md; --check exits 1 when the doc is stale.

    python benchmarks/published_runs.py [--write | --check]
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dspipe.planner.search import search  # noqa: E402
from dspipe.planner.throughput import model_flops_per_token  # noqa: E402
from dspipe.spec.cluster import ClusterSpec  # noqa: E402
from dspipe.spec.core import StrategyRequest  # noqa: E402
from dspipe.spec.hardware import gpu_type  # noqa: E402
from dspipe.spec.model import ModelSpec  # noqa: E402
from dspipe.spec.presets import MODEL_PRESETS, model_preset  # noqa: E402
from dspipe.spec.train import TrainSpec  # noqa: E402

DOC = ROOT / "docs" / "published-runs.md"
BAND = (0.67, 1.5)
"""Planner / published tokens/s per GPU every run must lie in (tests/unit/planner/test_published_runs.py)."""

FOUNDRY = (
    "MosaicML llm-foundry, scripts/train/benchmarking/README.md, table '{table}', row {row} "
    "(FSDP FULL_SHARD, bf16, flash attention)"
)
MEGATRON = (
    "Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU Clusters Using "
    "Megatron-LM' (arXiv 2104.04473), Table 1, row {row} (Selene, DGX A100 80GB, 8x HDR InfiniBand per node)"
)

TABLE_2 = (
    "Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM' "
    "(arXiv 2104.04473), Table 2, {scheme}, row {row} (Selene, DGX A100 80GB, 8x HDR InfiniBand per node; 300B "
    "tokens)"
)


def mpt(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    """An MPT benchmark model as llm-foundry's benchmark yamls build it: GPT block without biases, MLP 4h, tied
    embeddings, vocab 50432 (padded), learned positions (the table's NumParams grow with the sequence length)."""
    return ModelSpec(name, layers, hidden, heads, 50432, 2048, 4 * hidden, bias=False)


def megatron_gpt(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    """A GPT of Megatron-LM's scaling table: vocab 51,200, sequence 2048, MLP 4h, biases, learned positions."""
    return ModelSpec(name, layers, hidden, heads, 51200, 2048, 4 * hidden)


def megatron_flops_per_token(m: ModelSpec) -> float:
    """The FLOPs per token Narayanan et al. count (their eq. 3 / (B.s), full recomputation included):
    96.l.h^2 (1 + s/6h + V/16lh)."""
    layers, h, s, v = m.layers, m.hidden, m.seq_len, m.vocab
    return 96 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


@dataclass(frozen=True)
class PublishedRun:
    """One published training run (or benchmark run) and its measured throughput."""

    name: str
    """Short label for the table."""
    model: ModelSpec
    """The model's shape as the source gives it."""
    gpu: str
    """Catalog GPU type of the run."""
    gpus: int
    """GPUs in the run (8 per node)."""
    global_batch: int
    """Sequences per optimizer step."""
    tokens_per_s_per_gpu: float
    """Published (or derived, see `derived`) training throughput, tokens/s per GPU."""
    derived: str
    """How tokens_per_s_per_gpu follows from the source's figure ('' when the source states it)."""
    source: str
    """Paper or report, table or section."""
    zero: int
    """ZeRO stage pinned in the planner (FSDP FULL_SHARD = 3; Megatron-LM's plain data parallelism = 1: DeepSpeed
    refuses ZeRO-0 bf16 with tp, and ZeRO-1's reduce-scatter + all-gather move the bytes of one all-reduce)."""
    checkpointing: str | None
    """Activation recomputation the run used: 'none' or 'full' (None: not published, the planner chooses)."""
    tp: int = 1
    """Tensor-parallel size the run used."""
    pp: int = 1
    """Pipeline stages the run used."""
    tp_sp: bool = False
    """Whether the run used Megatron sequence parallelism with its tp (pinned: the planner's default is on;
    Megatron-LM's Table 1 runs predate it, Korthikanti et al. 2022)."""
    micro_batch: int | None = None
    """Micro-batch per GPU where published (None: the planner chooses)."""
    tokens: float | None = None
    """Training tokens of the whole run, where it is a real training run (for days)."""
    published_days: float | None = None
    """Published wall-clock days of the whole run, where given."""
    recompute_blocks: int | None = 0
    """Blocks per stage full recomputation re-runs (0: every block, as the papers ran; None: not published, the
    planner's fewest that fit)."""


MPT_1B, MPT_3B, MPT_7B, MPT_13B = (
    mpt("mpt-1b", 24, 2048, 16),
    mpt("mpt-3b", 32, 2560, 20),
    mpt("mpt-7b", 32, 4096, 32),
    mpt("mpt-13b", 40, 5120, 40),
)
H100_TABLE, A100_80_TABLE, A100_40_TABLE = (
    "H100 80GB BF16",
    "A100 80GB with 1600 Gbps node-node interconnect (RoCE)",
    "A100 40GB with 1600 Gbps node-node interconnect (RoCE)",
)
MEG_1_7B = megatron_gpt("megatron-1.7b", 24, 2304, 24)
MEG_18B = megatron_gpt("megatron-18.4b", 40, 6144, 48)
MEG_7_5B = megatron_gpt("megatron-7.5b", 36, 4096, 32)
MEG_175B = megatron_gpt("megatron-174.6b", 96, 12288, 96)
MEG_530B = megatron_gpt("megatron-529.6b", 105, 20480, 128)


def _megatron_rate(model: ModelSpec, tflops: float) -> float:
    return tflops * 1e12 / megatron_flops_per_token(model)


def foundry(
    name: str,
    model: ModelSpec,
    gpu: str,
    gpus: int,
    global_batch: int,
    tokens_per_s: float,
    *,
    table: str,
    micro_batch: int,
    checkpointing: str = "none",
) -> PublishedRun:
    """One row of llm-foundry's benchmark tables: FSDP FULL_SHARD (ZeRO-3), the stated tokens/s per GPU."""
    row = f"{model.name.removeprefix('mpt-')} / {model.seq_len} / {gpus} GPUs"
    return PublishedRun(
        name,
        model,
        gpu,
        gpus,
        global_batch,
        tokens_per_s,
        "",
        FOUNDRY.format(table=table, row=row),
        zero=3,
        checkpointing=checkpointing,
        micro_batch=micro_batch,
    )


def _megatron_run(name: str, model: ModelSpec, gpus: int, global_batch: int, tflops: float, source: str, **layout):
    """A Megatron-LM paper row on Selene's A100-80G, full recomputation, tokens/s per GPU derived from its TFLOP/s."""
    how = f"{tflops:g} TFLOP/s per GPU / the paper's 96.l.h^2(1 + s/6h + V/16lh) FLOPs per token"
    rate = _megatron_rate(model, tflops)
    return PublishedRun(name, model, "a100-80g", gpus, global_batch, rate, how, source, checkpointing="full", **layout)


def megatron(name: str, model: ModelSpec, gpus: int, global_batch: int, tflops: float, *, tp: int) -> PublishedRun:
    """One row of Megatron-LM's Table 1 (p 1, full recomputation)."""
    row = f"{name.split()[1]} (t {tp}, p 1, {gpus} GPUs, batch {global_batch})"
    label = f"{name}, {gpus}x A100, " + (f"tp {tp}" if tp > 1 else "dp only")
    return _megatron_run(label, model, gpus, global_batch, tflops, MEGATRON.format(row=row), zero=1, tp=tp)


def table_2(model: ModelSpec, gpus: int, global_batch: int, tflops: float, *, tp: int, pp: int, micro: int):
    """One row of Megatron-LM's Table 2 (300B tokens, full recomputation): 'ZeRO-3 without model parallelism'
    (DeepSpeed's ZeRO-3, tp 1, pp 1) or 'PTD-P' (Megatron's tp x pp with data parallelism). The micro-batch is the
    table's."""
    zero3 = tp == pp == 1
    scheme = "'ZeRO-3 without model parallelism'" if zero3 else "'PTD-P'"
    size = model.name.removeprefix("megatron-").upper()
    row = f"{size} (model-parallel size {tp * pp}, batch {global_batch}, {gpus} GPUs, micro-batch {micro})"
    label = f"{size} {'ZeRO-3' if zero3 else f'tp {tp} x pp {pp}'}, {gpus}x A100"
    source = TABLE_2.format(scheme=scheme, row=row)
    zero = 3 if zero3 else 1
    return _megatron_run(
        label, model, gpus, global_batch, tflops, source, zero=zero, tp=tp, pp=pp, micro_batch=micro, tokens=300e9
    )


RUNS: tuple[PublishedRun, ...] = (
    foundry("MPT-1B, 64x H100", MPT_1B, "h100-80g", 64, 1280, 44402, table=H100_TABLE, micro_batch=20),
    foundry("MPT-7B, 8x H100", MPT_7B, "h100-80g", 8, 48, 10643, table=H100_TABLE, micro_batch=6),
    foundry("MPT-13B, 64x H100", MPT_13B, "h100-80g", 64, 128, 4800, table=H100_TABLE, micro_batch=2),
    foundry("MPT-7B, 8x A100-80GB", MPT_7B, "a100-80g", 8, 96, 4641, table=A100_80_TABLE, micro_batch=6),
    foundry(
        "MPT-13B, 64x A100-40GB, recompute",
        MPT_13B,
        "a100-40g",
        64,
        1024,
        1976,
        table=A100_40_TABLE,
        micro_batch=16,
        checkpointing="full",
    ),
    foundry("MPT-3B, 32x A100-40GB", MPT_3B, "a100-40g", 32, 192, 9914, table=A100_40_TABLE, micro_batch=6),
    foundry("MPT-3B, 128x A100-40GB", MPT_3B, "a100-40g", 128, 768, 9538, table=A100_40_TABLE, micro_batch=6),
    PublishedRun(
        "TinyLlama 1.1B, 16x A100-40GB",
        MODEL_PRESETS["tinyllama-1.1b"],
        "a100-40g",
        16,
        1024,
        24000,
        "",
        "Zhang et al. 2024, 'TinyLlama: An Open-Source Small Language Model' (arXiv 2401.02385), section "
        "2.3: 24,000 tokens/s per A100-40G, no activation checkpointing, FSDP; 3T tokens on 16 GPUs, "
        "batch ~2M tokens (1024 x 2048)",
        zero=3,
        checkpointing="none",
        tokens=3e12,
    ),
    megatron("Megatron-LM 1.7B", MEG_1_7B, 32, 512, 137, tp=1),
    megatron("Megatron-LM 18.4B", MEG_18B, 256, 1024, 135, tp=8),
    megatron("Megatron-LM 7.5B", MEG_7_5B, 128, 512, 142, tp=4),
    table_2(MEG_175B, 384, 1536, 144, tp=1, pp=1, micro=4),
    table_2(MEG_175B, 768, 1536, 88, tp=1, pp=1, micro=2),
    table_2(MEG_175B, 1536, 1536, 44, tp=1, pp=1, micro=1),
    table_2(MEG_530B, 640, 2560, 138, tp=1, pp=1, micro=4),
    table_2(MEG_530B, 1120, 2240, 98, tp=1, pp=1, micro=2),
    table_2(MEG_530B, 2240, 2240, 48, tp=1, pp=1, micro=1),
    table_2(MEG_175B, 384, 1536, 153, tp=8, pp=12, micro=1),
    table_2(MEG_175B, 768, 1536, 149, tp=8, pp=12, micro=1),
    table_2(MEG_175B, 1536, 1536, 141, tp=8, pp=12, micro=1),
    table_2(MEG_530B, 560, 2240, 171, tp=8, pp=35, micro=1),
    table_2(MEG_530B, 1120, 2240, 167, tp=8, pp=35, micro=1),
    table_2(MEG_530B, 2240, 2240, 159, tp=8, pp=35, micro=1),
)
LLAMA3_405B = model_preset("llama3.1-405b", seq_len=8192)
META_TABLE_4 = (
    "Llama Team, AI @ Meta 2024, 'The Llama 3 Herd of Models' (arXiv 2407.21783), Table 4, row {gpus:,} GPUs (TP 8, "
    "CP 1, PP 16, DP {dp}, seq 8,192, batch/DP {per_dp}, 16M tokens per batch): {tflops} TFLOP/s per GPU, BF16 MFU "
    "{mfu}%"
)


def meta_405b(gpus: int, tflops: float, mfu: int) -> PublishedRun:
    """One of Meta's Llama 3 405B pre-training configurations (8K context): tp 8 x pp 16, an interleaved 1F1B
    schedule that DeepSpeed's pipeline engine does not run; recomputation not published (the planner's fewest)."""
    dp = gpus // 128
    how = f"{tflops:g} TFLOP/s per GPU / dspipe's 6N + attention FLOPs per token (the paper gives no formula)"
    source = META_TABLE_4.format(gpus=gpus, dp=dp, per_dp=2048 // dp, tflops=tflops, mfu=mfu)
    rate = tflops * 1e12 / model_flops_per_token(LLAMA3_405B)
    return PublishedRun(
        f"Llama 3 405B, {gpus:,}x H100",
        LLAMA3_405B,
        "h100-80g",
        gpus,
        2048,
        rate,
        how,
        source,
        zero=1,
        checkpointing=None,
        tp=8,
        pp=16,
        tp_sp=True,
        micro_batch=1,
        recompute_blocks=None,
    )


INTERLEAVED: tuple[PublishedRun, ...] = (meta_405b(8192, 430, 43), meta_405b(16384, 400, 41))
"""Published runs on an interleaved pipeline schedule: evaluated and discussed, outside the table and its band (the
planner models DeepSpeed's pipeline engine, which does not interleave)."""
DP_PAIR = ("MPT-3B, 32x A100-40GB", "MPT-3B, 128x A100-40GB")
"""The same ZeRO-3 model and micro-batch at 4x the data-parallel size: published tokens/s per GPU falls."""
ZERO3_AT_SCALE = ("174.6B ZeRO-3, 768x A100", "174.6B ZeRO-3, 1536x A100")
"""Twice the GPUs at the same global batch (the micro-batch halved): ZeRO-3's step time stays (bandwidth-bound)."""


@dataclass(frozen=True)
class Row:
    """One run's published figures beside the planner's estimate."""

    run: PublishedRun
    """The published run."""
    plan: str
    """The plan the planner evaluated (its describe())."""
    fits: bool
    """Whether the planner thinks the pinned layout fits in GPU memory."""
    tokens_per_s_per_gpu: float
    """The planner's tokens/s per GPU."""
    mfu: float
    """The planner's MFU (6N + 6Lhs model FLOPs)."""
    published_mfu: float
    """The published throughput as MFU, by the same FLOPs count and the catalog's peak."""
    days: float | None
    """The planner's days for the run's tokens (None without tokens)."""
    bubble_share: float = 0.0
    """Of the planner's step time, the pipeline bubble's share."""

    @property
    def ratio(self) -> float:
        """Planner / published tokens/s per GPU."""
        return self.tokens_per_s_per_gpu / self.run.tokens_per_s_per_gpu


def evaluate(run: PublishedRun) -> Row:
    """The planner's estimate for the run with its published layout pinned (the closest plan when none fits)."""
    cluster = ClusterSpec(nodes=run.gpus // 8, gpus_per_node=8, gpu=run.gpu)
    train = TrainSpec(global_batch=run.global_batch, micro_batch=run.micro_batch or 1, steps=1000, warmup_steps=10)
    request = StrategyRequest(
        zero=run.zero,
        offload="none",
        offload_params=False,
        tp=run.tp,
        tp_sp=run.tp_sp,
        pp=run.pp,
        sp=1,
        checkpointing=run.checkpointing,
        recompute_blocks=run.recompute_blocks,
        precision="bf16",
        micro_batch=run.micro_batch,
    )
    result = search(model=run.model, cluster=cluster, train=train, request=request)
    c = result.best or result.closest
    per_gpu = c.tokens_per_s / run.gpus
    peak = gpu_type(run.gpu).peak_bf16_tflops * 1e12
    return Row(
        run=run,
        plan=c.describe(every_axis=True),
        fits=result.best is not None,
        tokens_per_s_per_gpu=per_gpu,
        mfu=c.mfu,
        published_mfu=run.tokens_per_s_per_gpu * model_flops_per_token(run.model) / peak,
        days=None if run.tokens is None else run.tokens / c.tokens_per_s / 86400,
        bubble_share=c.est.bubble_s / c.est.step_time_s,
    )


def rows() -> list[Row]:
    return [evaluate(r) for r in RUNS]


def _days(run: PublishedRun, planner_days: float | None) -> str:
    if run.tokens is None:
        return "-"
    published = run.tokens / (run.tokens_per_s_per_gpu * run.gpus) / 86400
    return f"{published:.0f} / {planner_days:.0f}"


def table(all_rows: list[Row]) -> str:
    lines = [
        "| run | model | GPUs | batch (seqs x seq) | layout (published, pinned) | published tok/s/GPU | "
        "published MFU | planner tok/s/GPU | planner MFU | days (published / planner) | planner / published |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in all_rows:
        run = r.run
        layout = f"ZeRO-{run.zero}, tp {run.tp}, pp {run.pp}, recompute {run.checkpointing}" + (
            f", micro {run.micro_batch}" if run.micro_batch else ""
        )
        fits = "" if r.fits else " (planner: does not fit)"
        lines.append(
            f"| {run.name} | {run.model.num_params / 1e9:.2f}B {run.model.shape_text} | {run.gpus} x "
            f"{run.gpu} | {run.global_batch} x {run.model.seq_len} | {layout} | "
            f"{run.tokens_per_s_per_gpu:,.0f} | {r.published_mfu * 100:.1f}% | "
            f"{r.tokens_per_s_per_gpu:,.0f}{fits} | {r.mfu * 100:.1f}% | {_days(run, r.days)} | "
            f"{r.ratio:.2f} |"
        )
    return "\n".join(lines)


def sources(all_rows: list[Row]) -> str:
    out = []
    for i, r in enumerate(all_rows, start=1):
        how = f" Derived: {r.run.derived}." if r.run.derived else ""
        out.append(f"{i}. **{r.run.name}**: {r.run.source}.{how} Planner's plan: {r.plan}.")
    return "\n".join(out)


def published_step_s(run: PublishedRun) -> float:
    """Seconds of one published step: the global batch's tokens over the run's published tokens/s."""
    return run.global_batch * run.model.seq_len / (run.tokens_per_s_per_gpu * run.gpus)


def interleaved(meta: list[Row]) -> str:
    """The paragraph on Meta's interleaved tp 8 x pp 16 runs."""
    runs = " and ".join(
        f"{r.run.gpus:,} GPUs (dp {r.run.gpus // 128}, {r.run.global_batch * 128 // r.run.gpus} micro-batches per "
        f"step): published MFU {r.published_mfu * 100:.0f}%, planner {r.mfu * 100:.1f}% (recompute "
        f"{r.plan.split('recompute ')[1]}, bubble {r.bubble_share * 100:.0f}% of the step), planner / published "
        f"{r.ratio:.2f}"
        for r in meta
    )
    text = (
        "- **Interleaved pipelines (outside the table).** "
        f"Meta's Llama 3 405B runs at tp 8 x pp 16 (Table 4 of the Llama 3 paper; sources {len(RUNS) + 1}-"
        f"{len(RUNS) + len(meta)} below): {runs}. Meta's schedule interleaves the stages (the bubble divided by "
        "the virtual stages per rank) and balances their memory; the planner models DeepSpeed's pipeline engine, whose "
        "1F1B does not interleave, so its bubble is (p - 1) / m of the compute. These rows are that difference, "
        "not a calibration point, and stay outside the band until dspipe runs an interleaved schedule. On 256 x 8 "
        "H100 the planner chooses dp 16 with 128 micro-batches per step instead (docs/howto/plan-a-cluster.md)."
    )
    return textwrap.fill(text, width=120, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)


def document(all_rows: list[Row]) -> str:
    meta = [evaluate(r) for r in INTERLEAVED]
    ratios = [r.ratio for r in all_rows]
    by_name = {r.run.name: r for r in all_rows}
    small, large = (by_name[n] for n in DP_PAIR)
    z3a, z3b = (by_name[n] for n in ZERO3_AT_SCALE)
    ptdp = next(r for r in all_rows if r.run.model == z3b.run.model and r.run.pp > 1 and r.run.gpus == z3b.run.gpus)
    z3_small, z3_large = (published_step_s(r.run) for r in (z3a, z3b))
    z3a_plan, z3b_plan = (z3_small / z3a.ratio, z3_large / z3b.ratio)
    # bf16 weights gathered twice and bf16 gradients reduce-scattered once per micro-batch (ga 1), per GPU
    z3_gbps = 3 * z3b.run.model.num_params * 2 / z3_large / 1e9
    ptdp_gain = ptdp.run.tokens_per_s_per_gpu / z3b.run.tokens_per_s_per_gpu
    ptdp_gain_plan = ptdp.tokens_per_s_per_gpu / z3b.tokens_per_s_per_gpu
    return f"""# The planner against published training runs

Generated by `python benchmarks/published_runs.py --write` (`--check` fails when this file is stale; a unit test runs
it). For each run: the model, GPUs, global batch and the parallel layout the authors published, pinned in the planner
(`search()` with zero / tp / pp / recomputation / micro-batch fixed, bf16, no offload, Megatron sequence parallelism as
the run used it); the published tokens/s per GPU; and the planner's estimate with the catalog figures of
`dspipe/spec/hardware.py` (docs/hardware.md). MFU is computed the same way for both (6N + 6Lhs model FLOPs per token
over the catalog's bf16 peak).

{table(all_rows)}

Planner / published: {min(ratios):.2f} to {max(ratios):.2f} over {len(ratios)} runs (the unit test holds every ratio
in {BAND[0]}-{BAND[1]}). The ZeRO-3 pair {DP_PAIR[0]!r} -> {DP_PAIR[1]!r} (same micro-batch, 4x the data-parallel
size): published {small.run.tokens_per_s_per_gpu:,.0f} -> {large.run.tokens_per_s_per_gpu:,.0f} tokens/s per GPU
({(large.run.tokens_per_s_per_gpu / small.run.tokens_per_s_per_gpu - 1) * 100:+.1f}%), planner
{small.tokens_per_s_per_gpu:,.0f} -> {large.tokens_per_s_per_gpu:,.0f}
({(large.tokens_per_s_per_gpu / small.tokens_per_s_per_gpu - 1) * 100:+.1f}%).

## Where the planner is off, and why

- **The compute efficiency is one figure per GPU type.** The catalog's matmul_efficiency (A100 0.65, H100 0.48) was
  taken from the llm-foundry tables themselves, so the MPT rows check the communication and recomputation terms more
  than the compute term. Runs whose MFU differs from the table's typical one (a small 1B model, a 145B model in
  Megatron's hand-tuned kernels) are where the ratio drifts: the planner does not know that a GEMM of a 2,048-wide
  model runs slower than one of a 12,288-wide model, nor that fused kernels beat PyTorch eager.
- **Megatron-LM is not DeepSpeed.** Its rows use Megatron's own tensor parallelism (with overlapped, fused
  communication) and interleaved-free 1F1B schedule; the planner models the synchronous all-reduces of dspipe's own
  tensor-parallel layers (Megatron layout; sequence parallelism pinned off, as Table 1 ran without it) and
  DeepSpeed's pipeline, so for tp 8 it predicts more communication than Megatron pays, and Megatron's published
  TFLOP/s include recomputation (converted above with the paper's own FLOPs formula).
- **Large data-parallel ZeRO-3.** The planner's ZeRO-3 time is bytes over the network bandwidth plus NCCL's ring
  latency per gather, of which the prefetch hides half of what the pass's compute could cover
  (timing.ZERO3_OVERLAP); it has no congestion or straggler term. The published 3B pair loses
  {(1 - large.run.tokens_per_s_per_gpu / small.run.tokens_per_s_per_gpu) * 100:.1f}% per GPU from 32 to 128 GPUs;
  the planner's loss comes from the longer rings' latency alone. Hiding all of it (as the planner did before) left 13
  of these 14 ZeRO-3 / FSDP rows optimistic (0.97-1.46); hiding half brings the 14 to 0.94-1.12.
- **ZeRO-3 against tp x pp at scale (Table 2).** With twice the GPUs at the same global batch the micro-batch halves,
  and the published ZeRO-3 step time stays: {z3_small:.1f} s at {z3a.run.gpus} GPUs, {z3_large:.1f} s at
  {z3b.run.gpus} (planner {z3a_plan:.1f} and {z3b_plan:.1f} s): bandwidth-bound, each GPU gathering the whole model's
  bf16 weights per pass at ~{z3_gbps:.0f} GB/s, less than its own 25 GB/s HDR NIC. At {z3b.run.gpus} GPUs the
  published tp 8 x pp 12 layout trains {ptdp_gain:.1f}x as many tokens per GPU as ZeRO-3; the planner:
  {ptdp_gain_plan:.1f}x.
- **Memory.** {sum(r.fits for r in all_rows)} of {len(all_rows)} published layouts fit the planner's memory model as
  published: the activation terms are the census-measured ones (32sbh per GPT block with SDPA's fused
  kernels, ~4sbV for the head and loss; docs/planner-accuracy.md), not Korthikanti's 34sbh and 6sbV, which marked
  some of these flash-attention runs "does not fit".
- **Inter-node bandwidth is the node's NIC total, up to 32 nodes.** A collective that leaves the node runs one ring
  per NIC, so its bus bandwidth is the sum of the NICs its ranks in a node use (8 x 46 GB/s on DGX H100, capped by
  NVLink), not one GPU's share: charged per GPU (as the planner did before), the 64-GPU MPT-13B H100 row came out at
  0.45 of published. Beyond 32 nodes the planner charges one NIC per GPU (timing.NIC_AGGREGATION_MAX_NODES): Table
  2's ZeRO-3 rows (48-280 nodes) ran below one NIC per GPU, and credited the NIC total the planner put them at
  1.4-4.3x published. The threshold lies between the largest run where the NIC total fits (16 nodes) and the
  smallest where it does not (48); no published run pins it closer.
{interleaved(meta)}
- **Pipeline + tensor parallel runs.** Table 2's PTD-P rows (tp 8 x pp 12 for 175B, tp 8 x pp 35 for 530B, Megatron's
  own schedule) are in; Table 1's 39B-1T rows, BLOOM-176B's tp 4 x pp 12 and MT-NLG's tp 8 x pp 35 are still to be
  entered.
- **What the tables leave out.** Benchmark rows (llm-foundry, Megatron Table 1) are steady-state step throughput; a
  real run's GPU-hours also pay for restarts, evaluation and checkpointing. Figures derived from GPU-hours (Llama 2: 2T
  tokens in 184,320 A100-hours for 7B, 1,720,320 for 70B, Touvron et al. 2023 Table 2; Llama 3 8B: 1.3M H100-hours for
  15T+ tokens, model card) imply 3,014 / 323 / ~3,200 tokens/s per GPU, and are not in the table because the GPU count
  and layout they ran on are not published; Llama 3 8B's figure implies ~18% MFU on H100, far below any benchmark row
  (the GPU-hours include much more than steady-state training), which the planner would overestimate about 2.5x.

## Sources

{sources(all_rows + meta)}
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"write {DOC.relative_to(ROOT)}")
    mode.add_argument("--check", action="store_true", help="exit 1 when the doc differs from the table")
    args = ap.parse_args(argv)
    all_rows = rows()
    text = document(all_rows)
    if args.write:
        DOC.write_text(text)
        print(f"wrote {DOC.relative_to(ROOT)}")
    elif args.check:
        if not DOC.is_file() or DOC.read_text() != text:
            print(f"{DOC.relative_to(ROOT)} is stale: run python benchmarks/published_runs.py --write", file=sys.stderr)
            return 1
    else:
        print(table(all_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
