"""Reading checkpoint files without running code: every torch.load of a checkpoint, dspipe's or DeepSpeed's own.

A .pt file is a pickle, and a pickle may name any callable to run while it loads. Every read goes through
torch's weights-only unpickler, which builds tensors, containers and numbers and otherwise only the types in
ALLOWED_GLOBALS: the types DeepSpeed 0.19's checkpoint files hold besides those (listed by loading every file of
ZeRO-0/1/2/3, bf16/fp32, CPU-offload, pipeline, AutoTP, Ulysses and universal checkpoints written by dspipe runs).

    load(path)                  one file, weights-only; any failure is one SpecError naming the file and what is
                                wrong (empty, truncated, not a torch file, a type outside the table)
    weights_only_loads()        a block inside which every torch.load (DeepSpeed's load_checkpoint, zero_to_fp32,
                                ds_to_universal, which pass weights_only=False) is weights-only with the same table
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import warnings
from pathlib import Path

from dspipe.errors import SpecError, cannot_read

ALLOWED_GLOBALS: tuple[tuple[str, str, str], ...] = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler", "ZeRO optimizer states: the static loss scaler"),
    (
        "deepspeed.runtime.fp16.loss_scaler",
        "DynamicLossScaler",
        "ZeRO optimizer states under fp16 (DeepSpeed's source: zero/stage_1_and_2.py, stage3.py)",
    ),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum", "ZeRO optimizer states: zero_stage"),
    ("deepspeed.utils.tensor_fragment", "fragment_address", "BF16_Optimizer states: param_slice_mappings"),
    (
        "deepspeed.checkpoint.universal_checkpoint",
        "SubparamShape",
        "universal checkpoints: the sub-parameter shape of a fused tensor (q/k/v, gate/up)",
    ),
    ("numpy._core.multiarray", "_reconstruct", "rng-rankR.pt: numpy's generator state (numpy 2)"),
    ("numpy.core.multiarray", "_reconstruct", "rng-rankR.pt: numpy's generator state (numpy 1)"),
    ("numpy", "ndarray", "rng-rankR.pt: numpy's generator key"),
    ("numpy", "dtype", "rng-rankR.pt: the key's dtype"),
    ("numpy.dtypes", "UInt32DType", "rng-rankR.pt: the key's dtype class (numpy >= 1.25)"),
)
"""(module, name, where DeepSpeed or dspipe puts it): the only globals a checkpoint file may name beyond torch's own
weights-only set (tensors, dtypes, containers, numbers, strings)."""

FORCE_ENV = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"  # torch.load reads it on every call: weights_only=True whatever is passed
ZIP_MAGIC = b"PK\x03\x04"


def allowed_globals() -> list:
    """The objects of ALLOWED_GLOBALS that this environment has (numpy 1 or 2 names one of the two paths)."""
    found = []
    for module, name, _ in ALLOWED_GLOBALS:
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return found


@contextlib.contextmanager
def weights_only_loads():
    """Every torch.load inside the block is weights-only with ALLOWED_GLOBALS (torch honours FORCE_ENV even where the
    caller passes weights_only=False, as DeepSpeed's loaders do); the environment is restored afterwards."""
    import torch

    global _depth
    if _depth:  # nested (a dspipe read inside a DeepSpeed load): the outer block holds the settings; torch's
        yield  # safe_globals would drop the table on the inner block's exit
        return
    before = os.environ.get(FORCE_ENV)
    os.environ[FORCE_ENV] = "1"
    _depth += 1
    try:
        with torch.serialization.safe_globals(allowed_globals()), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's note on pickle protocols: not for the user
            yield
    finally:
        _depth -= 1
        if before is None:
            os.environ.pop(FORCE_ENV, None)
        else:
            os.environ[FORCE_ENV] = before


_depth = 0


def load(path: str | Path, *, mmap: bool = False, expect: type | None = dict):
    """The object in checkpoint file `path`, loaded weights-only on the CPU (mmap: tensor data mapped, not read;
    only for torch's zip format, the one DeepSpeed and dspipe write). `expect`: the type the file must hold.
    Anything else is one SpecError naming the file."""
    import torch

    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(4)
        size = path.stat().st_size
    except OSError as e:
        raise cannot_read(path, e) from None
    if size == 0:
        raise SpecError(f"{path} is empty (0 bytes): a damaged checkpoint file")
    try:
        with weights_only_loads():
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and head == ZIP_MAGIC)
    except SpecError:
        raise
    except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, EOFError, KeyError, ...
        raise SpecError(f"{path} {why_not_loaded(e, zip_file=head == ZIP_MAGIC)}") from None
    if expect is not None and not isinstance(obj, expect):
        raise SpecError(f"{path} holds a {type(obj).__name__}, not the {expect.__name__} a checkpoint file holds")
    return obj


UNSAFE_GLOBAL = re.compile(r"GLOBAL ([\w.]+)|but got <class '([\w.]+)'>")


def why_not_loaded(e: BaseException, *, zip_file: bool) -> str:
    """What a failed weights-only torch.load means, in a few words."""
    text = " ".join(str(e).split())
    m = UNSAFE_GLOBAL.search(text)
    if m:
        return (
            f"names {m.group(1) or m.group(2)}, which is not a type a checkpoint holds (tensors, "
            f"numbers, containers and dspipe.runtime.safeload.ALLOWED_GLOBALS): refused without loading it, "
            f"since loading it could run code"
        )
    if not zip_file:
        return "is not a torch checkpoint file (neither torch's zip format nor a torch pickle)"
    if "central directory" in text or "not a ZIP archive" in text or isinstance(e, (EOFError, OSError)):
        return "is truncated or damaged (torch's zip archive is incomplete)"
    detail = text.split("WeightsUnpickler error:")[-1].split(" Check the documentation")[0].strip()
    return f"is damaged: {detail[:200] or type(e).__name__}"
