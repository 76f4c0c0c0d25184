"""--compile: parallelize's compile_blocks compiles every transformer block in place, and the compiled model trains
as the eager one does (fp32 on the CPU: the same losses over optimizer steps and the same gradients, within 1e-5
relative), on the GPT-2 and Llama shapes, also with recomputation wired before the compile. The engine's settings
count the compiled blocks (check_engine refuses a run whose --compile did not reach the module)."""

import copy
import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from dspipe.model.gpt import GPT
from dspipe.runtime.engine import compiled_modules, held_blocks
from dspipe.runtime.parallelize import compile_blocks, recompute
from dspipe.spec.presets import MODEL_PRESETS

REL = 1e-5


def _train(model: GPT, batches: list) -> tuple[list[float], list[torch.Tensor]]:
    """Losses of an AdamW step per batch on `batches` and the first step's gradients."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    losses, grads = [], None
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        if grads is None:
            grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads


@pytest.mark.parametrize("preset,recomputation", [("tiny", "full"), ("tiny-llama", "selective")])
def test_compiled_blocks_train_as_the_eager_model(preset, recomputation):
    torch._dynamo.reset()
    spec = MODEL_PRESETS[preset]
    gen = torch.Generator().manual_seed(3)
    batch = (
        torch.randint(0, spec.vocab, (2, spec.seq_len), generator=gen),
        torch.randint(0, spec.vocab, (2, spec.seq_len), generator=gen),
    )
    batches = [batch] * 3  # the same batch: the loss must fall
    eager = GPT(spec, seed=7).train()
    compiled = copy.deepcopy(eager)
    fn = functools.partial(checkpoint, use_reentrant=False)
    for model in (eager, compiled):
        recompute(model, mode=recomputation, checkpoint_fn=fn)
    assert compiled_modules(compiled) == 0
    assert compile_blocks(compiled) == spec.layers == compiled_modules(compiled) == held_blocks(compiled)
    assert compiled_modules(eager) == 0
    want_losses, want_grads = _train(eager, batches)
    got_losses, got_grads = _train(compiled, batches)
    assert got_losses == pytest.approx(want_losses, rel=REL)
    assert want_losses[-1] < want_losses[0]  # it trains
    for (name, _), want, got in zip(eager.named_parameters(), want_grads, got_grads, strict=True):
        scale = want.abs().max().item()
        assert (got - want).abs().max().item() <= REL * scale + 1e-12, name
