"""A ZeRO-3 checkpoint of a mixture of experts at ep > 1 read back whole (pp 1, tp 1): its experts are partitioned
over their expert-data-parallel group and named by their local index, which DeepSpeed 0.19.8's zero_to_fp32 and
ds_to_universal cannot merge (they read every rank's partitions as data-parallel shards of one tensor per name).

What the files hold (dspipe.runtime.moe.spread_experts; DeepSpeed's stage 3 writes them): rank d's
zero_pp_rank_d_mp_rank_00_model_states.pt has `param_shapes`, one ordered {name: shape} per ZeRO-3 sub-group, and
its zero_pp_rank_d_mp_rank_00_optim_states.pt, per sub-group, the flat fp32 partition (`fp32_flat_groups`), Adam's
moments (optimizer_state_dict state[i]) and `ds_zero_partition_groups[i]`: how many ranks partition that sub-group
and this rank's place among them. Each parameter's partition is ceil(numel / count) values (DeepSpeed pads the last
one), one after the other in the flat tensor. Rank d's experts are [(d mod ep) x E/ep, (d mod ep + 1) x E/ep) of
every sparse block (deepspeed.utils.groups' expert-parallel layout), so `experts.J` in its names is expert
(d mod ep) x E/ep + J of the model.

whole_states puts every parameter back together under the model's names; master (export, generate) keeps the fp32
weights, to_universal writes DeepSpeed's universal checkpoint (zero/NAME/{fp32,exp_avg,exp_avg_sq,step}.pt,
zero/optimizer_state.pt and the engine's model-states files) for a resume at another dp or ep
(dspipe.runtime.reshard.load_resharded).
"""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

from dspipe.errors import SpecError
from dspipe.runtime.experts import ep_rank_of, ep_span
from dspipe.runtime.moe_reshard import global_expert_name

STATES = ("fp32", "exp_avg", "exp_avg_sq")
_OPTIM = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def _ranks(src: Path, *, tp_rank: int = 0) -> list[int]:
    found = sorted(int(m[1]) for f in src.iterdir() if (m := _OPTIM.match(f.name)) and int(m[2]) == tp_rank)
    if not found or found != list(range(len(found))):
        raise SpecError(f"{src}: ZeRO-3 optimizer files for ranks {found}, expected 0..{max(len(found), 1) - 1}")
    return found


