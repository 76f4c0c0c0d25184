"""Calibration profiles (`dspipe calibrate`, --profile) and the bandwidth overrides: validation, what the planner
does with the figures, and that a run directory keeps them."""

import json
import math
from dataclasses import replace

import pytest

from dspipe.errors import SpecError
from dspipe.planner.cost import estimate
from dspipe.planner.plan import make_plan
from dspipe.planner.throughput import model_flops_per_token
from dspipe.spec.cluster import ClusterSpec
from dspipe.spec.hardware import GPU_CATALOG
from dspipe.spec.presets import model_preset
from dspipe.spec.profile import PROFILE_FILE, Profile, profile_text, profile_to_dict, read_profile
from dspipe.spec.strategy import StrategySpec
from dspipe.spec.train import TrainSpec
from tests.helpers import ROOT, documented, run_cli, run_documented

CALIBRATE_PAGE = ROOT / "docs" / "howto" / "calibrate.md"
DEMO = ["--model", "tiny", "--layers", "4", "--hidden", "128", "--heads", "4", "--seq-len", "128", "--vocab", "4096"]
CPU2 = [
    "--gpus-per-node",
    "2",
    "--gpu",
    "cpu",
    "--precision",
    "fp32",
    "--micro-batch",
    "8",
    "--global-batch",
    "32",
    "--zero",
    "1",
    "--pp",
    "1",
    "--tp",
    "1",
    "--sp",
    "1",
    "--checkpointing",
    "none",
    "--offload",
    "none",
]


def a_profile(**changes) -> Profile:
    p = Profile(
        device="AMD EPYC",
        gpu="cpu",
        dtype="fp32",
        ranks=2,
        threads_per_rank=1,
        model="L4 h128 micro 8",
        created="2026-11-23T12:00:00",
        versions="dspipe 0.1.0",
        compute_tflops=0.015,
        matmul_tflops=0.025,
        allreduce_busbw_gbps=0.6,
        allreduce_latency_s=1e-3,
        host_copy_gbps=None,
        host_memcpy_gbps=5.0,
        cpu_adam_params_per_s=5e8,
        optimizer_params_per_s=4e7,
    )
    return replace(p, **changes)


def demo_estimate(cluster: ClusterSpec, *, zero=1, offload="none"):
    model = model_preset("tiny", layers=4, hidden=128, heads=4, seq_len=128, vocab=4096)
    train = TrainSpec(global_batch=32, micro_batch=8, steps=1000, precision="fp32")
    strategy = StrategySpec(zero=zero, offload=offload, pp=1, checkpointing="none")
    plan = make_plan(model=model, cluster=cluster, train=train, strategy=strategy)
    return model, plan, estimate(model=model, cluster=cluster, plan=plan)


