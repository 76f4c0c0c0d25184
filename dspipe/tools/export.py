"""A dspipe checkpoint -> one fp32 state dict (dspipe GPT names) -> a Hugging Face directory (GPT2LMHeadModel,
LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM or MistralForCausalLM: the class that computes the model,
dspipe.model.hf.architecture_of).

Where the weights come from, by layout:

    pp = 1, ZeRO 1-3    the fp32 master partitions in *_optim_states.pt, merged by DeepSpeed's own
                        deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint
    pp > 1, ZeRO 0-1    the module weights in layer_XX-model_states.pt (the tied embedding is stored once,
                        by layer 0), then per stage the fp32 master partitions of that stage's optimizer files
                        (DeepSpeed's zero_to_fp32 merge, applied to one stage's files at a time)
    bf16 ZeRO-1         DeepSpeed's BF16_Optimizer: fp32 partitions located by its saved param_slice_mappings
    pp = 1, ZeRO 0      bf16/fp16: FP16_Optimizer's flat fp32 groups; fp32: the module weights in
                        mp_rank_00_model_states.pt (they are the master weights)
    tp > 1              each tp rank's weights as above from its own files (pp 1: mp_rank_RR and the optimizer
                        files of mp rank RR; pp > 1: layer_LL-model_RR and the optimizer files of mp rank
                        stage x tp + RR), then the shards put back together by dspipe's tensor-parallel layout
                        (dspipe.model.tp_split.merge_shards: fused q/k/v and gate/up interleaved, row-parallel
                        along dim 1, vocabulary rows along dim 0; replicated tensors equal on every tp rank)
    experts (MoE)       the module weights in mp_rank_00_model_states.pt and the expert files
                        layer_L_expert_E_..., DeepSpeed's MoE names mapped back to the model's (_consolidate_experts)

Nothing is written until the whole export is complete: a sibling temp directory renamed into place."""
from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path

from dspipe.runtime import checkpoint as ckpt
from dspipe import outputs
from dspipe.atomic import staged_dir
from dspipe.errors import SpecError
from dspipe.jsonio import read_object
from dspipe.rundir import DS_CONFIG_FILE
from dspipe.spec.core import ModelSpec, from_dict
from dspipe.model.hf import architecture_of, hf_model  # the architectures (hf_model re-exported)
from dspipe.model.names import layer_prefix as _layer_prefix, pipeline_gpt_name as _pipeline_name

LAYER_FILE = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")  # -model_RR: tp rank RR (tp > 1)
OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


# ---- which checkpoint ---------------------------------------------------------------------------------------------

def resolve_checkpoint(path: str | Path) -> Path:
    """A complete checkpoint directory, or a run directory meaning its newest complete checkpoint."""
    path = Path(path)
    if not path.exists():
        raise SpecError(f"{path} does not exist (give a checkpoint runs/NAME/checkpoints/global_stepN or a run "
                        f"directory runs/NAME)")
    if (path / DS_CONFIG_FILE).is_file():  # a run directory: dspipe.json + ds_config.json
        from dspipe.rundir import load_run

        ckpt_dir = load_run(path).checkpoint_dir  # validated like every run directory dspipe reads
        latest = ckpt_dir / ckpt.LATEST_FILE
        if latest.is_file() and not ckpt.is_complete(ckpt_dir / ckpt.read_latest(ckpt_dir)):
            raise SpecError(f"{latest} names {ckpt.read_latest(ckpt_dir)!r}, which is missing or incomplete; "
                            f"give a complete checkpoint under {ckpt_dir}")
        found = ckpt.complete_checkpoints(ckpt_dir)
        if not found:
            raise SpecError(f"run {path} has no complete checkpoint under {ckpt_dir}")
        return found[-1][1]
    if not path.is_dir():
        raise SpecError(f"{path} is not a directory (give a checkpoint or a run directory)")
    if ckpt.is_complete(path):
        return path
    if path.name.startswith(ckpt.PARTIAL_PREFIX) or any(path.glob("*model_states.pt")):
        raise SpecError(f"checkpoint {path} is incomplete (no {ckpt.META_FILE}: its save was interrupted); "
                        f"use a complete one")
    raise SpecError(f"{path} is neither a dspipe checkpoint (no {ckpt.META_FILE}) nor a run directory "
                    f"(no {DS_CONFIG_FILE})")


