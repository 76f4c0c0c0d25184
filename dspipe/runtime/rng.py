"""Each rank's RNG streams (python, numpy, torch, cuda) in a checkpoint's rng-rankR.pt: saved, restored, or derived
anew when the layout changed. torch is imported inside the functions."""

from __future__ import annotations

from pathlib import Path

from dspipe.runtime.ckpt_meta import CheckpointMeta
from dspipe.runtime.safeload import load as safe_load


def rng_state() -> dict:
    import random

    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import random

    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def restore_rng(
    path: Path, *, meta: CheckpointMeta, seed: int, rank: int, world: int, same_layout: bool = True, tp: int = 1
) -> None:
    """This rank's saved RNG streams at the same world size and layout; under another one the saved per-rank
    streams mean nothing, so each rank starts new ones derived from (seed, step, the index of its tensor-parallel
    group in the layout's rank order): tensor-parallel peers
    share one stream, as at the start of a run (dspipe.runtime.loop), so that their dropout on the replicated
    activations agrees."""
    import random

    import numpy as np
    import torch

    rng = Path(path) / f"rng-rank{rank}.pt"
    if meta.world_size == world and same_layout and rng.is_file():
        set_rng_state(safe_load(rng))  # checked by resume_point (ckptfiles.check_rng_state)
        return
    group, _ = divmod(rank, tp)  # the layout's rank order: tensor fastest (dspipe.spec.layout)
    derived = (seed * 1_000_003 + meta.step * 4099 + group) % 2**31
    random.seed(derived)
    np.random.seed(derived)
    torch.manual_seed(derived)
