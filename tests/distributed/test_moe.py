"""Mixtures of experts on real CPU ranks (2 ranks but eight launches of 4, one of 8 and three of 1, fp32, dropout 0),
twenty-seven launches in all: a tiny random MixtralForCausalLM (4 experts, top 2) and Qwen3MoeForCausalLM (4
experts, top 2, norm_topk_prob off) written by save_pretrained with the corpus's tokenizer, trained with
`--init-from` on DeepSpeed's native MoE layer (ZeRO-3: the model's own); and a DeepSeek-V3-routed model from
dspipe's own draws (sigmoid scores, routed scale 2.5, 2 expert groups of which a token uses 1, aux-loss-free bias
balancing) at ep 2 and ep 1.

    Mixtral ep 2, ZeRO-2     killed after step 5 (checkpoint at 3), then resumed: step 1's LM loss is
                             transformers'; the resumed steps 4-5 are bitwise the ones before the kill; the
                             checkpoint holds DeepSpeed's expert files; export-hf computes dspipe's logits
    Mixtral ep 1, ZeRO-1     the same global batches: every step's loss within 1e-5 of ep 2's, aux_loss and
                             expert_load logged, dropped_routes 0 (dropless)
    Mixtral dp 4 x ep 2      ep 2's step-3 checkpoint resumed on 4 ranks (each expert's ZeRO-2 state now cut over 2
                             ranks): steps 4-6 within 1e-6 of ep 2's
    Mixtral ZeRO-3 x ep 2    the model's own SparseMLP, each rank its 2 experts partitioned over its expert-data-
                             parallel group: killed and resumed bitwise; step 1 transformers'; every step within
                             1e-5 of ep 1's, the same loads; no expert files; exports; its step-3 checkpoint
                             resumed by 1 rank at ep 1 (dspipe.runtime.zero3_experts): steps 4-6 within 1e-6
    Mixtral pp 2 x ep 2      4 ranks (pp 2 x dp 2), ZeRO-1, full recomputation: killed and resumed bitwise;
                             loss, aux loss, grad norm within 1e-5 of ep 1's, the same expert loads; exports; its
                             step-3 checkpoint resumed as the plain model at ep 1 on 2 ranks: steps 4-6 within 1e-6
    Mixtral tp 2 x pp 2 x    4 ranks, sequence parallel, ZeRO-1, full recomputation, the model's own experts
    ep 2                     spread over the tp group (2 per tp rank): killed and resumed bitwise; step 1
                             transformers'; loss, aux loss, grad norm within 1e-5 of ep 1's, the same loads; each
                             rank built the planner's count; exports
    Mixtral tp 2 x dp 2 x    4 ranks, sequence parallel, ZeRO-2, the experts over both tp groups on DeepSpeed's
    ep 4                     layer (1 per rank): killed and resumed bitwise; step 1 transformers'; loss, aux loss,
                             grad norm within 1e-5 of ep 1's, the same loads; expert files by their holders' tp
                             ranks; each rank built the planner's count; exports; its step-3 checkpoint resumed
                             at dp 4 on 8 ranks: steps 4-6 within 1e-6; the same under ZeRO-3 (the model's
                             own experts), which exports too
    Qwen3-MoE ep 2, ZeRO-2   lr 1e-12: step 1's LM loss is transformers', export-hf computes transformers' logits;
                             the same under ZeRO-3 (ep 1 and ep 2) and at tp 2 (the model's own experts, whole
                             on both tp ranks or spread over them)
    sigmoid ep 2 / ep 1      step 1's LM loss is the plain model's; every step's loss within 1e-5 of each other;
                             ep 1 (ZeRO-0) resumed at dp 1 from its step-3 checkpoint: steps 4-6 bitwise; ep 2
                             (ZeRO-2) resumed at ep 1 from its step-3 checkpoint: steps 4-6 within 1e-6; the
                             selection biases after step 6 and every step's expert_load equal in all four;
                             ZeRO-3 ep 2 the same losses, resumed by 1 rank at ep 1 (biases back too)

A resume at another ep or dp goes through dspipe's own universal conversion of the native MoE checkpoint
(dspipe.runtime.moe_reshard). Each launch's start-up (engine.json) records what each rank built: at ep 2 the dense
parameters and its own experts, the planner's count."""

import math

import pytest
import torch

from dspipe.errors import SpecError
from dspipe.runtime import ckpt_meta, ckpt_tags
from tests.helpers import OFFLINE, csv_rows, gen_config, launch, offline_here, ok, save_hf_checkpoint, written_metrics

pytestmark = pytest.mark.distributed

VOCAB, SEQ, EXPERTS = 1024, 64, 4
LOSS_TOL, LOGITS_TOL = 1e-5, 1e-4
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=SEQ,
    rms_norm_eps=1e-5,
    initializer_range=0.2,
    num_experts_per_tok=2,
)
FAMILIES = {
    "mixtral": (
        "MixtralForCausalLM",
        "MixtralConfig",
        dict(
            intermediate_size=48, num_local_experts=EXPERTS, rope_parameters=dict(rope_type="default", rope_theta=1e6)
        ),
    ),
    "qwen3-moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(
            intermediate_size=96,
            moe_intermediate_size=48,
            num_experts=EXPERTS,
            head_dim=32,
            norm_topk_prob=False,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
        ),
    ),
}


