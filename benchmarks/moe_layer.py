"""One sparse block's MLP, forward and backward, on the two layers dspipe trains a mixture of experts on, side by side
on the same shapes, weights and tokens: DeepSpeed's native MoE layer (ZeRO 0-2: dspipe.runtime.moe.NativeMoE, its
einsum dispatch into capacity-padded buffers) and the model's own SparseMLP (ZeRO-3: a loop over the experts on the
tokens routed to each). One process, a one-rank gloo group (ep 1), interleaved repeats, the median of each.

    python benchmarks/moe_layer.py [--hidden 256] [--experts 8] [--top-k 2] [--expert-ffn 512] [--tokens 2048]
                                   [--repeats 15] [--dtype fp32|bf16]

Prints each layer's median milliseconds and the ratio own / native, and the largest output difference between them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


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

    import copy

    import torch

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
    )
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    torch.manual_seed(0)
    own = SparseMLP(spec)
    native = NativeMoE(copy.deepcopy(own), spec=spec, ep=1, ep_rank=0)
    own, native = own.to(dtype), native.to(dtype)
    x = torch.randn(1, args.tokens, args.hidden, dtype=dtype)
    with torch.no_grad():
        difference = (own(x) - native(x)).abs().max().item()
    times: dict[str, list[float]] = {"own": [], "native": []}
    _time(own, x, repeats=2), _time(native, x, repeats=2)  # warm-up
    for _ in range(args.repeats):  # interleaved, so that the machine's other load falls on both
        times["own"] += _time(own, x, repeats=1)
        times["native"] += _time(native, x, repeats=1)
    own_ms, native_ms = (1e3 * statistics.median(times[k]) for k in ("own", "native"))
    print(
        f"MoE MLP forward+backward, {args.tokens} tokens, hidden {args.hidden}, {args.experts} experts of "
        f"{args.expert_ffn} top-{args.top_k}, {args.dtype}, {torch.get_num_threads()} thread(s), median of "
        f"{args.repeats}:"
    )
    print(f"  DeepSpeed's native MoE layer (ZeRO 0-2): {native_ms:8.2f} ms")
    print(f"  the model's own SparseMLP (ZeRO-3):      {own_ms:8.2f} ms")
    print(f"  own / native: {own_ms / native_ms:.3f}; largest output difference {difference:.3g}")


if __name__ == "__main__":
    main()
