"""Resuming under another layout (dspipe.runtime.reshard): the universal_checkpoint_info dspipe's module carries,
checked against the shard layout (dspipe.model.tp_split) and run through DeepSpeed 0.19.8's own universal-checkpoint
merge (ds_to_universal.merge_tp_slices) and restore (universal_checkpoint.load_hp_checkpoint_state) on synthetic
shards; the renaming between a pipeline and the plain model; the refusals, one line each."""

import json
import re
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dspipe.errors import SpecError
from dspipe.model import tp_split
from dspipe.model.names import pipeline_gpt_name
from dspipe.runtime import ckpt_meta
from dspipe.runtime.reshard import layout_change_refusal, pipeline_names, universal_checkpoint_info
from dspipe.spec.presets import model_preset
from tests.helpers import meta_of

SPECS = {
    "gpt2": model_preset("tiny"),
    "llama": model_preset("tiny-llama"),
    "qwen3-like": model_preset("tiny-llama", qk_norm=True, qkv_bias=True, tied_embeddings=True),
    "gpt2-mlp-bias-only": model_preset("tiny", out_bias=False, qkv_bias=False),
}


def pipeline_name(spec, name):
    return pipeline_names(spec, to_pipeline=True)(name)


def categories(info, name):
    """Which of info's categories match `name` (DeepSpeed matches with re.match)."""
    found = {
        key: [p for p in info[key] if re.match(p, name)]
        for key in (
            "tp_replicated_parameter_patterns",
            "parameter_with_row_parallelism_patterns",
            "vocabulary_parameter_patterns",
        )
    }
    found["sub"] = [s for s in info["parameter_with_sub_params"] for p in s["patterns"] if re.match(p, name)]
    return {k: v for k, v in found.items() if v}


def test_the_keys_are_deepspeeds():
    from deepspeed.checkpoint import constants as C

    info = universal_checkpoint_info(SPECS["llama"])
    assert set(info) == {
        C.TP_REPLICATED_PARAMETER_PATTERNS,
        C.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
        C.VOCABULARY_PARAMETER_PATTERNS,
        C.ORIGINAL_VOCAB_SIZE,
        C.PARAMETER_WITH_SUB_PARAMS,
        C.PIPELINE_REPLICATED_PARAMETER_PATTERNS,
    }
    assert universal_checkpoint_info(model_preset("tiny", experts=4)) == {}


@pytest.mark.parametrize("pipeline", [False, True])
def test_native_experts_at_tp_keep_routers_and_shared_experts_whole(pipeline):
    """DeepSpeed's layer at tp > 1 (ep = tp x k: dspipe.runtime.moe_reshard merges the dense parts by tp with these
    patterns): a router and a shared expert are replicated, a routed expert (whole on its holder, never merged by
    tp) matches no pattern, the attention and a dense block's MLP are split as in a dense model."""
    spec = model_preset("tiny-llama", experts=4, expert_ffn=32, shared_experts=1, moe_first_dense=1, layers=2)
    info = universal_checkpoint_info(spec, native_experts=True)
    gate = "h.1.mlp.moe.deepspeed_moe.gate.wg.weight"
    expert = "h.1.mlp.moe.deepspeed_moe.experts.deepspeed_experts.3.c_fc.weight"
    names = {
        gate: {"tp_replicated_parameter_patterns"},
        "h.1.mlp.shared.c_proj.weight": {"tp_replicated_parameter_patterns"},
        expert: set(),
        "h.0.mlp.c_proj.weight": {"parameter_with_row_parallelism_patterns"},
        "h.0.mlp.c_fc.weight": {"sub"},
        "h.1.attn.c_attn.weight": {"sub"},
    }
    for name, expected in names.items():
        ds_name = re.sub(r"^h\.(\d+)\.", lambda m: f"{int(m[1]) + 1}.", name) if pipeline else name
        assert set(categories(info, ds_name)) == expected, (ds_name, categories(info, ds_name))


