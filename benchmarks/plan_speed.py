"""How long `dspipe plan`'s search takes over 1024 GPUs with the tensor-, sequence- and expert-parallel dimensions.

    python benchmarks/plan_speed.py [--repeat N]

Prints, per case, the wall time of one whole search (cold: the stage-partition cache cleared first; best and median
of N), the candidates estimated, and the chosen plan. Goal: under 2 s per search on the 2-core CI machine.
A benchmark that prints figures, not a test.
"""

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dspipe.planner.enumerate import ep_choices, sp_choices, tp_choices  # noqa: E402
from dspipe.planner.search import search  # noqa: E402
from dspipe.spec.cluster import ClusterSpec  # noqa: E402
from dspipe.spec.core import StrategyRequest  # noqa: E402
from dspipe.spec.presets import MODEL_PRESETS, model_preset  # noqa: E402
from dspipe.spec.train import TrainSpec  # noqa: E402

CASES = (
    # (label, model, cluster, global batch, training tokens)
    (
        "gpt3-175b, 128 x 8 a100-80g, batch 1536",
        MODEL_PRESETS["gpt3-175b"],
        ClusterSpec(128, 8, "a100-80g"),
        1536,
        1.5e12,
    ),
    (
        "gpt3-6.7b at 32k tokens, 128 x 8 h100-80g, batch 512",
        model_preset("gpt3-6.7b", seq_len=32768),
        ClusterSpec(128, 8, "h100-80g"),
        512,
        1e12,
    ),
    (
        "qwen3-235b-a22b (MoE, 128 experts), 128 x 8 h100-80g, batch 2048",
        MODEL_PRESETS["qwen3-235b-a22b"],
        ClusterSpec(128, 8, "h100-80g"),
        2048,
        1e12,
    ),
)


def planner_caches() -> list:
    """Every lru_cache of the planner's modules (and the spec's): a cold search clears them all."""
    import importlib
    import pkgutil

    import dspipe.planner

    names = [f"dspipe.planner.{m.name}" for m in pkgutil.iter_modules(dspipe.planner.__path__)] + ["dspipe.spec.model"]
    found = {}
    for name in names:
        module = importlib.import_module(name)
        for value in vars(module).values():
            if callable(getattr(value, "cache_clear", None)):
                found[id(value)] = value
    return list(found.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="searches per case (default 5)")
    args = parser.parse_args()
    for label, model, cluster, gbs, tokens in CASES:
        train = TrainSpec(global_batch=gbs, micro_batch=1, steps=1000, warmup_steps=10)
        times = []
        for _ in range(args.repeat):
            for cached in planner_caches():
                cached.cache_clear()
            fresh = dataclasses.replace(model)  # a new instance: its cached counts computed again too
            start = time.perf_counter()
            result = search(model=fresh, cluster=cluster, train=train, request=StrategyRequest())
            times.append(time.perf_counter() - start)
        best = result.best
        e = best.est
        eps = f" x ep {ep_choices(model, cluster.world_size)} (at dp {cluster.world_size})" if model.experts else ""
        print(
            f"{label}: tp {tp_choices(model, cluster)} x sp {sp_choices(model, cluster)}{eps}; "
            f"{result.evaluated} candidates estimated (+ rule rejections) in {min(times):.3f} s best, "
            f"{statistics.median(times):.3f} s median of {args.repeat}"
        )
        print(
            f"    chosen: {best.describe(every_axis=True)}; "
            f"{e.memory.total / e.gpu_memory_bytes * 100:.0f}% of GPU memory, "
            f"bubble {e.bubble_s / e.step_time_s * 100:.0f}%, MFU {best.mfu * 100:.1f}%, "
            f"{tokens / best.tokens_per_s / 86400:.1f} days for {tokens:.3g} tokens"
        )


if __name__ == "__main__":
    main()
