"""The plan keeps its word (issue 40): the whole time to the first step, a CPU rank's resident memory, the JIT ops a
launch would compile, profile version 2 (start-up, memory and the runs' corrections), the report's verdicts and
`dspipe calibrate --from-run`. Synthetic metrics in real gen-config run directories; no launches."""

import csv
import json
import math
import shutil
from dataclasses import replace

import pytest

from dspipe.cluster.opcache import CPU_ADAM, FUSED_ADAM, SHM_COMM, build_dirs, cached, missing_ops, ops_needed
from dspipe.errors import SpecError
from dspipe.planner.throughput import STEP_COLUMNS
from dspipe.rundir import load_engine, load_run
from dspipe.spec.cluster import ClusterSpec
from dspipe.spec.hardware import GIB, GPU_CATALOG, MIB
from dspipe.spec.profile import apply_profile, profile_from_dict, profile_text, profile_to_dict
from dspipe.tools.fold import fold, remaining
from dspipe.tools.report import read_metrics, write_report
from dspipe.tools.run_terms import Term, verdict
from tests.helpers import ROOT, documented, dspipe, run_documented
from tests.unit.planner.test_calibration import CPU2, DEMO, a_profile, demo_estimate

# ---------------------------------------------------------------------------------------------------- ops cache


def test_the_op_cache_is_found_where_torch_builds(tmp_path):
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    assert build_dirs(env) == [tmp_path / "ext"]  # torch adds no py<ver>_<cpu|cu> level under the variable
    (tmp_path / "ext" / FUSED_ADAM).mkdir(parents=True)
    assert not cached(FUSED_ADAM, env=env)  # a directory without the built library is a build that never finished
    (tmp_path / "ext" / FUSED_ADAM / f"{FUSED_ADAM}.so").write_bytes(b"")
    assert cached(FUSED_ADAM, env=env)
    assert missing_ops((SHM_COMM, FUSED_ADAM), env=env) == (SHM_COMM,)
    home = {"HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    import sys

    lib = tmp_path / "xdg" / "torch_extensions" / f"py{sys.version_info.major}{sys.version_info.minor}_cpu" / SHM_COMM
    lib.mkdir(parents=True)
    (lib / f"{SHM_COMM}.so").write_bytes(b"")
    assert cached(SHM_COMM, env=home) and not cached(FUSED_ADAM, env=home)


def test_the_ops_a_run_loads():
    assert ops_needed(backend="gloo", offload=False, ranks=2) == (SHM_COMM, FUSED_ADAM)
    assert ops_needed(backend="gloo", offload=True, ranks=1) == (CPU_ADAM,)
    assert ops_needed(backend="nccl", offload=False, ranks=8) == (FUSED_ADAM,)


# ---------------------------------------------------------------------------------------------------- the plan


def test_the_first_step_is_the_sum_of_its_terms_and_a_missing_op_adds_its_compile():
    cluster = ClusterSpec(nodes=1, gpus_per_node=2, gpu="cpu")
    _, _, est = demo_estimate(cluster)
    fs = est.first_step
    cpu = GPU_CATALOG["cpu"]
    assert fs.launch_s == cpu.launch_s and fs.initialize_s == cpu.initialize_s
    assert fs.build_s == est.startup.seconds and math.isclose(fs.step_s, est.step_time_s)
    assert math.isclose(fs.seconds, fs.launch_s + fs.build_s + fs.initialize_s + fs.step_s + fs.extra_s)
    assert not fs.ops_checked and "cache not checked" in fs.text()
    built = est.with_ops((SHM_COMM, FUSED_ADAM), gpu=cluster.gpu_type).first_step
    assert built.jit_s == cpu.jit_seconds(SHM_COMM) + cpu.jit_seconds(FUSED_ADAM) > 100
    assert math.isclose(built.seconds, fs.seconds + built.jit_s)
    assert "deepspeed_shm_comm, fused_adam not cached here" in built.text()
    assert est.with_ops((), gpu=cluster.gpu_type).first_step.text().count("ops cached here") == 1


def test_a_cpu_ranks_memory_is_predicted_as_its_rss_and_a_gpus_is_not():
    _, _, est = demo_estimate(ClusterSpec(nodes=1, gpus_per_node=2, gpu="cpu"))
    cpu = GPU_CATALOG["cpu"]
    assert est.resident_bytes == int(
        cpu.rank_base_rss_bytes + cpu.engine_rss_bytes + cpu.host_alloc_factor * est.memory.total
    )
    assert est.resident_bytes > 5 * est.memory.total  # the process itself dominates a tiny model's
    _, _, gpu = demo_estimate(ClusterSpec(nodes=1, gpus_per_node=2, gpu="h100-80g"))
    assert gpu.resident_bytes is None


def test_plan_json_carries_the_first_step_and_the_resident_bytes(capsys):
    from tests.helpers import run_cli

    assert run_cli("plan", *DEMO, *CPU2, "--json") == 0
    summary = json.loads(capsys.readouterr().out)
    fs = summary["first_step"]
    assert math.isclose(
        fs["seconds"], sum(fs[k] for k in ("launch_s", "build_s", "initialize_s", "jit_s", "step_s", "extra_s"))
    )
    assert fs["ops_checked"] is True  # plan looked at this machine's cache
    assert summary["rank_resident_bytes"] > summary["memory_per_gpu_bytes"]["total"]


# ---------------------------------------------------------------------------------------------------- profile v2


def test_a_version_1_profile_still_reads_with_no_run_figures():
    d = profile_to_dict(a_profile())
    d["version"] = 1
    for name in ("launch_s", "initialize_s", "first_step_extra_s", "jit_build_s", "rank_base_rss_mib"):
        del d["figures"][name]
    del d["figures"]["host_alloc_factor"]
    for key in ("corrections", "runs", "measured_by"):
        del d[key]
    p = profile_from_dict(d, where="p.json")
    assert p.launch_s is None and p.corrections == () and p.runs == 0 and p.basis == "measured by calibrate"


def test_a_version_2_profile_round_trips_and_applies_its_corrections():
    p = a_profile(
        launch_s=5.0,
        jit_build_s=(("fused_adam", 80.0),),
        rank_base_rss_mib=300.0,
        host_alloc_factor=1.2,
        corrections=(("compute", 1.25), ("communication", 2.0), ("optimizer", 4.0)),
        runs=2,
    )
    assert profile_from_dict(json.loads(profile_text(p)), where="p.json") == p
    assert p.basis == "measured by calibrate, corrected by 2 runs"
    g = apply_profile(GPU_CATALOG["cpu"], p)
    assert math.isclose(g.calibrated_tflops, 0.015 / 1.25)
    assert math.isclose(g.intra_node_gbps, 0.6 / 2.0)
    assert math.isclose(g.optimizer_params_per_s, 4e7 / 4.0) and math.isclose(g.cpu_adam_params_per_s, 5e8 / 4.0)
    assert g.launch_s == 5.0 and g.initialize_s == GPU_CATALOG["cpu"].initialize_s  # a null keeps the catalog's
    assert g.jit_seconds("fused_adam") == 80.0 and g.jit_seconds(SHM_COMM) == GPU_CATALOG["cpu"].jit_seconds(SHM_COMM)
    assert g.rank_base_rss_bytes == 300 * MIB and g.host_alloc_factor == 1.2


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(corrections={"compute": 0}), "corrections must be an object of compute"),
        (lambda d: d.update(corrections={"speed": 1.0}), "corrections must be an object of compute"),
        (lambda d: d.update(runs=-1), "runs must be an integer in 0..1,000,000, got -1"),
        (lambda d: d.update(measured_by="me"), "measured_by must be 'calibrate' or 'gen-config'"),
        (lambda d: d["figures"].update(jit_build_s={"fused_adam": -3}), "figures.jit_build_s must be an object"),
        (lambda d: d["figures"].update(launch_s="7"), "figures.launch_s must be a number in 0..1e+13 or null"),
        (lambda d: d.update(version=3), "profile version 3 is not one this dspipe reads (1, 2)"),
        (lambda d: d.update(version=True), "profile version True is not one this dspipe reads (1, 2)"),
        (lambda d: d.update(dtype="x"), "dtype must be one of fp32, bf16, fp16, got 'x'"),
        (lambda d: d.update(corrections={"compute": 1e308}, runs=1), "corrections must be an object of compute"),
        (lambda d: d.update(corrections={"compute": 1.5}, runs=0), "with runs 0: corrections come from runs"),
        (lambda d: d["figures"].update(rank_base_rss_mib=1e308), "figures.rank_base_rss_mib must be a number in"),
        (lambda d: d["figures"].update(host_alloc_factor=1e308), "figures.host_alloc_factor must be a number in"),
        (lambda d: d["figures"].update(compute_tflops=5e-324), "figures.compute_tflops must be a number in 1e-09"),
    ],
)
def test_bad_version_2_fields_are_one_line(edit, message):
    d = profile_to_dict(a_profile())
    edit(d)
    with pytest.raises(SpecError, match=None) as e:
        profile_from_dict(d, where="p.json")
    assert message in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------------- verdicts


