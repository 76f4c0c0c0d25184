"""strategy.loss_chunk: the flag, its refusals, the plan and the planner's memory (one chunk of logits, not all)."""

import pytest

from dspipe.errors import SpecError
from dspipe.planner.cost import estimate
from dspipe.planner.memory import logits_bytes, loss_chunk_working_bytes, micro_batch_activations
from dspipe.planner.plan import make_plan
from dspipe.planner.search import search
from dspipe.spec.cluster import ClusterSpec
from dspipe.spec.core import StrategyRequest
from dspipe.spec.presets import model_preset
from dspipe.spec.strategy import StrategySpec
from dspipe.spec.train import TrainSpec
from tests.helpers import run_cli

CPU2 = ("--model", "tiny", "--nodes", "1", "--gpus-per-node", "2", "--gpu", "cpu", "--global-batch", "4")
LLAMA3 = model_preset("llama3-8b")  # V 128,256, h 4,096, s 8,192


def _plan(model, *, gbs=8, mb=1, precision="bf16", gpus=8, **strategy):
    cluster = ClusterSpec(1, gpus, "h100-80g")
    train = TrainSpec(global_batch=gbs, micro_batch=mb, steps=100, warmup_steps=10, precision=precision)
    plan = make_plan(model=model, cluster=cluster, train=train, strategy=StrategySpec(**strategy))
    return plan, estimate(model=model, cluster=cluster, plan=plan)


@pytest.mark.parametrize(
    "value, message",
    [
        ("-1", "strategy.loss_chunk must be an integer >= 0, got -1 (allowed range 0..16,777,216)"),
        ("16777217", "strategy.loss_chunk 16777217 is too large (allowed range 0..16,777,216)"),
    ],
)
def test_flag_validation_is_one_line_exit_2(capsys, value, message):
    assert run_cli("plan", *CPU2, "--loss-chunk", value) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_spec_rejects_what_is_not_a_token_count():
    for bad in (-5, 1.5, True, "8"):
        with pytest.raises(SpecError, match="strategy.loss_chunk must be an integer >= 0"):
            StrategySpec(loss_chunk=bad)
    assert StrategySpec().loss_chunk == 0


def test_tensor_parallel_is_refused_with_the_numbers(capsys):
    with pytest.raises(SpecError) as e:
        _plan(LLAMA3, tp=2, loss_chunk=1024)
    assert str(e.value) == (
        "loss_chunk 1024 with tp 2: the tensor-parallel head computes a vocab-parallel "
        "cross-entropy of its ceil(128256 / 2) = 64128 vocabulary rows (no chunked loss there); "
        "use --loss-chunk 0 or --tp 1"
    )
    assert run_cli("plan", *CPU2, "--tp", "2", "--loss-chunk", "16") == 2
    err = capsys.readouterr().err.strip()
    assert "loss_chunk 16 with tp 2" in err and len(err.splitlines()) == 1, err


def test_the_plan_carries_it_and_the_search_plans_no_tensor_parallel_head_with_it():
    plan, _ = _plan(LLAMA3, loss_chunk=2048, zero=3)
    assert plan.loss_chunk == 2048 and _plan(LLAMA3, zero=3)[0].loss_chunk == 0
    model, cluster = model_preset("gpt2-124m"), ClusterSpec(1, 8, "h100-80g")
    train = TrainSpec(global_batch=64, micro_batch=1, steps=100, warmup_steps=10)
    result = search(model=model, cluster=cluster, train=train, request=StrategyRequest(loss_chunk=512))
    assert result.best.plan.loss_chunk == 512 and result.best.plan.tp == 1
    assert all(c.plan.tp == 1 and c.plan.loss_chunk == 512 for c in result.ranked)
    assert all("loss_chunk 512 with tp" in result.rejected[f"tp {tp}"] for tp in (2, 4))  # the reason is shown


@pytest.mark.parametrize("precision, b", [("bf16", 2), ("fp32", 4)])
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_memory_counts_one_chunk_instead_of_the_full_logits(precision, b, checkpointing):
    """Llama-3 8B, one 8,192-token sequence: the plain loss keeps 4 bytes x V per token (4 GiB, the issue's
    figure); with 1,024-token chunks it keeps a 4-byte log-sum-exp per token and adds one chunk's logits,
    1,024 x V x (4 + b in 16-bit) bytes, at the loss's backward."""
    tokens, v, chunk = 8192, LLAMA3.vocab, 1024
    plain, plain_est = _plan(LLAMA3, precision=precision, zero=3, checkpointing=checkpointing)
    chunked, chunked_est = _plan(LLAMA3, precision=precision, zero=3, checkpointing=checkpointing, loss_chunk=chunk)
    assert round(4 * tokens * v / 2**30, 2) == 3.91  # the plain loss's log_softmax output: ~4 GiB
    one_chunk = chunk * v * (4 + (b if b == 2 else 0))
    assert loss_chunk_working_bytes(model=LLAMA3, micro_batch=1, loss_chunk=chunk, act_bytes=b) == one_chunk
    saved = 4 * tokens * v - 4 * tokens  # log_softmax's output replaced by the log-sum-exp
    assert (
        logits_bytes(model=LLAMA3, micro_batch=1, act_bytes=b)
        - logits_bytes(model=LLAMA3, micro_batch=1, act_bytes=b, loss_chunk=chunk)
    ) == saved
    less = plain_est.memory.activations - chunked_est.memory.activations
    if checkpointing == "none":  # held: the saved tensors; working: the chunk (no MoE block)
        assert less == saved - one_chunk
    else:  # the peak is the head's tensors (with the chunk) or one recomputed block, whichever is larger
        kw = dict(
            model=LLAMA3, micro_batch=1, checkpointing="full", act_bytes=b, blocks=LLAMA3.layers, first=True, last=True
        )
        held, working = micro_batch_activations(**kw)
        held_c, working_c = micro_batch_activations(**kw, loss_chunk=chunk)
        assert held == held_c and less == working - working_c > 2**30
    assert less > (3 * 2**30 if checkpointing == "none" else 2**30)  # of the ~4 GiB
    assert plain_est.memory.total - chunked_est.memory.total == less


def test_a_chunk_larger_than_the_tokens_counts_the_tokens():
    big = loss_chunk_working_bytes(model=LLAMA3, micro_batch=1, loss_chunk=10**6, act_bytes=4)
    assert big == 8192 * LLAMA3.vocab * 4
    assert loss_chunk_working_bytes(model=LLAMA3, micro_batch=1, loss_chunk=0, act_bytes=4) == 0
    assert (
        loss_chunk_working_bytes(model=LLAMA3, micro_batch=2, loss_chunk=1024, sp=8, act_bytes=4)
        == 1024 * LLAMA3.vocab * 4
    )  # sp 8: 2 x 1,024 tokens on a rank, chunks of 1,024


def test_plan_json_says_it(capsys):
    import json

    assert run_cli("plan", *CPU2, "--loss-chunk", "32", "--json") == 0
    assert json.loads(capsys.readouterr().out)["loss_chunk"] == 32
