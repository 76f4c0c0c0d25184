"""Entry point for DeepSpeed's launcher: deepspeed [--num_gpus N | --hostfile F] run.py --run runs/NAME"""
from dspipe.comm import exit_rank
from dspipe.train import main

if __name__ == "__main__":
    exit_rank(main())