def test_the_verdict_is_ok_within_25_percent_and_names_the_worst_term_otherwise():
    assert verdict(Term("step time (s)", "step", 1.0, 1.3)) == "ok"
    assert verdict(Term("step time (s)", "step", 1.0, 0.76)) == "ok"
    assert verdict(Term("step time (s)", "step", 1.0, None)) == "n/a"
    phases = [Term("forward (s)", "step", 0.3, 0.35), Term("optimizer (s)", "step", 0.01, 0.9)]
    v = verdict(Term("step time (s)", "step", 1.0, 2.0), others=phases)
    assert v.startswith("off: 2.00x (slower than planned); most of it is optimizer: 0.9 vs 0.01 planned")
    assert "dspipe calibrate --from-run" in v
    assert verdict(Term("peak RSS per rank (GiB)", "memory", 1.0, 0.5)).startswith("off: 0.50x (less than planned)")


# ---------------------------------------------------------------------------------------------------- runs


def write_rows(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=STEP_COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r[k]) for k in STEP_COLUMNS})


def cpu_rows(*, steps=20, fwd=0.3, bwd=0.55, opt=0.04, first=1.2, rss=0.5):
    rows = []
    for s in range(1, steps + 1):
        t = first if s == 1 else fwd + bwd + opt + 0.005
        rows.append(
            dict(
                step=s,
                tokens=s * 4096,
                loss=8 - s / 10,
                lr=1e-3,
                grad_norm=1.0,
                tokens_per_s=4096 / t,
                samples_per_s=32 / t,
                tflops_per_gpu=0.02,
                mfu=None,
                mem_allocated_gib=rss - 0.01 * (steps - s) / steps,
                mem_reserved_gib=rss,
                step_time_s=t,
                skipped=0,
                forward_s=fwd,
                backward_s=bwd,
                optimizer_s=opt,
            )
        )
    return rows