@pytest.mark.parametrize("key", list(SPECS))
@pytest.mark.parametrize("pipeline", [False, True])
def test_the_patterns_say_what_tp_split_says(key, pipeline):
    """Every parameter (plain or pipeline names) falls in the category its tp split means, at most one pattern per
    category; every pattern matches a parameter (ds_to_universal's strict mode refuses unused ones)."""
    spec = SPECS[key]
    info = universal_checkpoint_info(spec)
    used = set()
    for name, _ in spec.model_tensors():
        ds_name = pipeline_name(spec, name) if pipeline else name
        found = categories(info, ds_name)
        assert all(len(v) == 1 for v in found.values()), (ds_name, found)
        used.update(
            p for v in found.values() for item in v for p in (item["patterns"] if isinstance(item, dict) else [item])
        )
        rule = tp_split.split_of(name, spec)
        if rule is None:
            assert list(found) == ["tp_replicated_parameter_patterns"], ds_name
        elif rule[0] == 1:
            assert list(found) == ["parameter_with_row_parallelism_patterns"], ds_name
        elif rule[0] == "vocab":
            assert list(found) == ["vocabulary_parameter_patterns"], ds_name
        elif len(rule[1]) > 1:
            assert list(found) == ["sub"] and list(found["sub"][0]["shape"][0]) == rule[1], ds_name
        else:
            assert found == {}, ds_name  # one part (GELU c_fc): DeepSpeed's default, rows concatenated
    patterns = [
        p
        for k in (
            "tp_replicated_parameter_patterns",
            "parameter_with_row_parallelism_patterns",
            "vocabulary_parameter_patterns",
        )
        for p in info[k]
    ]
    patterns += [p for s in info["parameter_with_sub_params"] for p in s["patterns"]]
    assert sorted(used) == sorted(patterns)
    if pipeline and spec.tied_embeddings:  # the tied module on the last stage: skipped, the first stage's is read
        assert re.match(info["pipeline_replicated_parameter_patterns"][0], pipeline_name(spec, "embed.wte.weight"))


@pytest.mark.parametrize("key", list(SPECS))
def test_pipeline_names_round_trip(key):
    spec = SPECS[key]
    for name, _ in spec.model_tensors():
        stage = pipeline_name(spec, name)
        assert pipeline_gpt_name(stage, layers=spec.layers) == name
        assert pipeline_names(spec, to_pipeline=False)(stage) == name
    assert pipeline_name(SPECS["gpt2"], "embed.wte.weight") == "tied_modules.embed.wte.weight"
    assert pipeline_name(SPECS["llama"], "embed.wte.weight") == "0.wte.weight"
    assert pipeline_name(SPECS["llama"], "h.1.attn.c_attn.weight") == "2.attn.c_attn.weight"
    assert pipeline_name(SPECS["llama"], "final.ln_f.weight") == "3.ln_f.weight"
    assert pipeline_name(SPECS["llama"], "lm_head.weight") == "4.weight"


# ---- DeepSpeed's own merge and restore on synthetic shards -----------------------------------------------------


def universal_param(tmp_path: Path, spec, name, full, *, tp: int) -> Path:
    """zero/NAME/ as ds_to_universal writes it from tp ranks' shards of `full` (each rank's fragment one ZeRO
    partition), with the module's universal_checkpoint_info."""
    from deepspeed.checkpoint.ds_to_universal import merge_tp_slices

    slices = tmp_path / "tmp"
    shapes = []
    for r in range(tp):
        shard = tp_split.shard(name, full, spec, rank=r, size=tp)
        shapes.append(shard.shape)
        for state, value in (("fp32", shard), ("exp_avg", shard * 2), ("exp_avg_sq", shard.abs())):
            d = slices / name / str(r)
            d.mkdir(parents=True, exist_ok=True)
            torch.save(value.flatten().clone(), d / f"{state}.00")
    unused = merge_tp_slices(universal_checkpoint_info(spec), str(tmp_path / "zero"), str(slices), tp, (name, shapes))
    return tmp_path / "zero" / name, unused


