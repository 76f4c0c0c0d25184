"""The models in plain PyTorch (no parallelism) and the pipeline wrapper that partitions them into stages."""
