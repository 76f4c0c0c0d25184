"""Count the bytes a live DeepSpeed engine holds, by walking every tensor reachable from Python.

Method: gc.get_objects() finds every live torch.Tensor (parameters, their .grad, optimizer state, DeepSpeed's
flat buffers and partitions); tensors are deduplicated by their storage's data pointer, so views into one flat
buffer count once, at the storage's full size. Each storage goes to the first category that claims it:
params (module parameters, ZeRO-3 partitions ds_tensor), grads (.grad of module parameters, fp32 gradients of
the master partitions, the bf16 optimizer's fp32 accumulation buffer), optimizer (fp32 master partitions and
every tensor in the base optimizer's state), buffers (everything else DeepSpeed holds: reduce buckets, flat
gradient partitions, pipeline buffers).
"""
from __future__ import annotations

import gc

import torch


def _storage(t: torch.Tensor):
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def tensor_census(engine, *, exclude: tuple[torch.Tensor, ...] = ()) -> dict[str, int]:
    gc.collect()
    claimed: dict[int, str] = {}
    sizes: dict[int, int] = {}

    def claim(t, category):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            ptr, n = _storage(t)
            if ptr and n and ptr not in claimed:
                claimed[ptr], sizes[ptr] = category, n

    for t in exclude:
        claim(t, "excluded")
    module_params = list(engine.module.parameters())
    for p in module_params:
        claim(p.data, "params")
        if hasattr(p, "ds_tensor"):
            claim(p.ds_tensor, "params")
    for p in module_params:
        claim(p.grad, "grads")
    base, wrapper = engine.basic_optimizer, engine.optimizer
    masters = [p for group in base.param_groups for p in group["params"]]
    masters += list(getattr(wrapper, "fp32_partitioned_groups_flat", []))  # ZeRO-3 keeps them out of param_groups
    for p in masters:
        claim(p.grad, "grads")
    for t in getattr(wrapper, "fp32_groups_gradients_flat", []):  # BF16_Optimizer's fp32 accumulation buffer
        claim(t, "grads")
    claim(getattr(wrapper, "grad_partitions_flat_buffer", None), "grads")  # ZeRO-3's fp32 gradient partitions
    for p in masters:
        claim(p.data, "optimizer")
    for p, state in base.state.items():
        claim(p, "optimizer")
        for v in state.values():
            claim(v, "optimizer")
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor):
                claim(obj, "buffers")
        except ReferenceError:
            continue
    totals = {"params": 0, "grads": 0, "optimizer": 0, "buffers": 0}
    for ptr, category in claimed.items():
        if category != "excluded":
            totals[category] += sizes[ptr]
    totals["total"] = sum(totals.values())
    return totals