def test_profile_round_trips_through_its_file(tmp_path):
    p = a_profile()
    path = tmp_path / "p.json"
    path.write_text(profile_text(p))
    assert read_profile(path, gpu="cpu") == p
    assert json.loads(path.read_text())["figures"]["compute_tflops"] == 0.015


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(version=3), "profile version 3 is not one this dspipe reads (1, 2)"),
        (lambda d: d.update(format="x"), "not a dspipe profile"),
        (lambda d: d["figures"].pop("compute_tflops"), "missing figure compute_tflops"),
        (
            lambda d: d["figures"].update(compute_tflops=-1.0),
            "figures.compute_tflops must be a number in 1e-09..1e+13, got -1.0",
        ),
        (
            lambda d: d["figures"].update(allreduce_busbw_gbps="fast"),
            "figures.allreduce_busbw_gbps must be a number in 1e-09..1e+13 or null",
        ),
        (
            lambda d: d["figures"].update(matmul_tflops=None),
            "figures.matmul_tflops must be a number in 1e-09..1e+13, got None",
        ),
        (lambda d: d["figures"].update(allreduce_latency_s=None), "may be null only for a 1-rank profile (ranks 2)"),
        (lambda d: d["figures"].update(optimizer_params_per_s=True), "optimizer_params_per_s must be"),
        (lambda d: d.update(ranks=0), "ranks must be an integer in 1..1,024, got 0"),
        (lambda d: d.update(ranks=10**30), "ranks must be an integer in 1..1,024, got 1000000000000000000000000000000"),
        (lambda d: d.update(threads_per_rank=10**30), "threads_per_rank must be an integer in 1..1,024, got 1000"),
        (lambda d: d.update(runs=10**30), "runs must be an integer in 0..1,000,000, got 1000"),
        (lambda d: d.update(gpu=""), "gpu must be a one-line non-empty string"),
        (lambda d: d.update(extra=1), "unknown profile key extra"),
        (lambda d: d.update(gpu="tpu"), "gpu 'tpu' is not a catalog GPU type (cpu, "),
        (lambda d: d.update(corrections={"magic": 1.0}, runs=1), "-> a number in 0.001..1000, got 'magic': 1.0"),
    ],
)
def test_bad_profiles_are_one_line_exit_2(tmp_path, capsys, edit, message):
    d = profile_to_dict(a_profile())
    edit(d)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(d))
    assert run_cli("plan", *DEMO, *CPU2, "--profile", path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and str(path) in err[0], err


def test_profile_not_json_missing_or_for_another_gpu(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    good = tmp_path / "good.json"
    good.write_text(profile_text(a_profile()))
    for args, message in (
        (["--profile", bad], "is not valid JSON"),
        (["--profile", tmp_path / "none.json"], "cannot read it"),
        (
            ["--profile", good, "--gpu", "h100-80g", "--gpus-per-node", "8", "--precision", "bf16"],
            "profile measured on 'cpu' (AMD EPYC), but the cluster's GPU type is 'h100-80g'",
        ),
    ):
        assert run_cli("plan", *DEMO, *CPU2, *args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


def test_a_profile_with_a_key_twice_is_refused_in_one_line(tmp_path, capsys):
    path = tmp_path / "dup.json"
    path.write_text(profile_text(a_profile()).replace('"version": 2,', '"version": 2, "version": 1,', 1))
    assert run_cli("plan", *DEMO, *CPU2, "--profile", path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{path} is not valid: key 'version' given twice in one JSON object" in err[0], err


def test_a_profile_holding_nan_is_refused_in_one_line(tmp_path, capsys):
    path = tmp_path / "nan.json"
    d = profile_to_dict(a_profile())
    name = next(k for k, v in d["figures"].items() if isinstance(v, float))
    d["figures"][name] = math.nan
    path.write_text(json.dumps(d))  # Python's json writes a bare NaN
    assert "NaN" in path.read_text()
    with pytest.raises(SpecError, match="NaN is not a finite number"):
        read_profile(path)
    assert run_cli("plan", *DEMO, *CPU2, "--profile", path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "NaN is not a finite number" in err[0] and str(path) in err[0], err


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--intra-node-gbps", "0"),
        ("--inter-node-gbps", "-3"),
        ("--intra-node-gbps", "nan"),
        ("--inter-node-gbps", "inf"),
        ("--intra-node-gbps", "1e-310"),  # a step time of inf s (a traceback once)
        ("--inter-node-gbps", "0.0009"),
    ],
)
def test_bandwidth_overrides_must_be_at_least_1_mb_per_s(capsys, flag, value):
    assert run_cli("plan", *DEMO, *CPU2, flag, value) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{flag} must be at least 0.001 GB/s (1 MB/s), got {value}" in err[0], err


def test_spec_refuses_bad_overrides_and_foreign_profiles():
    with pytest.raises(SpecError, match=r"cluster.intra_node_gbps must be at least 0.001 GB/s \(1 MB/s\), got 0"):
        ClusterSpec(nodes=1, gpus_per_node=2, gpu="cpu", intra_node_gbps=0)
    with pytest.raises(SpecError, match="profile measured on 'cpu'"):
        ClusterSpec(nodes=1, gpus_per_node=8, gpu="a100-80g", profile=a_profile())


def test_the_planner_uses_the_profiles_figures():
    cat = ClusterSpec(nodes=1, gpus_per_node=2, gpu="cpu")
    prof = ClusterSpec(nodes=1, gpus_per_node=2, gpu="cpu", profile=a_profile())
    model, plan, e0 = demo_estimate(cat)
    _, _, e1 = demo_estimate(prof)
    tokens_per_rank = plan.micro_batch * model.seq_len * plan.grad_accum
    flops = tokens_per_rank * model_flops_per_token(model)
    assert math.isclose(e0.compute_s, flops / (GPU_CATALOG["cpu"].peak_fp32_tflops * 0.5e12), rel_tol=1e-12)
    assert math.isclose(e1.compute_s, flops / 0.015e12, rel_tol=1e-12)  # the measured rate, not peak x efficiency
    assert math.isclose(e1.matmul_efficiency, 0.015 / GPU_CATALOG["cpu"].peak_fp32_tflops)
    # ZeRO-1 without bf16: reduce-scatter of the fp32 gradients + all-gather of the params, at the measured busbw,
    # each with one ring latency per bucket: the measured 4 KiB all-reduce less its 2 hops
    phi = plan.num_params
    base = 1e-3 - 2 * GPU_CATALOG["cpu"].ring_hop_latency_s
    ring = base + 1 * GPU_CATALOG["cpu"].ring_hop_latency_s
    one = 0.5 * phi * 4 / 0.6e9
    want = 2 * one + (math.ceil(phi / plan.reduce_bucket_size) + math.ceil(phi / plan.allgather_bucket_size)) * ring
    assert math.isclose(e1.dp_comm_s, want, rel_tol=1e-9)
    assert e0.optimizer_s == 0.0  # not modelled without a profile
    assert math.isclose(e1.optimizer_s, (phi / 2) / 4e7)  # the ZeRO-1 shard at the measured AdamW rate
    assert math.isclose(e1.step_time_s, e1.compute_s + e1.dp_comm_s + e1.optimizer_s)


def test_profile_compute_applies_only_to_its_dtype():
    cluster = ClusterSpec(nodes=1, gpus_per_node=2, gpu="cpu", profile=a_profile(dtype="bf16"))
    assert cluster.gpu_type.compute_tflops("bf16") == 0.015
    assert cluster.gpu_type.compute_tflops("fp32") == GPU_CATALOG["cpu"].peak_fp32_tflops * 0.5


def test_offload_uses_the_measured_cpu_adam_and_copy_rates():
    prof = ClusterSpec(nodes=1, gpus_per_node=2, gpu="cpu", profile=a_profile())
    _, plan, e = demo_estimate(prof, offload="cpu")
    shard = plan.num_params / 2
    assert math.isclose(e.offload_s, 2 * shard / 5e8 + 2 * shard * 4 / 5e9)  # cpu type: the memcpy rate
    assert e.optimizer_s == 0.0  # the optimizer runs in CPU-Adam (counted in offload)


def test_overrides_win_over_catalog_and_profile():
    model = model_preset("gpt3-1.3b")
    train = TrainSpec(global_batch=512, micro_batch=4, steps=1000)
    strategy = StrategySpec(zero=0, pp=1, checkpointing="none")  # the all-reduce is not overlapped

    def dp_comm(**kw):
        cluster = ClusterSpec(nodes=4, gpus_per_node=8, gpu="h100-80g", **kw)
        plan = make_plan(model=model, cluster=cluster, train=train, strategy=strategy)
        return cluster, estimate(model=model, cluster=cluster, plan=plan).dp_comm_s

    c0, _ = dp_comm()
    _, slow = dp_comm(inter_node_gbps=1.0)
    c1, fast = dp_comm(inter_node_gbps=4.0)
    assert c1.gpu_type.inter_node_gbps == 4.0
    assert fast < slow / 2  # the group spans nodes: the (slow) inter-node link sets the time
    c2, _ = dp_comm(intra_node_gbps=123.0)
    assert c2.gpu_type.intra_node_gbps == 123.0 and c2.gpu_type.inter_node_gbps == c0.gpu_type.inter_node_gbps
    gpu_prof = a_profile(gpu="h100-80g", dtype="bf16", ranks=8, allreduce_busbw_gbps=300.0, host_copy_gbps=20.0)
    c3, _ = dp_comm(profile=gpu_prof, intra_node_gbps=111.0)
    assert c3.gpu_type.intra_node_gbps == 111.0 and c3.gpu_type.host_copy_gbps == 20.0


def test_plan_says_where_each_figure_came_from(tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text(profile_text(a_profile()))
    assert run_cli("plan", *DEMO, *CPU2, "--profile", path, "--inter-node-gbps", "3", "--top", "1") == 0
    out = capsys.readouterr().out
    assert f"compute 0.015 TFLOP/s per rank (profile {path})" in out
    assert "inter-node bandwidth 3 GB/s (--inter-node-gbps)" in out
    assert f"intra-node bandwidth 0.6 GB/s (profile {path})" in out
    assert "+ optimizer 0.0167" in out  # the step-time term: 1.33M params / 2 ranks / 4e7 params/s
    assert run_cli("plan", *DEMO, *CPU2, "--top", "1") == 0
    assert "time-model figures" not in capsys.readouterr().out  # all from the catalog


def test_gen_config_keeps_the_profile_and_load_run_reproduces_the_estimate(tmp_path):
    from dspipe.rundir import load_run

    path = tmp_path / "p.json"
    path.write_text(profile_text(a_profile()))
    out = tmp_path / "run"
    assert (
        run_cli(
            "gen-config",
            *DEMO,
            *CPU2,
            "--profile",
            path,
            "--intra-node-gbps",
            "0.5",
            "--data",
            tmp_path / "nodata",
            "--out",
            out,
        )
        == 0
    )
    assert read_profile(out / PROFILE_FILE) == a_profile()
    path.unlink()  # the run directory alone reproduces the prediction
    run = load_run(out)
    assert run.cluster.profile == a_profile() and run.cluster.intra_node_gbps == 0.5
    est = estimate(model=run.model, cluster=run.cluster, plan=run.plan)
    assert est.step_time_s == run.estimate.step_time_s
    assert math.isclose(
        est.compute_s, run.plan.micro_batch * 128 * run.plan.grad_accum * model_flops_per_token(run.model) / 0.015e12
    )
    spec = json.loads((out / "dspipe.json").read_text())
    spec["cluster"]["profile"]["figures"]["compute_tflops"] = 0
    (out / "dspipe.json").write_text(json.dumps(spec))
    with pytest.raises(SpecError, match="cluster.profile: figures.compute_tflops must be a number in 1e-09..1e\\+13"):
        load_run(out)
    assert run_cli("gen-config", *DEMO, *CPU2, "--data", tmp_path / "nodata", "--out", out, "--force") == 0
    assert not (out / PROFILE_FILE).exists() and load_run(out).cluster.profile is None  # no stale profile


def test_yaml_config_takes_the_profile(tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text(profile_text(a_profile()))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"cluster: {{profile: {path}, inter_node_gbps: 7.5}}\n")
    assert run_cli("plan", *DEMO, *CPU2, "--config", cfg, "--top", "1") == 0
    out = capsys.readouterr().out
    assert f"(profile {path})" in out and "inter-node bandwidth 7.5 GB/s" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--micro-batch", "0"], "--micro-batch must be at least 1, got 0"),
        (["--ranks", "0"], "--ranks must be at least 1, got 0 (allowed range 1..1,024)"),
        (["--ranks", "99999999999999999999"], "--ranks 99999999999999999999 is over the allowed range 1..1,024"),
        (["--threads", "100000"], "--threads 100000 is over the allowed range 1..1,024"),
        (["--repeats", "100000"], "--repeats 100000 is over the allowed range 1..1,000"),
        (["--micro-batch", "100000"], "--micro-batch 100000 is over the allowed range 1..4,096"),
        (["--allreduce-mib", "100000"], "--allreduce-mib 100000 is over the allowed range 1..4,096"),
        (["--min-seconds", "-1"], "--min-seconds must be in [0, 3600], got -1"),
    ],
)
def test_calibrate_refuses_bad_options(capsys, args, message):
    assert run_cli("calibrate", *DEMO, *args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_calibrate_refuses_an_unwritable_or_foreign_out_before_measuring(tmp_path, capsys):
    """A directory, or a file that is not a profile, is refused in one line before any measurement (the command
    returns at once) and the file is left as it was."""
    foreign = tmp_path / "notes.txt"
    foreign.write_text("mine\n")
    for out, message in (
        (tmp_path, f"--out {tmp_path} is a directory; give a file path"),
        (foreign, f"--out {foreign} exists and is not a dspipe profile; choose another --out"),
    ):
        assert run_cli("calibrate", *DEMO, "--out", out) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert foreign.read_text() == "mine\n"


def test_calibrate_runs_on_this_cpu(tmp_path, capsys):
    """The how-to's `calibrate` line, as written (tiny shapes, 2 gloo ranks at once, no CPU-Adam build): every figure
    positive and sane, and plan accepts it."""
    r = run_documented(documented(CALIBRATE_PAGE, "dspipe calibrate --model"), cwd=tmp_path)
    out = tmp_path / "profile.json"
    assert r.returncode == 0, r.stderr[-2000:]
    p = read_profile(out, gpu="cpu")
    assert (p.gpu, p.dtype, p.ranks, p.threads_per_rank) == ("cpu", "fp32", 2, 1)
    assert 0 < p.compute_tflops < 10 and 0 < p.matmul_tflops < 10  # a CPU core: GFLOP/s, not PFLOP/s
    assert 0 < p.allreduce_busbw_gbps < 1000 and 0 < p.allreduce_latency_s < 1
    assert p.host_copy_gbps is None and p.host_memcpy_gbps > 0.1
    assert p.cpu_adam_params_per_s is None and p.optimizer_params_per_s > 1e5
    capsys.readouterr()
    assert run_cli("plan", *DEMO, *CPU2, "--profile", out, "--json") == 0
    assert json.loads(capsys.readouterr().out)["matmul_efficiency"] == pytest.approx(p.compute_tflops / 1.0)