def engine_json(*, before=(7.0, 7.2), ready=(11.5, 11.0), ops=()):
    return {
        "zero_stage": 1,
        "dp": 2,
        "pp": 1,
        "backend": "gloo",
        "world_size": 2,
        "startup": {
            "mode": "device",
            "rss_before_build_mib": [330.0, 329.0],
            "build_rss_mib": [340.0, 339.0],
            "peak_rss_mib": [410.0, 395.0],
            "seconds_build": [0.05, 0.05],
            "seconds_to_first_step": list(ready),
            "built_params": [1334016, 1334016],
            "seconds_before_build": list(before),
            "ops_built": list(ops),
        },
    }


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """A gen-config run directory of the demo's GPT planned with a profile (a quick measurement's shape)."""
    cwd = tmp_path_factory.mktemp("gen")
    (cwd / "p.json").write_text(profile_text(a_profile(measured_by="gen-config")))
    r = dspipe("gen-config", *DEMO, *CPU2, "--profile", "p.json", "--steps", "20", "--out", "runs/t", cwd=cwd)
    assert r.returncode == 0, r.stderr
    return cwd / "runs/t"


@pytest.fixture
def run_dir(profiled, tmp_path):
    path = tmp_path / "runs/t"
    shutil.copytree(profiled, path)
    return path


