"""The plan covers the start-up (issue 25, items 5 and 6): host RAM per node while the ranks build their modules, the
build's device transient and the time to the first step, in `plan`, `--json`, dspipe.json and the fit; `dspipe report`
sets engine.json's measured start-up beside them. Pure planner arithmetic and the CLI; no launches."""

import json
import shutil

import pytest

from dspipe.planner.cost import estimate
from dspipe.planner.plan import make_plan
from dspipe.planner.stages import largest_tensor, stage_params
from dspipe.planner.startup import DISK_GBPS, DRAW_BLOCK, DRAW_RATE, build_mode, startup_estimate
from dspipe.planner.throughput import STEP_COLUMNS
from dspipe.spec.cluster import ClusterSpec
from dspipe.spec.hardware import GIB, GPU_CATALOG
from dspipe.spec.presets import MODEL_PRESETS
from dspipe.spec.strategy import StrategySpec
from dspipe.spec.train import TrainSpec
from tests.helpers import dspipe, run_cli

MIB = 1024**2

LLAMA70 = [
    "plan",
    "--model",
    "llama2-70b",
    "--nodes",
    "8",
    "--gpus-per-node",
    "8",
    "--gpu",
    "h100-80g",
    "--global-batch",
    "512",
]
CPU2 = [
    "--model",
    "tiny",
    "--gpus-per-node",
    "2",
    "--gpu",
    "cpu",
    "--global-batch",
    "16",
    "--micro-batch",
    "4",
    "--steps",
    "20",
    "--zero",
    "1",
]


def _json(capsys, *args) -> dict:
    assert run_cli(*args, "--json") == 0
    return json.loads(capsys.readouterr().out)


# ---- the formulas --------------------------------------------------------------------------------------------------


def test_a_random_draw_holds_one_block_of_rows_an_import_the_whole_tensor():
    """The host's share of the largest tensor: a draw is made in blocks of rows (at most 2 x DRAW_BLOCK elements
    held, dspipe.model.initial.BLOCK), an import reads it whole."""
    from dspipe.model.initial import BLOCK
    from dspipe.planner.startup import DRAW_BLOCK

    assert DRAW_BLOCK == BLOCK
    common = dict(
        num_params=10**10,
        stage_params=10**9,
        largest_tensor=10**9,
        precision="bf16",
        offload_params=False,
        zero_ranks=16,
        tp=8,
        ranks_per_node=8,
        host_offload_per_rank=0,
    )
    drawn = startup_estimate(mode="stage", **common)
    read = startup_estimate(mode="stage", **common, import_bytes=2 * 10**10)
    assert drawn.host_build_per_rank_bytes == 4 * 10**9 + 4 * 2 * DRAW_BLOCK
    assert read.host_build_per_rank_bytes == 4 * 10**9 + 4 * 10**9
    assert (
        drawn.holds() == "the stage's tp 8 shard in fp32 on the host, plus one block of rows of an fp32 draw at a time"
    )
    assert read.holds() == "the stage's tp 8 shard in fp32 on the host, plus one whole fp32 tensor read at a time"
    part = startup_estimate(mode="partitioned", **{**common, "tp": 1})
    assert part.host_build_per_rank_bytes == 8 * 2 * DRAW_BLOCK and part.device_bytes == 2 * 10**10 // 16 + 2 * 10**9


