"""The loss of a large-vocabulary head with and without its full logits (strategy.loss_chunk): forward + backward of
cross-entropy(hidden @ weight.T) for one micro-batch, the plain path (F.linear, then dspipe's lm_loss: the fp32
logits, log_softmax's output and their gradient, each tokens x V x 4 bytes) against dspipe's chunked cross-entropy
(dspipe.model.loss: one chunk of logits at a time) and, on CUDA with liger-kernel installed, liger's fused linear
cross-entropy (HeadLoss's GPU path). Prints the peak memory above the inputs and the time of each, side by side.

CPU: each variant runs in a fresh subprocess and its peak is the process's ru_maxrss high-water mark after the steps
less its resident bytes before them (the inputs allocated and touched); the default shape is a 32K-vocabulary head
at seq 2,048 (hidden 2,048, batch 1, fp32). CUDA: torch.cuda.max_memory_allocated above the inputs, bf16 by
default. Times are the best of --repeats steps after a warm-up. `--check` first compares every path's loss and
gradients (hidden, weight) with the plain path's, in fp32 and in the run's dtype.

    python benchmarks/chunked_loss.py [--device cpu|cuda] [--vocab 32768] [--hidden 2048] [--seq 2048]
                                      [--batch 1] [--chunk 256 1024] [--dtype fp32|bf16] [--repeats 3] [--check]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dspipe.model.gpt import lm_loss
from dspipe.model.loss import HeadLoss, chunked_cross_entropy, liger_available

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PLAIN = "plain (full logits)"


def inputs(*, tokens: int, hidden: int, vocab: int, dtype, device: str, seed: int = 0):
    """(hidden states (tokens, h), head weight (V, h), labels (tokens,)): leaves requiring grad, seeded."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) * 0.02).to(device, dtype).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    return x, w, y


def loss_of(variant: str):
    """(hidden, weight, labels) -> loss for 'plain', a chunk size ('1024': dspipe's chunked path) or 'liger:1024'
    (HeadLoss's CUDA path: liger's fused loss, its chunk at most 1,024 tokens where its rule allows)."""
    if variant == "plain":
        return lambda x, w, y: lm_loss(F.linear(x, w), y)
    if variant.startswith("liger:"):
        return HeadLoss(chunk=int(variant.split(":")[1]), use_liger=True)
    return lambda x, w, y: chunked_cross_entropy(x, w, y, chunk=int(variant))


def name_of(variant: str) -> str:
    if variant == "plain":
        return PLAIN
    if variant.startswith("liger:"):
        return f"liger, chunk <= {int(variant.split(':')[1]):,}"
    return f"chunked {int(variant):,} tokens"


def _step(fn, x, w, y) -> float:
    loss = fn(x, w, y)
    loss.backward()
    x.grad = w.grad = None
    return float(loss)


def _rss_now() -> int:
    """This process's resident bytes now (/proc/self/statm)."""
    import os

    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_cpu_child(a) -> dict:
    """In this (fresh) process: the high-water mark (ru_maxrss) over one warm-up and `repeats` timed steps less the
    resident bytes before them, and the best time (a shared machine's other work only slows a step down)."""
    x, w, y = inputs(tokens=a.batch * a.seq, hidden=a.hidden, vocab=a.vocab, dtype=DTYPES[a.dtype], device="cpu")
    fn = loss_of(a.child)
    before = _rss_now()  # the inputs allocated and touched
    loss = _step(fn, x, w, y)
    times = []
    for _ in range(a.repeats):
        start = time.perf_counter()
        _step(fn, x, w, y)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return dict(peak_bytes=peak, seconds=min(times), loss=loss)


def measure_cuda(variant: str, a) -> dict:
    x, w, y = inputs(tokens=a.batch * a.seq, hidden=a.hidden, vocab=a.vocab, dtype=DTYPES[a.dtype], device="cuda")
    fn = loss_of(variant)
    loss = _step(fn, x, w, y)  # warm-up (Triton compiles here)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(a.repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        _step(fn, x, w, y)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return dict(peak_bytes=torch.cuda.max_memory_allocated() - base, seconds=min(times), loss=loss)


def check(*, device: str, dtype, variants: list[str], tokens: int = 1000, hidden: int = 256, vocab: int = 32000):
    """Each variant's loss and gradients against the plain path's: (variant, loss rel, d hidden rel, d weight rel),
    relative to the largest magnitude."""
    x, w, y = inputs(tokens=tokens, hidden=hidden, vocab=vocab, dtype=dtype, device=device, seed=1)
    want_loss = lm_loss(F.linear(x, w), y)
    want = (want_loss, *torch.autograd.grad(want_loss, (x, w)))
    rows = []
    for variant in variants:
        loss = loss_of(variant)(x, w, y)
        got = (loss, *torch.autograd.grad(loss, (x, w)))
        rows.append(
            (
                variant,
                *(
                    ((g.double() - e.double()).abs().max() / e.double().abs().max()).item()
                    for g, e in zip(got, want, strict=True)
                ),
            )
        )
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--chunk", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--dtype", choices=tuple(DTYPES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--check", action="store_true", help="first compare losses and gradients with the plain path")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # a CPU variant's own process
    a = ap.parse_args(argv)
    a.dtype = a.dtype or ("bf16" if a.device == "cuda" else "fp32")
    if a.child:
        print(json.dumps(measure_cpu_child(a)))
        return
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("chunked_loss: --device cuda needs a CUDA device (torch.cuda.is_available() is False)")
    liger = a.device == "cuda" and liger_available()
    variants = ["plain", *map(str, a.chunk), *(f"liger:{c}" for c in a.chunk if liger)]
    where = torch.cuda.get_device_name() if a.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"{where}, torch {torch.__version__}, {a.dtype}, tokens {a.batch} x {a.seq}, hidden {a.hidden}, "
        f"vocab {a.vocab:,}; liger {'in use' if liger else 'not installed or no CUDA'}"
    )
    if a.check:
        for dtype in dict.fromkeys((torch.float32, DTYPES[a.dtype])):
            for variant, *rel in check(device=a.device, dtype=dtype, variants=variants[1:]):
                print(
                    f"check {str(dtype).replace('torch.', '')} {name_of(variant):24s} vs plain: "
                    f"loss rel {rel[0]:.1e}, d hidden rel {rel[1]:.1e}, d weight rel {rel[2]:.1e}"
                )
    rows = []
    for variant in variants:
        if a.device == "cuda":
            r = measure_cuda(variant, a)
        else:
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--child",
                variant,
                "--device",
                "cpu",
                *(f"--{k}={getattr(a, k)}" for k in ("vocab", "hidden", "seq", "batch", "dtype", "repeats")),
            ]
            r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        rows.append((name_of(variant), r))
    logits = a.batch * a.seq * a.vocab * 4
    print(f"fp32 logits of the micro-batch: {logits / 2**20:,.0f} MiB")
    plain_peak, plain_s = max(rows[0][1]["peak_bytes"], 1), rows[0][1]["seconds"]
    for name, r in rows:
        print(
            f"{name:24s} peak {r['peak_bytes'] / 2**20:8,.0f} MiB ({r['peak_bytes'] / plain_peak:5.2f}x)  "
            f"{r['seconds'] * 1e3:9,.0f} ms ({r['seconds'] / plain_s:4.2f}x)  loss {r['loss']:.6f}"
        )


if __name__ == "__main__":
    main()