def synthetic(run_dir, **kw):
    write_rows(run_dir / "metrics.csv", cpu_rows(**{k: v for k, v in kw.items() if k != "engine"}))
    (run_dir / "engine.json").write_text(json.dumps(kw.get("engine", engine_json())))
    run = load_run(run_dir)
    steps, _ = read_metrics(run)
    return run, load_engine(run), steps


def test_the_report_compares_like_with_like_and_gives_verdicts(run_dir):
    synthetic(run_dir)
    write_report(run_dir)
    text = (run_dir / "report" / "report.md").read_text()
    assert "| per GPU / job | predicted | measured | measured / predicted | verdict |" in text
    assert "| peak RSS per rank (GiB) |" in text and "max RSS of rank 0" in text
    for row in ("forward (s)", "backward (s)", "optimizer (s)", "launch (s)", "build (s)", "initialize (s)"):
        assert f"&nbsp;&nbsp;{row}" in text, row
    assert "| time to first step's end (s) |" in text
    assert "The plan used figures measured by gen-config: AMD EPYC, 2 rank(s) x 1 thread(s)" in text
    est = load_run(run_dir).estimate
    launch = next(line for line in text.splitlines() if "&nbsp;&nbsp;launch (s)" in line)
    assert launch.split("|")[2].strip() == f"{est.first_step['launch_s']:.4g}" and "| 7.2 |" in launch


def test_a_run_folds_into_its_profile_per_term(run_dir):
    run, engine, steps = synthetic(run_dir)
    est = run.estimate
    folded = fold(run, engine=engine, steps=steps)
    p = folded.profile
    assert p.runs == 1 and p.measured_by == "gen-config" and p.basis.endswith("corrected by 1 run")
    b = est.breakdown  # ZeRO-1 on 2 CPU ranks: its collectives are under 10% of the step, taken as planned
    assert b["dp_comm"] < 0.1 * est.step_time_s and "communication" not in folded.ratios
    # ZeRO-1's parameter all-gather is the optimizer step's (stage_1_and_2 issues it after the update), not the
    # backward's: each phase's ratio is taken less its own planned collectives
    gather = est.dp_after_step_s
    assert 0 < gather < b["dp_comm"]
    backward_comm = b["dp_comm"] - gather
    assert math.isclose(folded.ratios["compute"], (0.3 + 0.55 - backward_comm) / b["compute"], rel_tol=1e-9)
    assert math.isclose(p.correction("compute"), folded.ratios["compute"])
    assert math.isclose(folded.ratios["optimizer"], (0.04 - gather) / b["optimizer"], rel_tol=1e-9)
    assert p.launch_s == 7.2 and math.isclose(p.initialize_s, 11.5 - 7.0 - 0.05)
    assert p.rank_base_rss_mib == 330.0
    cpu = GPU_CATALOG["cpu"]
    assert math.isclose(
        p.host_alloc_factor, (0.5 * GIB - 330 * MIB - cpu.engine_rss_bytes) / est.memory_total_bytes, rel_tol=1e-6
    )
    left = {t.name.split(" (")[0]: t.ratio for t in remaining(run, p, engine=engine, steps=steps) if t.ratio}
    assert abs(left["step time"] - 1) < 0.05, left  # the correction explains this run's step
    assert abs(left["peak RSS per rank"] - 1) < 0.01, left
    assert abs(left["time to first step"] - 1) < 0.05, left


