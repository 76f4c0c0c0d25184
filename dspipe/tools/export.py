"""A dspipe checkpoint -> one fp32 state dict (dspipe GPT names) -> a Hugging Face directory (GPT2LMHeadModel,
LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM or MistralForCausalLM: the class that computes the model,
dspipe.model.hf_arch.architecture_of); the weights: dspipe.tools.consolidate.

Nothing is written until the whole export is complete: a sibling temp directory renamed into place."""

from __future__ import annotations

import os
from pathlib import Path

from dspipe import outputs
from dspipe.atomic import staged_dir
from dspipe.errors import SpecError
from dspipe.jsonio import read_object
from dspipe.log import get_logger
from dspipe.model.hf_arch import architecture_of  # the architectures
from dspipe.model.hf_state import hf_model
from dspipe.rundir import CHECKPOINTS_DIR, DS_CONFIG_FILE
from dspipe.runtime import ckpt_meta, ckpt_tags
from dspipe.tools.consolidate import consolidate, model_spec

# ---- which checkpoint ---------------------------------------------------------------------------------------------


def resolve_checkpoint(path: str | Path) -> Path:
    """A complete checkpoint directory, or a run directory meaning its newest complete checkpoint."""
    path = Path(path)
    if not path.exists():
        raise SpecError(
            f"{path} does not exist (give a checkpoint runs/NAME/checkpoints/global_stepN or a run directory runs/NAME)"
        )
    if os.path.lexists(path / DS_CONFIG_FILE):  # a run directory (load_run names a damaged one's problem)
        from dspipe.rundir import load_run

        ckpt_dir = load_run(path).checkpoint_dir  # validated like every run directory dspipe reads
        found = ckpt_tags.complete_checkpoints(ckpt_dir)
        tag = _latest_tag(ckpt_dir, newest=found[-1][1] if found else None)
        if tag is not None and not ckpt_tags.is_complete(ckpt_dir / tag):
            raise SpecError(
                f"{ckpt_dir / ckpt_tags.LATEST_FILE} names {tag!r}, which is missing or incomplete; "
                f"{_give_checkpoint(ckpt_dir, found[-1][1] if found else None)}"
            )
        if not found:
            raise SpecError(f"run {path} has no complete checkpoint under {ckpt_dir}")
        return found[-1][1]
    if not path.is_dir():
        raise SpecError(f"{path} is not a directory (give a checkpoint or a run directory)")
    if ckpt_tags.is_complete(path):
        return path
    if path.name.startswith(ckpt_tags.PARTIAL_PREFIX) or any(path.glob("*model_states.pt")):
        raise SpecError(
            f"checkpoint {path} is incomplete (no {ckpt_tags.META_FILE}: its save was interrupted); use a complete one"
        )
    if any(path.glob("*.safetensors")) or (path / "pytorch_model.bin").exists():
        raise SpecError(
            f"{path} holds a model's weights but no config.json: a Hugging Face model directory needs its config.json "
            f"(export-hf writes it)"
        )
    raise SpecError(
        f"{path} is neither a dspipe checkpoint (no {ckpt_tags.META_FILE}) nor a run directory (no {DS_CONFIG_FILE})"
    )


def _give_checkpoint(ckpt_dir: Path, newest: Path | None) -> str:
    """What to pass instead of the run directory whose `latest` cannot be used (export-hf and generate take a
    checkpoint directory; they have no --resume)."""
    example = newest if newest is not None else ckpt_dir / "global_stepN"
    return f"give a complete checkpoint directory instead of the run directory, e.g. {example}"


def _latest_tag(ckpt_dir: Path, *, newest: Path | None) -> str | None:
    """The tag checkpoints/latest names (None: no such file); a directory there, or a file that names no tag, is a
    SpecError naming it, as the runner's reader (dspipe.runtime.ckpt_tags.read_latest) refuses such a file."""
    latest = ckpt_dir / ckpt_tags.LATEST_FILE
    if not latest.exists() and not latest.is_symlink():
        return None
    if latest.is_dir():
        raise SpecError(
            f"{latest} is a directory, not the file naming the newest checkpoint; {_give_checkpoint(ckpt_dir, newest)}"
        )
    return ckpt_tags.read_latest(ckpt_dir, hint=_give_checkpoint(ckpt_dir, newest))


def read_checkpoint_meta(checkpoint: Path) -> ckpt_meta.CheckpointMeta:
    """The checkpoint's meta (dspipe.json); for a checkpoint of a run directory (runs/NAME/checkpoints/TAG) its model
    must be the run's (every save writes the run's model; a resume refuses another): one that differs was edited, and
    its weights would be read as another model (heads 8 where 4 were trained splits the same q/k/v rows otherwise)."""
    meta = ckpt_meta.read_meta(checkpoint)
    run_dir = checkpoint.parent.parent
    if checkpoint.parent.name == CHECKPOINTS_DIR and os.path.lexists(run_dir / DS_CONFIG_FILE):
        from dspipe.rundir import SPEC_FILE, load_run

        diff = ckpt_meta.model_diff(meta, load_run(run_dir).model)
        if diff:
            raise SpecError(
                f"{checkpoint / ckpt_tags.META_FILE} holds another model than its run's {run_dir / SPEC_FILE} "
                f"(checkpoint -> run: {', '.join(diff)}); a save writes the run's model, so one of the two was edited"
            )
    return meta


