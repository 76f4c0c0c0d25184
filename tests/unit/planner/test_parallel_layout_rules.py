"""Tensor and sequence parallelism before launch: the limits of dspipe's tensor-parallel layers and of Ulysses as
one-line errors (exit 2, nothing written), the rendered tensor_parallel block (DeepSpeed's AutoTP off at every tp) as
DeepSpeed parses it, the split's layer specs against the model's real parameter names, and the shard merge export
uses."""

import pytest

from dspipe.model.tp_split import merge_shards, split_of
from dspipe.planner.autotp import layer_specs
from dspipe.spec.presets import MODEL_PRESETS, model_preset
from tests.helpers import run_cli

CPU = ["--model", "tiny", "--gpu", "cpu", "--global-batch", "16", "--micro-batch", "4"]
BAD = [
    (["--gpus-per-node", "6", "--tp", "3"], "model heads 4 is not divisible by tp 3"),
    (["--gpus-per-node", "2", "--tp", "2", "--ffn", "257", "--layers", "2"], "model ffn 257 is not divisible by tp 2"),
    (["--gpus-per-node", "2", "--tp", "4"], "world size 2 (1 nodes x 2 GPUs) is not divisible by pp 1 x tp 4 x sp 1"),
    (["--gpus-per-node", "1", "--nodes", "2", "--tp", "2"], "tp 2 does not divide the 1 GPUs per node"),
    (
        ["--gpus-per-node", "4", "--tp", "2", "--sp", "2", "--zero", "3"],
        "ZeRO-3 with tp 2 x sp 2: DeepSpeed 0.19.8 partitions a module built outside zero.Init over the mpu's "
        "data-parallel group",
    ),
    (
        ["--gpus-per-node", "4", "--tp", "4", "--vocab", "6"],
        "model vocab 6 over tp 4: ceil(6 / 4) = 2 rows per rank leaves the last rank 0 (vocab - 3 x 2)",
    ),
    (["--gpus-per-node", "2", "--tp", "2", "--zero", "0", "--precision", "bf16"], "tp 2 with ZeRO-0 in bf16"),
    (["--gpus-per-node", "3", "--sp", "3"], "model heads 4 is not divisible by sp 3"),
    (["--gpus-per-node", "2", "--sp", "2", "--seq-len", "63"], "model seq_len 63 is not divisible by sp 2"),
    (
        ["--gpus-per-node", "8", "--sp", "4", "--tp", "2", "--zero", "1"],
        "model heads 4 / tp 2 = 2 heads per tp rank are not divisible by sp 4: "
        "Ulysses spreads each tp rank's heads over "
        "the sp ranks",
    ),
    (["--gpus-per-node", "4", "--sp", "2", "--pp", "2"], "sp 2 with pp 2"),
    (
        ["--gpus-per-node", "4", "--tp", "2", "--global-batch", "6", "--micro-batch", "4"],
        "global batch 6 is not divisible by micro_batch 4 x dp 2 = 8",
    ),
]