def test_compute_and_communication_are_told_apart_where_the_collectives_show():
    from dspipe.tools.fold import _compute_and_comm

    split = {"forward": (0.25, 0.12), "backward": (0.5, 0.12)}  # ZeRO-3's gathers in both phases
    k_c, k_m = 1.2, 3.0
    f = Term("forward (s)", "step", 0.37, k_c * 0.25 + k_m * 0.12)
    b = Term("backward (s)", "step", 0.62, k_c * 0.5 + k_m * 0.12)
    got = _compute_and_comm(f, b, split, step=1.0)
    assert math.isclose(got[0], k_c) and math.isclose(got[1], k_m)
    # collectives under 10% of the step: taken as planned, the compute from both phases
    small = {"forward": (0.25, 0.0), "backward": (0.5, 0.03)}
    f, b = Term("forward (s)", "step", 0.25, 0.3), Term("backward (s)", "step", 0.53, 0.63)
    assert _compute_and_comm(f, b, small, step=1.0) == ((0.3 + 0.63 - 0.03) / 0.75, None)


def test_later_runs_average_into_the_correction(run_dir):
    run, engine, steps = synthetic(run_dir)
    once = fold(run, engine=engine, steps=steps).profile
    # the next run was planned with the corrected profile and ran 1.44x slower in its forward than that plan said
    again = replace(run, cluster=replace(run.cluster, profile=once))
    from dspipe.tools.fold import run_ratios
    from dspipe.tools.run_terms import phase_split, plan_terms

    terms = plan_terms(again, engine, steps)
    split = phase_split(run.estimate, recomputed=0.0, zero_stage=1)
    ratio = run_ratios(terms, breakdown=run.estimate.breakdown, split=split)[0]["compute"]
    twice = fold(replace(again, estimate=run.estimate), engine=engine, steps=steps).profile
    assert twice.runs == 2
    c1 = once.correction("compute")
    assert math.isclose(twice.correction("compute"), math.sqrt(c1 * c1 * ratio), rel_tol=1e-9)


def test_a_run_that_compiled_ops_gives_their_compile_time(run_dir):
    engine = engine_json(before=(62.6, 62.3), ready=(165.8, 165.6), ops=(SHM_COMM, FUSED_ADAM))
    run, engine, steps = synthetic(run_dir, engine=engine)
    p = fold(run, engine=engine, steps=steps).profile
    jit = dict(p.jit_build_s)
    cpu = GPU_CATALOG["cpu"]
    assert p.launch_s is None and p.initialize_s is None  # a compile's launch says nothing of a normal one
    compiled = 62.6 + (165.6 - 62.3 - 0.05) - cpu.launch_s - cpu.initialize_s  # the slowest rank's initialize
    assert math.isclose(jit[SHM_COMM] + jit[FUSED_ADAM], compiled, rel_tol=1e-6)
    assert jit[FUSED_ADAM] > jit[SHM_COMM]  # shared as the catalog's figures are


def test_runs_that_cannot_be_folded_are_one_line(run_dir, tmp_path):
    run, engine, steps = synthetic(run_dir)
    with pytest.raises(SpecError, match="engine.json has no start-up record"):
        fold(run, engine=None, steps=steps)
    with pytest.raises(SpecError, match="metrics.csv has no steps yet"):
        fold(run, engine=engine, steps=[])
    with pytest.raises(SpecError, match="outside \\[0.05, 20\\]: a broken measurement"):
        fold(run, engine=engine, steps=[dict(r, forward_s=1e3) for r in steps])
    slow = run.estimate.breakdown["optimizer"] * 30 + run.estimate.dp_after_step_s
    with pytest.raises(SpecError, match="the run's optimizer ran 30x its plan, outside \\[0.05, 20\\]"):
        fold(run, engine=engine, steps=[dict(r, optimizer_s=slow) for r in steps])


