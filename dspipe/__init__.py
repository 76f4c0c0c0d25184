"""dspipe: DeepSpeed GPT pretraining with a config generator."""

__version__ = "0.1.0"