def model_spec(meta: dict) -> ModelSpec:
    """The model of a checkpoint meta that read_meta validated."""
    return from_dict(ModelSpec, meta["model"])


def tokenizer_dir(checkpoint: Path) -> Path:
    """The run's prepared data holds the tokenizer (DATA/tokenizer); the run is runs/NAME/checkpoints/TAG/../.."""
    from dspipe.data.blend import tokenizer_dir as data_tokenizer_dir
    from dspipe.rundir import load_run

    run_dir = Path(checkpoint).resolve().parent.parent
    if not (run_dir / DS_CONFIG_FILE).is_file():
        raise SpecError(f"cannot find the tokenizer of checkpoint {checkpoint}: {run_dir} is not its run directory "
                        f"(the run's dspipe.json names the data directory holding the tokenizer)")
    data = load_run(run_dir).data
    kept = run_dir / "tokenizer"  # a Megatron prefix's, copied by gen-config (cli.app.keep_tokenizer)
    tok = kept if (kept / "tokenizer.json").is_file() else data_tokenizer_dir(data)  # a blend's sources share one
    if not (tok / "tokenizer.json").is_file() and not (tok / "tokenizer_config.json").is_file():
        raise SpecError(f"tokenizer not found: {tok} (the data directory of run {run_dir} is {data}); "
                        f"prepare it again with 'dspipe prepare-data --out {data}'")
    return tok


VOCABULARY_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "vocab.txt", "spiece.model")
"""A tokenizer directory holds its vocabulary in one of these (fast tokenizer, BPE, SentencePiece, WordPiece)."""


def load_tokenizer(path: Path):
    """AutoTokenizer from a local directory, quietly (no progress bars or hub lookups). Without a vocabulary file
    transformers would build an empty tokenizer from config.json alone (every text encodes to nothing): refused."""
    from transformers import AutoTokenizer

    quiet_transformers()
    if not any((Path(path) / name).is_file() for name in VOCABULARY_FILES):
        raise SpecError(f"{path} holds no tokenizer (none of {', '.join(VOCABULARY_FILES)}); a directory written by "
                        f"export-hf has its tokenizer.json: export it again")
    for name in ("tokenizer_config.json", "special_tokens_map.json", "config.json"):
        if (Path(path) / name).is_file():
            read_object(Path(path) / name)  # one line naming the file, not transformers' traceback
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        if _substituted(tokenizer, path):
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    except Exception as e:  # OSError, ValueError, TypeError, AttributeError, ... on damaged tokenizer files
        raise SpecError(f"cannot load the tokenizer in {path}: {' '.join(str(e).split())[:300]}") from None
    if len(tokenizer) < 2:
        raise SpecError(f"the tokenizer in {path} has {len(tokenizer)} token(s): its vocabulary files are damaged")
    return tokenizer


GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""tokenizer_config.json's tokenizer_class of a tokenizer saved from its tokenizer.json alone (dspipe's BPE)."""


def _substituted(tokenizer, path: Path) -> bool:
    """Whether AutoTokenizer put a model type's own class in place of the generic tokenizer the directory saved:
    transformers 5 does so for model_type qwen2 (Qwen2Tokenizer, which splits text with Qwen's pre-tokenizer, not
    with the one in tokenizer.json)."""
    config = Path(path) / "tokenizer_config.json"
    if not config.is_file() or not (Path(path) / "tokenizer.json").is_file():
        return False
    declared = read_object(config).get("tokenizer_class")
    return declared in GENERIC_TOKENIZERS and type(tokenizer).__name__ not in GENERIC_TOKENIZERS


PROBE_TEXT = "Hello world! It's 2024-11-26: 12345 tokens,\n\n    indented\tline; don't STOP... naïve 漢字 🙂"
"""Text whose tokenization shows a different pre-tokenizer (digits, contractions, spaces, newlines, non-ASCII)."""


def auto_tokenizer_note(directory: Path, tokenizer) -> str | None:
    """A note when transformers' AutoTokenizer, loading `directory` as other programs will, splits text otherwise
    than `tokenizer` (the run's, saved there): for model_type qwen2 it substitutes Qwen2Tokenizer."""
    from transformers import AutoTokenizer

    try:
        auto = AutoTokenizer.from_pretrained(str(directory))
    except Exception:  # noqa: BLE001 - a note, not a refusal: dspipe generate loads it as saved
        return None
    ours = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    if auto.encode(PROBE_TEXT, add_special_tokens=False) == ours:
        return None
    return (f"note: transformers' AutoTokenizer loads {directory}'s tokenizer as {type(auto).__name__} (its choice "
            f"for this model type), which splits text differently from the run's tokenizer saved there; load it with "
            f"PreTrainedTokenizerFast.from_pretrained (dspipe generate does)")


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


# ---- consolidation ------------------------------------------------------------------------------------------------

def _quiet():
    """DeepSpeed's zero_to_fp32 prints its progress (and tqdm bars); keep the console for what dspipe prints."""
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    return stack


def _import_deepspeed() -> None:
    """DeepSpeed logs to stdout from import on (e.g. 'Setting accelerator to CPU'); `generate` prints only text."""
    if "deepspeed" in sys.modules:
        return
    import logging

    with _quiet():
        import deepspeed.utils.zero_to_fp32  # noqa: F401
        from deepspeed.utils import logger
    for handler in logger.handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(sys.stderr)


def _load(path: Path, *, mmap: bool = False) -> dict:
    """A checkpoint file, weights-only (dspipe.runtime.safeload): never runs code a file names."""
    from dspipe.runtime.safeload import load

    return load(path, mmap=mmap)


MERGE_ERRORS = (OSError, KeyError, ValueError, RuntimeError, TypeError, AttributeError, IndexError, EOFError)
"""What DeepSpeed's merge code raises on files whose content is not what it expects (one SpecError instead)."""


def _optim_files(checkpoint: Path) -> dict[int, list[Path]]:
    """Optimizer partition files per model-parallel (pipeline stage) rank, in data-parallel rank order."""
    stages: dict[int, list[tuple[int, Path]]] = {}
    for p in checkpoint.iterdir():
        if m := OPTIM_FILE.match(p.name):
            stages.setdefault(int(m.group(2)), []).append((int(m.group(1)), p))
    return {s: [p for _, p in sorted(files)] for s, files in sorted(stages.items())}


def _master_from_zero_files(*, model_file: Path, optim_files: list[Path], checkpoint: Path) -> dict:
    """DeepSpeed's zero_to_fp32 merge applied to one pipeline stage's files (its public entry point reads every
    file in the directory, and its parse_model_states expects the module weights in the file)."""
    from deepspeed.utils import zero_to_fp32 as z

    sd = _load(model_file)  # a pipeline stage's model states: no module (the layer files hold it), no buffers
    states = [z.zero_model_state(buffers={}, param_shapes=sd["param_shapes"],
                                 shared_params=[[k, v] for k, v in sd["shared_params"].items()],
                                 ds_version=sd.get("ds_version"), frozen_param_shapes=sd.get("frozen_param_shapes"),
                                 frozen_param_fragments=sd.get("frozen_param_fragments"))]
    with _quiet():
        stage, world, groups, paddings = z.parse_optim_states([str(p) for p in optim_files], str(checkpoint))
        if stage <= 2:
            sd = z._get_fp32_state_dict_from_zero2_checkpoint(world, groups, states, False, paddings)
        else:
            sd = z._get_fp32_state_dict_from_zero3_checkpoint(world, groups, states, False)
    return z.to_torch_tensor(sd)


def _master_from_bf16_optimizer(optim_files: list[Path]) -> dict:
    """BF16_Optimizer (bf16 + ZeRO-1): each rank's fp32 partition per group, and where each parameter's fragment
    lies in it (param_slice_mappings: name -> (numel, start)); a parameter is its fragments in rank order."""
    from deepspeed.checkpoint.constants import (OPTIMIZER_STATE_DICT, PARAM_SLICE_MAPPINGS,
                                                SINGLE_PARTITION_OF_FP32_GROUPS)
    import torch

    pieces: dict[str, list] = {}
    for f in optim_files:
        state = _load(f)[OPTIMIZER_STATE_DICT]
        for flat, mapping in zip(state[SINGLE_PARTITION_OF_FP32_GROUPS], state[PARAM_SLICE_MAPPINGS]):
            for name, frag in mapping.items():
                pieces.setdefault(name, []).append(flat.narrow(0, frag.start, frag.numel).float())
    return {name: torch.cat(parts) for name, parts in pieces.items()}  # flat; reshaped against the module weights


def _master_from_fp16_optimizer(checkpoint: Path, *, name: str = "mp_rank_00_model_states.pt") -> dict:
    """ZeRO-0 with bf16/fp16 (DeepSpeed's FP16_Optimizer): one flat fp32 copy per parameter group, in the model
    states file `name`. The groups are train.param_groups: matrices and embeddings, then 1-d tensors, in module
    order."""
    path = checkpoint / name
    if not path.is_file():
        return {}
    sd = _load(path)
    flats = (sd.get("optimizer") or {}).get("fp32_groups_flat")
    module = sd.get("module") or {}
    if not flats or not module:
        return {}
    groups = [[n for n, t in module.items() if t.dim() >= 2], [n for n, t in module.items() if t.dim() < 2]]
    out = {}
    for names, flat in zip(groups, flats):
        offset = 0
        for n in names:
            out[n] = flat.narrow(0, offset, module[n].numel()).view(module[n].shape)
            offset += module[n].numel()
        if offset != flat.numel():
            raise SpecError(f"checkpoint {checkpoint}: the fp32 copy holds {flat.numel()} values for parameters "
                            f"of {offset}")
    return out


def _master(checkpoint: Path, *, pp: int, model_file_for_stage) -> dict:
    """fp32 master weights (names as the engine's module has them) from the optimizer files, or {} if none."""
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, ZERO_STAGE

    if pp == 1 and not _optim_files(checkpoint):
        return _master_from_fp16_optimizer(checkpoint)
    merged: dict = {}
    for stage, files in _optim_files(checkpoint).items():
        probe = _load(files[0], mmap=True)[OPTIMIZER_STATE_DICT]  # mapped: only its keys are read
        if ZERO_STAGE in probe and pp == 1:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
            with _quiet():
                part = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.parent), tag=checkpoint.name)
        elif ZERO_STAGE in probe:
            part = _master_from_zero_files(model_file=model_file_for_stage(stage), optim_files=files,
                                           checkpoint=checkpoint)
        else:
            part = _master_from_bf16_optimizer(files)
        for name, t in part.items():
            merged.setdefault(name, t)  # a tied embedding appears in the first and the last stage: equal copies
    return merged


