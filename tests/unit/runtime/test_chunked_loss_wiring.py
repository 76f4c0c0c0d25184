"""parallelize's chunked_loss: the plain GPT and a pipeline's last stage compute their loss in chunks (the plain
loss's value and gradients), the engine reports it, and a tensor-parallel head is refused."""

import types

import pytest
import torch

from dspipe.model.gpt import GPT
from dspipe.model.loss import HeadLoss
from dspipe.runtime.parallelize import chunked_loss
from dspipe.spec.presets import model_preset
from tests.helpers import deepspeed_one_rank

TOL = 1e-5


def _batch(spec, *, b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, spec.vocab, (b, spec.seq_len + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _rel(got, want) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def _plain(spec, idx, labels):
    model = GPT(spec, seed=5)
    model(idx, labels).backward()
    return model


@pytest.fixture(scope="module")
def one_rank():
    with deepspeed_one_rank():
        yield


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
def test_the_plain_gpt_gets_the_chunked_loss(name):
    spec = model_preset(name)
    idx, labels = _batch(spec)
    plain = _plain(spec, idx, labels)
    model = GPT(spec, seed=5)
    loss_fn = chunked_loss(model, chunk=48)
    assert model.head_loss is loss_fn and isinstance(loss_fn, HeadLoss) and loss_fn.chunk == 48
    loss = model(idx, labels)
    loss.backward()
    assert _rel(loss.detach(), plain.last_lm_loss) <= TOL
    for (n, p), q in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert _rel(q.grad, p.grad) <= TOL, n


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])  # a tied head (TiedLayerSpec) and an untied LMHead
def test_a_pipeline_stage_with_the_head_computes_the_chunked_loss(one_rank, name):
    from dspipe.model.pipeline import build_pipeline

    spec = model_preset(name)
    idx, labels = _batch(spec)
    plain = _plain(spec, idx, labels)
    pipe = build_pipeline(
        model=spec,
        stages=1,
        partition_method="parameters",
        activation_checkpoint_interval=0,
        checkpoint_fn=None,
        seed=5,
    )
    loss_fn = chunked_loss(pipe, chunk=40)
    assert isinstance(loss_fn, HeadLoss) and pipe.loss_fn.loss is loss_fn
    hidden = pipe(idx)
    assert hidden.shape == (*idx.shape, spec.hidden)  # the head is now the loss's: the stage returns the hidden
    loss = pipe.loss_fn(hidden, labels)
    loss.backward()
    assert _rel(loss.detach(), plain.last_lm_loss) <= TOL
    grads = {n: p.grad for n, p in plain.named_parameters()}
    from dspipe.model.gpt import LMHead

    head = (
        pipe.tied_modules["embed"].wte.weight
        if spec.tied_embeddings
        else next(m for m in pipe.modules() if isinstance(m, LMHead)).weight
    )
    assert _rel(head.grad, grads["embed.wte.weight" if spec.tied_embeddings else "lm_head.weight"]) <= TOL


def test_a_tensor_parallel_head_is_refused():
    model = GPT(model_preset("tiny"), seed=1)
    model.embed.head_linear = lambda x, w: x @ w.t()  # as shard_tensor_parallel sets it
    with pytest.raises(RuntimeError, match="loss_chunk 64 with a tensor-parallel head"):
        chunked_loss(model, chunk=64)


def test_the_engine_reports_which_loss_runs():
    from dspipe.runtime.engine import loss_settings

    model = GPT(model_preset("tiny"), seed=1)
    engine = types.SimpleNamespace(module=model, device=torch.device("cpu"))
    assert loss_settings(engine) == {"loss": "full logits", "loss_chunk": 0}
    chunked_loss(model, chunk=64)
    assert loss_settings(engine) == {"loss": "chunked cross-entropy, 64 tokens per chunk", "loss_chunk": 64}
