"""Reading a Hugging Face model directory's weights (safetensors or PyTorch files, sharded or not) as dspipe's
parameters, fp32: check_weights (headers only, `gen-config --init-from HF_DIR`), HFWeights and load_into_module
(the runner's step 0, one tensor or partition at a time). The names' mapping is dspipe.model.hf_state's (weight_map: a
mixture of experts' tensors as the files hold them, one per expert). Every refusal is one SpecError line naming the
directory (or file) and the field."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Mapping

from dspipe.errors import SpecError
from dspipe.model.hf import BASE_PREFIX, function_of, spec_from_hf_dir
from dspipe.model.hf_arch import architecture_of
from dspipe.model.hf_state import hf_tensors, weight_map
from dspipe.model.names import pipeline_gpt_name
from dspipe.spec.model import ModelSpec

WEIGHT_FILES = (
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)
SAFETENSORS_FLOAT_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2}
"""The floating dtypes of a safetensors header that load as model weights, with their bytes per element."""


class CheckpointTensors(Mapping):
    """The tensors of a Hugging Face model directory, read lazily one by one (safetensors memory-maps, .bin files
    load once each, memory-mapped): model.safetensors(.index.json) or pytorch_model.bin(.index.json). Names
    without the base model's prefix (a checkpoint saved from GPT2Model) answer to the prefixed name too."""

    def __init__(self, path: Path, *, prefix: str = ""):
        from dspipe.jsonio import read_object

        self.path, self.prefix = Path(path), prefix
        self._open: dict[str, object] = {}
        found = next((f for f in WEIGHT_FILES if (self.path / f).is_file()), None)
        if found is None:
            raise SpecError(f"{self.path}: no weights ({', '.join(WEIGHT_FILES)})")
        self.source = self.path / found
        if found.endswith(".index.json"):
            index = read_object(self.source).get("weight_map")
            if not isinstance(index, dict) or not all(isinstance(v, str) for v in index.values()):
                raise SpecError(f"{self.source}: weight_map must map tensor names to file names")
            self.files = dict(index)
        else:
            self.files = {key: found for key in self._keys(found)}

    def _handle(self, file: str):
        if file not in self._open:
            path = self.path / file
            if os.path.basename(file) != file or not path.is_file():
                raise SpecError(f"{self.source}: names {file!r}, which is not a file in {self.path}")
            try:
                if file.endswith(".safetensors"):
                    from safetensors import safe_open

                    self._open[file] = safe_open(str(path), framework="pt")
                else:
                    import torch

                    try:
                        self._open[file] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                    except RuntimeError:  # a file in the legacy (non-zip) format cannot be memory-mapped
                        self._open[file] = torch.load(path, map_location="cpu", weights_only=True)
            except SpecError:
                raise
            except Exception as e:  # safetensors' and torch's errors on damaged files
                raise SpecError(f"{path}: cannot read the weights: {' '.join(str(e).split())[:200]}") from None
        return self._open[file]

    def _keys(self, file: str) -> list[str]:
        handle = self._handle(file)
        return list(handle.keys())

    def _resolve(self, key: str) -> str | None:
        if key in self.files:
            return key
        if self.prefix and key.startswith(self.prefix) and key[len(self.prefix) :] in self.files:
            return key[len(self.prefix) :]
        return None

    def __contains__(self, key) -> bool:
        return isinstance(key, str) and self._resolve(key) is not None

    def __getitem__(self, key: str):
        if self._resolve(key) is None:
            raise KeyError(key)
        return self.read(key)

    def read(self, key: str, *, rows: slice | None = None, cols: slice | None = None):
        """Tensor `key`, or only its rows/columns: safetensors reads just those bytes (get_slice), a .bin file is
        memory-mapped, so only the pages of the slice are touched."""
        stored = self._resolve(key)
        handle = self._handle(self.files[stored])
        index = (rows or slice(None),) if cols is None else (rows or slice(None), cols)
        try:
            if hasattr(handle, "get_slice"):
                return handle.get_slice(stored)[index] if rows or cols else handle.get_tensor(stored)
            return handle[stored][index] if rows or cols else handle[stored]
        except Exception as e:
            raise SpecError(
                f"{self.path / self.files[stored]}: cannot read tensor {stored}: {' '.join(str(e).split())[:200]}"
            ) from None

    def shape(self, key: str) -> tuple:
        return self.header(key)[0]

    def header(self, key: str) -> tuple[tuple, str, int]:
        """(shape, dtype name, bytes per element) of tensor `key`, from the file's header only."""
        stored = self._resolve(key)
        handle = self._handle(self.files[stored])
        if hasattr(handle, "get_slice"):
            view = handle.get_slice(stored)
            dtype = view.get_dtype()
            return tuple(view.get_shape()), dtype, SAFETENSORS_FLOAT_BYTES.get(dtype, 0)
        t = handle[stored]
        return tuple(t.shape), str(t.dtype).replace("torch.", ""), t.element_size() if t.is_floating_point() else 0

    def __iter__(self):
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


def check_matches(path: str | Path, spec: ModelSpec) -> None:
    """HF_DIR's config describes `spec` (up to its name, dropout and a shorter context; compared by what they
    compute, function_of); one line otherwise."""
    hf = spec_from_hf_dir(path, name=spec.name, dropout=spec.dropout)
    if spec.seq_len > hf.seq_len:
        raise SpecError(f"{path}: the model has {hf.seq_len} positions, the run's seq_len is {spec.seq_len}")
    theirs, ours = function_of(hf), function_of(spec)
    diff = [f"{k} {theirs.get(k)!r} (run: {ours.get(k)!r})" for k in {**theirs, **ours} if theirs.get(k) != ours.get(k)]
    if diff:
        raise SpecError(f"{path}: its config.json describes another model than the run's: {', '.join(diff[:3])}")


