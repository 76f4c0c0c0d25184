"""A mixture of experts' universal checkpoint (dspipe.runtime.moe_reshard) from synthetic ZeRO-1/2 files laid out as
DeepSpeed 0.19.8 lays them out: each optimizer group flattened, padded and cut into equal partitions, a dense
group's over the dp ranks, an expert group's over the expert-data-parallel ranks (dp index mod ep: the same ep rank),
each rank naming its experts by their local index. The real thing, resumed on live ranks: tests/distributed/
test_moe.py."""

from collections import OrderedDict

import pytest
import torch
from deepspeed.checkpoint.constants import PARAM
from deepspeed.utils.tensor_fragment import fragment_address

from dspipe.errors import SpecError
from dspipe.runtime import moe_reshard

STATES = ("fp32", "exp_avg", "exp_avg_sq")
EXPERT = "h.0.mlp.moe.deepspeed_moe.experts.deepspeed_experts.{}.c_fc.weight"


def test_global_expert_name():
    name = EXPERT.format(1)
    assert moe_reshard.global_expert_name(name, ep_rank=3, local=2) == EXPERT.format(7)
    assert moe_reshard.global_expert_name(name, ep_rank=0, local=2) == name
    assert moe_reshard.global_expert_name("h.1.attn.c_attn.weight", ep_rank=1, local=2) == "h.1.attn.c_attn.weight"
    layer_11 = "11.mlp.moe.deepspeed_moe.experts.deepspeed_experts.10.c_proj.weight"  # only the expert index moves
    assert moe_reshard.global_expert_name(layer_11, ep_rank=1, local=16) == layer_11.replace(".10.", ".26.")