def family_dir(path, family: str, corpus):
    """A random tiny checkpoint (save_pretrained; norm weights moved off 1) with the corpus's tokenizer beside it;
    returns the model transformers loads back from it."""
    cls, config_cls, kwargs = FAMILIES[family]
    return save_hf_checkpoint(
        path,
        cls=cls,
        config_cls=config_cls,
        config={**BASE, **kwargs},
        seed=sorted(FAMILIES).index(family) + 31,
        tokenizer_dir=corpus / "tokenizer",
    )


def configure(run, corpus, hf_dir, *flags, gpus=2, pp=1, checkpointing="none"):
    r = gen_config(
        "--init-from",
        hf_dir,
        "--gpus-per-node",
        gpus,
        "--gpu",
        "cpu",
        "--global-batch",
        "16",
        "--micro-batch",
        "4",
        "--warmup",
        "1",
        "--log-interval",
        "1",
        "--eval-interval",
        "0",
        "--data",
        corpus,
        "--out",
        run,
        "--precision",
        "fp32",
        "--offload",
        "none",
        "--no-offload-params",
        "--checkpointing",
        checkpointing,
        "--pp",
        pp,
        *flags,
    )
    assert r.returncode == 0, r.stderr


def first_loss(model, corpus) -> float:
    """transformers' LM loss on the run's first global batch (the runner's dp-invariant order, seed 1234)."""
    from dspipe.data import TokenWindows, TrainLoader

    loader = TrainLoader(windows=TokenWindows(str(corpus), seq_len=SEQ), seed=1234, micro_batch=16, dp=1, dp_rank=0)
    inputs, labels = next(loader)
    with torch.no_grad():
        logits = model(inputs).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)).item()