def _module_weights(checkpoint: Path, *, pp: int, layers: int) -> dict:
    """The module's own weights (bf16 in bf16 runs; empty placeholders under ZeRO-3), GPT names."""
    if pp == 1:
        sd = _load(checkpoint / "mp_rank_00_model_states.pt") if (checkpoint / "mp_rank_00_model_states.pt").is_file() \
            else {}
        return dict(sd.get("module") or {})
    out = {}
    for p in sorted(checkpoint.iterdir()):
        if m := LAYER_FILE.match(p.name):
            prefix = _layer_prefix(int(m.group(1)), layers=layers)
            out.update({prefix + k: v for k, v in _load(p).items()})
    return out


def consolidate(checkpoint: Path, *, meta: dict) -> dict:
    """One fp32 state dict with dspipe GPT names: the fp32 master weights where the checkpoint has them, else the
    module weights. Shapes and names are checked when the dict is loaded into a model (strict)."""
    from dspipe.runtime.ckptfiles import check_checkpoint
    from dspipe.runtime.safeload import weights_only_loads

    _import_deepspeed()
    check_checkpoint(checkpoint, meta=meta)  # every file: present, weights-only, keys, step, names and shapes
    with weights_only_loads():  # DeepSpeed's zero_to_fp32 passes weights_only=False: forced weights-only here
        return _consolidate(checkpoint, meta=meta)


