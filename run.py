"""`deepspeed [--num_gpus N | --hostfile F] run.py --run runs/NAME`: a shim for dspipe.runtime.entry."""

from dspipe.runtime.entry import run_rank

if __name__ == "__main__":  # the background checkpoint writer's process (spawned) imports this file too
    run_rank()