def _checked_tensors(path: Path, spec: ModelSpec) -> tuple[CheckpointTensors, int]:
    """HF_DIR's tensors after checking, from the config and the files' headers only (no tensor data is read), that
    they are the model `spec`: every tensor it needs present, with its shape and a floating dtype. Returns them and
    the bytes those tensors take in the files."""
    check_matches(path, spec)
    tensors = CheckpointTensors(path, prefix=BASE_PREFIX[architecture_of(spec)])
    total = 0
    for key, shape in hf_tensors(spec):
        if key not in tensors:
            raise SpecError(f"{tensors.source}: missing tensor {key}")
        have, dtype, size = tensors.header(key)
        rows_ok = key.endswith("wpe.weight") and len(have) == 2 and have[0] >= shape[0] and have[1] == shape[1]
        if have != tuple(shape) and not rows_ok:
            raise SpecError(f"{tensors.source}: tensor {key} has shape {list(have)}, the model needs {list(shape)}")
        if not size:
            raise SpecError(f"{tensors.source}: tensor {key} has dtype {dtype}, not a floating-point type")
        total += math.prod(shape) * size
    return tensors, total


def check_weights(path: str | Path, spec: ModelSpec) -> int:
    """`gen-config --init-from` before it writes the run: the weights of HF_DIR are the model `spec`'s (files
    present and readable, every tensor name, shape and dtype; headers only). Returns the bytes of those tensors."""
    return _checked_tensors(Path(path), spec)[1]


class HFWeights:
    """A Hugging Face model directory as the source of dspipe's parameters, read lazily: a whole tensor, some of
    its rows, or a flat range of its elements (a ZeRO-3 partition), each read from the files' bytes for just that
    part (safetensors get_slice) and converted to fp32. Checked like check_weights when opened."""

    def __init__(self, path: str | Path, spec: ModelSpec):
        self.path, self.spec = Path(path), spec
        self.tensors, self.bytes = _checked_tensors(self.path, spec)
        self.map = weight_map(spec)
        self.shapes = dict(spec.model_tensors())

    def rows(self, name: str, start: int, stop: int):
        """Rows start..stop-1 (dim 0) of dspipe parameter `name`, fp32."""
        import torch

        parts, how = self.map[name]
        if how == "t":  # dspipe's rows are the HF tensor's columns
            t = self.tensors.read(parts[0][0], cols=slice(start, stop)).t()
        elif how == "rows":  # stacked HF tensors: take each one's share of the range
            pieces, offset = [], 0
            for key, shape in parts:
                lo, hi = max(start, offset), min(stop, offset + shape[0])
                if lo < hi:
                    pieces.append(self.tensors.read(key, rows=slice(lo - offset, hi - offset)))
                offset += shape[0]
            t = torch.cat(pieces, dim=0)
        else:
            t = self.tensors.read(parts[0][0], rows=slice(start, stop))
        return t.to(torch.float32).contiguous()

    def full(self, name: str):
        return self.rows(name, 0, self.shapes[name][0])

    def flat(self, name: str, start: int, stop: int):
        """Elements start..stop-1 of parameter `name` flattened (row-major), reading only the rows they lie in."""
        shape = self.shapes[name]
        width = math.prod(shape[1:])
        first, last = start // width, -(-stop // width)
        return self.rows(name, first, last).reshape(-1)[start - first * width : stop - first * width]


def gpt_parameters(module, spec: ModelSpec, *, prefix: str | None = None):
    """(GPT name, parameter) of every parameter `module` holds: the plain GPT's own names, a PipelineModule stage's
    translated from pipeline names ('3.attn.c_attn.weight', 'tied_modules.embed.wte.weight'), one layer's under
    its GPT `prefix` ('h.2.', 'embed.')."""
    from dspipe.model.gpt import GPT

    for name, param in module.named_parameters():
        if prefix is not None:
            yield prefix + name, param
        else:
            yield (name if isinstance(module, GPT) else pipeline_gpt_name(name, layers=spec.layers)), param


def layer_prefix_of(layer) -> str:
    """The GPT prefix of one pipeline layer as a LayerSpec makes it: a Block's h.{index}., the embedding (and the
    tied head, the same module), the final norm, the untied head."""
    from dspipe.model.gpt import Block, Embedding, FinalNorm, LMHead

    for cls, prefix in ((Embedding, "embed."), (FinalNorm, "final."), (LMHead, "lm_head.")):
        if isinstance(layer, cls):
            return prefix
    if isinstance(layer, Block):
        return f"h.{layer.index}."
    raise TypeError(f"{type(layer).__name__} is not a layer of dspipe's pipeline")


def load_into_module(module, weights: HFWeights, *, spec: ModelSpec, write=None, layer: bool = False) -> int:
    """Overwrite `module`'s parameters with HF weights, one tensor at a time (the runner's step 0 under
    `--init-from`): the plain GPT all of them, a PipelineModule stage only its own, with `layer` one pipeline
    layer as a LayerSpec makes it. `write(param, name)` puts parameter `name`'s value into `param` (default: read it
    whole and copy). Returns the number of tensors."""
    import torch

    count = 0
    prefix = layer_prefix_of(module) if layer else None
    with torch.no_grad():
        for name, param in gpt_parameters(module, spec, prefix=prefix):
            if write is None:
                param.copy_(weights.full(name))
            else:
                write(param, name)
            count += 1
    return count