def partitions(params: list[tuple[str, torch.Tensor]], count: int):
    """DeepSpeed's ZeRO-1/2 cut of one group: the flat concatenation padded to a multiple of `count`, in `count`
    equal pieces; per piece its tensor and {name: fragment_address(numel, start within the piece)}."""
    flat = torch.cat([t.flatten() for _, t in params])
    size = -(-flat.numel() // count)
    flat = torch.cat([flat, torch.zeros(size * count - flat.numel())])
    pieces = []
    for r in range(count):
        lo, hi = r * size, (r + 1) * size
        mapping, at = OrderedDict(), 0
        for name, t in params:
            start, end = max(lo, at), min(hi, at + t.numel())
            if start < end:
                mapping[name] = fragment_address(numel=end - start, start=start - lo)
            at += t.numel()
        pieces.append((flat[lo:hi].clone(), mapping))
    return pieces


def write_checkpoint(path, *, dp: int, ep: int, experts: int, drop=None, stage=0, dense_names=("a", "b")):
    """A synthetic dp x ep checkpoint (of pipeline stage `stage`: its experts are named STAGE.x...): dense
    parameters `dense_names` (3 x 5 and 7), experts of w (5) and v (2 x 2), each state a distinct tensor; returns
    {global name: {state: full tensor}}. `drop`: (rank, name) whose fragment is left out of the rank's mapping."""
    path.mkdir(parents=True, exist_ok=True)
    local = experts // ep
    gen = torch.Generator().manual_seed(stage)
    x = f"{stage}.x" if stage else "x"
    shapes = {dense_names[0]: (3, 5), dense_names[1]: (7,), "w": (5,), "v": (2, 2)}
    full = {}
    for state in STATES:
        for name in dense_names:
            full.setdefault(name, {})[state] = torch.randn(shapes[name], generator=gen)
        for e in range(experts):
            for p in ("w", "v"):
                full.setdefault(f"{x}.deepspeed_experts.{e}.{p}", {})[state] = torch.randn(shapes[p], generator=gen)
    dense = {s: partitions([(n, full[n][s]) for n in dense_names], dp) for s in STATES}
    ranks = []
    for d in range(dp):
        ep_rank, edp = d % ep, d // ep
        held = [(f"{x}.deepspeed_experts.{i}.{p}", ep_rank * local + i) for i in range(local) for p in ("w", "v")]
        cut = {
            s: partitions([(n, full[f"{x}.deepspeed_experts.{g}.{n.rsplit('.', 1)[1]}"][s]) for n, g in held], dp // ep)
            for s in STATES
        }
        groups = [dense, cut]
        mappings = [dense["fp32"][d][1], cut["fp32"][edp][1]]
        if drop and drop[0] == d:
            for m in mappings:
                m.pop(drop[1], None)
        index = [d, edp]
        osd = {
            "optimizer_state_dict": {
                "loss_scaler": 1.0,
                "clip_grad": 1.0,
                "partition_count": [dp, dp // ep],
                "ds_version": "0.19.8",
                "single_partition_of_fp32_groups": [g["fp32"][i][0] for g, i in zip(groups, index, strict=True)],
                "base_optimizer_state": {
                    "state": {
                        k: {"step": 3, "exp_avg": g["exp_avg"][i][0], "exp_avg_sq": g["exp_avg_sq"][i][0]}
                        for k, (g, i) in enumerate(zip(groups, index, strict=True))
                    },
                    "param_groups": [
                        {"name": "group0", "lr": 0.1, "weight_decay": 0.1, "params": [0]},
                        {"name": f"ep_size_{ep}", "moe": True, "lr": 0.1, "weight_decay": 0.1, "params": [1]},
                    ],
                },
                "param_slice_mappings": mappings,
            }
        }
        torch.save(osd, path / f"zero_pp_rank_{d}_mp_rank_{stage:02d}_optim_states.pt")
        ranks.append(osd)
    local_shapes = OrderedDict((n, torch.Size(shapes[n.rsplit(".", 1)[1]])) for n, _ in held)
    model = {
        "module": {f"{x}.router_bias": torch.arange(4.0) + stage},
        "param_shapes": [OrderedDict((n, torch.Size(shapes[n])) for n in dense_names), local_shapes],
        "global_steps": 3,
    }
    torch.save(model, path / f"mp_rank_{stage:02d}_model_states.pt")
    return full


@pytest.mark.parametrize(("dp", "ep", "experts"), [(4, 2, 4), (2, 2, 4), (2, 1, 4), (3, 3, 6), (6, 2, 6)])
def test_every_parameter_whole_and_every_expert_under_its_global_index(tmp_path, dp, ep, experts):
    full = write_checkpoint(tmp_path / "src", dp=dp, ep=ep, experts=experts)
    out = tmp_path / "out"
    moe_reshard.to_universal(tmp_path / "src", out, experts=experts, ep=ep, ep_now=1)
    names = sorted(p.name for p in (out / "zero").iterdir() if p.is_dir())
    assert names == sorted(full)  # dense a, b and every expert's w and v, each once
    for name, states in full.items():
        for state, tensor in states.items():
            assert torch.equal(torch.load(out / "zero" / name / f"{state}.pt")[PARAM], tensor), (name, state)
        assert torch.load(out / "zero" / name / "step.pt") == 3
    groups = torch.load(out / "zero" / "optimizer_state.pt")["param_groups"]
    assert [g["name"] for g in groups] == ["group0", "ep_size_1"]  # named for the run that loads it
    assert "param_slice_mappings" not in torch.load(out / "zero" / "optimizer_state.pt")
    assert torch.load(out / "mp_rank_00_model_states.pt")["global_steps"] == 3  # the engine's own state, copied


def test_pipeline_stages_each_from_their_own_files_and_the_tied_embedding_from_the_first(tmp_path):
    tied = "tied_modules.embed.wte.weight"
    first = write_checkpoint(tmp_path / "src", dp=4, ep=2, experts=4, stage=0, dense_names=(tied, "1.b"))
    last = write_checkpoint(tmp_path / "src", dp=4, ep=2, experts=4, stage=1, dense_names=(tied, "3.c"))
    assert not torch.equal(first[tied]["fp32"], last[tied]["fp32"])  # the stages' copies differ here
    out = tmp_path / "out"
    moe_reshard.to_universal(tmp_path / "src", out, experts=4, ep=2, ep_now=4)
    expected = {**last, **first}  # the tied embedding: the first stage's
    assert sorted(p.name for p in (out / "zero").iterdir() if p.is_dir()) == sorted(expected)
    for name, states in expected.items():
        for state, tensor in states.items():
            assert torch.equal(torch.load(out / "zero" / name / f"{state}.pt")[PARAM], tensor), (name, state)
    assert sorted(p.name for p in out.glob("mp_rank_*")) == [f"mp_rank_0{s}_model_states.pt" for s in (0, 1)]
    assert torch.load(out / "zero" / "optimizer_state.pt")["param_groups"][1]["name"] == "ep_size_4"
    (tmp_path / "src" / "zero_pp_rank_3_mp_rank_01_optim_states.pt").unlink()
    with pytest.raises(SpecError, match=r"for dp ranks \[0, 1, 2\] of model-parallel rank 1, expected 0\.\.3$"):
        moe_reshard.to_universal(tmp_path / "src", tmp_path / "o", experts=4, ep=2, ep_now=1)


def test_damaged_checkpoints_are_refused_in_one_line(tmp_path):
    write_checkpoint(tmp_path / "gap", dp=4, ep=2, experts=4, drop=(1, "a"))
    with pytest.raises(SpecError, match=r"the fragments of a hold 9 values, its shape \(3, 5\) has 15$"):
        moe_reshard.to_universal(tmp_path / "gap", tmp_path / "o1", experts=4, ep=2, ep_now=1)
    write_checkpoint(tmp_path / "missing", dp=4, ep=2, experts=4)
    (tmp_path / "missing" / "zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(SpecError, match=r"for dp ranks \[0, 1, 3\] of model-parallel rank 0, expected 0\.\.2$"):
        moe_reshard.to_universal(tmp_path / "missing", tmp_path / "o2", experts=4, ep=2, ep_now=1)
    write_checkpoint(tmp_path / "ep", dp=4, ep=2, experts=4)
    with pytest.raises(SpecError, match=r"expert group 1 is partitioned over 2 ranks, expected dp 4 / ep 4 = 1$"):
        moe_reshard.to_universal(tmp_path / "ep", tmp_path / "o3", experts=4, ep=4, ep_now=1)
    with pytest.raises(SpecError, match=r"dp 4 \(its optimizer files\) is not divisible by ep 3$"):
        moe_reshard.to_universal(tmp_path / "ep", tmp_path / "o4", experts=6, ep=3, ep_now=1)


def test_restore_buffers_puts_the_saved_selection_biases_back(tmp_path):
    from types import SimpleNamespace

    for stage in (0, 1):  # their biases x.router_bias and 1.x.router_bias, each in its stage's file
        write_checkpoint(tmp_path / "src", dp=2, ep=2, experts=4, stage=stage)

    def holder():
        m = torch.nn.Module()
        m.register_buffer("router_bias", torch.zeros(4))
        m.register_buffer("cache", torch.ones(2), persistent=False)  # not saved: left alone
        return m

    live = torch.nn.ModuleDict({"x": holder(), "1": torch.nn.ModuleDict({"x": holder()})})
    assert moe_reshard.restore_buffers(SimpleNamespace(module=live), tmp_path / "src") == [
        "x.router_bias",
        "1.x.router_bias",
    ]
    assert torch.equal(live["x"].router_bias, torch.arange(4.0))
    assert torch.equal(live["1"]["x"].router_bias, torch.arange(4.0) + 1)
    assert torch.equal(live["x"].cache, torch.ones(2))
    other = torch.nn.ModuleDict({"y": holder()})  # at another pipeline depth: the saved names renamed
    renamed = moe_reshard.restore_buffers(
        SimpleNamespace(module=other), tmp_path / "src", rename=lambda n: n.replace("1.x.", "y.")
    )
    assert renamed == ["y.router_bias"] and torch.equal(other["y"].router_bias, torch.arange(4.0) + 1)