def test_a_first_step_no_slower_than_the_others_folds_into_a_profile_that_reads_back(run_dir):
    """first_step_extra_s 0 (the first step as fast as a steady one) is a figure a profile holds, not damage."""
    run, engine, steps = synthetic(run_dir, first=0.3 + 0.55 + 0.04 + 0.005)
    p = fold(run, engine=engine, steps=steps).profile
    assert p.first_step_extra_s == 0.0
    assert profile_from_dict(profile_to_dict(p), where="folded") == p


@pytest.mark.parametrize(
    "startup, message",
    [
        (
            {"seconds_to_first_step": [1.0, 1.0]},
            "engine.json's startup is damaged: rank 0 reached its first step at 1 s, before its build ended at 7 + ",
        ),
        ({"rss_before_build_mib": [1e15, 1e15]}, "startup.rss_before_build_mib is damaged: one number in 0..1e9"),
        ({"seconds_before_build": [1e300, 1e300]}, "startup.seconds_before_build is damaged: one number in 0..1e9"),
    ],
)
def test_a_damaged_start_up_record_is_one_line_and_writes_nothing(run_dir, startup, message):
    engine = engine_json()
    engine["startup"].update(startup)
    run, engine, steps = synthetic(run_dir, engine=engine)
    with pytest.raises(SpecError, match=None) as e:
        fold(run, engine=engine, steps=steps)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_term_outside_the_limits_under_5_percent_of_the_step_is_left_as_it_was(run_dir):
    """A term of a few milliseconds (fixed overhead the plan does not model) can run 20x its plan on a loaded
    machine: it is not corrected, and the run still folds (CI's demo run: the optimizer at 24x, 4% of the step)."""
    run, engine, steps = synthetic(run_dir)
    est = run.estimate
    slow = est.breakdown["optimizer"] * 30 + est.dp_after_step_s
    whole = [r if r["step"] == 1 else dict(r, optimizer_s=slow, step_time_s=slow / 0.04) for r in steps]  # 4%
    folded = fold(run, engine=engine, steps=whole)
    assert "optimizer" not in folded.ratios and "compute" in folded.ratios
    assert "optimizer" not in dict(folded.profile.corrections)
    assert any(
        n.startswith("optimizer: unchanged (it ran 30x its plan, outside [0.05, 20], but ") for n in folded.notes
    )
    catalog = replace(run, cluster=replace(run.cluster, profile=None))
    with pytest.raises(SpecError, match="planned on the catalog's figures"):
        fold(catalog, engine=engine, steps=steps)


