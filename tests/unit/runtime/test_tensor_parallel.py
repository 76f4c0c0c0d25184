"""dspipe's tensor-parallel layers on 2 gloo CPU processes (no DeepSpeed engine): every model family, swapped for
its tp shards on the meta device and given its step-0 values shard by shard, holds exactly (bitwise) its slice of
the plain model's weights, and gives the plain model's loss and, on each shard, its slice of the plain gradients,
with Megatron sequence parallelism off and on; a column-parallel layer's backward issues its collectives before the
GEMMs they overlap (Megatron's order). One spawn of 2 processes for every case."""

import os

import pytest

from tests.helpers import free_port

CASES = {  # name: (preset, overrides)
    "gpt2-tied-biases": ("tiny", {}),
    "gpt2-uneven-vocab": ("tiny", {"vocab": 4097}),
    "llama-gqa": ("tiny-llama", {}),
    "qwen3-qk-norm-untied-uneven": ("tiny-llama", {"qk_norm": True, "vocab": 4095, "tied_embeddings": False}),
    "mistral-window": ("tiny-llama", {"sliding_window": 24}),
}


def _rank(rank, world, port, out):
    import torch.distributed as dist

    from dspipe.spec.presets import model_preset

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        group = dist.new_group(list(range(world)))
        for case, (preset, overrides) in CASES.items():
            spec = model_preset(preset, dropout=0.0, **overrides)
            for seq_parallel in (False, True):
                out[(case, seq_parallel, rank)] = _compare(
                    spec, rank=rank, world=world, group=group, seq_parallel=seq_parallel
                )
        for seq_parallel in (False, True):
            out[("order", seq_parallel, rank)] = _backward_order(rank=rank, world=world, group=group, sp=seq_parallel)
    finally:
        dist.destroy_process_group()


