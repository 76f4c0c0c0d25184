import math
from dataclasses import dataclass, fields, replace

import pytest

from dspipe.errors import SpecError
from dspipe.spec.cluster import ClusterSpec
from dspipe.spec.core import LIMITS, SPECS, StrategyRequest
from dspipe.spec.hardware import GPU_CATALOG, gpu_type
from dspipe.spec.model import ModelSpec
from dspipe.spec.presets import MODEL_PRESETS, PRESETS, model_preset
from dspipe.spec.settings import declared, setting
from dspipe.spec.strategy import StrategySpec
from dspipe.spec.train import TrainSpec


def test_gpt2_small_parameter_count_matches_the_released_model():
    # 124,439,808 is the parameter count of Hugging Face's gpt2 checkpoint (tied head).
    assert model_preset("gpt2-124m").num_params == 124_439_808


@pytest.mark.parametrize("name", list(MODEL_PRESETS))
def test_every_preset_is_valid_and_near_its_nominal_size(name):
    spec = MODEL_PRESETS[name]
    assert spec.hidden % spec.heads == 0
    if spec.mlp == "gelu":
        assert spec.ffn == 4 * spec.hidden
    if name.startswith("tiny") or PRESETS[name].published_params is not None:
        return  # a released checkpoint's exact count: tests/unit/spec/test_presets_published.py
    nominal = name.split("-")[1]
    value = float(nominal[:-1]) * (1e9 if nominal.endswith("b") else 1e6)
    # GPT-3's names count ~12Lh^2 non-embedding params plus embeddings; allow 12% for rounding and GPT-2's vocab
    assert abs(spec.num_params - value) / value < 0.12, (name, spec.num_params)


def test_gpt3_175b_shape_from_the_paper():
    m = MODEL_PRESETS["gpt3-175b"]
    assert (m.layers, m.hidden, m.heads, m.seq_len) == (96, 12288, 96, 2048)
    assert math.isclose(m.num_params, 175e9, rel_tol=0.01)


def test_unknown_preset_lists_the_valid_names():
    with pytest.raises(SpecError, match="unknown model preset 'gpt5'.*gpt2-124m.*gpt3-175b"):
        model_preset("gpt5")


def test_preset_overrides_rename_and_rescale_ffn():
    m = model_preset("tiny", hidden=128, heads=8)
    assert (m.name, m.hidden, m.ffn, m.layers) == ("tiny+custom", 128, 512, 2)
    assert model_preset("tiny", layers=None) is MODEL_PRESETS["tiny"]


def test_hidden_not_divisible_by_heads_shows_the_division():
    with pytest.raises(
        SpecError, match=r"hidden 100 is not divisible by heads 3 \(100 / 3 = 33.3333; or give head_dim\)"
    ):
        ModelSpec("x", 2, 100, 3, 64, 16, 400)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            dict(global_batch=8, micro_batch=0, steps=10, warmup_steps=1),
            "micro_batch must be a positive integer, got 0",
        ),
        (dict(global_batch=-8, micro_batch=1, steps=10, warmup_steps=1), "global_batch must be a positive"),
        (
            dict(global_batch=8, micro_batch=1, steps=10, warmup_steps=1, precision="fp8"),
            "precision 'fp8' is not one of",
        ),
    ],
)
def test_train_spec_rejects(kwargs, match):
    with pytest.raises(SpecError, match=match):
        TrainSpec(**kwargs)


def test_unknown_gpu_lists_the_catalog():
    with pytest.raises(SpecError, match="unknown GPU type 'v100'; valid: cpu, a100-40g, a100-80g, h100-80g, h200"):
        ClusterSpec(nodes=1, gpus_per_node=8, gpu="v100")


def test_catalog_peaks():
    assert gpu_type("a100-80g").peak_tflops("bf16") == 312.0
    assert gpu_type("h100-80g").peak_tflops("bf16") == 989.0
    assert all(g.memory_bytes > 0 for g in GPU_CATALOG.values())


