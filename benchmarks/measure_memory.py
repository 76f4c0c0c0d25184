"""Launch with deepspeed: train a run dir for 2 steps, then write each rank's tensor census to --out-dir/rankN.json.

    deepspeed --num_gpus 2 benchmarks/measure_memory.py --run runs/X --out-dir /tmp/census
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dspipe.runtime.census import tensor_census  # noqa: E402
from dspipe.runtime.comm import exit_rank, process_group  # noqa: E402
from dspipe.rundir import load_run  # noqa: E402
from dspipe.runtime.engine import build_engine  # noqa: E402


def random_batches(*, vocab: int, seq_len: int, micro_batch: int, seed: int):
    """Random token batches: the census measures model states, which do not depend on the text."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        ids = torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=gen)
        yield ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--run", required=True)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    run = load_run(args.run)
    with process_group():
        eng = build_engine(run)
        engine, plan = eng.engine, run.plan
        batches = random_batches(vocab=run.model.vocab, seq_len=run.model.seq_len, micro_batch=plan.micro_batch,
                                 seed=eng.dp_rank)  # tensor/sequence-parallel peers read the same batches
        for _ in range(2):
            eng.train_step(batches)
        census = tensor_census(engine)
        census["stage"] = engine.stage_id if hasattr(engine, "stage_id") else 0
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(census))


if __name__ == "__main__":
    main()
    exit_rank(0)