def restored(folder: Path, shape, *, rank: int, size: int) -> torch.Tensor:
    """What DeepSpeed's universal load (load_hp_checkpoint_state) gives a parameter of `shape` on tp rank `rank`."""
    from deepspeed.checkpoint.universal_checkpoint import load_hp_checkpoint_state

    from dspipe.runtime.safeload import ALLOWED_GLOBALS, weights_only_loads

    numel = int(torch.Size(shape).numel())
    dst = torch.empty(numel)
    mapping = SimpleNamespace(
        lp_fragment_address=SimpleNamespace(start=0, numel=numel), get_hp_fragment=lambda: dst, optim_fragment={}
    )
    param = SimpleNamespace(_hp_mapping=mapping, shape=torch.Size(shape), numel=lambda: numel)
    assert any(n == "SubparamShape" for _, n, _ in ALLOWED_GLOBALS)
    with weights_only_loads():  # as dspipe loads it: weights-only, SubparamShape allowed
        load_hp_checkpoint_state(param, str(folder), rank, size)
    assert torch.equal(mapping.optim_fragment["exp_avg"], dst * 2)
    return dst.view(shape)


@pytest.mark.parametrize("key", ["gpt2", "llama", "qwen3-like"])
@pytest.mark.parametrize("source,targets", [(2, (1, 2)), (1, (2, 4)), (4, (1, 2))])
def test_deepspeed_merges_and_recuts_every_parameter_kind(tmp_path, key, source, targets):
    spec = SPECS[key]
    if spec.kv_groups % max(source, *targets):
        pytest.skip(f"kv heads {spec.kv_groups} over tp {max(source, *targets)}")
    g = torch.Generator().manual_seed(0)
    for name, shape in spec.model_tensors():
        full = torch.randn(shape, generator=g)
        folder, _ = universal_param(tmp_path / name, spec, name, full, tp=source)
        merged = torch.load(folder / "fp32.pt", weights_only=False)["param"]
        assert torch.equal(merged, full), name
        for tp in targets:
            for r in range(tp):
                want = tp_split.shard(name, full, spec, rank=r, size=tp)
                assert torch.equal(restored(folder, want.shape, rank=r, size=tp), want), (name, tp, r)


def test_an_uneven_vocabulary_merges_but_cannot_be_recut(tmp_path):
    """Measured reason for the refusal: vocab 4097 from tp 2 merges (2049 + 2048 rows) and restores at tp 1, but at
    tp 2 DeepSpeed pads every rank's rows to rows x tp, and the last rank (2048 rows) fails its assertion."""
    spec = model_preset("tiny", vocab=4097)
    full = torch.randn(4097, 64)
    folder, _ = universal_param(tmp_path, spec, "embed.wte.weight", full, tp=2)
    assert torch.equal(restored(folder, (4097, 64), rank=0, size=1), full)
    assert torch.equal(restored(folder, (2049, 64), rank=0, size=2), full[:2049])
    with pytest.raises(AssertionError, match="Vocab tensor padded size 4096 < loaded universal size 4097"):
        restored(folder, (2048, 64), rank=1, size=2)


# ---- refusals ---------------------------------------------------------------------------------------------------


def fake_checkpoint(path: Path, *, info: bool):
    path.mkdir(parents=True, exist_ok=True)
    torch.save(
        {"module": None, **({"universal_checkpoint_info": {"original_vocab_size": 4096}} if info else {})},
        path / "mp_rank_00_model_states.pt",
    )
    return path