@pytest.mark.parametrize("flags,message", BAD, ids=[m[:30] for _, m in BAD])
def test_bad_layouts_are_one_line_exit_2_nothing_written(flags, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for command in (["plan"], ["gen-config", "--out", tmp_path / "run"]):
        code = run_cli(*command, *CPU, *flags)
        err = capsys.readouterr().err
        assert code == 2 and message in err and err.count("\n") == 1, (command, err)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "flags,layout",
    [
        (["--gpus-per-node", "2", "--tp", "2", "--zero", "3"], (3, 2, 1, 1)),  # ZeRO-3 with tp alone
        (["--gpus-per-node", "4", "--sp", "2", "--tp", "2", "--zero", "1"], (1, 2, 2, 1)),  # tp x Ulysses, ZeRO 1-2
    ],
)
def test_layouts_the_rules_no_longer_refuse_plan_and_write(flags, layout, tmp_path, capsys, monkeypatch):
    """ZeRO-3 with tp, and tp x sp under ZeRO-1, were refused while dspipe's tp was DeepSpeed's AutoTP: they plan,
    and gen-config writes them with Megatron sequence parallelism on (no partitioned pipe tensors to render)."""
    import json

    monkeypatch.chdir(tmp_path)
    assert run_cli("plan", *CPU, *flags, "--json") == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["zero_stage"], d["tp"], d["sp"], d["dp"]) == layout and d["fits"]
    assert run_cli("gen-config", *CPU, *flags, "--out", tmp_path / "run") == 0
    spec = json.loads((tmp_path / "run" / "dspipe.json").read_text())
    assert (spec["plan"]["zero_stage"], spec["plan"]["tp"], spec["plan"]["sp"], spec["plan"]["tp_sp"]) == (
        *layout[:3],
        True,
    )
    ds = json.loads((tmp_path / "run" / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == layout[0] and ds["sequence_parallel_size"] == layout[2]
    assert ds["tensor_parallel"]["autotp_size"] == 0


def _render(**strategy):
    from dspipe.planner.plan import make_plan
    from dspipe.planner.render import render_ds_config
    from dspipe.spec.cluster import ClusterSpec
    from dspipe.spec.presets import model_preset
    from dspipe.spec.strategy import StrategySpec
    from dspipe.spec.train import TrainSpec

    model = model_preset("tiny")
    cluster = ClusterSpec(nodes=1, gpus_per_node=4, gpu="cpu")
    train = TrainSpec(global_batch=16, micro_batch=2, steps=10, warmup_steps=2, precision="fp32")
    plan = make_plan(model=model, cluster=cluster, train=train, strategy=StrategySpec(**strategy))
    return plan, render_ds_config(plan=plan, model=model_preset("tiny"), train=train, monitor_dir="/tmp/m")


def test_tp_renders_autotp_off_and_deepspeed_parses_it():
    """dspipe's own tensor-parallel layers split the model: the tensor_parallel block is rendered as at tp 1 (AutoTP
    off), and train_batch_size is the global batch (the mpu's data-parallel group excludes the tp ranks)."""
    from dspipe.runtime.dscheck import parse_with_deepspeed

    _, at_tp1 = _render(zero=1)
    plan, cfg = _render(zero=1, tp=2)
    assert (plan.dp, plan.tp, plan.grad_accum, plan.ds_batch_ranks) == (2, 2, 4, 2)
    assert cfg["tensor_parallel"] == at_tp1["tensor_parallel"]
    tp = cfg["tensor_parallel"]
    assert tp["autotp_size"] == 0 and tp["tp"]["tp_size"] == 1
    assert tp["partition_config"] == {"use_default_specs": False, "layer_specs": layer_specs(model_preset("tiny"))}
    assert cfg["train_batch_size"] == plan.global_batch == 16
    parsed = parse_with_deepspeed(cfg, dp=plan.ds_batch_ranks)
    assert parsed.train_batch_size == 16 and parsed.gradient_accumulation_steps == 4
    assert parsed.tensor_parallel_config.autotp_size == 0


def test_tp1_leaves_autotp_off_and_sp_with_zero3_turns_reduce_scatter_off():
    _, cfg = _render(zero=1)
    assert cfg["tensor_parallel"]["autotp_size"] == 0 and cfg["sequence_parallel_size"] == 1
    assert cfg["zero_optimization"]["reduce_scatter"] is True
    plan, cfg = _render(zero=3, sp=2)
    assert (plan.dp, plan.sp, cfg["train_batch_size"], cfg["sequence_parallel_size"]) == (2, 2, 16, 2)
    assert cfg["zero_optimization"]["reduce_scatter"] is False  # stage 3's averaging lacks the sp correction
    _, cfg = _render(zero=2, sp=2)
    assert cfg["zero_optimization"]["reduce_scatter"] is True


@pytest.mark.parametrize("name", ["tiny", "tiny-llama", "llama3-8b"])
def test_layer_specs_match_exactly_the_block_projections_of_the_model(name):
    import re

    spec = MODEL_PRESETS[name]
    names = [n for n, _ in spec.model_tensors()]  # the model's parameter names (tied to the module elsewhere)
    split = {n: split_of(n, spec) for n in names if split_of(n, spec)}
    vocab = {n: split.pop(n) for n in list(split) if split[n][0] == "vocab"}  # the vocabulary-parallel tables
    assert vocab == {n: ("vocab", spec.vocab) for n in ("embed.wte.weight", "lm_head.weight") if n in names}
    hd, kv, f = spec.head_dim, spec.kv_groups, spec.ffn
    qkv = (0, [spec.heads * hd, kv * hd, kv * hd])
    up = (0, [f, f] if spec.mlp == "swiglu" else [f])
    per_block = {
        "attn.c_attn.weight": qkv,
        "mlp.c_fc.weight": up,
        "attn.c_proj.weight": (1, [spec.hidden]),
        "mlp.c_proj.weight": (1, [f]),
    }
    if spec.bias:
        per_block.update({"attn.c_attn.bias": qkv, "mlp.c_fc.bias": up})
    assert split == {f"h.{i}.{k}": v for i in range(spec.layers) for k, v in per_block.items()}
    matched = {n for n in names for s in layer_specs(spec) if any(re.match(p, n) for p in s["patterns"])}
    assert matched == set(split)  # DeepSpeed matches exactly the tensors export knows how to merge


def test_gqa_and_swiglu_render_unequal_and_paired_parts():
    specs = layer_specs(MODEL_PRESETS["llama3-8b"])
    assert specs[0]["shape"] == [[4096, 1024, 1024], -1] and specs[0]["partition_dim"] == 0
    assert specs[1]["shape"] == [2, -1]


@pytest.mark.parametrize("gqa", [False, True])
def test_merge_shards_inverts_the_tensor_parallel_split(gqa):
    torch = pytest.importorskip("torch")
    spec = MODEL_PRESETS["tiny-llama" if gqa else "tiny"]
    tp, h = 2, spec.hidden
    parts = [spec.heads * spec.head_dim, spec.kv_groups * spec.head_dim, spec.kv_groups * spec.head_dim]
    qkv = torch.randn(sum(parts), h)
    q, k, v = qkv.split(parts)
    shards = [torch.cat([q.chunk(tp)[r], k.chunk(tp)[r], v.chunk(tp)[r]]) for r in range(tp)]  # whole heads each
    assert torch.equal(merge_shards("h.0.attn.c_attn.weight", shards, spec), qkv)
    proj = torch.randn(h, spec.ffn)
    assert torch.equal(merge_shards("h.1.mlp.c_proj.weight", list(proj.chunk(tp, dim=1)), spec), proj)
    norm = torch.randn(h)
    assert torch.equal(merge_shards("h.0.ln_1.weight", [norm, norm.clone()], spec), norm)
    with pytest.raises(ValueError, match="differs between tp rank 0 and tp rank 1"):
        merge_shards("h.0.ln_1.weight", [norm, norm + 1], spec)


# ---- a third-party DeepSpeed config with AutoTP / Ulysses settings, and the monitor blocks ------------------------


def _gen_from_preset(tmp_path, cfg, *flags):
    import json

    from tests.helpers import dspipe

    path = tmp_path / "preset.json"
    path.write_text(json.dumps(cfg))
    return dspipe(
        "gen-config",
        "--model",
        "tiny",
        "--gpu",
        "cpu",
        "--gpus-per-node",
        "4",
        "--preset",
        path,
        *flags,
        "--out",
        "runs/p",
        cwd=tmp_path,
    )


def test_preset_autotp_size_becomes_tp_and_its_batch_counts_the_tp_ranks(tmp_path):
    """A third-party JSON written for DeepSpeed's AutoTP counts the tp ranks in train_batch_size: it imports as --tp 2
    with the global batch 32 / 2; dspipe renders AutoTP off and train_batch_size as the global batch, and says so."""
    import json

    cfg = {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 1},
        "tensor_parallel": {"autotp_size": 2, "tp": {"tp_size": 2}},
        "sequence_parallel_size": 1,
    }
    r = _gen_from_preset(tmp_path, cfg, "--precision", "fp32")
    assert r.returncode == 0, r.stderr
    assert (
        "train_batch_size 32 counts the 2 AutoTP ranks of each replica (DeepSpeed 0.19.8's AutoTP semantics): "
        "global batch 16 sequences, which dspipe renders as train_batch_size 16"
    ) in r.stdout
    assert (
        "tensor_parallel.autotp_size 2 -> --tp 2: dspipe runs tp with its own tensor-parallel layers (Megatron "
        "layout) and renders DeepSpeed's AutoTP off (autotp_size 0, tp.tp_size 1)"
    ) in r.stdout
    spec = json.loads((tmp_path / "runs/p/dspipe.json").read_text())
    assert (spec["plan"]["tp"], spec["plan"]["dp"], spec["plan"]["global_batch"], spec["plan"]["grad_accum"]) == (
        2,
        2,
        16,
        2,
    )
    ds = json.loads((tmp_path / "runs/p/ds_config.json").read_text())
    assert ds["train_batch_size"] == 16 and ds["tensor_parallel"]["autotp_size"] == 0
    assert ds["tensor_parallel"]["tp"]["tp_size"] == 1


@pytest.mark.parametrize(
    "tensor_parallel,key",
    [
        ({"autotp_size": 2, "preset_model": "llama"}, "tensor_parallel.preset_model"),
        (
            {"autotp_size": 2, "partition_config": {"use_default_specs": True, "layer_specs": []}},
            "tensor_parallel.partition_config",
        ),
        ({"autotp_size": 2, "vocab_parallel_lm_head": True}, "tensor_parallel.vocab_parallel_lm_head"),
        ({"autotp_size": 2, "injection_policy_tuple": [1]}, "tensor_parallel.injection_policy_tuple"),
        (
            {"autotp_size": 2, "tp": {"tp_size": 4}},
            "tensor_parallel.tp.tp_size 4 disagrees with tensor_parallel.autotp_size 2",
        ),
        ({"tp": {"tp_size": 2}}, "tensor_parallel.tp.tp_size 2 cannot be honoured: this plan renders 1"),
        ({"autotp_size": 3}, "is not divisible by pp 1 x tp 3 x sp 1 = 3"),
    ],
)
def test_preset_tensor_parallel_settings_dspipe_cannot_honour_are_refused(tmp_path, tensor_parallel, key):
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}, "tensor_parallel": tensor_parallel}
    r = _gen_from_preset(tmp_path, cfg, "--precision", "fp32", "--global-batch", "16")
    assert r.returncode == 2 and key in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "runs").exists()


