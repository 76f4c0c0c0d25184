"""Launch with deepspeed: for each run dir, build its engine, train 2 steps and write each rank's tensor census to
--out-dir/NAME/rankN.json (NAME: the run dir's name). Several run dirs share one launch (one engine after another;
what the earlier engines left alive is excluded from the later censuses).

    deepspeed --num_gpus 2 benchmarks/measure_memory.py --run runs/X [runs/Y ...] --out-dir /tmp/census

Each rank's JSON: 'steady' (the census after the second step: what the rank holds between steps), 'peak' (the census
with the largest device total among the probes of the second step), 'peak_at' (that probe), 'host_peak' (the host
census with the largest total among the probes), 'gathered_peak' / 'gathered_at' (the most ZeRO-3 gathered parameter
bytes any probe saw, and where), 'trace' (every probe of the second step in order, with its device bytes by
category), 'stage' (pipeline stage). Probes: under ZeRO-3, before every parameterised module's
forward (after DeepSpeed's own pre-forward hook: the gathered and prefetched parameters are live); when each
module's first parameter gradient is produced in backward; on entering the optimizer wrapper's step (all gradients
reduced); on entering and leaving the base optimizer's step (the fp32 gradients built for it are live).
"""

import argparse
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.census.tensors import CATEGORIES, tensor_census  # noqa: E402
from dspipe.rundir import load_run  # noqa: E402
from dspipe.runtime.comm import exit_rank, process_group  # noqa: E402
from dspipe.runtime.engine import build_engine  # noqa: E402


def random_batches(*, vocab: int, seq_len: int, micro_batch: int, seed: int):
    """Random token batches: the census measures model states, which do not depend on the text."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        ids = torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=gen)
        yield ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


class Probes:
    """Census at instrumented points of a step while armed; keeps the largest device and host totals."""

    def __init__(self, engine, *, exclude: tuple):
        self.engine, self.exclude, self.armed = engine, exclude, False
        self.peak, self.peak_at, self.host_peak = None, None, None
        self.gathered, self.gathered_at = 0, None
        self.trace = []  # (probe, device bytes by category) at every probe: where the working set grows
        self.handles = []
        zero3 = any(hasattr(p, "ds_tensor") for p in engine.module.parameters())
        for name, module in engine.module.named_modules():
            params = list(module.parameters(recurse=False))
            if not params:
                continue
            if zero3:  # below ZeRO-3 the forward changes no model state
                self.handles.append(module.register_forward_pre_hook(lambda m, a, name=name: self.probe(f"fwd {name}")))
            p = params[0]  # one probe per module in backward: its first parameter's gradient is being produced
            if p.requires_grad:
                self.handles.append(p.register_hook(lambda g, name=name: self.probe(f"bwd {name}", g)))
        self._wrap(engine.optimizer, "step enter", exit_label=None)
        if engine.basic_optimizer is not engine.optimizer:
            self._wrap(engine.basic_optimizer, "adam enter", exit_label="adam exit")

    def _wrap(self, optimizer, label, *, exit_label):
        inner = optimizer.step

        def step(*args, **kwargs):
            self.probe(label)
            out = inner(*args, **kwargs)
            if exit_label:
                self.probe(exit_label)
            return out

        optimizer.step = step

    def probe(self, label, grad=None):
        if not self.armed:
            return None
        census = tensor_census(
            self.engine, exclude=self.exclude, grads=(grad,) if grad is not None else (), collect=False
        )
        self.trace.append((label, {k: census[k] for k in (*CATEGORIES, "total")}))
        if self.peak is None or census["total"] > self.peak["total"]:
            self.peak, self.peak_at = census, label
        if census["gathered"] > self.gathered:
            self.gathered, self.gathered_at = census["gathered"], label
        if self.host_peak is None or census["host"]["total"] > self.host_peak["total"]:
            self.host_peak = census["host"]
        return None

    def remove(self):
        for h in self.handles:
            h.remove()


def measure_run(run_dir: str, out_dir: Path) -> None:
    gc.collect()
    before = tuple(o for o in gc.get_objects() if isinstance(o, torch.Tensor))  # left by earlier engines
    run = load_run(run_dir)
    eng = build_engine(run)
    engine, plan = eng.engine, run.plan
    batches = random_batches(
        vocab=run.model.vocab, seq_len=run.model.seq_len, micro_batch=plan.micro_batch, seed=eng.dp_rank
    )  # tensor/sequence-parallel peers read the same batches
    probes = Probes(engine, exclude=before)
    eng.train_step(batches)
    probes.armed = True
    eng.train_step(batches)
    probes.armed = False
    probes.remove()
    steady = tensor_census(engine, exclude=before)
    record = {
        "steady": steady,
        "peak": probes.peak,
        "peak_at": probes.peak_at,
        "host_peak": probes.host_peak,
        "gathered_peak": probes.gathered,
        "gathered_at": probes.gathered_at,
        "trace": probes.trace,
        "stage": engine.stage_id if hasattr(engine, "stage_id") else 0,
    }
    out = out_dir / Path(run_dir).name
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    dist.barrier()
    if hasattr(engine, "destroy"):
        engine.destroy()
    del eng, engine, probes, steady, before


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--run", required=True, nargs="+")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    gc.collect()
    gc.freeze()  # what the imports left: never engine state, and no census (gc.get_objects) walks it again
    with process_group():
        for run_dir in args.run:
            measure_run(run_dir, Path(args.out_dir))


if __name__ == "__main__":
    main()
    exit_rank(0)