def exported_logits(run, out, ids):
    """export-hf of the run's last checkpoint: (its class name, its logits, dspipe's logits from the checkpoint)."""
    from transformers import AutoModelForCausalLM

    from dspipe.tools.consolidate import load_gpt

    r = offline_here("export-hf", run, "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    exported = AutoModelForCausalLM.from_pretrained(out).float().eval()
    tag = ckpt_tags.complete_checkpoints(run / "checkpoints")[-1][1]
    with torch.no_grad():
        return type(exported).__name__, exported(ids).logits, load_gpt(tag, meta=ckpt_meta.read_meta(tag))(ids)


def built_params(run) -> list[int]:
    """The parameter values each rank built at start-up (engine.json's "startup")."""
    import json

    return json.loads((run / "engine.json").read_text())["startup"]["built_params"]


def planned_params(run, *, ep: int, pp: int = 1, tp: int = 1) -> list[int]:
    """The planner's parameters per rank at start-up, in rank order (the stage outermost: dense / tp + experts / ep
    of each sparse block its pipeline stage holds)."""
    from dspipe.planner.stages import stage_params
    from dspipe.rundir import load_run

    r = load_run(run)
    assert (r.plan.ep, r.plan.pp, r.plan.tp) == (ep, pp, tp)
    stages = stage_params(model=r.model, pp=pp, partition_method=r.plan.partition_method, tp=tp, ep=ep)
    return [n for n in stages for _ in range(r.plan.dp * tp)]


def killed_and_resumed(run, *, gpus: int) -> list[dict]:
    """Launch `run` on `gpus` ranks, kill -9 it after step 5 (its checkpoint at 3), resume it: the replayed steps 4-5
    bitwise the ones before the kill; returns metrics.csv's 6 rows."""
    r = launch(run, "--test-faults", '{"kill_at_step": 5}', num_gpus=gpus)
    assert r.returncode != 0
    before = written_metrics(run)
    ok(launch(run, "--resume", "auto", num_gpus=gpus))
    rows = csv_rows(run / "metrics.csv")
    assert written_metrics(run)[:5] == before and len(rows) == 6
    return rows


def relative_differences(rows: list[dict], reference: list[dict]) -> dict[str, float]:
    """The largest relative difference of each step's loss, aux loss and gradient norm from `reference`'s."""
    return {
        key: max(abs(float(a[key]) - float(b[key])) / abs(float(b[key])) for a, b in zip(rows, reference, strict=True))
        for key in ("loss", "aux_loss", "grad_norm")
    }


def start_from_hf(tmp_path, family: str, corpus, monkeypatch):
    """(checkpoint directory, the model transformers loads from it, its first-batch loss), offline."""
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    hf_dir = tmp_path / "hf"
    hf = family_dir(hf_dir, family, corpus)
    return hf_dir, hf, first_loss(hf, corpus)


def test_mixtral_expert_parallel_equals_ep1_resumes_exactly_and_exports(tmp_path, corpus, monkeypatch):

    hf_dir, hf, expected = start_from_hf(tmp_path, "mixtral", corpus, monkeypatch)
    assert abs(expected - math.log(VOCAB)) > 0.3, expected
    train = ["--steps", "6", "--lr", "3e-3", "--save-interval", "3"]

    ep2 = tmp_path / "ep2"
    configure(ep2, corpus, hf_dir, *train, "--zero", "2", "--ep", "2")
    r = launch(ep2, "--test-faults", '{"kill_at_step": 5}')
    assert r.returncode != 0  # SIGKILL after step 5, checkpoint at 3
    before = written_metrics(ep2)
    assert [s for s, *_ in before] == ["1", "2", "3", "4", "5"]
    assert (ep2 / "checkpoints" / "latest").read_text() == "global_step3"
    r = launch(ep2, "--resume", "auto")
    ok(r)
    assert "resumed from" in r.stderr and "at step 3" in r.stderr  # a diagnostic: the dspipe logger's (stderr)
    after = written_metrics(ep2)
    assert after[:5] == before  # steps 4 and 5 replayed after the kill: loss, lr, grad norm bitwise
    last = ep2 / "checkpoints" / "global_step6"
    assert sorted(p.name for p in last.glob("layer_*_expert_*")) == sorted(
        f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in range(2) for e in range(EXPERTS)
    )
    assert ckpt_meta.read_meta(last).ep == 2

    ep1 = tmp_path / "ep1"
    configure(ep1, corpus, hf_dir, *train, "--zero", "1", "--ep", "1")
    ok(launch(ep1))
    rows1, rows2 = csv_rows(ep1 / "metrics.csv"), csv_rows(ep2 / "metrics.csv")
    loss_diffs = [abs(float(a["loss"]) - float(b["loss"])) for a, b in zip(rows1, rows2, strict=True)]
    aux = [float(row["aux_loss"]) for row in rows2]
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    cls, logits, ours = exported_logits(ep2, tmp_path / "export", ids)
    with torch.no_grad():
        moved = (logits - hf(ids).logits).abs().max().item()
    print(
        f"mixtral: HF loss {expected:.6f}, step 1 {rows2[0]['loss']}; ep1 - ep2 loss per step {loss_diffs}; "
        f"aux {aux}; export - dspipe logits {(logits - ours).abs().max().item():.3g}, moved by training {moved:.3g}"
    )
    assert abs(float(rows2[0]["loss"]) - expected) < LOSS_TOL  # the LM loss, not LM + coef x aux
    assert len(loss_diffs) == 6 and max(loss_diffs) < LOSS_TOL
    assert float(rows2[-1]["loss"]) < float(rows2[0]["loss"]) - 0.01  # it trained
    assert all(0 < a < 2 * EXPERTS for a in aux) and all(float(row["aux_loss"]) > 0 for row in rows1)
    assert all(1 <= float(row["expert_load"]) <= EXPERTS / 2 for row in rows1 + rows2)  # busiest / mean, top-2 of 4
    assert {row["dropped_routes"] for row in rows1 + rows2} == {"0"}  # dropless: no capacity_factor
    assert cls == "MixtralForCausalLM" and (logits - ours).abs().max().item() < LOGITS_TOL and moved > 1e-2
    # start-up: each ep 2 rank built (read) the dense parameters and its own experts, the planner's count
    for run, ep in ((ep2, 2), (ep1, 1)):
        assert built_params(run) == planned_params(run, ep=ep), (run.name, built_params(run))
    assert built_params(ep1)[0] - built_params(ep2)[0] == 2 * (EXPERTS // 2) * 3 * 64 * 48  # 2 layers' 2 experts

    _pipeline_of_experts(tmp_path, corpus, hf_dir, train=train, reference=rows1)
    _tensor_parallel_experts(tmp_path, corpus, hf_dir, train=train, reference=rows1, expected=expected)
    _experts_over_tp_groups(tmp_path, corpus, hf_dir, train=train, reference=rows1, expected=expected)
    _zero3_experts(tmp_path, corpus, hf_dir, train=train, reference=rows1, expected=expected, hf=hf)

    # ep 2's step-3 checkpoint (ZeRO-2, dp 2: each rank its 2 experts whole) resumed on 4 ranks at dp 4 x ep 2, each
    # expert's state now cut over 2 expert-data-parallel ranks
    dp4 = tmp_path / "dp4-ep2"
    _resumed_elsewhere(dp4, corpus, hf_dir, zero=2, ep=2, gpus=4, train=train, source=ep2, reference=rows2[3:])


def _resumed_elsewhere(
    run, corpus, hf_dir, *, zero: int, ep: int, gpus: int, train: list, source, reference, tp: int = 1
) -> None:
    """`source`'s step-3 checkpoint resumed in `run` on `gpus` ranks at ZeRO-`zero`, `ep` and `tp` (pp 1), through a
    universal checkpoint (DeepSpeed's layer: dspipe.runtime.moe_reshard's): steps 4-6 those of the run that went on
    (`reference`: loss, aux loss, grad norm within 1e-6); the conversion's copy is gone afterwards."""
    import shutil

    configure(run, corpus, hf_dir, *train, "--zero", str(zero), "--ep", str(ep), "--tp", str(tp), gpus=gpus)
    shutil.copytree(source / "checkpoints", run / "checkpoints", ignore=shutil.ignore_patterns("global_step6"))
    (run / "checkpoints" / "latest").write_text("global_step3")
    r = launch(run, "--resume", "auto", num_gpus=gpus)
    ok(r)
    assert "at step 3" in r.stderr
    rows = csv_rows(run / "metrics.csv")
    diffs = relative_differences(rows, reference)
    print(f"mixtral {source.name} -> {run.name} at step 3: relative differences in steps 4-6 {diffs}")
    assert [row["step"] for row in rows] == ["4", "5", "6"] and max(diffs.values()) < 1e-6, diffs
    assert not [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".universal-")]


def _zero3_experts(tmp_path, corpus, hf_dir, *, train: list, reference: list, expected: float, hf) -> None:
    """The same Mixtral under ZeRO-3 at ep 2: the model's own SparseMLP, each rank holding its 2 experts of every
    block, partitioned by ZeRO-3 over its expert-data-parallel group, the tokens dispatched to them
    (dspipe.runtime.moe.spread_experts). Killed after step 5 and resumed: steps 4-5 bitwise; step 1's LM loss is
    transformers'; every step's loss, aux loss and grad norm within 1e-5 of ep 1's on DeepSpeed's layer
    (`reference`), the same expert loads; each rank built the dense parameters and its experts (the planner's
    count); no expert files (the experts are in the ZeRO-3 partitions); export-hf computes transformers' Mixtral
    with the run's weights; its step-3 checkpoint resumed by one rank at ep 1 continues it."""
    run = tmp_path / "zero3"
    configure(run, corpus, hf_dir, *train, "--zero", "3", "--ep", "2")
    rows = killed_and_resumed(run, gpus=2)
    diffs = relative_differences(rows, reference)
    print(f"mixtral ZeRO-3 ep 2 (the model's own experts) vs ep 1 on DeepSpeed's layer: relative differences {diffs}")
    assert abs(float(rows[0]["loss"]) - expected) < LOSS_TOL and max(diffs.values()) < LOSS_TOL, diffs
    assert [row["expert_load"] for row in rows] == [row["expert_load"] for row in reference]
    assert {row["dropped_routes"] for row in rows} == {"0"}
    assert built_params(run) == planned_params(run, ep=2)  # the dense parameters and its own experts
    last = run / "checkpoints" / "global_step6"
    assert not list(last.glob("layer_*_expert_*")) and len(list(last.glob("*zero_pp_rank_*_optim_states.pt"))) == 2
    assert ckpt_meta.read_meta(last).ep == 2
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    cls, logits, ours = exported_logits(run, tmp_path / "export-zero3", ids)
    with torch.no_grad():
        moved = (logits - hf(ids).logits).abs().max().item()
    assert cls == "MixtralForCausalLM" and (logits - ours).abs().max().item() < LOGITS_TOL and moved > 1e-2
    # its step-3 checkpoint resumed by one rank (dp 1, ep 1): every expert put back together from its
    # expert-data-parallel partitions under its global name (dspipe.runtime.zero3_experts)
    dp1 = tmp_path / "zero3-dp1"
    _resumed_elsewhere(dp1, corpus, hf_dir, zero=3, ep=1, gpus=1, train=train, source=run, reference=rows[3:])


def _pipeline_of_experts(tmp_path, corpus, hf_dir, *, train: list, reference: list) -> None:
    """The same Mixtral as 2 pipeline stages x dp 2 x ep 2 on 4 ranks, every block recomputed: each stage's blocks
    hand their load-balancing loss to the backward themselves (dspipe.runtime.moe.wire_stage). Killed after step 5
    (checkpoint at 3) and resumed: steps 4-5 bitwise; every step's loss, aux loss, expert load and gradient norm
    those of the ep 1 run at pp 1 (`reference`); each rank built its stage's dense parameters and its own experts;
    the checkpoint (each stage's module in its mp_rank file, its experts' files) exports dspipe's logits."""
    run = tmp_path / "pp2"
    configure(run, corpus, hf_dir, *train, "--zero", "1", "--ep", "2", gpus=4, pp=2, checkpointing="full")
    rows = killed_and_resumed(run, gpus=4)
    diffs = relative_differences(rows, reference)
    print(f"mixtral pp 2 x dp 2 x ep 2 vs pp 1 ep 1: relative differences {diffs}")
    assert max(diffs.values()) < LOSS_TOL, diffs
    assert [row["expert_load"] for row in rows] == [row["expert_load"] for row in reference]
    assert {row["dropped_routes"] for row in rows} == {"0"}
    assert built_params(run) == planned_params(run, ep=2, pp=2), built_params(run)
    last = run / "checkpoints" / "global_step6"
    stage_files = sorted(p.name for p in last.glob("layer_*_expert_*"))
    assert stage_files == sorted(
        f"layer_0_expert_{e}_mp_rank_{stage:02d}_model_states.pt" for stage in range(2) for e in range(EXPERTS)
    )  # one sparse block per stage, numbered from 0 in each
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    cls, logits, ours = exported_logits(run, tmp_path / "export-pp2", ids)
    assert cls == "MixtralForCausalLM" and (logits - ours).abs().max().item() < LOGITS_TOL
    # its step-3 checkpoint resumed as the plain model on 2 ranks at ep 1 (dspipe.runtime.moe_reshard, the
    # parameters renamed): steps 4-6 those of the pipeline that went on
    pp1 = tmp_path / "pp1-ep1"
    _resumed_elsewhere(pp1, corpus, hf_dir, zero=1, ep=1, gpus=2, train=train, source=run, reference=rows[3:])


def _tensor_parallel_experts(tmp_path, corpus, hf_dir, *, train: list, reference: list, expected: float) -> None:
    """The same Mixtral at tp 2 x pp 2 on 4 ranks (Megatron sequence parallelism, ZeRO-1, every block recomputed)
    with its experts spread over the tp group (ep = tp = 2: dspipe.runtime.experts.folded): attention
    tensor-parallel, each tp rank holding 2 experts of every block and dispatching its half of the sequence to
    their holders. Killed after step 5 and resumed: steps 4-5 bitwise; step 1's LM loss is transformers'; every
    step's loss, aux loss and gradient norm within 1e-5 of the ep 1 run at tp 1 (`reference`), the same expert
    loads (each token counted once); each rank built its stage's attention shard and its own experts, the planner's
    count; the checkpoint exports dspipe's logits."""
    run = tmp_path / "tp2-pp2"
    configure(run, corpus, hf_dir, *train, "--zero", "1", "--tp", "2", "--ep", "2", gpus=4, pp=2, checkpointing="full")
    rows = killed_and_resumed(run, gpus=4)
    diffs = relative_differences(rows, reference)
    print(
        f"mixtral tp 2 x pp 2 x ep 2 vs tp 1: step 1 {rows[0]['loss']} (HF {expected:.6f}); relative differences "
        f"{diffs}"
    )
    assert abs(float(rows[0]["loss"]) - expected) < LOSS_TOL
    assert max(diffs.values()) < LOSS_TOL, diffs
    assert [row["expert_load"] for row in rows] == [row["expert_load"] for row in reference]
    assert {row["dropped_routes"] for row in rows} == {"0"}
    assert built_params(run) == planned_params(run, ep=2, pp=2, tp=2), built_params(run)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    cls, logits, ours = exported_logits(run, tmp_path / "export-tp2", ids)
    assert cls == "MixtralForCausalLM" and (logits - ours).abs().max().item() < LOGITS_TOL


def _experts_over_tp_groups(tmp_path, corpus, hf_dir, *, train: list, reference: list, expected: float) -> None:
    """The same Mixtral at tp 2 x dp 2 on 4 ranks with its experts over both tp groups (ep 4 = tp 2 x 2:
    dspipe.runtime.experts.beyond_tp; DeepSpeed's native layer, ZeRO-2, sequence parallel): each rank holds one
    expert of every block and routes its half of the sequence to the holders over the 4 ranks. Killed after step 5
    and resumed: steps 4-5 bitwise; step 1's LM loss is transformers'; every step's loss, aux loss and gradient norm
    within 1e-5 of the ep 1 run at tp 1 (`reference`; measured: the gradient norms equal, the losses within 1.2e-7),
    the same expert loads; each expert's file written once, by its holder's tp rank; each rank built its attention
    shard and its own expert, the planner's count; the checkpoint exports dspipe's logits; its step-3 checkpoint
    resumed at dp 4 on 8 ranks continues it (steps 4-6 within 1e-6). Under ZeRO-3 (the model's own experts, each
    rank's partitioned over its expert-data-parallel group) the same losses, loads and export."""
    run = tmp_path / "tp2-ep4"
    configure(run, corpus, hf_dir, *train, "--zero", "2", "--tp", "2", "--ep", "4", gpus=4)
    rows = killed_and_resumed(run, gpus=4)
    diffs = relative_differences(rows, reference)
    print(f"mixtral tp 2 x dp 2 x ep 4 vs tp 1 ep 1: step 1 {rows[0]['loss']} (HF {expected:.6f}); {diffs}")
    assert abs(float(rows[0]["loss"]) - expected) < LOSS_TOL
    assert max(diffs.values()) < LOSS_TOL, diffs
    assert [row["expert_load"] for row in rows] == [row["expert_load"] for row in reference]
    assert {row["dropped_routes"] for row in rows} == {"0"}
    last = run / "checkpoints" / "global_step6"
    assert sorted(p.name for p in last.glob("layer_*_expert_*")) == sorted(
        f"layer_{layer}_expert_{e}_mp_rank_{e % 2:02d}_model_states.pt" for layer in range(2) for e in range(EXPERTS)
    )
    assert built_params(run) == planned_params(run, ep=4, tp=2), built_params(run)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    cls, logits, ours = exported_logits(run, tmp_path / "export-tp2-ep4", ids)
    assert cls == "MixtralForCausalLM" and (logits - ours).abs().max().item() < LOGITS_TOL
    # its step-3 checkpoint resumed on 8 ranks at dp 4 (each expert's ZeRO-2 state now cut over 2 ranks, the
    # attention's over 4): dspipe.runtime.moe_reshard merges the tp shards, DeepSpeed's universal load cuts them again
    dp4 = tmp_path / "tp2-dp4-ep4"
    _resumed_elsewhere(dp4, corpus, hf_dir, zero=2, ep=4, tp=2, gpus=8, train=train, source=run, reference=rows[3:])
    # under ZeRO-3 the model's own experts, each rank's partitioned over its expert-data-parallel group (1 rank)
    zero3 = tmp_path / "tp2-ep4-zero3"
    configure(zero3, corpus, hf_dir, *train, "--zero", "3", "--tp", "2", "--ep", "4", gpus=4)
    ok(launch(zero3, num_gpus=4))
    rows3 = csv_rows(zero3 / "metrics.csv")
    diffs3 = relative_differences(rows3, reference)
    print(f"mixtral ZeRO-3 tp 2 x dp 2 x ep 4 vs tp 1 ep 1: {diffs3}")
    assert max(diffs3.values()) < LOSS_TOL, diffs3
    assert [row["expert_load"] for row in rows3] == [row["expert_load"] for row in reference]
    assert not list((zero3 / "checkpoints" / "global_step6").glob("layer_*_expert_*"))  # in the ZeRO-3 partitions
    cls, logits, ours = exported_logits(zero3, tmp_path / "export-tp2-ep4-zero3", ids)
    assert cls == "MixtralForCausalLM" and (logits - ours).abs().max().item() < LOGITS_TOL


def test_qwen3_moe_expert_parallel_starts_from_transformers_and_exports_its_logits(tmp_path, corpus, monkeypatch):
    """Qwen3-MoE at ep 2 on DeepSpeed's layer (ZeRO-2), under ZeRO-3 at ep 1 and ep 2 and at tp 2 (its q/k norms
    and attention tensor-parallel; the experts whole on both tp ranks, or spread over them at ep 2) on the model's
    own experts: step 1's LM loss is transformers' (lr 1e-12), and export-hf computes transformers' logits, from all
    five."""
    hf_dir, hf, expected = start_from_hf(tmp_path, "qwen3-moe", corpus, monkeypatch)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf_logits = hf(ids).logits
    layouts = {
        "ep2": ("--zero", "2", "--ep", "2"),
        "zero3": ("--zero", "3", "--ep", "1"),
        "zero3-ep2": ("--zero", "3", "--ep", "2"),
        "tp2": ("--zero", "1", "--tp", "2"),
        "tp2-ep2": ("--zero", "1", "--tp", "2", "--ep", "2"),
    }
    for name, flags in layouts.items():
        run = tmp_path / name
        configure(run, corpus, hf_dir, "--steps", "2", "--lr", "1e-12", "--weight-decay", "0", *flags)
        ok(launch(run))
        rows = csv_rows(run / "metrics.csv")
        cls, logits, ours = exported_logits(run, tmp_path / f"export-{name}", ids)
        print(
            f"qwen3-moe {name}: HF loss {expected:.6f}, step 1 {rows[0]['loss']} aux {rows[0]['aux_loss']}; export - "
            f"HF logits {(logits - hf_logits).abs().max().item():.3g}"
        )
        assert abs(float(rows[0]["loss"]) - expected) < LOSS_TOL
        assert float(rows[0]["aux_loss"]) > 0
        if name in ("ep2", "zero3-ep2", "tp2-ep2"):
            # dense + this rank's experts, read lazily
            assert built_params(run) == planned_params(run, ep=2, tp=2 if name == "tp2-ep2" else 1)
        assert cls == "Qwen3MoeForCausalLM"
        assert (logits - hf_logits).abs().max().item() < LOGITS_TOL
        assert (logits - ours).abs().max().item() < LOGITS_TOL


def test_sigmoid_routing_expert_parallel_equals_ep1_and_the_plain_model(tmp_path, corpus):
    """DeepSeek-V3's routing (sigmoid scores, routed scale 2.5, group-limited, aux-loss-free bias) on DeepSpeed's
    layer: ep 2 under ZeRO-2 trains as ep 1 under ZeRO-0, and its first LM loss is the plain model's (GPT with the
    run's seed) on the first global batch. The ZeRO-0 run's step-3 checkpoint resumed by one rank (dp 1, whole
    state, the biases from the checkpoint) continues it exactly. ZeRO-3 at ep 2 (the model's own experts) trains as
    ZeRO-2 at ep 2, and its step-3 checkpoint resumed by one rank at ep 1 continues it (the biases too)."""
    import shutil

    from dspipe.data import TokenWindows, TrainLoader
    from dspipe.model.gpt import GPT
    from dspipe.rundir import load_run

    model = [
        "--model",
        "tiny-llama",
        "--layers",
        "2",
        "--hidden",
        "64",
        "--heads",
        "4",
        "--seq-len",
        str(SEQ),
        "--experts",
        str(EXPERTS),
        "--expert-ffn",
        "48",
        "--router-score",
        "sigmoid",
        "--router-scale",
        "2.5",
        "--router-groups",
        "2",
        "--router-group-limit",
        "1",
        "--router-bias-rate",
        "0.01",
        "--dropout",
        "0",
        "--steps",
        "6",
        "--lr",
        "3e-3",
        "--save-interval",
        "3",
    ]
    rows = {}
    for name, gpus, flags, source in (
        ("ep2", 2, ("--zero", "2", "--ep", "2"), None),
        ("ep1", 2, ("--zero", "0", "--ep", "1"), None),
        ("dp1", 1, ("--zero", "0", "--ep", "1"), "ep1"),  # the ep 1 run's step-3 checkpoint resumed by one rank
        ("ep2-ep1", 2, ("--zero", "2", "--ep", "1"), "ep2"),  # ep 2's resumed at ep 1 (dspipe.runtime.moe_reshard)
        ("zero3-ep2", 2, ("--zero", "3", "--ep", "2", "--tp", "1"), None),  # the model's own experts spread
        ("zero3-dp1", 1, ("--zero", "3", "--ep", "1", "--tp", "1"), "zero3-ep2"),  # (dspipe.runtime.zero3_experts)
    ):
        r = gen_config(
            *model,
            "--gpus-per-node",
            gpus,
            "--gpu",
            "cpu",
            "--global-batch",
            "16",
            "--micro-batch",
            "4",
            "--warmup",
            "1",
            "--log-interval",
            "1",
            "--eval-interval",
            "0",
            "--data",
            corpus,
            "--out",
            tmp_path / name,
            "--precision",
            "fp32",
            "--offload",
            "none",
            "--no-offload-params",
            "--checkpointing",
            "none",
            "--pp",
            "1",
            *flags,
        )
        assert r.returncode == 0, r.stderr
        if source:  # its step-3 checkpoint resumed at this layout
            shutil.copytree(
                tmp_path / source / "checkpoints",
                tmp_path / name / "checkpoints",
                ignore=shutil.ignore_patterns("global_step6"),
            )
            (tmp_path / name / "checkpoints" / "latest").write_text("global_step3")
            r = launch(tmp_path / name, "--resume", "auto", num_gpus=gpus)
            ok(r)
            assert "at step 3" in r.stderr  # "resumed from ... at step 3": the dspipe logger's (stderr)
        else:
            ok(launch(tmp_path / name))
        rows[name] = csv_rows(tmp_path / name / "metrics.csv")
    assert [row["loss"] for row in rows["dp1"]] == [row["loss"] for row in rows["ep1"][3:]]  # steps 4-6, bitwise
    moved = [abs(float(a["loss"]) - float(b["loss"])) for a, b in zip(rows["ep2-ep1"], rows["ep2"][3:], strict=True)]
    print(f"sigmoid ep 2 -> ep 1 at step 3: loss differences in steps 4-6 {moved}")
    assert len(moved) == 3 and max(moved) < 1e-6  # the selection biases came back too (restore_buffers)
    zero3 = [abs(float(a["loss"]) - float(b["loss"])) for a, b in zip(rows["zero3-ep2"], rows["ep2"], strict=True)]
    resumed = [
        abs(float(a["loss"]) - float(b["loss"])) for a, b in zip(rows["zero3-dp1"], rows["zero3-ep2"][3:], strict=True)
    ]
    print(f"sigmoid ZeRO-3 ep 2 - ZeRO-2 ep 2 losses {zero3}; resumed by 1 rank at ep 1: steps 4-6 {resumed}")
    assert len(zero3) == 6 and max(zero3) < 1e-5 and len(resumed) == 3 and max(resumed) < 1e-6
    run = load_run(tmp_path / "ep2")
    assert (run.model.router_score, run.model.router_scale, run.plan.ep) == ("sigmoid", 2.5, 2)
    from dspipe.tools.consolidate import load_gpt

    biases = {}  # the selection biases after 6 steps: moved by 0.01 steps, the same whichever ranks held the experts
    for name in ("ep2", "ep1", "dp1", "ep2-ep1", "zero3-ep2", "zero3-dp1"):
        tag = ckpt_tags.complete_checkpoints(tmp_path / name / "checkpoints")[-1][1]
        biases[name] = torch.stack([b.mlp.router_bias for b in load_gpt(tag, meta=ckpt_meta.read_meta(tag)).h])
    assert all(torch.equal(biases["ep2"], b) for b in biases.values())
    assert biases["ep2"].abs().max() > 0.005 and biases["ep2"].abs().max() <= 0.06 + 1e-6  # at most 6 x 0.01
    # a bias of the wrong shape (or none) in a checkpoint: one line before anything loads, not DeepSpeed's traceback
    from dspipe.runtime.ckptfiles import check_checkpoint

    tag = tmp_path / "ep1" / "checkpoints" / "global_step6"
    states = tag / "mp_rank_00_model_states.pt"
    sd = torch.load(states, weights_only=False)
    for edit, says in (
        (
            lambda m: m.update({"h.1.mlp.router_bias": torch.zeros(3)}),
            r"h.1.mlp.router_bias has shape \[3\], the checkpoint's model has \[4\]",
        ),
        (lambda m: m.pop("h.1.mlp.router_bias"), r"holds no weights for h.1.mlp.router_bias"),
    ):
        module = dict(sd["module"])
        edit(module)
        torch.save({**sd, "module": module}, states)
        with pytest.raises(SpecError, match=says):
            check_checkpoint(tag, meta=ckpt_meta.read_meta(tag))
    plain = GPT(run.model, seed=run.train.seed).eval()
    loader = TrainLoader(windows=TokenWindows(str(corpus), seq_len=SEQ), seed=1234, micro_batch=16, dp=1, dp_rank=0)
    with torch.no_grad():
        plain(*next(loader))
    losses = {name: [float(row["loss"]) for row in r] for name, r in rows.items()}
    diffs = [abs(a - b) for a, b in zip(losses["ep1"], losses["ep2"], strict=True)]
    print(f"sigmoid: plain step-1 LM loss {plain.last_lm_loss.item():.6f}, ep 2 {losses['ep2']}, ep1 - ep2 {diffs}")
    assert abs(losses["ep2"][0] - plain.last_lm_loss.item()) < LOSS_TOL
    assert len(diffs) == 6 and max(diffs) < LOSS_TOL
    assert losses["ep2"][-1] < losses["ep2"][0] - 0.05  # it trained
    assert all(float(row["aux_loss"]) > 0 for row in rows["ep2"])
    loads = {name: [float(row["expert_load"]) for row in r] for name, r in rows.items()}
    assert loads["ep2"] == loads["ep1"] and loads["dp1"] == loads["ep1"][3:] == loads["ep2-ep1"]  # every rank's
    assert loads["zero3-ep2"] == loads["ep2"] and loads["zero3-dp1"] == loads["ep2"][3:]
    assert all(1 <= x <= EXPERTS / 2 for x in loads["ep2"])


def test_experts_over_tp_groups_resume_at_another_ep(tmp_path, corpus):
    """8 experts at tp 2 x dp 4 on 8 ranks, ZeRO-2 (DeepSpeed's layer, the experts over whole tp groups): the ep 8
    run's step-3 checkpoint resumed at ep 4 (dspipe.runtime.moe_reshard: each expert under its global name, the tp
    shards merged, cut again at the load) continues it: steps 4-6 within 1e-6 of the run that went on (measured:
    bitwise)."""
    import shutil

    model = ["--model", "tiny-llama", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", str(SEQ)]
    model += ["--experts", "8", "--expert-ffn", "48", "--dropout", "0", "--steps", "6", "--lr", "3e-3"]
    runs = {}
    for name, ep, source in (("ep8", 8, None), ("ep8-ep4", 4, "ep8")):
        run = tmp_path / name
        r = gen_config(
            *model,
            *("--save-interval", "3", "--gpus-per-node", "8", "--gpu", "cpu", "--global-batch", "16"),
            *("--micro-batch", "4", "--warmup", "1", "--log-interval", "1", "--eval-interval", "0"),
            *("--data", corpus, "--out", run, "--precision", "fp32", "--offload", "none", "--no-offload-params"),
            *("--zero", "2", "--tp", "2", "--ep", str(ep), "--pp", "1"),
        )
        assert r.returncode == 0, r.stderr
        if source:
            shutil.copytree(
                tmp_path / source / "checkpoints", run / "checkpoints", ignore=shutil.ignore_patterns("global_step6")
            )
            (run / "checkpoints" / "latest").write_text("global_step3")
            r = launch(run, "--resume", "auto", num_gpus=8)
            ok(r)
            assert "at step 3" in r.stderr
        else:
            ok(launch(run, num_gpus=8))
        runs[name] = csv_rows(run / "metrics.csv")
    moved = {
        key: max(abs(float(a[key]) - float(b[key])) for a, b in zip(runs["ep8-ep4"], runs["ep8"][3:], strict=True))
        for key in ("loss", "grad_norm")
    }
    print(f"tp 2 x dp 4: ep 8 -> ep 4 at step 3, steps 4-6 differ by {moved}")
    assert [row["step"] for row in runs["ep8-ep4"]] == ["4", "5", "6"] and max(moved.values()) < 1e-6, moved
    assert not [p.name for p in (tmp_path / "ep8-ep4" / "checkpoints").iterdir() if p.name.startswith(".universal-")]