def test_monitor_values_render_wandb_and_comet_as_deepspeed_reads_them():
    from deepspeed.monitor.config import get_monitor_config

    from dspipe.planner.plan import make_plan
    from dspipe.planner.render import monitor_values, render_ds_config
    from dspipe.spec.cluster import ClusterSpec
    from dspipe.spec.presets import model_preset
    from dspipe.spec.strategy import StrategySpec
    from dspipe.spec.train import TrainSpec

    train = TrainSpec(global_batch=16, micro_batch=2, steps=10, warmup_steps=2, precision="fp32")
    plan = make_plan(
        model=model_preset("tiny"),
        cluster=ClusterSpec(nodes=1, gpus_per_node=2, gpu="cpu"),
        train=train,
        strategy=StrategySpec(zero=1),
    )
    off = get_monitor_config(render_ds_config(plan=plan, model=model_preset("tiny"), train=train, monitor_dir="/tmp/m"))
    assert (off.wandb.enabled, off.comet.enabled, off.tensorboard.enabled, off.csv_monitor.enabled) == (
        False,
        False,
        True,
        True,
    )
    values = monitor_values(
        {
            "wandb_project": "gpt",
            "wandb_group": "sweep",
            "wandb_team": None,
            "comet_project": "gpt-c",
            "comet_workspace": "lab",
            "comet_offline": True,
            "comet_experiment": "run-1",
        }
    )
    cfg = render_ds_config(plan=plan, model=model_preset("tiny"), train=train, monitor_dir="/tmp/m", monitors=values)
    on = get_monitor_config(cfg)
    assert (on.wandb.enabled, on.wandb.project, on.wandb.group, on.wandb.team) == (True, "gpt", "sweep", None)
    assert (
        on.comet.enabled,
        on.comet.project,
        on.comet.workspace,
        on.comet.online,
        on.comet.experiment_name,
        on.comet.api_key,
    ) == (True, "gpt-c", "lab", False, "run-1", None)
    assert on.enabled


