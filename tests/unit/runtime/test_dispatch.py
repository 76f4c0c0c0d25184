"""dspipe.runtime.dispatch. On 2 gloo ranks (spawned in one test): the dropless dispatch at ep 2 gives each rank's
tokens the output, the input gradients and (summed over the ranks that sent rows) the expert gradients of ep 1 run
over all experts, for k = 1, 2, 3; with skewed routing: one rank sends the other no rows, an expert no token chose
(its weights get a zero gradient, not none), and a rank that routes every token to its own experts. In one process:
a capacity keeps each expert's first C routes in token order and drops the rest (counted); the model's own SparseMLP
dispatched (DispatchedSparseMLP) computes the plain loop's output bitwise, and counts the drops of its training
forwards only."""

import pytest

torch = pytest.importorskip("torch")

from tests.helpers import free_port  # noqa: E402

E, H, TOKENS = 4, 8, 12


def _experts():
    torch.manual_seed(0)
    return torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(H, 16), torch.nn.GELU(), torch.nn.Linear(16, H)) for _ in range(E)
    )


def _routes(case: str, rank: int, k: int):
    gen = torch.Generator().manual_seed(10 * rank + k)
    x = torch.randn(TOKENS, H, generator=gen)
    weights = torch.rand(TOKENS, k, generator=gen)
    if case == "spread":
        chosen = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(TOKENS)])
    elif case == "skewed":  # expert 3 never chosen; rank 1 sends rank 0's experts 0-1 nothing
        pool = torch.tensor([0, 1, 2]) if rank == 0 else torch.tensor([2, 2, 2])
        chosen = torch.stack([pool[torch.randperm(3, generator=gen)[:k]] for _ in range(TOKENS)])
        if rank == 1:
            chosen = torch.full((TOKENS, k), 2) if k == 1 else chosen
    else:
        raise ValueError(case)
    return x, chosen, weights


def _rank(rank: int, port: int, out):
    import os

    import torch.distributed as dist

    from dspipe.runtime.dispatch import dispatch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    for case in ("spread", "skewed"):
        for k in (1, 2, 3):
            if case == "skewed" and k == 3:  # rank 1 has 3 experts to choose from, all of them 2: k = 1 and 2 only
                continue
            whole = _experts()
            grads = [torch.zeros_like(p) for p in whole.parameters()]
            reference = {}
            for r in (0, 1):  # ep 1 over all experts, each rank's tokens in turn
                x, chosen, weights = _routes(case, r, k)
                x = x.clone().requires_grad_()
                y, _ = dispatch(x, chosen=chosen, weights=weights, experts=whole, num_experts=E, ep=1)
                g = torch.autograd.grad((y * y).sum(), [x, *whole.parameters()])
                reference[r] = (y.detach(), g[0])
                grads = [a + b for a, b in zip(grads, g[1:], strict=True)]
            local = _experts()[2 * rank : 2 * rank + 2]
            x, chosen, weights = _routes(case, rank, k)
            x = x.clone().requires_grad_()
            y, _ = dispatch(
                x, chosen=chosen, weights=weights, experts=local, num_experts=E, ep=2, group=dist.group.WORLD
            )
            (y * y).sum().backward()
            mine = grads[8 * rank : 8 * rank + 8]  # 4 tensors per expert
            out[(case, k, rank)] = dict(
                out=(y.detach() - reference[rank][0]).abs().max().item(),
                x_grad=(x.grad - reference[rank][1]).abs().max().item(),
                expert_grad=max((p.grad - g).abs().max().item() for p, g in zip(local.parameters(), mine, strict=True)),
                every_grad=all(p.grad is not None for p in local.parameters()),
                unchosen_zero=rank == 0 or case != "skewed" or not local[1][0].weight.grad.any(),
            )
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def compared():
    import torch.multiprocessing as mp

    out = mp.Manager().dict()
    mp.spawn(_rank, args=(free_port(), out), nprocs=2)
    return dict(out)


@pytest.mark.parametrize("case,k", [("spread", 1), ("spread", 2), ("spread", 3), ("skewed", 1), ("skewed", 2)])
def test_ep2_equals_ep1(compared, case, k):
    for rank in (0, 1):
        r = compared[(case, k, rank)]
        assert r["out"] < 1e-6 and r["x_grad"] < 1e-5 and r["expert_grad"] < 1e-5, (rank, r)
        assert r["every_grad"] and r["unchosen_zero"], (rank, r)


def _loop(x, chosen, weights, experts, *, keep=None):
    """The plain per-expert loop, over the routes `keep` allows (all by default)."""
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        token, slot = (chosen == e).nonzero(as_tuple=True)
        if keep is not None:
            token, slot = token[: keep[e]], slot[: keep[e]]
        out.index_add_(0, token, expert(x.index_select(0, token)) * weights[token, slot, None])
    return out


def test_a_capacity_keeps_each_experts_first_routes_in_token_order():
    from dspipe.runtime.dispatch import dispatch
    from dspipe.runtime.experts import capacity_slots

    experts = _experts()
    gen = torch.Generator().manual_seed(3)
    x, weights = torch.randn(TOKENS, H, generator=gen), torch.rand(TOKENS, 2, generator=gen)
    chosen = torch.stack([torch.tensor([0, 1]) if t % 3 else torch.tensor([2, 0]) for t in range(TOKENS)])
    capacity = capacity_slots(tokens=TOKENS, experts=E, k=2, factor=0.5)
    assert capacity == 3  # ceil(12 / 4 x 0.5 x 2)
    out, dropped = dispatch(x, chosen=chosen, weights=weights, experts=experts, num_experts=E, capacity=capacity)
    counts = torch.bincount(chosen.reshape(-1), minlength=E)  # 12, 8, 4, 0 routes
    assert dropped == int((counts - counts.clamp(max=capacity)).sum()) == 9 + 5 + 1
    with torch.no_grad():
        want = _loop(x, chosen, weights, experts, keep=[capacity] * E)
        assert torch.equal(out.detach(), want)
        assert not torch.equal(want, _loop(x, chosen, weights, experts))  # the drops changed the output
    full, none = dispatch(x, chosen=chosen, weights=weights, experts=experts, num_experts=E, capacity=None)
    assert none == 0 and torch.equal(full.detach(), _loop(x, chosen, weights, experts).detach())


def test_the_models_own_sparse_mlp_dispatched_is_the_loop():
    import copy

    from dspipe.model.gpt import SparseMLP
    from dspipe.runtime.dispatch import DispatchedSparseMLP
    from dspipe.spec.presets import model_preset

    spec = model_preset("tiny-llama", hidden=32, heads=4, kv_heads=4, experts=4, experts_per_token=3, expert_ffn=24)
    torch.manual_seed(0)
    plain = SparseMLP(spec)
    mine = DispatchedSparseMLP.adopt(copy.deepcopy(plain), capacity_factor=None)
    capped = DispatchedSparseMLP.adopt(copy.deepcopy(plain), capacity_factor=0.5)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    a, b = plain(x), mine(x)
    assert torch.equal(a, b) and torch.equal(plain.aux, mine.aux)
    a.square().sum().backward()
    b.square().sum().backward()
    for p, q in zip(plain.parameters(), mine.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    capped.eval()
    capped(x)
    assert capped.dropped == 0  # eval forwards count no drops
    capped.train()
    capped(x)
    assert capped.dropped > 0