def test_layout_change_refusals(tmp_path):
    tiny = asdict(model_preset("tiny"))
    with_info, without = fake_checkpoint(tmp_path / "a", info=True), fake_checkpoint(tmp_path / "b", info=False)

    def refusal(meta=None, path=with_info, **now):
        saved = meta_of(**{"dp": 1, "tp": 2, "pp": 2, "sp": 1, "model": tiny, **(meta or {})})
        return layout_change_refusal(
            **{
                "meta": saved,
                "zero_stage": 1,
                "dp": 1,
                "tp": 2,
                "pp": 2,
                "sp": 1,
                "offload": "none",
                "path": path,
                **now,
            }
        )

    assert refusal() is None and refusal(path=without) is None  # the same layout: the plain load
    for now in (dict(tp=1), dict(pp=1), dict(tp=1, pp=1), dict(dp=2, tp=1), dict(dp=2)):
        assert refusal(**now) is None, now
    assert refusal(meta=dict(tp=1, pp=1), tp=2, pp=1) is None
    assert "saved without universal_checkpoint_info" in refusal(path=without, tp=1)
    assert refusal(meta=dict(tp=1, pp=1, dp=2), path=without, tp=1, pp=1) is None  # dp alone: DeepSpeed injects it
    assert refusal(zero_stage=0, dp=2) is None  # ZeRO-0 at another dp: whole state
    assert "ZeRO-0 keeps no optimizer partitions" in refusal(zero_stage=0, tp=1)
    assert "verified by dspipe between pp 1 and pp 2 only (pp 2 -> pp 4)" in refusal(pp=4)
    assert refusal(meta=dict(model={**tiny, "vocab": 4097}), tp=1) is None  # uneven at tp 2 -> tp 1: fine
    assert refusal(meta=dict(model={**tiny, "vocab": 4097}), dp=2) == (
        "vocab 4097 over tp 2 is uneven (2049 rows per rank, the last 2048): DeepSpeed 0.19.8's universal load pads "
        "each rank's vocabulary rows to rows x tp and cannot give the last rank fewer"
    )
    assert "sequence-parallel" in refusal(meta=dict(tp=1, sp=2), tp=1, sp=1)
    moe = dict(model={**tiny, "experts": 4}, tp=1, pp=1, dp=2, ep=2)
    # at tp > 1 the experts are the model's own modules (DeepSpeed's layer at tp 1): another dp only
    assert refusal(meta=dict(model=moe["model"]), dp=2) is None
    for now in (dict(tp=1), dict(pp=1), dict(tp=1, pp=1)):
        assert refusal(meta=dict(model=moe["model"]), **now).startswith("a mixture of experts at tp > 1"), now
    assert "(tp 1 -> 2, pp 1 -> 1, ep 2 -> 1)" in refusal(meta=moe, tp=2, pp=1, dp=1, ep=1)
    # at tp 2 the experts whole on both tp ranks (ep 1) or spread over them (ep 2): the ep stays, the dp may change
    spread = dict(model=moe["model"], tp=2, pp=1, dp=1, ep=2)
    assert refusal(meta=spread, tp=2, pp=1, dp=2, ep=2) is None
    assert "(tp 2 -> 2, pp 1 -> 1, ep 2 -> 1)" in refusal(meta=spread, tp=2, pp=1, dp=2, ep=1)
    # over 2 tp groups (ep 4 = tp 2 x 2, DeepSpeed's layer at tp > 1): another dp only (dspipe.runtime.moe_reshard)
    over = dict(model=moe["model"], tp=2, pp=1, dp=2, ep=4)
    assert refusal(meta=over, tp=2, pp=1, dp=2, ep=4) is None and refusal(meta=over, tp=2, pp=1, dp=4, ep=4) is None
    assert refusal(meta=over, tp=2, pp=1, dp=4, ep=8) is None  # another k (moe_reshard's global names)
    said = refusal(meta={**over, "zero_stage": 3}, zero_stage=3, tp=2, pp=1, dp=4, ep=4)
    assert said.startswith("ZeRO-3 with the experts over 2 tp groups (ep 4 = tp 2 x 2) resumes at its saved"), said
    for now in (dict(dp=2, ep=2), dict(tp=1, dp=4), dict(tp=4, ep=8), dict(pp=2)):
        said = refusal(meta=over, **{"tp": 2, "pp": 1, "dp": 2, "ep": 4, **now})
        assert said.startswith(
            "experts over 2 tp groups (ep 4 = tp 2 x 2, DeepSpeed's native MoE layer at tp > 1) resume at another dp, "
            "or another ep over whole tp groups, at the same tp and pp only (tp 2 -> "
        ), (now, said)
    assert refusal(meta=moe, tp=1, pp=1, dp=2) is None  # ep None: the saved ep
    assert refusal(meta=moe, tp=1, pp=1, dp=2, ep=1) is None  # ep 2 -> 1: dspipe.runtime.moe_reshard
    assert refusal(meta=moe, tp=1, pp=1, dp=4, ep=2) is None  # dp 2 -> 4 at ep 2
    assert refusal(meta=moe, tp=1, pp=2, dp=1, ep=1) is None  # pp 1 -> 2
    assert "between pp 1 and pp 2 only (pp 1 -> pp 4)" in refusal(meta=moe, tp=1, pp=4, dp=1, ep=1)
    zero0 = refusal(meta=moe, zero_stage=0, tp=1, pp=1, dp=2, ep=1)
    assert zero0.startswith("ZeRO-0 keeps no optimizer partitions") and zero0.endswith("or expert-parallel ranks")
    assert refusal(meta=moe, zero_stage=0, tp=1, pp=1, dp=4, ep=2) is None  # ZeRO-0 at another dp: whole state
    assert "NVMe" in refusal(offload="nvme", tp=1)