def test_calibrate_from_run_writes_the_folded_profile(run_dir, tmp_path):
    """The calibrate how-to's `--from-run` line, as written, on this run (its runs/demo)."""
    synthetic(run_dir)
    (tmp_path / "runs" / "demo").symlink_to(run_dir, target_is_directory=True)
    r = run_documented(
        documented(ROOT / "docs" / "howto" / "calibrate.md", "dspipe calibrate --from-run"), cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    assert "corrected by 1 run" in r.stderr and "after them, this run's plan vs. measured: " in r.stderr
    assert "step time (s)" in r.stderr.split("after them")[1]
    folded = json.loads((tmp_path / "folded.json").read_text())
    assert folded["runs"] == 1 and set(folded["corrections"]) >= {"compute", "optimizer", "startup"}
    r = dspipe("plan", *DEMO, *CPU2, "--profile", str(tmp_path / "folded.json"))
    assert r.returncode == 0 and "corrected" not in r.stderr, r.stderr
    r = dspipe("calibrate", "--from-run", str(run_dir), "--micro-batch", "4")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith("drop --micro-batch")


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--measure", "always", "--gpu", "h100-80g"], {}, "--measure always: this machine has no h100-80g GPU"),
        ([], {"DSPIPE_MEASURE": "sometimes"}, "$DSPIPE_MEASURE must be one of auto, always, never"),
    ],
)
def test_measure_refusals_are_one_line(args, env, message):
    cpu2 = [a for a in CPU2 if a not in ("--gpu", "cpu")] if "--gpu" in args else CPU2
    r = dspipe("plan", *DEMO, *cpu2, *args, env=env)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_plan_measures_this_machine_once_and_reads_it_back(tmp_path):
    tiny = ["--model", "tiny", "--layers", "2", "--hidden", "64", "--heads", "2", "--seq-len", "64", "--vocab", "512"]
    env = {"DSPIPE_CACHE": str(tmp_path), "DSPIPE_MEASURE": "auto"}
    first = dspipe("plan", *tiny, *CPU2, "--json", env=env)
    assert first.returncode == 0, first.stderr
    assert "measured now, cached in" in first.stderr
    summary = json.loads(first.stdout)  # the measurement's line is on stderr: --json stays one object
    cached_files = list((tmp_path / "machine").glob("*.json"))
    assert len(cached_files) == 1
    measured = json.loads(cached_files[0].read_text())
    assert measured["measured_by"] == "gen-config" and measured["figures"]["compute_tflops"] > 0
    again = dspipe("plan", *tiny, *CPU2, "--json", env=env)
    assert "measured here before" in again.stderr and json.loads(again.stdout) == summary
    third = dspipe("plan", *tiny, *CPU2, "--json", "--measure", "never", env=env)
    assert "machine:" not in third.stderr and json.loads(third.stdout) != summary  # the catalog's figures


def test_a_model_too_big_to_measure_quickly_on_cpu_keeps_the_catalog(tmp_path):
    env = {"DSPIPE_CACHE": str(tmp_path), "DSPIPE_MEASURE": "auto"}
    r = dspipe("plan", "--model", "gpt3-1.3b", "--gpus-per-node", "2", "--gpu", "cpu", "--global-batch", "8", env=env)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("machine:"))
    assert (
        line.startswith("machine: not measured: one forward + backward of 4 x 2048 tokens is") and "--profile" in line
    )
    assert not (tmp_path / "machine").exists()  # nothing measured, nothing cached


def test_a_damaged_cached_measurement_is_measured_again(tmp_path):
    from dspipe.tools.machine import _read_cached

    path = tmp_path / "m.json"
    said = []
    assert _read_cached(path, gpu="cpu", say=said.append) is None and said == []  # none yet: nothing to say
    path.write_text("{not json")
    assert _read_cached(path, gpu="cpu", say=said.append) is None
    assert len(said) == 1 and "is unreadable" in said[0] and said[0].endswith("measuring again")
    path.write_text(profile_text(a_profile()))
    assert _read_cached(path, gpu="cpu", say=said.append) == a_profile()
    assert _read_cached(path, gpu="h100-80g", say=said.append) is None  # another type's: not this plan's


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda d: d["estimate"]["step_time_breakdown_s"].update(compute="x"),
            "estimate.step_time_breakdown_s.compute must be a number >= 0, got 'x'",
        ),
        (lambda d: d.pop("estimate"), "dspipe.json's estimate has no step time and breakdown to compare the run with"),
        (lambda d: d.update(format_version=True), "format_version True != "),
    ],
)
def test_a_damaged_plan_in_the_run_is_one_line_for_calibrate(run_dir, edit, message):
    """calibrate --from-run compares the run with dspipe.json's estimate: a damaged or missing one is one line, not a
    fold against whatever was left (each exits 2 and writes no profile)."""
    synthetic(run_dir)
    d = json.loads((run_dir / "dspipe.json").read_text())
    edit(d)
    (run_dir / "dspipe.json").write_text(json.dumps(d))
    r = dspipe("calibrate", "--from-run", str(run_dir), "--out", str(run_dir / "f.json"))
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (run_dir / "f.json").exists()