def test_strategy_rejects_unknown_values():
    with pytest.raises(SpecError, match="zero 4 is not one of: 0, 1, 2, 3"):
        StrategySpec(zero=4)
    with pytest.raises(SpecError, match="offload 'disk'"):
        StrategySpec(offload="disk")


@pytest.mark.parametrize(
    "name, memory_gib, key",
    [
        ("NVIDIA H200", 140, "h200"),
        ("NVIDIA H100 80GB HBM3", 79.6, "h100-80g"),
        ("NVIDIA A100-SXM4-80GB", 79.2, "a100-80g"),
        ("NVIDIA A100-PCIE-40GB", 39.4, "a100-40g"),
        ("NVIDIA A100-SXM4-80GB", None, "a100-80g"),
        ("NVIDIA A100-PCIE-40GB", None, "a100-40g"),
        ("NVIDIA GeForce RTX 4090", 24, None),
        ("cpu", None, None),
    ],
)
def test_one_rule_maps_a_device_to_the_catalog(name, memory_gib, key):
    from dspipe.spec.hardware import match_device

    found = match_device(name, memory_bytes=None if memory_gib is None else int(memory_gib * 2**30))
    assert (found.name if found else None) == key


def test_help_and_errors_list_the_catalog():
    from dspipe.spec.hardware import names_text

    assert names_text() == ", ".join(GPU_CATALOG)
    with pytest.raises(SpecError, match=f"valid: {names_text()}"):
        gpu_type("v100")


def test_limits_and_sections_come_from_the_field_declarations():
    """LIMITS is the `limit` of each declared field; a field's section is its spec's unless it names its own; the
    strategy request has a field (None: auto) for each field of the strategy section."""
    for cls, _section in SPECS:
        for f in fields(cls):
            meta = f.metadata.get("setting")
            assert meta is not None, f"{cls.__name__}.{f.name} is not declared with setting()"
            assert LIMITS.get(f.name) == meta.get("limit"), f.name
    assert {s.key: s.section for s in declared(TrainSpec, section="train") if s.section != "train"} == {
        "micro_batch": "strategy",
        "precision": "strategy",
        "log_interval": "logging",
        "init_from": "model",
        "data_order": "data",
    }
    asked = {f.name for f in fields(StrategyRequest)}
    assert asked == {f.name for f in fields(StrategySpec)} | {"micro_batch", "precision"}
    assert StrategyRequest().zero is None


def test_the_type_checkers_strategy_request_is_the_built_one():
    """spec/core.py declares StrategyRequest's fields for the type checker (under TYPE_CHECKING) next to the
    make_dataclass that builds it: both must list the same fields, types and defaults, in the same order."""
    import ast
    import inspect

    import dspipe.spec.core as core

    tree = ast.parse(inspect.getsource(core))
    stub = next(node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == "StrategyRequest")
    declared_fields = [
        (n.target.id, ast.unparse(n.annotation), ast.unparse(n.value))
        for n in stub.body
        if isinstance(n, ast.AnnAssign)
    ]
    assert declared_fields == [(f.name, f.type, repr(f.default)) for f in fields(StrategyRequest)]