def _consolidate(checkpoint: Path, *, meta: dict) -> dict:
    spec, pp = model_spec(meta), int(meta["pp"])
    if int(meta.get("tp", 1)) > 1:
        return _consolidate_tensor_parallel(checkpoint, meta=meta, spec=spec)
    if spec.experts:
        return _consolidate_experts(checkpoint, spec=spec)
    module = _module_weights(checkpoint, pp=pp, layers=spec.layers)

    def model_file(stage: int) -> Path:  # pipelines run ZeRO 0-1: one model-states file per stage
        return checkpoint / f"mp_rank_{stage:02d}_model_states.pt"

    try:
        raw = _master(checkpoint, pp=pp, model_file_for_stage=model_file)
    except MERGE_ERRORS as e:
        raise SpecError(f"checkpoint {checkpoint}: cannot merge the fp32 master weights: "
                        f"{' '.join(str(e).split())[:300]}") from None
    master = {(name if pp == 1 else _pipeline_name(name, layers=spec.layers)): t for name, t in raw.items()}
    out = _prefer_master(module=module, master=master, checkpoint=checkpoint)
    if spec.tied_embeddings:
        out.pop("lm_head.weight", None)
    return out


def _consolidate_experts(checkpoint: Path, *, spec: ModelSpec) -> dict:
    """A mixture-of-experts checkpoint (DeepSpeed's native MoE, pp 1, ZeRO 0-2): the module weights of
    mp_rank_00_model_states.pt (the router under DeepSpeed's gate name) and each expert's file (its global id),
    under the model's names (dspipe.runtime.experts.model_name). They are the module's weights: fp32 runs' are the
    master weights; bf16 runs' are bf16 (DeepSpeed's zero_to_fp32 cannot merge expert-parallel optimizer
    partitions: each rank's experts would be read as data-parallel shards of one tensor)."""
    from dspipe.runtime.experts import EXPERT_FILE, model_name

    module = {model_name(k): v for k, v in _module_weights(checkpoint, pp=1, layers=spec.layers).items()}
    for p in sorted(checkpoint.iterdir()):
        if EXPERT_FILE.match(p.name):
            module.update({model_name(k): v for k, v in _load(p).items()})
    out = _prefer_master(module=module, master={}, checkpoint=checkpoint)
    if spec.tied_embeddings:
        out.pop("lm_head.weight", None)
    return out


def _prefer_master(*, module: dict, master: dict, checkpoint: Path) -> dict:
    """Every parameter in fp32: the master copy where there is one (reshaped like the module's tensor), else the
    module weight."""
    import torch

    if not master and not module:
        raise SpecError(f"checkpoint {checkpoint} holds no model weights (no mp_rank_00_model_states.pt, layer_*, "
                        f"or *_optim_states.pt files)")
    if not master and any(t.dtype != torch.float32 for t in module.values()):
        print(f"note: {checkpoint} has no fp32 master weights; using its "
              f"{next(iter(module.values())).dtype} module weights", file=sys.stderr)
    out = {}
    for name in sorted(set(module) | set(master)):
        t = master.get(name)
        if t is None:
            t = module[name]
        elif name in module and module[name].numel() == t.numel() and module[name].dim() > 0:
            t = t.reshape(module[name].shape)  # BF16_Optimizer fragments are flat
        out[name] = t.detach().float().contiguous()
    return out


def _consolidate_tensor_parallel(checkpoint: Path, *, meta: dict, spec: ModelSpec) -> dict:
    """tp > 1 (dspipe's Megatron-layout layers, pp >= 1): every tp rank's fp32 weights read as the single-rank path
    reads them, from that rank's own files (its module weights: mp_rank_RR, or under a pipeline the layer files
    layer_LL-model_RR; its master weights: the optimizer files of model-parallel rank stage x tp + RR of every
    stage), then the shards put back together by the layout (dspipe.model.tp_split.merge_shards); replicated
    tensors must agree across the tp ranks."""
    from dspipe.model.tp_split import merge_shards

    tp, pp = int(meta["tp"]), int(meta["pp"])
    ranks = [_tp_rank_weights(checkpoint, rank=r, tp=tp, pp=pp, spec=spec) for r in range(tp)]
    names = set(ranks[0])
    for r, state in enumerate(ranks[1:], start=1):
        if set(state) != names:
            raise SpecError(f"checkpoint {checkpoint}: tp rank {r} holds other parameters than tp rank 0: "
                            f"{sorted(set(state) ^ names)[:3]}")
    try:
        out = {name: merge_shards(name, [state[name] for state in ranks], spec) for name in sorted(names)}
    except (ValueError, RuntimeError) as e:
        raise SpecError(f"checkpoint {checkpoint}: {' '.join(str(e).split())[:300]}") from None
    if spec.tied_embeddings:
        out.pop("lm_head.weight", None)
    return out


