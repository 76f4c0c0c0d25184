"""Sliding-window attention on a GPU: what dspipe's windowed blocks cost today (scaled_dot_product_attention with a
boolean (s, s) mask, which rules out the flash kernel) against the plain causal kernel and, where torch has it,
flex_attention with a sliding-window block mask. Prints forward + backward time and the peak memory above the
inputs for each, at bf16, one sequence of 32 heads x 128.

    python benchmarks/window_attention.py [--seq 4096 8192] [--window 4096]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from dspipe.model.gpt import window_mask


def measure(fn, q, k, v, *, repeats: int = 10) -> tuple[float, int]:
    """Median seconds of forward + backward, and the peak bytes allocated above the inputs."""
    for _ in range(3):
        fn(q, k, v).sum().backward()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn(q, k, v).sum().backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2], torch.cuda.max_memory_allocated() - base


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    a = ap.parse_args()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, heads {a.heads} x {a.head_dim}")
    for s in a.seq:
        shape = (1, a.heads, s, a.head_dim)
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        w = min(a.window, s - 1)
        mask = window_mask(s, w, device="cuda")
        sides = {"causal (flash)": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                 f"window {w}, bool mask (dspipe)":
                     lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)}
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            block = create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (qi - ki < w), None, None, s, s,
                                      device="cuda")
            flex = torch.compile(flex_attention)
            sides[f"window {w}, flex_attention"] = lambda q, k, v: flex(q, k, v, block_mask=block)
        except Exception as e:  # noqa: BLE001  (reported, not hidden)
            print(f"flex_attention unavailable: {type(e).__name__}: {e}")
        ref = None
        for name, fn in sides.items():
            try:
                out = fn(q, k, v).float()
                if ref is None and "window" in name:
                    ref = out
                diff = "" if ref is None or out is ref else f", max |diff| vs mask {(out - ref).abs().max().item():.2e}"
                sec, peak = measure(fn, q, k, v)
                print(f"seq {s:6d}  {name:34s} fwd+bwd {sec * 1e3:8.2f} ms  peak +{peak / 2**20:8.1f} MiB{diff}")
            except Exception as e:  # noqa: BLE001
                print(f"seq {s:6d}  {name:34s} failed: {type(e).__name__}: {str(e)[:200]}")
        print(f"seq {s:6d}  mask tensor: {mask.numel() * mask.element_size() / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