def test_a_new_setting_is_one_declaration():
    @dataclass(frozen=True)
    class Knob:
        size: int | None = setting(None, kind="int", limit=99, help="a knob [{default}]")
        """A knob."""
        ratio: float = setting(0.5, key="knob_ratio", kind="float", section="logging", help="a ratio")
        """A ratio."""

    size, ratio = declared(Knob, section="strategy")
    assert (size.key, size.section, size.limit, size.flags, size.field) == ("size", "strategy", 99, "--size", "size")
    assert (ratio.key, ratio.section, ratio.flags, ratio.field) == ("knob_ratio", "logging", "--knob-ratio", "ratio")


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(rope_factor=8.0), "model.rope_factor 8 has no effect without rope_scaling"),
        (
            dict(rope_scaling="linear", rope_factor=2.0, rope_original_context=16),
            "model.rope_original_context 16 has no effect with rope_scaling linear",
        ),
        (dict(window_start_layer=1), "model.window_start_layer 1 has no effect without sliding_window"),
        (
            dict(positions="learned", rope_theta=500000.0),
            r"model.rope_theta 500000 has no effect with positions learned \(it is the rotary base",
        ),
        (dict(rope_beta_fast=16.0), r"model.rope_beta_fast 16 has no effect with rope_scaling none \(only yarn"),
        (
            dict(rope_scaling="yarn", rope_factor=4.0, rope_original_context=16, rope_low_freq_factor=2.0),
            r"model.rope_low_freq_factor 2 has no effect with rope_scaling yarn \(only llama3 reads it",
        ),
        (
            dict(router_score="sigmoid", router_scale=2.5),
            r"model.router_score sigmoid, router_scale 2.5 has no effect without experts",
        ),
        (
            dict(router_groups=2, router_group_limit=1, router_bias_rate=0.001),
            r"model.router_groups 2, router_group_limit 1, router_bias_rate 0.001 has no effect without experts",
        ),
        (dict(aux_loss_coef=5.0), r"model.aux_loss_coef 5.0 has no effect without experts"),
        (dict(router_norm_topk=False), r"model.router_norm_topk False has no effect without experts"),
    ],
)
def test_a_setting_that_would_be_ignored_is_refused(settings, message):
    base = MODEL_PRESETS["tiny-llama"]
    with pytest.raises(SpecError, match=message):
        ModelSpec(**{**{f.name: getattr(base, f.name) for f in fields(ModelSpec)}, **settings})


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(router_score="tanh"), "model.router_score 'tanh' is not one of: softmax, sigmoid"),
        (dict(router_score=True), "model.router_score True is not one of: softmax, sigmoid"),
        (dict(router_scale=0.0), r"model.router_scale must be a finite number in \(0, 1000\], got 0.0"),
        (dict(router_scale=float("nan")), r"model.router_scale must be a finite number in \(0, 1000\]"),
        (dict(router_groups=3), r"model.experts 128 is not divisible by router_groups 3 \(128 / 3 = 42.6667\)"),
        (dict(router_groups=8), "model.router_groups 8 has no effect without router_group_limit"),
        (dict(router_group_limit=2), "model.router_group_limit 2 has no effect without router_groups > 1"),
        (dict(router_groups=8, router_group_limit=9), "model.router_group_limit 9 exceeds router_groups 8"),
        (dict(router_groups=128, router_group_limit=4), "model.router_groups 128 leaves 1 expert per group"),
        (
            dict(router_groups=32, router_group_limit=1),
            r"model.experts_per_token 8 exceeds the experts of router_group_limit 1 groups \(1 x 128 / 32 = 4\)",
        ),
        (dict(router_groups=0), "router_groups"),
        (dict(router_bias_rate=-0.1), r"model.router_bias_rate must be a finite number in \[0, 1\], got -0.1"),
        (dict(router_bias_rate=float("inf")), r"model.router_bias_rate must be a finite number in \[0, 1\]"),
    ],
)
def test_bad_router_settings_are_refused(settings, message):
    base = MODEL_PRESETS["qwen3-30b-a3b"]
    with pytest.raises(SpecError, match=message):
        ModelSpec(**{**{f.name: getattr(base, f.name) for f in fields(ModelSpec)}, **settings})


def test_router_settings_show_in_the_shape():
    base = MODEL_PRESETS["qwen3-30b-a3b"]
    assert "-sigmoid-scale2.5" in replace(base, router_score="sigmoid", router_scale=2.5).shape_text
    assert replace(base, router_groups=8, router_group_limit=4, router_bias_rate=0.001).shape_text.endswith(
        "-groups4of8-bias0.001"
    )
    assert "sigmoid" not in base.shape_text and "scale" not in base.shape_text
