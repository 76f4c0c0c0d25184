"""How long planning takes: GPT-3 175B over 128 nodes x 8 A100-80G, every candidate evaluated.

python benchmarks/bench_planner.py
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dspipe.planner.search import search  # noqa: E402
from dspipe.spec.cluster import ClusterSpec  # noqa: E402
from dspipe.spec.core import StrategyRequest  # noqa: E402
from dspipe.spec.presets import MODEL_PRESETS  # noqa: E402
from dspipe.spec.train import TrainSpec  # noqa: E402

for gbs in (1536, 2048):
    start = time.perf_counter()
    result = search(
        model=MODEL_PRESETS["gpt3-175b"],
        cluster=ClusterSpec(128, 8, "a100-80g"),
        train=TrainSpec(global_batch=gbs, micro_batch=1, steps=1000, warmup_steps=10),
        request=StrategyRequest(),
    )
    seconds = time.perf_counter() - start
    print(
        f"gpt3-175b, 1024 x a100-80g, global batch {gbs}: {result.evaluated} candidates estimated "
        f"(+ rule rejections) in {seconds:.3f} s; chosen: {result.best.describe()}"
    )
