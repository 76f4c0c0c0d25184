"""Measurements of live models for the planner-accuracy benchmarks and their tests: tensors.py counts the model states
a DeepSpeed engine holds, activations.py the bytes autograd keeps for backward."""
