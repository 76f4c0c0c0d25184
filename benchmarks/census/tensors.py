"""Count the bytes a live DeepSpeed engine holds, by walking every tensor reachable from Python.

Method: gc.get_objects() finds every live torch.Tensor (parameters, their .grad, optimizer state, DeepSpeed's
flat buffers and partitions); tensors are deduplicated by their storage's data pointer, so views into one flat
buffer count once, at the storage's full size. Each storage goes to the first category that claims it:
params (module parameters, ZeRO-3 partitions ds_tensor), gathered (ZeRO-3 parameters all-gathered to full size:
ds_status AVAILABLE and not persistent, their param.data), grads (.grad of module parameters, fp32 gradients of
the master partitions, the bf16 optimizer's fp32 accumulation buffer, ZeRO-3's fp32 gradient partitions), optimizer
(fp32 master partitions and every tensor in the base optimizer's state), buffers (everything else DeepSpeed holds:
reduce buckets, flat gradient partitions, pipeline buffers, the offload staging buffers).

Activations are not model states: a tensor with a grad_fn (the output of a differentiable op: activations, logits,
the loss) is skipped, so a census taken inside a step counts model states only (this census measures
what the planner's Memory.params/grads/optimizer/buffers predict).

Device or host. On a GPU DeepSpeed places the offloaded state on the host; on this CPU-only build every tensor is
'cpu', so a storage is classified by what DeepSpeed allocates on its offload device (DeepSpeed 0.19.8):
  - optimizer offload, ZeRO-1/2 (stage_1_and_2.cpu_offload): the fp32 master partitions and their fp32 gradient
    partitions (single_partition_of_fp32_groups and .grad), the 16-bit copies of the partitions
    (param_buffer_of_bit16_for_cpu_offload_groups), the host gradient staging buffer (temp_grad_buffer_for_cpu_offload,
    largest parameter), the per-parameter host accumulation buffers (accumulated_grads_in_cpu), the Adam state;
  - optimizer offload, ZeRO-3 (stage3.offload_optimizer): the fp32 master partitions and their gradients
    (fp32_partitioned_groups_flat and .grad), the fp32 gradient partitions (grad_partitions_flat_buffer, allocated on
    the offload device), the Adam state;
  - parameter offload, ZeRO-3 (offload_param): the 16-bit partitions (ds_tensor) and their flat host buffers
    (param_groups_fp16_flat_cpu_memory).
Everything else is on the device (the accelerator), including the device-side gradient staging buffer of ZeRO-1/2
offload (temp_grad_buffer_for_gpu_offload, largest parameter) and gathered ZeRO-3 parameters.
"""

from __future__ import annotations

import gc

import torch

CATEGORIES = ("params", "gathered", "grads", "optimizer", "buffers")


def _storage(t: torch.Tensor):
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _tensors(x):
    """Tensors in x: a tensor, or a list/tuple/dict of them (one level)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        return [t for t in x if isinstance(t, torch.Tensor)]
    return []


def host_tensors(engine) -> list[torch.Tensor]:
    """Tensors DeepSpeed allocates on the offload device (the module docstring's rule); [] without offload."""
    wrapper, base = engine.optimizer, engine.basic_optimizer
    out: list[torch.Tensor] = []
    offload_optimizer = bool(getattr(wrapper, "cpu_offload", False) or getattr(wrapper, "offload_optimizer", False))
    if offload_optimizer:
        for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
            for t in getattr(wrapper, name, None) or []:
                out += [t, t.grad] if t.grad is not None else [t]
        for name in (
            "param_buffer_of_bit16_for_cpu_offload_groups",
            "temp_grad_buffer_for_cpu_offload",
            "accumulated_grads_in_cpu",
            "grad_partitions_flat_buffer",
        ):
            out += _tensors(getattr(wrapper, name, None))
        for p, state in base.state.items():
            out += [p, *_tensors(state)]
    if getattr(wrapper, "offload_param", False) or getattr(wrapper, "params_in_nvme_and_cpu", False):
        out += _tensors(getattr(wrapper, "param_groups_fp16_flat_cpu_memory", None))
        out += [p.ds_tensor for p in engine.module.parameters() if hasattr(p, "ds_tensor")]
    return out


def _named_storages(engine) -> dict[int, str]:
    """Storage pointer -> the engine or optimizer attribute holding it (one level into lists, tuples and dicts),
    to name the tensors that land in 'buffers'."""
    names: dict[int, str] = {}
    for owner, obj in (("engine", engine), ("optimizer", engine.optimizer)):
        for attr, value in list(vars(obj).items()):
            items = (
                value.items()
                if isinstance(value, dict)
                else enumerate(value)
                if isinstance(value, (list, tuple))
                else [(None, value)]
            )
            for _, t in items:
                for x in _tensors(t) + _tensors(getattr(t, "buffer", None)):  # ZeRO's IPG buckets keep .buffer
                    names.setdefault(_storage(x)[0], f"{owner}.{attr}")
    return names


def tensor_census(
    engine, *, exclude: tuple[torch.Tensor, ...] = (), grads: tuple[torch.Tensor, ...] = (), collect: bool = True
) -> dict:
    """Bytes by category on the device (top-level keys, 'total') and on the host ('host': the same keys).
    exclude: tensors not to count (what was alive before the engine was built); grads: gradients being produced
    (a backward hook's argument), counted as grads; collect: run the cycle collector first (a census inside a step
    skips it: it is the slow part, and what a step frees it frees by reference count)."""
    if collect:
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
    host = {_storage(t)[0] for t in host_tensors(engine) if t.device.type != "meta"}
    module_params = list(engine.module.parameters())
    for p in module_params:
        gathered = (
            hasattr(p, "ds_tensor")
            and not getattr(p, "ds_persist", False)
            and getattr(p.ds_status, "name", "") in ("AVAILABLE", "INFLIGHT")
        )
        claim(p.data, "gathered" if gathered else "params")
        if hasattr(p, "ds_tensor"):
            claim(p.ds_tensor, "params")
    for p in module_params:
        claim(p.grad, "grads")
    for g in grads:
        claim(g, "grads")
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
            if isinstance(obj, torch.Tensor) and obj.grad_fn is None:  # grad_fn: an activation, not a model state
                claim(obj, "buffers")
        except (ReferenceError, RuntimeError):
            continue
    device = dict.fromkeys(CATEGORIES, 0)
    on_host = dict.fromkeys(CATEGORIES, 0)
    for ptr, category in claimed.items():
        if category != "excluded":
            (on_host if ptr in host else device)[category] += sizes[ptr]
    device["total"] = sum(device.values())
    on_host["total"] = sum(on_host.values())
    names = _named_storages(engine)
    detail: dict[str, int] = {}
    for ptr, category in claimed.items():
        if category == "buffers" and sizes[ptr] >= 1 << 16:
            key = ("host " if ptr in host else "") + names.get(ptr, "unnamed")
            detail[key] = detail.get(key, 0) + sizes[ptr]
    return {**device, "host": on_host, "buffers_by_owner": detail}
