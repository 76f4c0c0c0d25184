"""What runs on every rank: the engine, the training loop, evaluation, checkpoints, logs, process groups."""
