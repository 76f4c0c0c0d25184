"""The rank entry point DeepSpeed's launcher starts (from any directory, the package installed or not):

    deepspeed --num_gpus N --module dspipe.runtime.entry --run runs/NAME [--resume auto|TAG|PATH | --restart]
"""
from dspipe.runtime.comm import exit_rank
from dspipe.runtime.loop import main


def run_rank() -> None:
    exit_rank(main())


if __name__ == "__main__":
    run_rank()
