"""Entry point for DeepSpeed's launcher: deepspeed [--num_gpus N | --hostfile F] run.py --run runs/NAME"""
import sys

from dspipe.train import main

if __name__ == "__main__":
    sys.exit(main())
