"""The pipeline bubble of DeepSpeed 0.19.8's two training schedules, from their own instruction streams.

    python benchmarks/pipeline_schedules.py [--compute-s 51.6]

DeepSpeed ships two: `PipelineEngine`'s 1F1B (`TrainSchedule`, what dspipe runs and the planner prices: a bubble of
(p - 1) / m of the compute) and `DualPipeVEngine`'s DualPipeV (`DualPipeVSchedule`: each of the p ranks holds two
stages, the micro-batches go out through the first and come back through the second, rank 0 loads the data and
computes the loss). This replays DualPipeVSchedule's own instructions, rank by rank, with a forward of f/2 and a
backward of b/2 seconds per stage (a rank's micro-batch forward f and backward b, split in two), and each CommitP2P
done when every send and receive in it has met its peer's (DeepSpeed's batch_isend_irecv, waited). The bubble is the
slowest rank's idle time over its m x (f + b) of compute. No GPU, no process group: a replay, not a measurement.

Prints, per (p, m, b/f): 1F1B's bubble, DualPipeV's replayed, the closed form ((p - 1) b + (p - 2) f / 2) / (m (f + b))
it follows, and the micro-batches of activations a rank holds at its peak (1F1B's first stage: p). `--compute-s`
turns the fractions into seconds for one case (default: the Llama 3.1 405B plan's 51.6 s at p 16, m 128).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CASES = ((2, 4), (4, 8), (4, 16), (8, 32), (16, 32), (16, 64), (16, 128))


def replay(*, p: int, m: int, f: float, b: float) -> tuple[float, float]:
    """(makespan, peak micro-batches of activations held on any rank) of DualPipeVSchedule on p ranks, m
    micro-batches: a stage's forward f / 2, its backward b / 2 (the rank's two stages split its work evenly)."""
    from deepspeed.runtime.pipe import schedule as S

    streams = [
        [i for step in S.DualPipeVSchedule(micro_batches=m, stages=p, stage_id=r).steps() for i in step]
        for r in range(p)
    ]
    clock, at = [0.0] * p, [0] * p
    queued: list[list[tuple]] = [[] for _ in range(p)]
    posted: dict[tuple, dict[int, float]] = {}
    held, peak = [0] * p, 0
    while any(at[r] < len(streams[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while at[r] < len(streams[r]):
                ins = streams[r][at[r]]
                name = type(ins).__name__
                if name == "ForwardPass":
                    clock[r] += f / 2
                    held[r] += 1
                    peak = max(peak, held[r])
                elif name == "BackwardPass":
                    clock[r] += b / 2
                    held[r] -= 1
                elif name in _PEERS:
                    queued[r].append(_message(name, rank=r, phase=ins.phase, micro=ins.buffer_id % m))
                elif name == "CommitP2P" and queued[r]:
                    for key in queued[r]:
                        posted.setdefault(key, {})[r] = clock[r]
                    if any(len(posted[key]) < 2 for key in queued[r]):
                        break  # a peer has not reached its commit yet
                    clock[r] = max([clock[r]] + [max(posted[key].values()) for key in queued[r]])
                    queued[r] = []
                at[r] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"the replay stopped: ranks at instructions {at}")
    return max(clock), peak / 2  # two stage-halves make one micro-batch of a rank's activations


_PEERS = {  # instruction -> (kind, +1 if phase 0 sends towards the last rank)
    "SendActivation": ("activation", 1),
    "RecvActivation": ("activation", -1),
    "SendGrad": ("grad", -1),
    "RecvGrad": ("grad", 1),
}


def _message(name: str, *, rank: int, phase: int, micro: int) -> tuple:
    """(kind, phase, micro-batch, sender, receiver): the same key on both ends of one p2p message."""
    kind, towards = _PEERS[name]
    peer = rank + (towards if phase == 0 else -towards)
    sends = name.startswith("Send")
    return (kind, phase, micro, rank if sends else peer, peer if sends else rank)


def closed_form(*, p: int, m: int, f: float, b: float) -> float:
    """DualPipeV's bubble over the compute, its weight gradients kept in the backward (DeepSpeed's: no deferred W):
    ((p - 1) b + (p - 2) f / 2) / (m (f + b)). 1F1B's is (p - 1)(f + b) / (m (f + b))."""
    return ((p - 1) * b + (p - 2) * f / 2) / (m * (f + b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compute-s", type=float, default=51.6, help="a step's compute for the seconds line [51.6]")
    ap.add_argument("--pp", type=int, default=16, help="its pipeline ranks [16]")
    ap.add_argument("--micro-batches", type=int, default=128, help="its micro-batches per step [128]")
    a = ap.parse_args()
    print("bubble / compute (a rank's forward f, backward b per micro-batch)")
    heads = ("p", 3), ("m", 4), ("b/f", 4), ("1F1B", 7), ("DualPipeV", 10), ("closed form", 12)
    print(" ".join(f"{h:>{w}}" for h, w in heads), f"{'DualPipeV / 1F1B':>17} {'peak held':>10}")
    for p, m in CASES:
        for ratio in (2, 3):  # 3: the backward recomputes the forward
            makespan, peak = replay(p=p, m=m, f=1.0, b=float(ratio))
            work = m * (1 + ratio)
            dpv, one = makespan / work - 1, (p - 1) / m
            cf = closed_form(p=p, m=m, f=1.0, b=float(ratio))
            print(f"{p:>3} {m:>4} {ratio:>4} {one:>7.4f} {dpv:>10.4f} {cf:>12.4f} {dpv / one:>17.3f} {peak:>10.1f}")
    p, m = a.pp, a.micro_batches
    makespan, _ = replay(p=p, m=m, f=1.0, b=2.0)
    dpv = makespan / (3 * m) - 1
    print(
        f"\na step of {a.compute_s:g} s of compute at p {p}, m {m} (b = 2f): 1F1B's bubble "
        f"{a.compute_s * (p - 1) / m:.2f} s, DualPipeV's {a.compute_s * dpv:.2f} s"
    )


if __name__ == "__main__":
    main()
