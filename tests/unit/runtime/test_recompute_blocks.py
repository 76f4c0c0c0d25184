"""The runtime's --recompute-blocks N: only the first N blocks of the plain GPT or of a pipeline stage are recomputed
(Megatron's block method), the model trains to the same losses and gradients, and what the engine check reads back
(recomputed_blocks) is what was wired."""

import functools
from dataclasses import replace

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from dspipe.model.gpt import GPT
from dspipe.runtime.parallelize import recompute, recomputed_blocks
from dspipe.spec.presets import MODEL_PRESETS

LLAMA4 = replace(MODEL_PRESETS["tiny-llama"], layers=4)
MOE4 = replace(MODEL_PRESETS["tiny-llama"], name="tiny-moe", layers=4, experts=4, experts_per_token=2, expert_ffn=96)


def _step(model, *, mode: str, blocks: int):
    """One forward and backward of a fresh copy of the seeded model: (loss, gradients, checkpoint calls)."""
    torch.manual_seed(0)
    gpt = GPT(model, seed=0).train()
    calls = []

    def counted(run, *args):
        calls.append(getattr(run, "__self__", run))
        return checkpoint(run, *args, use_reentrant=False)

    recompute(gpt, mode=mode, checkpoint_fn=counted if mode != "none" else None, blocks=blocks)
    ids = torch.randint(0, model.vocab, (2, model.seq_len + 1), generator=torch.Generator().manual_seed(1))
    loss = gpt(ids[:, :-1], ids[:, 1:])
    loss.backward()
    grads = [p.grad.clone() for p in gpt.parameters() if p.grad is not None]
    return loss.item(), grads, calls, gpt


@pytest.mark.parametrize("model", [LLAMA4, MOE4], ids=["dense", "moe"])
@pytest.mark.parametrize("blocks", [1, 3])
def test_the_first_blocks_only_are_recomputed_with_the_same_gradients(model, blocks):
    loss, grads, calls, gpt = _step(model, mode="full", blocks=blocks)
    ref_loss, ref_grads, none_calls, _ = _step(model, mode="none", blocks=0)
    assert calls == list(gpt.h)[:blocks] and none_calls == []  # one checkpoint per chosen block, in order
    assert recomputed_blocks(gpt) == blocks
    assert loss == ref_loss
    assert len(grads) == len(ref_grads) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))


def test_recomputed_blocks_reads_back_each_mode():
    for mode, blocks, want in (("none", 0, 0), ("selective", 0, 0), ("full", 0, 4), ("full", 2, 2), ("full", 9, 4)):
        gpt = GPT(LLAMA4, seed=0)
        fn = functools.partial(checkpoint, use_reentrant=False)
        recompute(gpt, mode=mode, checkpoint_fn=None if mode == "none" else fn, blocks=blocks)
        assert recomputed_blocks(gpt) == min(want, 4), (mode, blocks)


def test_a_pipeline_stage_recomputes_its_first_blocks():
    """A stage built with activation_checkpoint_interval 1 (as the plan renders full recomputation under pp > 1):
    its per-layer switches are on for its first N blocks only, and DeepSpeed's forward checkpoints exactly those."""
    from benchmarks.census.activations import _process_group
    from dspipe.model.gpt import Block
    from dspipe.model.pipeline import build_pipeline

    five = replace(LLAMA4, layers=5)
    with _process_group(rank=0, world=2):
        calls = []

        def counted(function, *args):
            calls.append(function)
            return checkpoint(function, *args, use_reentrant=False)

        def stage(interval: int):
            return build_pipeline(
                model=five,
                stages=2,
                partition_method="type:Block",
                activation_checkpoint_interval=interval,
                checkpoint_fn=counted,
                seed=0,
            )

        pipe = stage(1)
        held = sum(isinstance(layer, Block) for layer in pipe.forward_funcs)
        recompute(pipe, mode="full", checkpoint_fn=counted, blocks=2)
        assert held > 2 and recomputed_blocks(pipe) == 2
        ids = torch.randint(0, five.vocab, (2, five.seq_len))
        pipe(ids).float().sum().backward()
        assert len(calls) == 2
        plain = stage(0)
        with pytest.raises(RuntimeError, match="activation_checkpoint_interval 1, got 0"):
            recompute(plain, mode="full", checkpoint_fn=counted, blocks=2)