def test_build_host_device_and_time_per_mode(monkeypatch):
    """Each mode's host and device bytes and its draws, on round numbers: Phi 1e9, Phi_s 2.5e8, T 1e7, n 16, g 8
    (blocks of rows larger than T: the draw holds T)."""
    monkeypatch.setattr("dspipe.planner.startup.DRAW_BLOCK", 10**8)
    common = dict(
        num_params=10**9,
        stage_params=25 * 10**7,
        largest_tensor=10**7,
        precision="bf16",
        offload_params=False,
        zero_ranks=16,
        tp=1,
        ranks_per_node=8,
        host_offload_per_rank=0,
    )
    part = startup_estimate(mode="partitioned", **common)
    assert (part.host_build_per_rank_bytes, part.device_bytes) == (8 * 10**7, 2 * 10**9 // 16 + 2 * 10**7)
    assert part.host_per_node_bytes == 8 * 8 * 10**7 and part.drawn_elements == 10**9
    assert part.seconds == pytest.approx(10**9 / DRAW_RATE)
    off = startup_estimate(mode="partitioned", **{**common, "offload_params": True})
    assert (off.host_build_per_rank_bytes, off.device_bytes) == (2 * 10**9 // 16 + 8 * 10**7, 2 * 10**7)
    dev = startup_estimate(mode="device", **{**common, "precision": "fp32"})
    assert (dev.host_build_per_rank_bytes, dev.device_bytes) == (8 * 10**7, 4 * 10**9)
    assert dev.holds() == "one block of rows of an fp32 draw at a time on its way to the GPU"
    # tp 8 without a pipeline: the rank's shard (Phi_r) in bf16 on the device, one whole fp32 tensor on the host at a
    # time; every element is still drawn (whole tensors, then sliced)
    shard = startup_estimate(mode="device", **{**common, "tp": 8, "rank_params": 10**9 // 8})
    assert (shard.host_build_per_rank_bytes, shard.device_bytes, shard.drawn_elements) == (
        8 * 10**7,
        2 * 10**9 // 8,
        10**9,
    )
    assert shard.holds() == "one block of rows of an fp32 draw at a time, cut to the rank's tp 8 shard on the GPU"
    stage = startup_estimate(mode="stage", **common)
    assert (stage.host_build_per_rank_bytes, stage.device_bytes, stage.drawn_elements) == (10**9, 10**9, 25 * 10**7)
    assert startup_estimate(mode="stage", **{**common, "stage_params": 10**6}).host_build_per_rank_bytes == 8 * 10**7
    # a stage at tp 4: its shard in fp32 plus one whole fp32 tensor; the whole stage (E_s) drawn
    tp_stage = startup_estimate(
        mode="stage", **{**common, "tp": 4, "stage_params": 25 * 10**7 // 4, "stage_elements": 25 * 10**7}
    )
    assert (tp_stage.host_build_per_rank_bytes, tp_stage.device_bytes, tp_stage.drawn_elements) == (
        25 * 10**7 + 4 * 10**7,
        25 * 10**7,
        25 * 10**7,
    )
    assert tp_stage.holds() == (
        "the stage's tp 4 shard in fp32 on the host, plus one block of rows of an fp32 draw at a time"
    )
    with pytest.raises(ValueError, match="unknown build mode 'host'"):  # AutoTP's whole-model host build is retired
        startup_estimate(mode="host", **common)
    # the offload's host peak, when larger, is the rank's host figure; the build's stays beside it
    held = startup_estimate(mode="partitioned", **{**common, "host_offload_per_rank": 10**9})
    assert (held.host_per_rank_bytes, held.host_build_per_rank_bytes, held.host_per_node_bytes) == (
        10**9,
        8 * 10**7,
        8 * 10**9,
    )
    assert held.holds() == "the offloaded optimizer states, after the build"


def test_build_modes_by_layout():
    assert [
        build_mode(zero_stage=z, tp=t, pp=p)
        for z, t, p in ((3, 1, 1), (1, 1, 1), (2, 8, 1), (3, 8, 1), (1, 1, 4), (1, 8, 4), (0, 8, 16))
    ] == ["partitioned", "device", "device", "device", "stage", "stage", "stage"]


def test_import_reads_the_nodes_distinct_bytes_at_the_stated_disk_bandwidth():
    common = dict(
        num_params=10**9,
        stage_params=25 * 10**7,
        largest_tensor=10**7,
        precision="bf16",
        offload_params=False,
        zero_ranks=64,
        tp=1,
        ranks_per_node=8,
        host_offload_per_rank=0,
        import_bytes=2 * 10**9,
    )
    part = startup_estimate(mode="partitioned", **common)  # a node holds 8 of 64 partitions: 1/8 of the bytes
    assert (part.drawn_elements, part.read_bytes) == (0, 2 * 10**9 // 8)
    assert part.seconds == pytest.approx(2 * 10**9 / 8 / (DISK_GBPS * 1e9))
    assert startup_estimate(mode="device", **{**common, "tp": 8, "rank_params": 10**9 // 8}).read_bytes == 2 * 10**9
    assert startup_estimate(mode="device", **common).read_bytes == 2 * 10**9
    assert startup_estimate(mode="stage", **common).read_bytes == 2 * 10**9  # 8 ranks x 1/4 of the model: all of it
    assert startup_estimate(mode="stage", **{**common, "ranks_per_node": 2}).read_bytes == 10**9
    # tp 4: the node's 8 ranks are 2 tp groups, each reading one stage's tensors (a quarter of the model)
    assert (
        startup_estimate(
            mode="stage", **{**common, "tp": 4, "stage_params": 25 * 10**7 // 4, "stage_elements": 25 * 10**7}
        ).read_bytes
        == 10**9
    )
    text = part.first_step_text()
    assert "0.2 GB of the checkpoint read per node at an assumed 2 GB/s" in text
    assert "not counted" not in text  # the build's own seconds: the whole first step is first_step's


def test_the_stage_figure_is_the_largest_pipeline_stage():
    model = MODEL_PRESETS["gpt3-1.3b"]
    cluster = ClusterSpec(1, 8, "a100-80g")
    train = TrainSpec(global_batch=64, micro_batch=1, steps=10, warmup_steps=1)
    plan = make_plan(model=model, cluster=cluster, train=train, strategy=StrategySpec(zero=1, pp=4))
    s = estimate(model=model, cluster=cluster, plan=plan).startup
    phi_s = max(stage_params(model=model, pp=4, partition_method=plan.partition_method))
    assert s.mode == build_mode(zero_stage=1, tp=1, pp=4) == "stage"
    assert s.drawn_elements == phi_s < model.num_params
    assert s.host_build_per_rank_bytes == max(4 * phi_s, 8 * largest_tensor(model))


# ---- the plan: llama2-70b on 8 x 8 H100 --------------------------------------------------------------------------


def test_llama2_70b_zero3_plan_shows_the_partitioned_start_up(capsys):
    assert run_cli(*LLAMA70, "--zero", "3") == 0
    out = capsys.readouterr().out
    model = MODEL_PRESETS["llama2-70b"]
    t = largest_tensor(model)
    held = min(t, 2 * DRAW_BLOCK)  # a draw's block of rows (the largest tensor, 470M elements, is drawn in blocks)
    assert out.startswith("plan: ZeRO-3, bf16, pp 1, tp 1")
    line = next(ln for ln in out.splitlines() if ln.startswith("start-up: "))
    per_rank, per_node = 8 * held / MIB, 64 * held / MIB  # a block and its slice, 8 ranks: not the whole model
    assert line.startswith(
        f"start-up: partitioned build (ZeRO-3 under zero.Init), host RAM {per_node:.1f} MiB per "
        f"node (8 ranks x {per_rank:.1f} MiB: one block of rows of a drawn fp32 tensor, plus its slice"
    )
    seconds = model.num_params / DRAW_RATE
    assert f"build ~{seconds:,.0f} s (69B values drawn per rank at 60M/s, measured on one CPU rank)" in out
    h100 = GPU_CATALOG["h100-80g"]
    whole = next(ln for ln in out.splitlines() if "first step ends" in ln)
    assert f"launch {h100.launch_s:.3g} + build {seconds:,.0f} + initialize {h100.initialize_s:.3g} + JIT" in whole
    assert "start GiB/node" in out  # the --top table
    s = _json(capsys, *LLAMA70, "--zero", "3")["startup"]
    assert s["mode"] == "partitioned" and s["host_build_per_rank_bytes"] == 8 * held == s["host_per_rank_bytes"]
    assert s["host_per_node_bytes"] == 64 * held < 2 * model.num_params  # far below one whole bf16 model
    assert s["device_bytes"] == 2 * model.num_params // 64 + 2 * t
    assert s["seconds"] == pytest.approx(seconds) and s["drawn_elements"] == model.num_params
    assert (s["import_bytes"], s["read_bytes_per_node"], s["disk_gbps"]) == (None, 0, DISK_GBPS)
    assert "deepspeed.initialize" in s["not_counted"]
    fs = _json(capsys, *LLAMA70, "--zero", "3")["first_step"]
    assert fs["build_s"] == pytest.approx(seconds) and fs["seconds"] > seconds + h100.launch_s


def test_a_tp_plan_builds_only_its_shard(capsys):
    """tp 8 without a pipeline: the device build of the rank's tp shard (dspipe's tensor-parallel layers), not
    AutoTP's whole model on the host: one whole fp32 tensor on the host at a time, the shard on the GPU, every element
    drawn."""
    model = MODEL_PRESETS["llama2-70b"]
    out = _json(capsys, *LLAMA70, "--tp", "8", "--pp", "1", "--zero", "2", "--offload", "none", "--top", "2")
    s = out["startup"]
    assert (out["tp"], out["pp"], s["mode"]) == (8, 1, "device")
    assert s["host_build_per_rank_bytes"] == 8 * min(largest_tensor(model), 2 * DRAW_BLOCK)
    shard = stage_params(model=model, pp=1, partition_method="parameters", tp=8)[0]
    assert s["device_bytes"] == 2 * shard and shard < model.num_params / 7  # the blocks, embedding and head / 8
    assert s["drawn_elements"] == model.num_params
    assert s["host_per_node_bytes"] == 8 * s["host_per_rank_bytes"] <= out["host_memory_capacity_bytes"]
    assert all(c["startup"]["mode"] == "device" for c in out["top"])


def test_a_start_up_over_the_host_ram_does_not_fit(capsys):
    """--tp 2 --pp 4 pins a stage build whose fp32 shards (8 ranks x 32 GiB) are over 256 GiB per node: the one line
    names the start-up, its numbers and what would fit (with --pp auto, tp 2 x pp 16 under ZeRO-1, recomputing 2 of
    each stage's 5 blocks: each rank builds a smaller stage)."""
    code = run_cli(*LLAMA70, "--tp", "2", "--pp", "4", "--host-memory-gib", "256")
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert (
        "start-up needs 259 GiB host RAM per node (8 ranks x 32.4 GiB: the stage's tp 2 shard in fp32 on the "
        "host, plus one block of rows of an fp32 draw at a time), has 256 GiB"
    ) in err
    assert (
        "would fit with: --tp auto (ZeRO-1), or --pp auto (ZeRO-1), or --tp auto --pp auto "
        "(ZeRO-1), or 260 GiB host RAM per node (--host-memory-gib) (ZeRO-1)"
    ) in err  # the 16-bit gradients freed as produced, tp 2 x pp 4 fits the GPUs without offloading the optimizer


def test_start_up_shortfall_in_the_reasons_and_the_fit():
    """The fit refuses a plan whose start-up host peak is over the node's RAM even when its step fits."""
    model = MODEL_PRESETS["llama2-70b"]
    cluster = ClusterSpec(8, 8, "h100-80g", host_memory_gib=128)
    train = TrainSpec(global_batch=512, micro_batch=1, steps=10, warmup_steps=1)
    plan = make_plan(
        model=model, cluster=cluster, train=train, strategy=StrategySpec(zero=1, tp=4, pp=4, checkpointing="full")
    )
    e = estimate(model=model, cluster=cluster, plan=plan)
    assert e.memory.total <= e.usable_gpu_memory_bytes and e.host_memory_bytes == 0  # the step itself fits
    assert not e.fits and e.startup_host_shortfall_bytes == e.startup.host_per_node_bytes - 128 * GIB
    roomy = estimate(model=model, cluster=ClusterSpec(8, 8, "h100-80g"), plan=plan)
    assert roomy.fits and roomy.startup_host_shortfall_bytes == 0


# ---- dspipe.json and the report ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("gen")
    r = dspipe("gen-config", *CPU2, "--out", "runs/t", cwd=cwd)
    assert r.returncode == 0, r.stderr
    assert "start-up: device build" in r.stdout and "first step ends ~" in r.stdout
    return cwd / "runs/t"


@pytest.fixture
def run(template, tmp_path):
    path = tmp_path / "runs/t"
    shutil.copytree(template, path)
    rows = [
        [s, s * 1024, 8.0 - s / 10, 1e-4, 1.0, 2000.0, "", 0.5, "", "", "", 0.5, 0, "", "", ""] for s in range(1, 6)
    ]
    (path / "metrics.csv").write_text("\n".join(",".join(map(str, r)) for r in [STEP_COLUMNS, *rows]) + "\n")
    return path


ENGINE = {
    "zero_stage": 1,
    "dp": 2,
    "pp": 1,
    "backend": "gloo",
    "wrapper_optimizer": "DeepSpeedZeroOptimizer",
    "base_optimizer": "AdamW",
    "world_size": 2,
}
STARTUP = {
    "mode": "device",
    "peak_rss_mib": [900.0, 1000.5],
    "rss_before_build_mib": [700.0, 720.25],
    "build_rss_mib": [800.0, 830.0],
    "seconds_to_first_step": [12.5, 11.0],
    "seconds_build": [1.25, 1.5],
}


def test_dspipe_json_carries_the_start_up(template):
    est = json.loads((template / "dspipe.json").read_text())["estimate"]
    s = est["startup"]
    assert s["mode"] == "device" and s["ranks_per_node"] == 2
    for key in (
        "host_build_per_rank_bytes",
        "host_per_rank_bytes",
        "host_per_node_bytes",
        "device_bytes",
        "seconds",
        "drawn_elements",
        "read_bytes_per_node",
        "disk_gbps",
        "draw_rate_per_s",
    ):
        assert isinstance(s[key], (int, float)) and s[key] >= 0, key


def _report(run):
    r = dspipe("report", "runs/t", cwd=run.parent.parent)
    assert r.returncode == 0, r.stderr
    return r.stdout, (run / "report" / "report.md").read_text()


def test_report_sets_the_measured_start_up_beside_the_plan(run):
    (run / "engine.json").write_text(json.dumps({**ENGINE, "startup": STARTUP}))
    stdout, md = _report(run)
    s = json.loads((run / "dspipe.json").read_text())["estimate"]["startup"]
    plan_mib = s["host_per_rank_bytes"] / 2**20
    growth = 1000.5 - 720.25
    assert (
        f"| start-up host RAM per rank (MiB) | {plan_mib:,.1f} (device build) | worst rank 1 of 2: peak 1,000.5, "
        f"+{growth:,.1f} over the 720.2 before the build (after the build 830.0) | {growth / plan_mib:.2f} "
        f"(growth) |"
    ) in md
    whole = json.loads((run / "dspipe.json").read_text())["estimate"]["first_step"]["seconds"]
    assert (  # engine.json's seconds to the first step + the first row's step time
        f"| time to first step's end (s) | {whole:.4g} | 13 (slowest rank) | {13 / whole:.2f} |"
    ) in md
    assert "then the first step (metrics.csv's first row)" in md
    assert (
        f"start-up: worst rank 1 peak RSS 1,000.5 MiB (+{growth:,.1f} over the 720.2 before the build; plan "
        f"{plan_mib:,.1f} MiB), first step began 12.5 s after the process start; plan {whole:,.4g} s to its end"
    ) in stdout


@pytest.mark.parametrize(
    "engine, why",
    [
        (ENGINE, "engine.json has no startup figures: its runner predates them"),
        ({**ENGINE, "startup": [1, 2]}, "engine.json's startup is damaged: an object expected, got list"),
        (
            {**ENGINE, "startup": {**STARTUP, "peak_rss_mib": [1.0, "x"]}},
            "engine.json's startup.peak_rss_mib is damaged: one number in 0..1e9 per rank expected, got [1.0, 'x']",
        ),
        (
            {**ENGINE, "startup": {**STARTUP, "seconds_build": [1.0]}},
            "engine.json's startup.seconds_build is damaged: one number in 0..1e9 per rank expected, got [1.0]",
        ),
        (
            {**ENGINE, "startup": {**STARTUP, "build_rss_mib": [1.0, -5.0]}},
            "engine.json's startup.build_rss_mib is damaged",
        ),
        ({**ENGINE, "startup": {**STARTUP, "mode": None}}, "engine.json's startup.mode is damaged"),
        (None, "engine.json not written yet"),
    ],
)
def test_report_without_start_up_figures_says_not_recorded(run, engine, why):
    if engine is not None:
        (run / "engine.json").write_text(json.dumps(engine))
    stdout, md = _report(run)
    assert "| start-up host RAM per rank (MiB) |" in md and "| not recorded | n/a (growth) |" in md
    assert f"Start-up: not recorded ({why}" in md and f"start-up: not recorded ({why}" in stdout


def test_report_of_a_plan_without_a_start_up_prediction(run):
    spec = json.loads((run / "dspipe.json").read_text())
    del spec["estimate"]["startup"]
    (run / "dspipe.json").write_text(json.dumps(spec))
    (run / "engine.json").write_text(json.dumps({**ENGINE, "startup": STARTUP}))
    stdout, md = _report(run)
    assert "| start-up host RAM per rank (MiB) | n/a | worst rank 1 of 2: peak 1,000.5" in md
    assert "has no start-up prediction" in md and "plan " not in stdout.splitlines()[-1]


def test_init_from_reads_the_checkpoint_instead_of_drawing(tmp_path, capsys):
    """With --init-from the plan's start-up reads check_weights' bytes at the stated disk bandwidth: nothing drawn."""
    pytest.importorskip("transformers")
    from dspipe.model.hf import spec_from_hf_dir
    from dspipe.model.hf_weights import check_weights
    from tests.unit.model.test_hf import llama_model

    d = tmp_path / "hf"
    llama_model(kv_heads=2).save_pretrained(d)
    capsys.readouterr()
    size = check_weights(d, spec_from_hf_dir(d))
    args = [
        "plan",
        "--gpu",
        "cpu",
        "--gpus-per-node",
        "2",
        "--global-batch",
        "8",
        "--micro-batch",
        "2",
        "--precision",
        "fp32",
        "--zero",
        "3",
        "--init-from",
        str(d),
    ]
    s = _json(capsys, *args)["startup"]
    assert (s["mode"], s["import_bytes"], s["drawn_elements"]) == ("partitioned", size, 0)
    assert s["read_bytes_per_node"] == size  # 2 ranks per node, 2 partitions: the node reads it all
    assert s["seconds"] == pytest.approx(size / (DISK_GBPS * 1e9))
    assert run_cli(*args) == 0
    assert "of the checkpoint read per node at an assumed 2 GB/s" in capsys.readouterr().out