def whole_states(
    src: Path, *, experts: int, ep: int, states: tuple[str, ...] = STATES, tp: int = 1, tp_rank: int = 0
) -> tuple[dict, dict, dict]:
    """({name: {state: whole tensor}}, {name: shape}, rank 0's optimizer file) of the checkpoint directory `src`,
    names the model's. Files are read memory-mapped; each tensor is made whole once. At tp > 1 (ep = tp x k: the
    experts over k whole tp groups, dspipe.runtime.experts.beyond_tp) tp rank `tp_rank`'s: its files
    zero_pp_rank_D_mp_rank_RR, its shards of the dense tensors; dp rank d's experts are then those of ep rank
    (d mod k) x tp + tp_rank (ranks are numbered tp-fastest)."""
    import torch

    from dspipe.runtime.safeload import load

    src = Path(src)
    ranks = _ranks(src, tp_rank=tp_rank)
    spread = ep_span(tp=tp, ep=ep)  # data-parallel ranks an expert-parallel group spans
    if len(ranks) % spread:
        over = f"ep {ep}" if tp == 1 else f"ep {ep} / tp {tp} = {spread}"
        raise SpecError(f"{src}: dp {len(ranks)} (its optimizer files) is not divisible by {over}")
    per = experts // ep
    pieces: dict[str, dict[int, tuple]] = {}
    counts: dict[str, int] = {}
    shapes: dict[str, tuple] = {}
    first_file = None
    for d in ranks:
        model = load(src / f"zero_pp_rank_{d}_mp_rank_{tp_rank:02d}_model_states.pt", mmap=True)
        osd = load(src / f"zero_pp_rank_{d}_mp_rank_{tp_rank:02d}_optim_states.pt", mmap=True)["optimizer_state_dict"]
        ep_rank = ep_rank_of(dp_rank=d, tp_rank=tp_rank, tp=tp, ep=ep)
        first_file = first_file or osd
        groups = osd.get("ds_zero_partition_groups")
        if not groups or len(groups) != len(model["param_shapes"]):
            raise SpecError(
                f"{src}: rank {d}'s files hold no ZeRO-3 partition groups for its {len(model['param_shapes'])} "
                f"sub-groups (not a ZeRO-3 checkpoint with experts spread over ep {ep})"
            )
        for i, group_shapes in enumerate(model["param_shapes"]):
            count, place = int(groups[i]["partition_count"]), int(groups[i]["partition_rank"])
            flats = {"fp32": osd["fp32_flat_groups"][i]}
            moments = osd["optimizer_state_dict"]["state"].get(i, {})
            flats.update({s: moments[s] for s in ("exp_avg", "exp_avg_sq") if s in moments})
            offset = 0
            for name, shape in group_shapes.items():
                numel = math.prod(shape)
                part = math.ceil(numel / count)
                key = global_expert_name(name, ep_rank=ep_rank, local=per)
                shapes[key], counts[key] = tuple(shape), count
                pieces.setdefault(key, {})[place] = {s: flats[s].narrow(0, offset, part) for s in states}
                offset += part
    out = {}
    for key, parts in pieces.items():
        if sorted(parts) != list(range(counts[key])):
            raise SpecError(f"{src}: {key} has partitions {sorted(parts)} of {counts[key]}")
        numel = math.prod(shapes[key])
        out[key] = {
            s: torch.cat([parts[p][s] for p in range(counts[key])])[:numel].view(shapes[key]).clone() for s in states
        }
    return out, shapes, first_file


def master(src: Path, *, experts: int, ep: int, tp: int = 1, tp_rank: int = 0) -> dict:
    """{model name: fp32 weights} (with rank 0's persistent buffers: routers' selection biases); at tp > 1 tp rank
    `tp_rank`'s (whole_states)."""
    from dspipe.runtime.safeload import load

    states, _, _ = whole_states(src, experts=experts, ep=ep, states=("fp32",), tp=tp, tp_rank=tp_rank)
    out = {name: s["fp32"] for name, s in states.items()}
    model = load(Path(src) / f"zero_pp_rank_0_mp_rank_{tp_rank:02d}_model_states.pt")
    for name in model.get("buffer_names") or []:
        if name in (model.get("module") or {}):
            out[name] = model["module"][name].float()
    return out


def to_universal(src: Path, out: Path, *, experts: int, ep: int) -> None:
    """Write the universal checkpoint of `src` (saved at `ep`) to `out`: every parameter whole under the model's
    names, the optimizer's global state (rank 0's, without its partitions), the model-states files copied."""
    import torch
    from deepspeed.checkpoint.constants import PARAM

    src, out = Path(src), Path(out)
    states, _, first = whole_states(src, experts=experts, ep=ep)
    zero = out / "zero"
    inner = first["optimizer_state_dict"]
    step = next((s["step"] for s in inner["state"].values() if "step" in s), None)
    for name, whole in states.items():
        folder = zero / name
        folder.mkdir(parents=True, exist_ok=True)
        for state, tensor in whole.items():
            torch.save({PARAM: tensor}, folder / f"{state}.pt")
        if step is not None:
            torch.save(step, folder / "step.pt")
    saved = {k: v for k, v in first.items() if k != "fp32_flat_groups"}
    saved["optimizer_state_dict"] = {
        "state": {i: {"step": s["step"]} for i, s in inner["state"].items() if "step" in s},
        "param_groups": inner["param_groups"],
    }
    saved["param_groups"] = inner["param_groups"]
    torch.save(saved, zero / "optimizer_state.pt")
    for f in src.glob("*_model_states.pt"):
        shutil.copy2(f, out / f.name)