def tokenizer_dir(checkpoint: Path) -> Path:
    """The run's prepared data holds the tokenizer (DATA/tokenizer); the run is runs/NAME/checkpoints/TAG/../.."""
    from dspipe.data.blend import tokenizer_dir as data_tokenizer_dir
    from dspipe.rundir import load_run

    run_dir = Path(checkpoint).resolve().parent.parent
    if not (run_dir / DS_CONFIG_FILE).is_file():
        raise SpecError(
            f"cannot find the tokenizer of checkpoint {checkpoint}: {run_dir} is not its run directory "
            f"(the run's dspipe.json names the data directory holding the tokenizer)"
        )
    data = load_run(run_dir).data
    kept = run_dir / "tokenizer"  # a Megatron prefix's, copied by gen-config (cli.app.keep_tokenizer)
    tok = kept if (kept / "tokenizer.json").is_file() else data_tokenizer_dir(data)  # a blend's sources share one
    if not (tok / "tokenizer.json").is_file() and not (tok / "tokenizer_config.json").is_file():
        raise SpecError(
            f"tokenizer not found: {tok} (the data directory of run {run_dir} is {data}); "
            f"prepare it again with 'dspipe prepare-data --out {data}'"
        )
    return tok


VOCABULARY_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "vocab.txt", "spiece.model")
"""A tokenizer directory holds its vocabulary in one of these (fast tokenizer, BPE, SentencePiece, WordPiece)."""


def load_tokenizer(path: Path):
    """AutoTokenizer from a local directory, quietly (no progress bars or hub lookups). Without a vocabulary file
    transformers would build an empty tokenizer from config.json alone (every text encodes to nothing): refused."""
    from transformers import AutoTokenizer

    quiet_transformers()
    if not any((Path(path) / name).is_file() for name in VOCABULARY_FILES):
        raise SpecError(
            f"{path} holds no tokenizer (none of {', '.join(VOCABULARY_FILES)}); a directory written by "
            f"export-hf has its tokenizer.json: export it again"
        )
    for name in ("tokenizer_config.json", "special_tokens_map.json", "config.json"):
        if (Path(path) / name).is_file():
            read_object(Path(path) / name)  # one line naming the file, not transformers' traceback
    if (Path(path) / "tokenizer_config.json").is_file():
        _check_tokenizer_config(Path(path) / "tokenizer_config.json")
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


def _check_tokenizer_config(source: Path) -> None:
    """tokenizer_config.json's model_max_length: a positive number (transformers compares every encoded text with
    it; a string there fails inside encode)."""
    from dspipe.jsonio import show

    length = read_object(source).get("model_max_length")
    if length is not None and (isinstance(length, bool) or not isinstance(length, (int, float)) or not length > 0):
        raise SpecError(f"{source}: model_max_length must be a positive number of tokens, got {show(length)}")


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
    return (
        f"note: transformers' AutoTokenizer loads {directory}'s tokenizer as {type(auto).__name__} (its choice "
        f"for this model type), which splits text differently from the run's tokenizer saved there; load it with "
        f"PreTrainedTokenizerFast.from_pretrained (dspipe generate does)"
    )


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


# ---- Hugging Face ------------------------------------------------------------------------------------------------


def export_hf(*, source: str | Path, out: str | Path, force: bool = False) -> Path:
    """Write the Hugging Face directory (safetensors) of the class that computes the model, with the run's tokenizer;
    returns the checkpoint used. A note when transformers' AutoTokenizer would read that tokenizer otherwise."""
    out = outputs.target(out, flag="--out", expect="dir")
    outputs.claim_dir(out, kind="export-hf", replace=force)  # only a previous export, never a run or other data
    checkpoint = resolve_checkpoint(source)
    meta = read_checkpoint_meta(checkpoint)
    tok_dir = tokenizer_dir(checkpoint)
    tokenizer = load_tokenizer(tok_dir)
    spec = model_spec(meta)
    architecture_of(spec)  # a model no supported architecture computes: refused before the weights are merged
    if len(tokenizer) > spec.vocab:
        raise SpecError(f"tokenizer {tok_dir} has {len(tokenizer)} tokens, more than the model's vocab {spec.vocab}")
    model = hf_model(
        consolidate(checkpoint, meta=meta),
        spec,
        eos_id=tokenizer.eos_token_id,
        bos_id=tokenizer.bos_token_id,
        source=checkpoint,
    )
    with outputs.writing(out), staged_dir(out) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        for f in tmp.iterdir():
            f.chmod(0o644)
        outputs.write_marker(tmp, kind="export-hf")
        note = auto_tokenizer_note(tmp, tokenizer)
    if note:
        get_logger(__name__).info(note.replace(str(tmp), str(out)))
    return checkpoint
