"""`deepspeed [--num_gpus N | --hostfile F] run.py --run runs/NAME`: a shim for dspipe.runtime.entry."""
from dspipe.runtime.entry import run_rank
run_rank()
