"""One sparse block's MLP, forward and backward, three ways, side by side on the same shapes, weights and tokens:
DeepSpeed's MoE layer as DeepSpeed ships it (deepspeed.moe.layer.MoE: its top-k gate and einsum dispatch into
capacity-padded buffers, dropless: drop_tokens off, every expert padded to the busiest one's load), the same layer as
dspipe trains it (dspipe.runtime.moe.NativeMoE: DeepSpeed's layer holds the experts, dspipe.runtime.dispatch moves
the tokens), and the model's own SparseMLP (the plain loop over the experts on the tokens routed to each). One
process, a one-rank gloo group (ep 1), interleaved repeats, the median of each. The model renormalises its top-k
softmax weights (router_norm_topk) as DeepSpeed's gate does, so all three compute the same output.

    python benchmarks/moe_layer.py [--hidden 256] [--experts 8] [--top-k 2] [--expert-ffn 512] [--tokens 2048]
                                   [--repeats 15] [--dtype fp32|bf16]

Prints each layer's median milliseconds, the ratios dspipe / DeepSpeed's and dspipe / loop, and the largest output
difference from the loop's.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch


def _group() -> None:
    """A one-rank gloo process group with DeepSpeed's comm on it (the native layer builds its expert groups)."""
    import deepspeed
    import torch.distributed as dist

    from dspipe.cluster.ports import free_port

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())  # its own: an inherited one may be a live group's
    dist.init_process_group("gloo", rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)


def _time(layer, x, *, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        layer.zero_grad(set_to_none=True)
        start = time.perf_counter()
        layer(x).float().square().mean().backward()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-ffn", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args()

    from dspipe.model.gpt import SparseMLP
    from dspipe.runtime.moe import NativeMoE
    from dspipe.spec.presets import model_preset

    _group()
    spec = model_preset(
        "tiny-llama",
        hidden=args.hidden,
        heads=4,
        kv_heads=4,  # attention is not timed: any width the hidden divides
        experts=args.experts,
        experts_per_token=args.top_k,
        expert_ffn=args.expert_ffn,
        router_norm_topk=True,  # DeepSpeed's gate renormalises the top-k weights (k >= 2)
    )
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    torch.manual_seed(0)
    loop = SparseMLP(spec)
    dspipe = NativeMoE(copy.deepcopy(loop), spec=spec, ep=1, ep_rank=0)
    layers = {"deepspeed": _Shipped(loop, spec=spec), "dspipe": dspipe, "loop": loop}
    layers = {k: layer.to(dtype) for k, layer in layers.items()}
    x = torch.randn(1, args.tokens, args.hidden, dtype=dtype)
    with torch.no_grad():
        reference = layers["loop"](x)
        difference = {k: (layer(x) - reference).abs().max().item() for k, layer in layers.items()}
    times: dict[str, list[float]] = {k: [] for k in layers}
    for layer in layers.values():
        _time(layer, x, repeats=2)  # warm-up
    for _ in range(args.repeats):  # interleaved, so that the machine's other load falls on all three
        for k, layer in layers.items():
            times[k] += _time(layer, x, repeats=1)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    print(
        f"MoE MLP forward+backward, {args.tokens} tokens, hidden {args.hidden}, {args.experts} experts of "
        f"{args.expert_ffn} top-{args.top_k}, {args.dtype}, {torch.get_num_threads()} thread(s), median of "
        f"{args.repeats}:"
    )
    print(f"  DeepSpeed's MoE layer as shipped (einsum dispatch): {ms['deepspeed']:8.2f} ms")
    print(f"  DeepSpeed's MoE layer, dspipe's dispatch:           {ms['dspipe']:8.2f} ms")
    print(f"  the model's own SparseMLP (the loop):               {ms['loop']:8.2f} ms")
    print(
        f"  dspipe / deepspeed: {ms['dspipe'] / ms['deepspeed']:.3f}; dspipe / loop: {ms['dspipe'] / ms['loop']:.3f}; "
        f"largest output difference from the loop: deepspeed {difference['deepspeed']:.3g}, "
        f"dspipe {difference['dspipe']:.3g}"
    )


class _Shipped(torch.nn.Module):
    """deepspeed.moe.layer.MoE as DeepSpeed ships it (its gate, its einsum dispatch), with the SparseMLP's router and
    experts' weights; called like the others (its output only)."""

    def __init__(self, sparse, *, spec):
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.moe = MoE(
            spec.hidden,
            expert=copy.deepcopy(sparse.experts[0]),
            num_experts=spec.experts,
            ep_size=1,
            k=spec.experts_per_token,
            min_capacity=0,
            drop_tokens=False,
            use_rts=False,
            top2_2nd_expert_sampling=False,
        )
        with torch.no_grad():
            self.moe.deepspeed_moe.gate.wg.weight.copy_(sparse.router.weight)
            for mine, theirs in zip(self.moe.deepspeed_moe.experts.deepspeed_experts, sparse.experts, strict=True):
                for a, b in zip(mine.parameters(), theirs.parameters(), strict=True):
                    a.copy_(b)

    def forward(self, x):
        return self.moe(x)[0]


if __name__ == "__main__":
    main()