def _tp_rank_weights(checkpoint: Path, *, rank: int, tp: int, pp: int, spec: ModelSpec) -> dict:
    """Tp rank `rank`'s shards in fp32, GPT names: the master copy where the checkpoint has one, else the module's."""
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, ZERO_STAGE

    optim = _optim_files(checkpoint)
    mp_ranks = [stage * tp + rank for stage in range(pp)]  # DeepSpeed's model-parallel ranks (pp 1: rank)
    if pp == 1:
        model_file = checkpoint / f"mp_rank_{rank:02d}_model_states.pt"
        module = dict(_load(model_file).get("module") or {})
    else:
        module = {}
        for p in sorted(checkpoint.iterdir()):
            if (m := LAYER_FILE.match(p.name)) and m.group(2) is not None and int(m.group(2)) == rank:
                prefix = _layer_prefix(int(m.group(1)), layers=spec.layers)
                module.update({prefix + k: v for k, v in _load(p).items()})
    master: dict = {}
    try:
        if not optim and pp == 1:
            master = _master_from_fp16_optimizer(checkpoint, name=f"mp_rank_{rank:02d}_model_states.pt")
        for mp in mp_ranks:
            if mp not in optim:
                continue
            model_file = checkpoint / f"mp_rank_{mp:02d}_model_states.pt"
            if ZERO_STAGE in _load(optim[mp][0], mmap=True)[OPTIMIZER_STATE_DICT]:
                part = _master_from_zero_files(model_file=model_file, optim_files=optim[mp], checkpoint=checkpoint)
            else:
                part = _master_from_bf16_optimizer(optim[mp])
            for name, t in part.items():  # a tied embedding is on the first and the last stage: equal copies
                master.setdefault(name if pp == 1 else _pipeline_name(name, layers=spec.layers), t)
    except MERGE_ERRORS as e:
        raise SpecError(f"checkpoint {checkpoint}: cannot merge tp rank {rank}'s fp32 master weights: "
                        f"{' '.join(str(e).split())[:300]}") from None
    return _prefer_master(module=module, master=master, checkpoint=checkpoint)


def load_gpt(checkpoint: Path, *, meta: dict):
    """dspipe's GPT holding the consolidated weights, in eval mode."""
    from dspipe.model.gpt import GPT

    spec = model_spec(meta)
    model = GPT(spec, seed=0)
    _load_strict(model, consolidate(checkpoint, meta=meta), checkpoint)
    return model.eval()


def _load_strict(model, state: dict, source) -> None:
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise SpecError(f"checkpoint {source} does not match its model shape: {' '.join(str(e).split())[:300]}") \
            from None


# ---- Hugging Face ------------------------------------------------------------------------------------------------

def export_hf(*, source: str | Path, out: str | Path, force: bool = False) -> Path:
    """Write the Hugging Face directory (safetensors) of the class that computes the model, with the run's tokenizer;
    returns the checkpoint used. A note when transformers' AutoTokenizer would read that tokenizer otherwise."""
    out = outputs.target(out, flag="--out", expect="dir")
    outputs.claim_dir(out, kind="export-hf", replace=force)  # only a previous export, never a run or other data
    checkpoint = resolve_checkpoint(source)
    meta = ckpt.read_meta(checkpoint)
    tok_dir = tokenizer_dir(checkpoint)
    tokenizer = load_tokenizer(tok_dir)
    spec = model_spec(meta)
    architecture_of(spec)  # a model no supported architecture computes: refused before the weights are merged
    if len(tokenizer) > spec.vocab:
        raise SpecError(f"tokenizer {tok_dir} has {len(tokenizer)} tokens, more than the model's vocab {spec.vocab}")
    model = hf_model(consolidate(checkpoint, meta=meta), spec, eos_id=tokenizer.eos_token_id,
                     bos_id=tokenizer.bos_token_id, source=checkpoint)
    with outputs.writing(out), staged_dir(out) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        for f in tmp.iterdir():
            f.chmod(0o644)
        outputs.write_marker(tmp, kind="export-hf")
        note = auto_tokenizer_note(tmp, tokenizer)
    if note:
        print(note.replace(str(tmp), str(out)), file=sys.stderr)
    return checkpoint
