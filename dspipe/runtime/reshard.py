"""Resuming under another layout: another data-parallel size, tensor-parallel size or pipeline depth.

ZeRO-0 state is not partitioned (DeepSpeed loads it as is at another dp); ZeRO-1/2/3 optimizer state is partitioned
by dp, and tp shards and pipeline stages are cut by the layout, which DeepSpeed's plain load refuses, so rank 0
converts the checkpoint to a universal checkpoint (deepspeed.checkpoint.ds_to_universal: every parameter whole,
tp shards merged as the module's universal_checkpoint_info says) in .universal-TAG/ and every rank loads that with
load_universal; the copy is deleted afterwards. Under ZeRO-3 each optimizer group's hyper-parameters are then put
back as saved (restore_group_hyperparameters). What DeepSpeed 0.19.8 cannot do is refused before anything is built
(layout_change_refusal).

universal_checkpoint_info(spec) is what the build attaches to the module (module.universal_checkpoint_info) so that
the conversion knows dspipe's tensor-parallel layout (dspipe.model.tp_split)."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from dspipe.errors import SpecError
from dspipe.runtime.experts import beyond_tp
from dspipe.runtime.writefail import WriteFailures
from dspipe.spec.kinds import Offload

UNIVERSAL_PREFIX = ".universal-"  # a resharding copy of a checkpoint, deleted once loaded


def layout_change_refusal(
    *,
    meta,
    zero_stage: int,
    dp: int,
    tp: int = 1,
    pp: int = 1,
    sp: int = 1,
    ep: int | None = None,
    offload: str,
    path: Path,
) -> str | None:
    """Why this checkpoint cannot be resumed at (dp, tp, pp, sp, ep) (None: it can; the saved layout always can; ep
    None: the checkpoint's). A changed dp alone at ZeRO-0 loads as is (the state is whole; a bf16 pipeline's
    BF16_Optimizer partitions: dspipe.runtime.bf16_reshard); any other change goes
    through a universal checkpoint (load_resharded; a pipeline <-> the plain model with its parameters renamed; a
    mixture of experts converted by dspipe.runtime.moe_reshard), measured to continue the run (fp32: the next losses
    equal to 1.2e-7) for dp, tp (1 <-> 2, GPT-2 and Llama/GQA/untied) and pp (1 <-> 2) changes, alone and together,
    and for a mixture of experts' dp, ep and pp (1 <-> 2) changes (ZeRO-1/2, fp32: the next losses bitwise those of
    the run that went on at the saved layout, 1.1e-7 relative at dp 1; bf16: as close as a fresh run at the new
    layout comes). Refused, because DeepSpeed 0.19.8 cannot do it: ZeRO-0 at another tp, pp or ep (no optimizer
    partitions to convert; a bf16 pipeline without ZeRO keeps DeepSpeed's BF16_Optimizer partitions, which
    ds_to_universal refuses: dspipe.runtime.bf16_reshard re-partitions them at another dp), NVMe-offloaded optimizer
    state, a vocabulary that does not divide by tp > 1 (its
    universal load pads every rank's rows to rows x tp: the last rank's assertion fails), a tp- or pipeline-sharded
    checkpoint saved without the module's universal_checkpoint_info; because dspipe has not verified it:
    sequence-parallel checkpoints, pipeline depths beyond 2 (a change between pp 2 and pp 3 or 4), a mixture of
    experts at tp > 1 at another tp, pp or ep (at another dp it resumes: measured, the next losses within 1.2e-7,
    its experts whole on every tp rank, spread over the tp group, or over k tp groups: ep = tp x k,
    dspipe.runtime.experts.beyond_tp, DeepSpeed's native layer at tp > 1, converted by moe_reshard, which also
    moves them to another k: measured bitwise, tp 2 x dp 4 at ep 8 <-> ep 4).
    `meta`: the checkpoint's dspipe.runtime.ckpt_meta.CheckpointMeta (not imported here: it imports this module)."""
    saved_ep = getattr(meta, "ep", 1) or 1
    ep = saved_ep if ep is None else ep
    saved = (meta.dp, meta.tp, meta.pp, meta.sp, saved_ep)
    if saved == (dp, tp, pp, sp, ep):
        return None
    model = meta.model or {}
    if zero_stage == 0:
        if bf16_optimizer_files(path) and saved[1:] != (tp, pp, sp, ep):
            return (
                "bf16 without ZeRO under a pipeline runs DeepSpeed's BF16_Optimizer, whose state dspipe "
                "re-partitions at another dp only (dspipe.runtime.bf16_reshard: DeepSpeed 0.19.8's universal "
                "conversion refuses its files, which carry no param_shapes outside ZeRO); a run that must change "
                "tp or pp needs --zero 1"
            )
        if saved[1:] == (tp, pp, sp, ep):
            return None
        return (
            "ZeRO-0 keeps no optimizer partitions (*_optim_states.pt), which DeepSpeed's universal checkpoint "
            "conversion needs to re-cut tensor-parallel shards, pipeline stages or expert-parallel ranks"
        )
    if offload == Offload.NVME or (Path(path) / "offloaded_tensors").is_dir():
        return "DeepSpeed restores NVMe-offloaded optimizer state only onto the ranks that saved it"
    if saved[3] > 1 or sp > 1:
        return (
            "re-partitioning a sequence-parallel ZeRO checkpoint is not verified by dspipe (each rank's "
            "partition covers its sequence group)"
        )
    if saved[2] != pp and max(saved[2], pp) > 2:
        return (
            f"re-cutting a pipeline into another number of stages is verified by dspipe between pp 1 and pp 2 "
            f"only (pp {saved[2]} -> pp {pp})"
        )
    over_groups = bool(model.get("experts")) and beyond_tp(tp=saved[1], ep=saved[4])
    if over_groups and meta.zero_stage == 3:
        return (
            f"ZeRO-3 with the experts over {saved[4] // saved[1]} tp groups (ep {saved[4]} = tp {saved[1]} x "
            f"{saved[4] // saved[1]}) resumes at its saved layout only (dp {saved[0]}, tp {saved[1]}, ep {saved[4]}; "
            f"now dp {dp}, tp {tp}, ep {ep}): dspipe's ZeRO-3 expert conversion (zero3_experts) writes tp 1 "
            f"universal checkpoints; export-hf reads the checkpoint at any layout"
        )
    if over_groups and (saved[1:3] != (tp, pp) or not beyond_tp(tp=tp, ep=ep)):
        return (
            f"experts over {saved[4] // saved[1]} tp groups (ep {saved[4]} = tp {saved[1]} x {saved[4] // saved[1]}, "
            f"DeepSpeed's native MoE layer at tp > 1) resume at another dp, or another ep over whole tp groups, at "
            f"the same tp and pp only (tp {saved[1]} -> {tp}, pp {saved[2]} -> {pp}, ep {saved[4]} -> {ep}): "
            f"dspipe has not verified re-cutting their tensor-parallel or pipeline layout, nor moving them to the "
            f"model's own experts (ep 1 or tp); export-hf reads the checkpoint at any layout"
        )
    over_groups = beyond_tp(tp=saved[1], ep=saved[4]) and beyond_tp(tp=tp, ep=ep) and saved[1:3] == (tp, pp)
    if model.get("experts") and max(saved[1], tp) > 1 and (*saved[1:3], saved[4]) != (tp, pp, ep) and not over_groups:
        return (
            f"a mixture of experts at tp > 1 resumes at another dp only (tp {saved[1]} -> {tp}, pp {saved[2]} -> "
            f"{pp}, ep {saved[4]} -> {ep}): its experts are the model's own modules there (whole on every tp rank, "
            f"or spread over the tp group) and DeepSpeed's native layer at tp 1, and dspipe has not verified "
            f"re-cutting its tensor-parallel, expert or pipeline layout"
        )
    vocab = model.get("vocab")
    if tp > 1 and isinstance(vocab, int) and vocab % tp:
        per = -(-vocab // tp)
        return (
            f"vocab {vocab} over tp {tp} is uneven ({per} rows per rank, the last {vocab - (tp - 1) * per}): "
            f"DeepSpeed 0.19.8's universal load pads each rank's vocabulary rows to rows x tp and cannot give "
            f"the last rank fewer"
        )
    if max(saved[1], saved[2], tp, pp) > 1 and not model.get("experts") and not saved_universal_info(path):
        return (
            "the checkpoint was saved without universal_checkpoint_info (by a dspipe before tensor-parallel "
            "resharding), which DeepSpeed's universal conversion needs to merge tp shards and pipeline stages"
        )
    return None


def bf16_optimizer_files(path: Path) -> bool:
    """Whether checkpoint `path` holds DeepSpeed's BF16_Optimizer partition files (bf16_zero_pp_rank_*): under ZeRO-0
    a bf16 pipeline's (dspipe.planner.plan.Plan.bf16_optimizer)."""
    return any(Path(path).glob("bf16_zero_pp_rank_*_optim_states.pt"))


def saved_universal_info(path: Path) -> bool:
    """Whether checkpoint `path`'s model states carry DeepSpeed's universal_checkpoint_info (a non-empty dict)."""
    from dspipe.runtime.safeload import load

    files = sorted(Path(path).glob("mp_rank_*_model_states.pt"))
    return bool(files) and bool(load(files[0], mmap=True).get("universal_checkpoint_info"))


_ANY = r"(?:^|.*\.)"  # the plain GPT's h.N. / embed. / final., a PipelineModule's N. / tied_modules.embed.


def universal_checkpoint_info(spec, *, native_experts: bool = False) -> dict:
    """What DeepSpeed's universal checkpoint conversion (deepspeed.checkpoint.ds_to_universal) needs to know about
    dspipe's tensor-parallel layout (dspipe.model.tp_split), for the model's module attribute
    `universal_checkpoint_info` (DeepSpeed saves it into every mp_rank_*_model_states.pt). Pure data, for the plain
    GPT and its PipelineModule alike (the patterns match both naming schemes); only patterns that match a parameter
    of `spec` (ds_to_universal's strict mode refuses unused ones). A mixture-of-experts model gets {} (tp is 1 there;
    dspipe.runtime.moe_reshard converts it without DeepSpeed's converter).

    replicated          wpe, every norm, q/k norms, the row-parallel biases: equal on every tp rank, kept whole
    row parallelism     attn.c_proj.weight, mlp.c_proj.weight: concatenated along dim 1, cut along dim 1
    vocabulary          wte, an untied head: rows concatenated, cut to original_vocab_size
    sub-parameters      c_attn [q; k; v] and a SwiGLU c_fc [gate; up]: each part merged and re-cut on its own
                        (shape ((q, k, v), -1), partition_dim 0), so that another tp gives whole heads again
    pipeline replicated the tied embedding module, held by the first and the last stage: read from the first
    `native_experts`: a mixture of experts on DeepSpeed's layer at tp > 1 (dspipe.runtime.experts.beyond_tp), for
    dspipe.runtime.moe_reshard's merge of its dense parts: the routers and shared experts replicated (the routed
    experts, whole on their holders, are not merged by tp)."""
    if spec.experts and not native_experts:
        return {}
    qkv_bias, out_bias, mlp_bias = spec.biases
    replicated = [_ANY + r"ln_(?:1|2|f)\.(?:weight|bias)$"]
    if native_experts:
        replicated.append(_ANY + r"mlp\.moe\.deepspeed_moe\.gate\.wg\.weight$")
        if spec.shared_experts:
            replicated.append(_ANY + r"mlp\.shared\.c_(?:fc|proj)\.(?:weight|bias)$")
    if spec.positions == "learned":
        replicated.append(_ANY + r"wpe\.weight$")
    if out_bias or mlp_bias:
        replicated.append(_ANY + r"(?:attn|mlp)\.c_proj\.bias$")
    if spec.qk_norm:
        replicated.append(_ANY + r"attn\.[qk]_norm\.weight$")
    vocab = [_ANY + r"wte\.weight$"]
    if not spec.tied_embeddings:
        vocab.append(rf"^(?:lm_head|{spec.layers + 2})\.weight$")  # the plain GPT's, the pipeline's last layer
    hd = spec.head_dim
    qkv = (spec.heads * hd, spec.kv_groups * hd, spec.kv_groups * hd)
    sub = [dict(patterns=[_ANY + r"attn\.c_attn\.weight$"], shape=(qkv, -1), partition_dim=0)]
    if qkv_bias:
        sub.append(dict(patterns=[_ANY + r"attn\.c_attn\.bias$"], shape=(qkv,), partition_dim=0))
    if spec.mlp == "swiglu":
        sub.append(dict(patterns=[_ANY + r"mlp\.c_fc\.weight$"], shape=((spec.ffn, spec.ffn), -1), partition_dim=0))
        if mlp_bias:
            sub.append(dict(patterns=[_ANY + r"mlp\.c_fc\.bias$"], shape=((spec.ffn, spec.ffn),), partition_dim=0))
    return {
        "tp_replicated_parameter_patterns": replicated,
        "parameter_with_row_parallelism_patterns": [_ANY + r"attn\.c_proj\.weight$", _ANY + r"mlp\.c_proj\.weight$"],
        "vocabulary_parameter_patterns": vocab,
        "original_vocab_size": spec.vocab,
        "parameter_with_sub_params": sub,
        "pipeline_replicated_parameter_patterns": [r"^tied_modules\."],
    }
    # the keys: deepspeed.checkpoint.constants' TP_REPLICATED_PARAMETER_PATTERNS, ... (a unit test ties them)


def to_universal(src: Path, out: Path) -> None:
    """Convert the DeepSpeed checkpoint directory `src` into a universal checkpoint at `out` (DeepSpeed's
    ds_to_universal, in this process: no worker pool inside a rank, its progress output swallowed)."""
    import argparse
    import io

    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(
        input_folder=str(src),
        output_folder=str(out),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        ds_to_universal.main(args)


def load_resharded(
    engine,
    path: Path,
    *,
    saved: str,
    now: str,
    rename=None,
    experts: int = 0,
    saved_ep: int = 1,
    saved_zero: int = 1,
    saved_tp: int = 1,
    spec=None,
):
    """Collective: rank 0 converts `path` to .universal-TAG/TAG next to it, every rank loads that with
    DeepSpeed's load_universal (its optimizer cuts the whole fp32 weights and Adam moments to this rank's tp shard
    and re-partitions them for this dp), then the copy is deleted. `saved`, `now`: the layouts, for messages;
    `rename`: a function of a parameter name, when this run names its parameters otherwise than the checkpoint
    (a pipeline <-> the plain model: pipeline_names); `experts`, `saved_ep`, `saved_zero`: a mixture of experts'
    routed experts per block and the ep, ZeRO stage and tp it was saved with (0 experts: a dense model; `spec`,
    its model, at tp > 1). Its
    checkpoint is converted by dspipe (DeepSpeed's native layer: dspipe.runtime.moe_reshard; ZeRO-3 at ep > 1:
    dspipe.runtime.zero3_experts), every expert under its global name, and this rank's optimizer looks its own
    experts up by those names. Returns DeepSpeed's load path."""
    import functools

    import torch.distributed as dist

    from dspipe.runtime import moe_reshard, zero3_experts
    from dspipe.runtime.experts import native_layer

    path = Path(path)
    convert, names = to_universal, contextlib.nullcontext()
    native = bool(experts) and native_layer(zero_stage=saved_zero, tp=saved_tp, ep=saved_ep)
    if native:
        ep_now = moe_reshard.engine_ep(engine)
        info = universal_checkpoint_info(spec, native_experts=True) if saved_tp > 1 else None
        convert = functools.partial(
            moe_reshard.to_universal, experts=experts, ep=saved_ep, ep_now=ep_now, tp=saved_tp, info=info
        )
    elif experts and saved_ep > 1:
        convert = functools.partial(zero3_experts.to_universal, experts=experts, ep=saved_ep)
    if experts:
        names = moe_reshard.global_expert_names(engine, experts=experts)
    root = path.parent / (UNIVERSAL_PREFIX + path.name)
    failures = WriteFailures()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
        try:
            convert(path, root / path.name)
            if rename is not None:
                rename_parameters(root / path.name / "zero", rename)
        except Exception as e:  # any failure: agreed on below, then one SpecError on every rank
            failures.record(e)
    if failures.agreed():
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
        raise SpecError(
            f"cannot re-partition checkpoint {path} from {saved} to {now}: converting it to "
            f"a universal checkpoint in {root} failed ({failures.detail or 'on rank 0'}); "
            f"resume with {saved}"
        )
    own = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    config = engine._config  # what engine.load_universal_checkpoint() reads; only for this load
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    try:
        with names:
            load_path, _ = engine.load_checkpoint(str(root), tag=path.name)
    finally:
        config.load_universal_checkpoint = before
    if experts:
        moe_reshard.restore_buffers(engine, path, rename=rename)
    if engine.zero_optimization_stage() == 3:
        restore_group_hyperparameters(engine.optimizer, saved_groups=saved_param_groups(root / path.name), own=own)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    return load_path


def rename_parameters(zero: Path, rename) -> None:
    """A universal checkpoint's parameter directories (zero/NAME/) renamed to rename(NAME)."""
    for d in sorted(p for p in Path(zero).iterdir() if p.is_dir()):
        new = rename(d.name)
        if new != d.name:
            d.rename(d.with_name(new))


def pipeline_names(spec, *, to_pipeline: bool):
    """The parameter renaming between the plain GPT (embed.wte.weight, h.0.ln_1.weight, final.ln_f.weight,
    lm_head.weight) and its PipelineModule (tied_modules.embed.wte.weight or 0.wte.weight, 1.ln_1.weight,
    L+1.ln_f.weight, L+2.weight), in the direction asked."""
    from dspipe.model.names import TIED_PREFIX, pipeline_gpt_name

    if not to_pipeline:
        return lambda name: pipeline_gpt_name(name, layers=spec.layers)

    def to_stage(name: str) -> str:
        head, rest = name.split(".", 1)
        if head == "embed":
            return (TIED_PREFIX + rest) if spec.tied_embeddings else f"0.{rest}"
        if head == "h":
            index, rest = rest.split(".", 1)
            return f"{int(index) + 1}.{rest}"
        return {"final": f"{spec.layers + 1}.{rest}", "lm_head": f"{spec.layers + 2}.{rest}"}.get(head, name)

    return to_stage


def saved_param_groups(universal: Path) -> list[dict]:
    """The optimizer's parameter groups (hyper-parameters) as a universal checkpoint holds them."""
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT

    from dspipe.runtime.safeload import load

    source = Path(universal) / "zero" / "optimizer_state.pt"
    groups = (load(source).get(OPTIMIZER_STATE_DICT) or {}).get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise SpecError(f"{source}: no optimizer param_groups (a list of dicts) in {OPTIMIZER_STATE_DICT}")
    return groups


def restore_group_hyperparameters(optimizer, *, saved_groups: list[dict], own: list[dict] | None = None) -> None:
    """DeepSpeed 0.19's ZeRO-3 universal load copies the first saved group's hyper-parameters (its name and moe flag
    too) into every group (stage3.py, load_hp_checkpoint_state_from_checkpoint_dir_stage3), which puts weight decay
    on biases and LayerNorms; give each group back its own, as saved (`params` stays DeepSpeed's). Groups are paired
    by name, a mixture of experts' expert groups (moe) with the saved expert groups in order; `own`: each group's
    hyper-parameters before the load, which keep its name and moe flag and stand in for a group the checkpoint does
    not have (experts spread over ep ranks now, not when it was saved: their group is split off a dense one with
    its hyper-parameters)."""

    def key(group: dict):
        return "moe" if group.get("moe") else group.get("name")

    live = own if own is not None else [dict(g) for g in optimizer.param_groups]
    pool: dict = {}
    for saved in saved_groups:
        pool.setdefault(key(saved), []).append(saved)
    sources = [pool[key(g)].pop(0) if pool.get(key(g)) else None for g in live]
    if own is None and None in sources:
        raise SpecError(
            f"the checkpoint has {len(saved_groups)} optimizer parameter groups, this run has "
            f"{len(optimizer.param_groups)}: resume with the dp it was saved with"
        )
    for group, mine, saved in zip(optimizer.param_groups, live, sources, strict=True):
        group.update({k: v for k, v in mine.items() if k != "params"})
        if saved is not None:
            group.update({k: v for k, v in saved.items() if k not in ("params", "name", "moe")})