def test_check_compatible_names_both_layouts_in_one_line(tmp_path):
    model = model_preset("tiny", vocab=4097)
    run = SimpleNamespace(model=model, plan=SimpleNamespace(pp=2, tp=2, sp=1, zero_stage=1, dp=2, offload="none"))
    meta = meta_of(model=asdict(model), pp=2, tp=2, sp=1, zero_stage=1, dp=1)
    path = fake_checkpoint(tmp_path / "c", info=True)
    with pytest.raises(SpecError) as e:
        ckpt_meta.check_compatible(meta, run, path)
    assert str(e.value) == (
        f"checkpoint {path} was saved with dp 1 x tp 2 x pp 2, this run has dp 2 x tp 2 x pp 2: vocab 4097 over tp 2 "
        f"is uneven (2049 rows per rank, the last 2048): DeepSpeed 0.19.8's universal load pads each rank's "
        f"vocabulary rows to rows x tp and cannot give the last rank fewer; resume with dp 1 x tp 2 x pp 2 (world "
        f"size 4)"
    )
    ckpt_meta.check_compatible(replace(meta, dp=2), run, path)  # the same layout
    with pytest.raises(SpecError, match=r"saved with zero_stage 2, this run has zero_stage 1; resume with the same"):
        ckpt_meta.check_compatible(replace(meta, zero_stage=2), run, path)


def test_a_bf16_pipeline_without_zero_changes_dp_only(tmp_path):
    """bf16 ZeRO-0 under a pipeline saves DeepSpeed's BF16_Optimizer partitions (the files of the checkpoint census's
    pp2z0bf16 layout, a real save), which ds_to_universal refuses (measured: "param_shapes must contain
    dictionaries"): dspipe.runtime.bf16_reshard re-partitions them at another dp, and any other change is refused in
    one line. A fp32 pipeline without ZeRO (the plain optimizer, its whole state in pp2z0fp32's model-states files)
    changes dp as is."""
    census = json.loads((Path(__file__).parents[2] / "data" / "checkpoint_census.json").read_text())["layouts"]
    tiny = asdict(model_preset("tiny"))
    paths = {}
    for layout in ("pp2z0bf16", "pp2z0fp32"):
        paths[layout] = tmp_path / layout
        paths[layout].mkdir()
        for name in census[layout]["files"]:
            (paths[layout] / name).touch()

    def refusal(layout, **now):
        saved = meta_of(dp=1, tp=1, pp=2, sp=1, model=tiny)
        now = {"dp": 1, "tp": 1, "pp": 2, "sp": 1, **now}
        return layout_change_refusal(meta=saved, zero_stage=0, offload="none", path=paths[layout], **now)

    assert refusal("pp2z0bf16") is None and refusal("pp2z0bf16", dp=2) is None
    assert refusal("pp2z0bf16", pp=1) == (
        "bf16 without ZeRO under a pipeline runs DeepSpeed's BF16_Optimizer, whose state dspipe re-partitions at "
        "another dp only (dspipe.runtime.bf16_reshard: DeepSpeed 0.19.8's universal conversion refuses its files, "
        "which carry no param_shapes outside ZeRO); a run that must change tp or pp needs --zero 1"
    )
    assert refusal("pp2z0bf16", dp=2, pp=4) == refusal("pp2z0bf16", pp=1)
    assert refusal("pp2z0fp32", dp=2) is None  # the whole state in the model-states files
    assert refusal("pp2z0fp32", pp=1).startswith("ZeRO-0 keeps no optimizer partitions")
