"""ZeRO-3 with experts spread over ep ranks (dspipe.runtime.moe.spread_experts): its checkpoint merged back by
dspipe.runtime.zero3_experts from files laid out as DeepSpeed 0.19.8's stage 3 writes them, the optimizer groups
paired after a universal load, and what the planner counts for it. The live engines: tests/distributed/test_moe.py."""

import math
from collections import OrderedDict

import pytest
import torch

from dspipe.errors import SpecError
from dspipe.runtime import zero3_experts

# 2 ranks at ep 2 (each its own expert-data-parallel group of 1), 2 experts: a dense tensor partitioned over both
# ranks, one expert on each rank whole
DENSE = ("h.0.attn.c_attn.weight", (3, 5))
EXPERT = ("h.0.mlp.experts.0.c_fc.weight", (4, 2))


def _write_rank(directory, rank: int, *, dense: torch.Tensor, expert: torch.Tensor, drop_groups=False) -> None:
    """Rank `rank`'s model-states and optimizer files: sub-group 0 the dense tensor's partition (15 values over 2
    ranks: 8 each, the last padded), sub-group 1 its expert whole (its group of 1)."""
    part = math.ceil(dense.numel() / 2)
    flat = torch.cat([dense.reshape(-1), torch.zeros(1)])[rank * part : (rank + 1) * part]
    shapes = [OrderedDict([(DENSE[0], torch.Size(DENSE[1]))]), OrderedDict([(EXPERT[0], torch.Size(EXPERT[1]))])]
    groups = [
        dict(sub_group=0, partition_count=2, partition_rank=rank, partition_ranks=[0, 1]),
        dict(sub_group=1, partition_count=1, partition_rank=0, partition_ranks=[rank]),
    ]
    osd = {
        "fp32_flat_groups": [flat.clone(), expert.reshape(-1).clone()],
        "optimizer_state_dict": {
            "state": {
                0: dict(step=3, exp_avg=flat * 10, exp_avg_sq=flat * 100),
                1: dict(step=3, exp_avg=expert.reshape(-1) * 10, exp_avg_sq=expert.reshape(-1) * 100),
            },
            "param_groups": [{"name": "group0", "params": [0]}, {"name": "ep_size_2", "moe": True, "params": [1]}],
        },
    }
    if not drop_groups:
        osd["ds_zero_partition_groups"] = groups
    torch.save({"optimizer_state_dict": osd}, directory / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    torch.save(
        {"param_shapes": shapes, "buffer_names": [], "module": {}},
        directory / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
    )


def _checkpoint(tmp_path, **kwargs):
    dense = torch.arange(15, dtype=torch.float32).reshape(DENSE[1])
    experts = [torch.full(EXPERT[1], 1.0), torch.full(EXPERT[1], 2.0)]
    for rank in range(2):
        _write_rank(tmp_path, rank, dense=dense, expert=experts[rank], **kwargs)
    return dense, experts


def test_each_expert_comes_back_whole_under_its_global_name(tmp_path):
    dense, experts = _checkpoint(tmp_path)
    states, shapes, _ = zero3_experts.whole_states(tmp_path, experts=2, ep=2)
    assert sorted(states) == [DENSE[0], "h.0.mlp.experts.0.c_fc.weight", "h.0.mlp.experts.1.c_fc.weight"]
    assert torch.equal(states[DENSE[0]]["fp32"], dense)  # the two partitions, the padding cut off
    assert torch.equal(states[DENSE[0]]["exp_avg_sq"], dense * 100)
    for e in range(2):  # rank e's local expert 0 is expert e of the model
        assert torch.equal(states[f"h.0.mlp.experts.{e}.c_fc.weight"]["exp_avg"], experts[e] * 10)
    assert shapes[DENSE[0]] == DENSE[1]
    master = zero3_experts.master(tmp_path, experts=2, ep=2)
    assert torch.equal(master["h.0.mlp.experts.1.c_fc.weight"], experts[1])


def test_the_universal_checkpoint_holds_every_expert_and_the_step(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _, experts = _checkpoint(src)
    out = tmp_path / "universal" / "global_step3"
    zero3_experts.to_universal(src, out, experts=2, ep=2)
    saved = torch.load(out / "zero" / "h.0.mlp.experts.1.c_fc.weight" / "fp32.pt", weights_only=False)
    assert torch.equal(saved["param"], experts[1])
    assert torch.load(out / "zero" / DENSE[0] / "step.pt", weights_only=False) == 3
    state = torch.load(out / "zero" / "optimizer_state.pt", weights_only=False)
    assert "fp32_flat_groups" not in state and state["optimizer_state_dict"]["state"][0] == {"step": 3}
    assert sorted(p.name for p in out.glob("*_model_states.pt")) == [
        f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(2)
    ]


def test_files_without_partition_groups_or_ranks_are_one_error(tmp_path):
    _checkpoint(tmp_path, drop_groups=True)
    with pytest.raises(SpecError, match="no ZeRO-3 partition groups for its 2 sub-groups"):
        zero3_experts.whole_states(tmp_path, experts=2, ep=2)
    (tmp_path / "zero_pp_rank_1_mp_rank_00_optim_states.pt").rename(tmp_path / "x.pt")
    (tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt").rename(
        tmp_path / "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    )
    with pytest.raises(SpecError, match=r"ZeRO-3 optimizer files for ranks \[2\], expected 0..0"):
        zero3_experts.whole_states(tmp_path, experts=2, ep=2)


def test_a_missing_partition_is_named(tmp_path):
    _checkpoint(tmp_path)
    # rank 1's file claims a third place in the dense group: the dense tensor lacks partition 2 of 3
    path = tmp_path / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    sd = torch.load(path, weights_only=False)
    for g in sd["optimizer_state_dict"]["ds_zero_partition_groups"][:1]:
        g["partition_count"] = 3
    torch.save(sd, path)
    with pytest.raises(SpecError, match="has partitions"):
        zero3_experts.whole_states(tmp_path, experts=2, ep=2)


def test_global_names():
    """A rank's local expert index made the model's (moe_reshard.global_expert_name): DeepSpeed's layer's names and
    the model's own experts' (ZeRO-3 at ep > 1, or spread over the tp group)."""
    from dspipe.runtime.moe_reshard import global_expert_name

    assert global_expert_name("h.3.mlp.experts.1.c_fc.weight", ep_rank=2, local=2) == "h.3.mlp.experts.5.c_fc.weight"
    assert global_expert_name("h.3.mlp.shared.c_fc.weight", ep_rank=2, local=2) == "h.3.mlp.shared.c_fc.weight"
    native = "h.0.mlp.moe.deepspeed_moe.experts.deepspeed_experts.1.c_fc.weight"
    assert global_expert_name(native, ep_rank=1, local=2) == native.replace("experts.1.", "experts.3.")


def test_expert_groups_split_off_after_the_save_keep_their_own_hyperparameters():
    """A universal load into ZeRO-3 overwrites every group with the first saved group's hyper-parameters, its name
    and moe flag included: each group gets back its own by name (an expert group from the saved expert group), and a
    group the checkpoint lacks (experts spread over ep ranks now, not then) keeps the values it had."""
    from dspipe.runtime.reshard import restore_group_hyperparameters

    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(3)]
    own = [
        dict(name="group0", weight_decay=0.1, lr=1.0),
        dict(name="group1", weight_decay=0.0, lr=1.0),
        dict(name="ep_size_2", moe=True, weight_decay=0.1, lr=1.0),
    ]
    opt = torch.optim.AdamW([{"params": [p], **own[0]} for p in params])  # as the load leaves them: group 0's
    saved = [dict(name="group0", weight_decay=0.1, lr=2e-3), dict(name="group1", weight_decay=0.0, lr=2e-3)]
    restore_group_hyperparameters(opt, saved_groups=saved, own=own)
    got = [(g["name"], g.get("moe", False), g["weight_decay"], g["lr"]) for g in opt.param_groups]
    assert got == [("group0", False, 0.1, 2e-3), ("group1", False, 0.0, 2e-3), ("ep_size_2", True, 0.1, 1.0)]
    saved.append(dict(name="ep_size_4", moe=True, weight_decay=0.1, lr=3e-3))  # saved at another ep
    restore_group_hyperparameters(opt, saved_groups=saved, own=own)
    assert [(g["name"], g["lr"]) for g in opt.param_groups][2] == ("ep_size_2", 3e-3)


def test_the_planner_counts_the_rank_s_experts_over_their_group():
    from dspipe.planner.stages import param_groups
    from dspipe.planner.startup import build_mode
    from dspipe.planner.timing import zero3_expert_gathers_per_pass, zero3_gathers_per_pass
    from dspipe.spec.presets import model_preset

    m = model_preset("tiny", experts=8)
    assert build_mode(zero_stage=3, tp=1, pp=1, ep=2) == "device"  # the dense parts and the rank's experts
    assert build_mode(zero_stage=3, tp=1, pp=1, ep=1) == "partitioned"
    whole = zero3_gathers_per_pass(m, threshold=0)
    assert whole - zero3_gathers_per_pass(m, threshold=0, ep=4) == 3 * zero3_expert_gathers_per_pass(
        m, threshold=0, ep=4
    )  # 8 experts' modules at ep 1, 2 at ep 4
    from dspipe.planner.stages import stage_params
    from tests.unit.planner.test_moe import _plan

    _, e1 = _plan(m, gpus=4, gbs=8, zero=3, ep=1)
    p4, e4 = _plan(m, gpus=4, gbs=8, zero=3, ep=4)
    # the same optimizer bytes per rank: dense / dp + (experts / ep) / (dp / ep), each expert on one rank
    assert abs(e1.memory.optimizer - e4.memory.optimizer) <= 12 * 4
    phi = stage_params(model=m, pp=1, partition_method=p4.partition_method, tp=1, ep=4)[0]
    assert [n for _, n in param_groups(model=m, plan=p4, phi=phi)] == [4, 1]


def test_the_partitioned_build_writes_a_buffer_whole():
    """ZeRO-3's partitioned build (dspipe.runtime.build._partitioned) writes each parameter's partition; a tensor
    ZeRO-3 does not partition, the selection bias of auxiliary-loss-free routing (a buffer), is written whole (a
    1-rank ZeRO-3 run with --router-bias-rate crashed at start-up without it)."""
    from dspipe.runtime.build import write_partition

    bias = torch.full((4,), 7.0)
    write_partition(bias, read=lambda start, stop: torch.arange(start, stop, dtype=torch.float32))
    assert bias.tolist() == [0.0, 1.0, 2.0, 3.0]