def test_monitor_names_must_be_printable_one_line_names(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for flag in ("--wandb-project", "--comet-project", "--wandb-group"):
        for bad in ("", "a\nb"):
            code = run_cli("gen-config", *CPU, "--gpus-per-node", "2", flag, bad, "--out", tmp_path / "run")
            err = capsys.readouterr().err
            why = "'' is empty: give a value" if bad == "" else "must be a name: 1-128 printable characters"
            assert code == 2 and why in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def _gen(tmp_path, out, *flags):
    from tests.helpers import dspipe

    return dspipe(
        "gen-config", "--model", "tiny", "--gpu", "cpu", "--gpus-per-node", "4", *flags, "--out", out, cwd=tmp_path
    )


@pytest.mark.parametrize("preset", ["zero1-bf16", "zero2-bf16", "zero3-bf16", "pipeline-zero1-bf16"])
def test_a_shipped_preset_takes_tp(tmp_path, preset):
    """autotp_size 0 in a preset is DeepSpeed's AutoTP off, not tp 1: --tp 2 is dspipe's own tensor parallelism
    (with Megatron sequence parallelism on, which renders pipe/grad_partitioned false where the preset leaves them
    "auto")."""
    import json

    r = _gen(tmp_path, "runs/p", "--preset", preset, "--tp", "2", "--global-batch", "16")
    assert r.returncode == 0, r.stderr
    plan = json.loads((tmp_path / "runs/p/dspipe.json").read_text())["plan"]
    assert plan["tp"] == 2 and plan["tp_sp"] is True
    ds = json.loads((tmp_path / "runs/p/ds_config.json").read_text())
    assert ds["tensor_parallel"]["autotp_size"] == 0 and ds["pipeline"]["pipe_partitioned"] is False


def test_a_runs_own_ds_config_as_a_preset_gives_the_same_run_back(tmp_path):
    """The run's ds_config.json (tp 2 x dp 2, autotp_size 0, every batch key a number) as --preset, with and
    without --tp: the batch keys fix dp 2, so tp is 2 again."""
    import json

    r = _gen(tmp_path, "runs/a", "--tp", "2", "--global-batch", "16", "--micro-batch", "2")
    assert r.returncode == 0, r.stderr
    first = json.loads((tmp_path / "runs/a/ds_config.json").read_text())
    for name, flags in (("b", ["--tp", "2"]), ("c", [])):
        r = _gen(tmp_path, f"runs/{name}", "--preset", "runs/a/ds_config.json", *flags)
        assert r.returncode == 0, r.stderr
        again = json.loads((tmp_path / f"runs/{name}/ds_config.json").read_text())
        for monitor in ("tensorboard", "csv_monitor"):  # each run directory's own monitor/
            again[monitor]["output_path"] = first[monitor]["output_path"]
        assert again == first
    assert "preset: tp 2 = world 4 / (dp 2 x pp 1 x sp 1), dp 2 = train_batch_size 16 / (micro 2 x " in r.stdout


@pytest.mark.parametrize(
    "flag,value",
    [("--zero", "auto"), ("--offload", "auto"), ("--precision", "auto"), ("--pp", "auto"), ("--tp", "auto")],
)
def test_auto_beside_a_preset_is_the_flag_left_out(tmp_path, flag, value):
    import json

    r = _gen(tmp_path, "runs/p", "--preset", "zero3-bf16", "--global-batch", "16", flag, value)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "runs/p/ds_config.json").read_text())["zero_optimization"]["stage"] == 3


def test_a_typed_switch_that_contradicts_a_preset_is_named_as_typed(tmp_path):
    r = _gen(tmp_path, "runs/p", "--preset", "zero2-bf16", "--global-batch", "16", "--offload-params")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--offload-params contradicts zero_optimization.offload_param.device" in r.stderr, r.stderr
    assert not (tmp_path / "runs").exists()
