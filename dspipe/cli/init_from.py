"""`gen-config --init-from HF_DIR` (and plan, bench, calibrate): the model options merged with the Hugging Face
model's config, its weights checked, and a note comparing its tokenizer with the data's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from dspipe.errors import SpecError
from dspipe.log import get_logger
from dspipe.model.hf import CONFIG_FILE, TRAINING_ONLY, spec_from_hf_dir
from dspipe.model.hf_weights import check_weights
from dspipe.spec.model import ModelSpec

SHAPE_FLAGS = ("layers", "hidden", "heads", "vocab", "ffn")


def init_from_spec(path: str, o: dict) -> ModelSpec:
    """The model of `gen-config --init-from HF_DIR` (and plan/bench): HF_DIR's config; a shape or architecture flag
    must agree with it, --seq-len may shorten the context (never beyond the model's positions), --dropout,
    --aux-loss-coef and --capacity-factor replace the config's; its weights are checked (check_weights). Prints a note
    comparing HF_DIR's tokenizer with the data's where both are known."""
    flag = f"--init-from {path}"
    if o.get("model"):
        raise SpecError(f"--model {o['model']} and {flag} both name the model; give one of them")
    if o.get("pad_vocab"):
        raise SpecError(f"--pad-vocab contradicts {flag}: the vocabulary is the Hugging Face model's")
    spec = spec_from_hf_dir(path, dropout=o.get("dropout"))
    for key in SHAPE_FLAGS:
        if o.get(key) is not None and o[key] != getattr(spec, key):
            raise SpecError(
                f"--{key} {o[key]} contradicts {flag} ({key} {getattr(spec, key)} in its "
                f"{CONFIG_FILE}); the shape comes from the Hugging Face model: drop --{key}"
            )
    if o.get("untied") and spec.tied_embeddings:
        raise SpecError(f"--untied contradicts {flag} (tie_word_embeddings true in its {CONFIG_FILE})")
    _check_architecture_flags(spec, o, flag=flag)
    training = {k: o[k] for k in TRAINING_ONLY if o.get(k) is not None}
    if training:  # how a mixture of experts trains (aux loss weight, capacity), not what it computes: like --dropout
        spec = replace(spec, **training)
    seq_len = o.get("seq_len")
    if seq_len is not None and seq_len != spec.seq_len:
        if isinstance(seq_len, int) and seq_len > spec.seq_len:
            why = (
                "learned positions: there are no weights for more"
                if spec.positions == "learned"
                else "the context its rotary embedding and rope scaling were trained for, max_position_embeddings"
            )
            raise SpecError(f"--seq-len {seq_len} exceeds the {spec.seq_len} positions of {flag} ({why})")
        spec = replace(spec, seq_len=seq_len)
    check_weights(path, spec)  # before anything is written or launched: files, names, shapes, dtypes (headers)
    note = tokenizer_note(path, o.get("data"))
    if note:
        get_logger(__name__).info(note)
    return spec


ARCHITECTURE_SKIP = ("name", "init_from", "seq_len", "dropout", "untied", *TRAINING_ONLY, *SHAPE_FLAGS)
"""Model options init_from_spec checks on their own (or that are not the model's architecture)."""


def _check_architecture_flags(spec: ModelSpec, o: dict, *, flag: str) -> None:
    """An architecture option given with --init-from (--norm, --head-dim, --qkv-bias, --rope-scaling, ...) must
    describe the Hugging Face model: it is the config's, so a flag can only agree with it (compared by what the model
    computes: --no-qkv-bias agrees with a config without biases)."""
    from dspipe.model.hf import function_of
    from dspipe.spec.options import TABLE

    for s in TABLE["model"]:
        value = o.get(s.key)
        if s.field is None or s.key in ARCHITECTURE_SKIP or value is None or (s.kind == "flag" and not value):
            continue
        try:
            same = function_of(replace(spec, **{s.field: value})) == function_of(spec)
        except SpecError:
            same = False
        if not same:
            field = "head_dim" if s.field == "head_width" else s.field  # function_of's names
            shown = function_of(spec).get(field, getattr(spec, s.field))
            typed = (
                s.flags.split("/")[0 if value else -1]
                if isinstance(value, bool)
                else f"{s.flag_name} {_flag_value(value)}"
            )  # as typed: --qk-norm, --no-qkv-bias, --head-dim 8
            raise SpecError(
                f"{typed} contradicts {flag} ({s.key} {_flag_value(shown)} from its {CONFIG_FILE}); the "
                f"architecture comes from the Hugging Face model: drop {typed.split()[0]}"
            )


def _flag_value(value) -> str:
    return (
        str(value).lower()
        if isinstance(value, bool) or value is None
        else f"{value:g}"
        if isinstance(value, float)
        else str(value)
    )


def tokenizer_vocab(tokenizer_json: Path) -> tuple[int, dict] | None:
    """(size, vocabulary) of a tokenizer.json: its model's vocab and its added tokens; None if unreadable."""
    from dspipe.jsonio import read_object

    try:
        tok = read_object(tokenizer_json)
        vocab = dict(tok["model"]["vocab"]) if isinstance(tok["model"].get("vocab"), dict) else {}
        vocab.update({t["content"]: t["id"] for t in tok.get("added_tokens") or []})
        return len(set(vocab.values())), vocab
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def tokenizer_note(hf_dir: str, data: str | None) -> str | None:
    """Whether the prepared data's tokenizer is HF_DIR's (its vocabulary size, and whether the vocabulary is
    the same), as one note line; None when either side is unknown."""
    from dspipe.data.checks import tokenizer_path
    from dspipe.data.megatron import is_prefix
    from dspipe.data.shards import META_FILE, is_prepared, read_meta
    from dspipe.jsonio import read_object

    if not data or not is_prepared(data):
        return None
    hint = f"prepare the data with the model's tokenizer: 'dspipe prepare-data --tokenizer {hf_dir} --out {data}'"
    # a Megatron prefix: its tokenizer's vocab (or its largest id + 1); a directory: meta.json's, read as it is
    data_vocab = (
        read_meta(data)["vocab_size"] if is_prefix(data) else read_object(Path(data) / META_FILE).get("vocab_size")
    )
    if not (Path(hf_dir) / "tokenizer.json").is_file():
        return (
            f"note: {hf_dir} has no tokenizer.json, so its tokenizer was not compared with {data}'s "
            f"({data_vocab} tokens); {hint}"
        )
    theirs = tokenizer_vocab(Path(hf_dir) / "tokenizer.json")
    ours = tokenizer_vocab(tokenizer_path(data) / "tokenizer.json")
    if theirs is None:
        return f"note: cannot read {Path(hf_dir) / 'tokenizer.json'}; {hint}"
    if theirs[0] != data_vocab:
        return (
            f"note: {data} was tokenized with a {data_vocab}-token tokenizer, {hf_dir}'s has {theirs[0]} "
            f"tokens: token ids would not mean what the model learned; {hint}"
        )
    if ours is not None and ours[1] != theirs[1]:
        return (
            f"note: {data}'s tokenizer has the same vocab size as {hf_dir}'s ({data_vocab}) but another "
            f"vocabulary; {hint}"
        )
    return f"note: {data}'s tokenizer has the same vocab size as {hf_dir}'s ({data_vocab} tokens)"