def _compare(spec, *, rank, world, group, seq_parallel) -> dict:
    import torch

    from dspipe.model.gpt import GPT, fill
    from dspipe.runtime.parallelize import shard_tensor_parallel
    from dspipe.runtime.tensor_parallel import TensorGroup, mark_shards, shard_of

    plain = GPT(spec, seed=7)
    tp = TensorGroup(rank=rank, size=world, sequence_parallel=seq_parallel, group=group)
    with torch.device("meta"):
        model = GPT(spec, seed=None)
    shard_tensor_parallel(model, spec=spec, tp=tp)
    model = model.to_empty(device="cpu")
    mark_shards(model)
    fill(model, seed=7, write=lambda p, draw: p.copy_(shard_of(p, draw())))
    gen = torch.Generator().manual_seed(3)
    idx = torch.randint(0, spec.vocab, (2, spec.seq_len), generator=gen)
    labels = torch.randint(0, spec.vocab, (2, spec.seq_len), generator=gen)
    want, got = plain(idx, labels), model(idx, labels)
    want.backward()
    got.backward()
    whole = dict(plain.named_parameters())
    sharded, weights_equal, worst = 0, True, 0.0
    for name, p in model.named_parameters():
        sharded += bool(getattr(p, "tensor_model_parallel", False))
        weights_equal &= torch.equal(shard_of(p, whole[name].detach()), p.detach())
        ref = shard_of(p, whole[name].grad)
        worst = max(worst, ((p.grad - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item())
    return dict(
        loss=(want.item(), got.item()),
        weights_equal=weights_equal,
        grad_rel=worst,
        sharded=sharded,
        names=sorted(n for n, _ in model.named_parameters()) == sorted(whole),
    )


def _backward_order(*, rank, world, group, sp) -> list[str]:
    """The matrix products and collectives of one column-parallel layer's backward, in the order the rank issues
    them (a collective's 'wait' is when the rank blocks on its result); its gradients are the plain layer's (the
    model-level comparison above)."""
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    import dspipe.runtime.tensor_parallel as T

    events: list[str] = []

    class Products(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.mm.default:
                events.append("mm")
            return func(*args, **(kwargs or {}))

    def logged(name, collective):
        def call(*args, **kwargs):
            work = collective(*args, **kwargs)
            if not kwargs.get("async_op"):
                events.append(name)
                return work
            events.append(f"start {name}")

            class Pending:
                def wait(self):
                    events.append(f"wait {name}")
                    return work.wait()

            return Pending()

        return call

    tp = T.TensorGroup(rank=rank, size=world, sequence_parallel=sp, group=group)
    layer = T.ColumnParallelLinear(torch.nn.Linear(8, 6 * world), parts=[6 * world], tp=tp)
    with torch.no_grad():
        layer.weight.normal_(), layer.bias.normal_()
    x = torch.randn(2, 4 if sp else 4 * world, 8, requires_grad=True)  # under sp: the rank's slice of the sequence
    y = layer(x)
    dy = torch.randn_like(y)
    saved = dist.all_reduce, T._ALL_GATHER, T._REDUCE_SCATTER
    dist.all_reduce = logged("all_reduce", dist.all_reduce)
    T._ALL_GATHER, T._REDUCE_SCATTER = logged("all_gather", T._ALL_GATHER), logged("reduce_scatter", T._REDUCE_SCATTER)
    try:
        with Products():
            y.backward(dy)
    finally:
        dist.all_reduce, T._ALL_GATHER, T._REDUCE_SCATTER = saved
    return events


@pytest.fixture(scope="module")
def compared():
    import torch.multiprocessing as mp

    out = mp.Manager().dict()
    mp.spawn(_rank, args=(2, free_port(), out), nprocs=2)
    return dict(out)


@pytest.mark.parametrize("seq_parallel", [False, True], ids=["tp", "tp-sp"])
@pytest.mark.parametrize("case", list(CASES))
def test_shards_hold_the_plain_weights_and_give_its_loss_and_gradients(compared, case, seq_parallel):
    for rank in (0, 1):
        r = compared[(case, seq_parallel, rank)]
        want, got = r["loss"]
        assert got == pytest.approx(want, rel=1e-6), (rank, want, got)
        assert r["weights_equal"], rank  # step 0: bitwise the plain model's slice
        assert r["grad_rel"] < 1e-5, (rank, r["grad_rel"])
        assert r["names"], rank  # the same parameter names as the plain model (checkpoints, export)
        assert r["sharded"] >= 2 * 4 + 1  # every block's 4 projections and the embedding at least


def test_vocab_rows_cover_the_vocabulary_once():
    from dspipe.runtime.tensor_parallel import vocab_rows

    for vocab, tp in ((50257, 8), (4096, 2), (4097, 4), (7, 7)):
        rows = [vocab_rows(vocab, rank=r, size=tp) for r in range(tp)]
        assert rows[0][0] == 0 and rows[-1][1] == vocab
        assert all(a[1] == b[0] for a, b in zip(rows[:-1], rows[1:], strict=True))
    with pytest.raises(ValueError, match=r"vocab 5 over tp 4: rank 3 would hold no rows \(ceil\(5 / 4\) = 2"):
        vocab_rows(5, rank=3, size=4)


def test_experts_spread_over_the_tp_group_are_the_rank_s_tp_shards():
    """shard_tensor_parallel at ep = tp: tp rank 1 of 2 holds experts 2 and 3 of 4 (`held`), whole and marked as its
    tensor-parallel shards once materialised (DeepSpeed reduces them over dp and counts them on every tp rank); the
    others are left for the build to skip; the shared expert stays a replicated, reduced projection."""
    import torch

    from dspipe.model.gpt import GPT
    from dspipe.runtime.parallelize import shard_tensor_parallel
    from dspipe.runtime.tensor_parallel import ReducedLinear, TensorGroup, mark_shards
    from dspipe.spec.presets import model_preset

    spec = model_preset("tiny", layers=2, hidden=64, heads=4, seq_len=32, experts=4, expert_ffn=48, shared_experts=1)
    with torch.device("meta"):
        model = GPT(spec, seed=None)
    shard_tensor_parallel(model, spec=spec, tp=TensorGroup(rank=1, size=2, sequence_parallel=True), ep=2)
    mlp = model.h[spec.sparse_layers[0]].mlp
    assert mlp.held == range(2, 4)
    model = model.to_empty(device="cpu")
    mark_shards(model)
    for e in range(4):
        weight = mlp.experts[e].c_fc.weight
        assert type(mlp.experts[e].c_fc) is torch.nn.Linear
        assert getattr(weight, "tensor_model_parallel", False) is (e in mlp.held)
        assert weight.shape[1] == spec.hidden and weight.shape[0] in (spec.expert_ffn, 2 * spec.expert_ffn)  # whole
    assert isinstance(mlp.shared.c_fc, ReducedLinear)


def test_column_backward_overlaps_its_collectives_with_the_gemms(compared):
    """Megatron's order: without sequence parallelism the input gradient's all-reduce starts before the weight
    gradient's product and is waited for after it; with it, the input's re-gather runs beside the input gradient's
    product and that gradient's reduce-scatter beside the weight gradient's."""
    for rank in (0, 1):
        assert compared[("order", False, rank)] == ["mm", "start all_reduce", "mm", "wait all_reduce"]
        assert compared[("order", True, rank)] == [
            "start all_gather",
            "mm",
            "start reduce_scatter",
            "wait all_gather",
            "mm",
            "wait reduce_scatter",
        ]
