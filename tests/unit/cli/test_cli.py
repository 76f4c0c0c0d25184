"""gen-config end to end through the real command: outputs, printed command, one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest

from tests.helpers import dspipe, run_cli

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
]


def test_gen_config_writes_the_run_and_prints_the_command(tmp_path, corpus):
    r = dspipe("gen-config", *CPU2, "--zero", "2", "--data", corpus, "--out", "runs/a", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"run:  deepspeed --num_gpus 2 --module dspipe.runtime.entry --run {tmp_path / 'runs/a'}" in r.stdout
    assert "global 16 = micro 4 x grad_accum 2 x dp 2" in r.stdout
    run = tmp_path / "runs/a"
    spec = json.loads((run / "dspipe.json").read_text())
    cfg = json.loads((run / "ds_config.json").read_text())
    assert spec["plan"]["grad_accum"] == cfg["gradient_accumulation_steps"] == 2
    assert spec["model"]["name"] == "tiny" and spec["cluster"]["gpu"] == "cpu"
    assert spec["data"] == str(corpus)
    assert cfg["zero_optimization"]["stage"] == 2 and cfg["gradient_clipping"] == 1.0
    assert cfg["tensorboard"]["output_path"] == "runs/a/monitor"
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "ds_config.json", "dspipe.json"]


def test_bucket_size_flags_reach_the_json(tmp_path):
    r = dspipe(
        "gen-config",
        *CPU2,
        "--zero",
        "3",
        "--reduce-bucket-size",
        "123456",
        "--prefetch-bucket-size",
        "65432",
        "--param-persistence-threshold",
        "999",
        "--out",
        "runs/b",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    z = json.loads((tmp_path / "runs/b/ds_config.json").read_text())["zero_optimization"]
    assert (
        z["reduce_bucket_size"],
        z["allgather_bucket_size"],
        z["stage3_prefetch_bucket_size"],
        z["stage3_param_persistence_threshold"],
    ) == (123456, 123456, 65432, 999)


def test_zero3_live_parameter_flags_reach_the_json_and_the_estimate(tmp_path):
    from dspipe.planner.cost import estimate
    from dspipe.rundir import load_run

    sizes = {}
    whole = ["--max-live-parameters", "1000000000", "--max-reuse-distance", "1000000000"]
    for name, knobs in (("default", []), ("whole", whole), ("zero", ["--max-live-parameters", "0"])):
        r = dspipe(
            "gen-config",
            *CPU2,
            "--layers",
            "4",
            "--hidden",
            "768",
            "--heads",
            "12",
            "--zero",
            "3",
            "--offload",
            "cpu",
            "--offload-params",
            *knobs,
            "--out",
            f"runs/{name}",
            cwd=tmp_path,
        )
        # 31.5M parameters (the census row zero3-offload-params), offloaded: the backward is the peak
        assert r.returncode == 0, r.stderr
        z = json.loads((tmp_path / f"runs/{name}/ds_config.json").read_text())["zero_optimization"]
        run = load_run(tmp_path / f"runs/{name}")
        knob = dict(zip(knobs[::2], map(int, knobs[1::2]), strict=True))
        expected = (
            knob.get("--max-live-parameters", run.plan.prefetch_bucket_size + 4096 * 768),  # + the embedding
            knob.get("--max-reuse-distance", run.plan.prefetch_bucket_size),
        )  # 0 is a value, not "unset"
        assert (z["stage3_max_live_parameters"], z["stage3_max_reuse_distance"]) == expected
        assert (run.plan.max_live_parameters, run.plan.max_reuse_distance) == expected  # what the estimate reads
        sizes[name] = estimate(model=run.model, cluster=run.cluster, plan=run.plan).memory.total
    assert sizes["whole"] > sizes["default"]  # 1e9 keeps the whole model gathered from forward to backward


def test_multi_node_command_uses_a_hostfile(tmp_path):
    (tmp_path / "hosts.txt").write_text("node-a slots=8\nnode-b slots=8\n")  # gen-config validates it
    r = dspipe(
        "gen-config",
        "--model",
        "gpt2-124m",
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "--global-batch",
        "64",
        "--hostfile",
        "hosts.txt",
        "--out",
        "runs/mn",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert (
        f"deepspeed --hostfile {tmp_path / 'hosts.txt'} --num_nodes 2 --num_gpus 8 --module dspipe.runtime.entry "
        f"--run {tmp_path / 'runs/mn'}"
    ) in r.stdout  # absolute: works from any directory


def test_existing_run_dir_is_kept_unless_forced(tmp_path):
    assert dspipe("gen-config", *CPU2, "--out", "runs/a", cwd=tmp_path).returncode == 0
    r = dspipe("gen-config", *CPU2, "--zero", "3", "--out", "runs/a", cwd=tmp_path)
    assert r.returncode == 2 and "runs/a already exists (pass --force" in r.stderr
    r = dspipe("gen-config", *CPU2, "--zero", "3", "--out", "runs/a", "--force", cwd=tmp_path)
    assert r.returncode == 0
    assert json.loads((tmp_path / "runs/a/ds_config.json").read_text())["zero_optimization"]["stage"] == 3
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["a"]  # no temp or .old leftovers


BAD = [
    (["--model", "gpt5"], "unknown model preset 'gpt5'; valid: tiny, gpt2-124m"),
    (["--layers", "2", "--hidden", "100", "--heads", "3", "--vocab", "64"], "hidden 100 is not divisible by heads 3"),
    (["--layers", "2"], "give --model NAME"),
    (
        ["--model", "tiny", "--global-batch", "512", "--micro-batch", "3", "--gpus-per-node", "8"],
        "global batch 512 is not divisible by micro_batch 3 x dp 8 = 24",
    ),
    (["--model", "tiny", "--pp", "3"], "pipeline stages 3 > layers 2"),
    (["--model", "gpt2-124m", "--gpus-per-node", "6", "--pp", "4"], "is not divisible by pp 4 x tp 1 x sp 1 = 4"),
    (["--model", "tiny", "--pp", "2", "--zero", "2"], "supports ZeRO stages 0-1 only; use --zero 1"),
    (["--model", "tiny", "--zero", "2", "--precision", "fp16", "--pp", "2"], "ZeRO-2 with pp 2"),
    (["--model", "tiny", "--zero", "2", "--offload", "cpu", "--offload-params"], "--offload-params needs ZeRO-3"),
    (["--model", "tiny", "--zero", "3", "--offload", "nvme"], "--offload nvme needs --nvme-path"),
    (["--model", "tiny", "--micro-batch", "0"], "micro_batch must be a positive integer, got 0"),
    (["--model", "tiny", "--gpu", "v100"], "unknown GPU type 'v100'; valid: cpu, a100-40g"),
    (["--model", "tiny", "--precision", "fp8"], "'--precision': 'fp8' is not one of: auto, bf16, fp16, fp32"),
    (
        ["--model", "tiny", "--gpu", "cpu", "--precision", "fp16"],
        "fp16 is not supported by DeepSpeed's CPU accelerator",
    ),
    (["--model", "tiny", "--preset", "zero9"], "unknown DeepSpeed preset 'zero9'; valid: fp16-zero2"),
    (["--model", "tiny", "--zero", "x"], "'--zero': 'x' is not one of: auto, 0, 1, 2, 3"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, args, message):
    r = dspipe("gen-config", *args, "--out", "runs/bad", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert r.stderr.startswith("dspipe: error: ") and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "runs").exists()


def test_vocab_mismatch_with_prepared_data(tmp_path, corpus):
    r = dspipe("gen-config", *CPU2, "--vocab", "512", "--data", corpus, "--out", "runs/v", cwd=tmp_path)
    assert r.returncode == 2 and "tokenizer vocab 1024" in r.stderr and "model vocab 512" in r.stderr
    assert r.stderr.count("\n") == 1 and not (tmp_path / "runs").exists()


def test_pad_vocab_takes_the_data_vocab_to_a_multiple_of_64(tmp_path, corpus):
    r = dspipe("gen-config", *CPU2, "--pad-vocab", "--data", corpus, "--out", "runs/p", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "runs/p/dspipe.json").read_text())["model"]["vocab"] == 1024  # 1024 = 16 x 64
    assert "V1024" in r.stdout


def test_pad_vocab_refuses_another_vocab_and_sets_a_custom_shapes(tmp_path, corpus, capsys):
    shape = [
        "--layers",
        "2",
        "--hidden",
        "64",
        "--heads",
        "2",
        "--gpu",
        "cpu",
        "--gpus-per-node",
        "2",
        "--eval-interval",
        "0",
    ]
    for vocab, code in (("50257", 2), ("1024", 0)):  # 1024: the value --pad-vocab gives
        capsys.readouterr()
        args = ["--vocab", vocab, "--pad-vocab", "--data", corpus, "--print-config"]
        assert run_cli("gen-config", *CPU2, *args) == code
        if code:
            err = capsys.readouterr().err
            assert (
                err.strip()
                == "dspipe: error: --vocab 50257 contradicts --pad-vocab, which makes it 1024; drop one of them"
            )
    capsys.readouterr()  # no --vocab with a custom shape: the data's, padded
    out = tmp_path / "runs/c"
    assert run_cli("gen-config", *shape, "--pad-vocab", "--data", corpus, "--global-batch", "8", "--out", out) == 0
    assert json.loads((out / "dspipe.json").read_text())["model"]["vocab"] == 1024
    none = tmp_path / "none"
    assert run_cli("gen-config", *shape, "--pad-vocab", "--data", none, "--global-batch", "8", "--out", out / "d") == 2
    assert f"--pad-vocab pads the data's tokenizer vocab, but {none} is not prepared" in capsys.readouterr().err


def test_recompute_blocks_beyond_the_layers_is_refused(capsys):
    args = ["--checkpointing", "full", "--recompute-blocks", "3"]
    assert run_cli("plan", *CPU2, *args) == 2
    assert "--recompute-blocks 3 is more than the model's 2 layers" in capsys.readouterr().err


def test_corpus_shorter_than_one_sequence_is_refused_at_gen_config(tmp_path, corpus):
    r = dspipe("gen-config", *CPU2, "--seq-len", "1000000", "--data", corpus, "--out", "runs/s", cwd=tmp_path)
    assert r.returncode == 2 and "is shorter than one sequence of 1000001 tokens" in r.stderr, r.stderr


def test_planning_modules_import_without_torch_or_deepspeed():
    code = (
        "import sys, dspipe.spec.core, dspipe.planner.plan, dspipe.planner.render, dspipe.spec.presets, "
        "dspipe.rundir, dspipe.cli.app; "
        "bad = [m for m in ('torch', 'deepspeed') if m in sys.modules]; print(bad); sys.exit(bool(bad))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_presets_command_lists_models_and_deepspeed_presets():
    r = dspipe("presets")
    assert r.returncode == 0 and "gpt3-175b" in r.stdout and "zero3-nvme-offload" in r.stdout


def test_a_click_option_is_generated_from_its_setting():
    import click

    from dspipe.cli.options import FLOAT, INT, AutoChoice, click_option
    from dspipe.spec.options import SETTINGS

    def param(key):
        return click_option(SETTINGS[key])(lambda **o: None).__click_params__[0]

    lr = param("lr")
    assert (lr.opts, lr.type, lr.default, lr.show_default) == (["--lr"], FLOAT, 6e-4, True)
    assert lr.help == "peak learning rate"
    zero = param("zero")
    assert isinstance(zero.type, AutoChoice) and zero.type.choices == ("0", "1", "2", "3") and zero.default is None
    bias = param("bias")
    assert (bias.opts, bias.secondary_opts, bias.default) == (["--bias"], ["--no-bias"], None)
    untied = param("untied")
    assert untied.is_flag and untied.default is False and untied.help == "separate output head (default: tied)"
    seq = param("seq_len")
    assert isinstance(seq.type, type(INT)) and seq.type.limit == 2**20  # names its limit to a 5,000-digit value
    assert seq.help == "context length [the preset's; custom 1024]"
    assert isinstance(param("norm").type, click.Choice)


def test_a_warmup_of_one_step_is_noted_as_the_two_deepspeed_runs(tmp_path):
    """DeepSpeed's WarmupCosineLR takes max(2, warmup_num_steps): gen-config says so rather than change it silently."""
    import torch
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    common = (
        "gen-config",
        "--model",
        "tiny",
        "--gpus-per-node",
        "1",
        "--gpu",
        "cpu",
        "--global-batch",
        "4",
        "--steps",
        "10",
    )
    r = dspipe(*common, "--warmup", "1", "--out", tmp_path / "w1")
    assert r.returncode == 0, r.stderr
    assert (
        "note: --warmup 1 runs as 2 warmup steps (DeepSpeed's WarmupLR and WarmupCosineLR warm up over at least 2)"
    ) in r.stderr
    params = json.loads((tmp_path / "w1" / "ds_config.json").read_text())["scheduler"]["params"]
    assert params["warmup_num_steps"] == 1  # the value asked for is written; DeepSpeed clamps it
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    assert WarmupCosineLR(opt, **params).warmup_num_steps == 2
    r = dspipe(*common, "--warmup", "2", "--out", tmp_path / "w2")
    assert r.returncode == 0 and "warmup steps" not in r.stderr, r.stderr
