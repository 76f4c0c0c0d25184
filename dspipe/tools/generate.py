"""Text from a trained model: one sampling loop, fed by a dspipe checkpoint (its weights consolidated into dspipe's
GPT, the tokenizer from the run's data) or by an exported Hugging Face directory (AutoModelForCausalLM)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dspipe.errors import SpecError
from dspipe.spec.checks import is_int, is_number

HF_CONFIG = "config.json"


@dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy; top_k 0 = the whole vocabulary; a seeded generator makes a run repeatable."""

    max_tokens: int = 50
    temperature: float = 1.0
    top_k: int = 50
    seed: int = 0

    def __post_init__(self):
        _whole("--max-tokens", self.max_tokens, low=1, high=MAX_NEW_TOKENS, rule="must be at least 1")
        t = self.temperature
        finite = not isinstance(t, bool) and isinstance(t, (int, float)) and math.isfinite(t)
        if not (finite and 0 <= t <= MAX_TEMPERATURE):
            raise SpecError(
                f"--temperature must be >= 0 (0 = greedy), got {str(t)[:40]} "
                f"(allowed: finite, [0, {MAX_TEMPERATURE:g}])"
            )
        _whole("--top-k", self.top_k, low=0, high=2**31 - 1, rule="must be >= 0 (0 = no limit)")
        _whole("--seed", self.seed, low=0, high=2**63 - 1, rule="must be >= 0")


MAX_NEW_TOKENS = 100_000
MAX_TEMPERATURE = 100.0


def _whole(flag: str, value, *, low: int, high: int, rule: str) -> None:
    """An int in [low, high] (torch.Generator.manual_seed takes seeds up to 2^63 - 1 here)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        shown = str(value) if len(str(value)) <= 40 else str(value)[:37] + "..."
        what = f"{shown} is too large" if isinstance(value, int) and value > high else f"{rule}, got {shown}"
        raise SpecError(f"{flag} {what} (allowed range {low}..{high:,})")


@dataclass(frozen=True)
class Model:
    """What the loop needs: ids (1, t) -> logits (1, t, V), the context length, the tokenizer."""

    logits: Callable
    context: int
    tokenizer: object


def next_token(logits, *, sampling: Sampling, generator) -> int:
    """One token from the last position's logits (1-d, float). Any temperature in range is exact: the logits are
    shifted so that the largest is 0 before dividing, so a tiny temperature gives -inf (probability 0) to every
    token below the largest instead of overflowing to inf - inf = nan; its limit, temperature 0, is greedy."""
    import torch

    if not bool(torch.isfinite(logits).all()):
        bad = int((~torch.isfinite(logits)).sum())
        raise SpecError(
            f"the model computed {bad} non-finite logits (NaN or infinite) of {logits.numel()}: its "
            f"weights are damaged or overflow; nothing can be sampled"
        )
    if sampling.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits.double()
    logits = (logits - logits.max()) / sampling.temperature  # <= 0 everywhere, 0 at the largest: never nan
    if 0 < sampling.top_k < logits.numel():
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def check_fits(*, prompt_tokens: int, sampling: Sampling, context: int, vocab: int) -> None:
    """Refuse a prompt longer than the model's context (it would be cut before the first new token; transformers
    refuses such input too). Notes, one line each: a --top-k above the vocabulary samples from all of it (as
    transformers clamps it), and a prompt that leaves less room than --max-tokens is continued with a sliding window
    (past the context, each new token sees the last `context` tokens)."""
    from dspipe.log import get_logger

    if prompt_tokens > context:
        raise SpecError(
            f"the prompt is {prompt_tokens:,} tokens, more than the model's context of {context:,}: shorten it "
            f"(nothing is truncated)"
        )
    if sampling.top_k > vocab:
        get_logger(__name__).info(
            f"note: --top-k {sampling.top_k:,} is more than the model's vocabulary of {vocab:,} tokens: sampling "
            f"from all of them (as --top-k 0)"
        )
    if prompt_tokens + sampling.max_tokens > context:
        get_logger(__name__).info(
            f"note: the prompt's {prompt_tokens:,} token(s) + --max-tokens {sampling.max_tokens:,} = "
            f"{prompt_tokens + sampling.max_tokens:,} exceed the model's context of {context:,}: past it, each new "
            f"token sees only the last {context:,} tokens (a sliding window)"
        )


def sample(model: Model, prompt_ids: list[int], *, sampling: Sampling) -> list[int]:
    """The new token ids: stop at EOS (not included) or after max_tokens. The prompt must fit the context and
    --top-k the vocabulary (check_fits); past the context the model sees its last `context` tokens."""
    import torch

    tok = model.tokenizer
    eos, vocab = tok.eos_token_id, len(tok)  # never sample ids the tokenizer cannot decode (a padded vocab)
    ids = list(prompt_ids) or ([] if eos is None else [eos])  # an empty prompt starts from a document boundary
    if not ids:
        raise SpecError("--prompt is empty and the tokenizer has no end-of-text token to start from; give a prompt")
    check_fits(prompt_tokens=len(ids), sampling=sampling, context=model.context, vocab=vocab)
    generator = torch.Generator().manual_seed(sampling.seed)
    new: list[int] = []
    with torch.inference_mode():
        for _ in range(sampling.max_tokens):
            window = torch.tensor([ids[-model.context :]], dtype=torch.long)
            logits = model.logits(window)[0, -1, :vocab].float()
            token = next_token(logits, sampling=sampling, generator=generator)
            if token == eos:
                break
            ids.append(token)
            new.append(token)
    return new


def is_hf_dir(path: Path) -> bool:
    from dspipe.runtime.ckpt_tags import META_FILE

    return (path / HF_CONFIG).is_file() and not (path / META_FILE).is_file()


def load_model(source: str | Path) -> Model:
    path = Path(source)
    if path.is_dir() and is_hf_dir(path):
        return _load_hf(path)
    return _load_checkpoint(path)


def _load_hf(path: Path) -> Model:
    from transformers import AutoModelForCausalLM

    from dspipe.tools.export import load_tokenizer, quiet_transformers

    quiet_transformers()
    context = hf_context(path)
    _transformers_config(path)  # its errors name config.json, not the tokenizer that reads it too
    _check_generation_config(path)
    tokenizer = load_tokenizer(path)
    check_eos(tokenizer, path=path)
    try:  # mismatched shapes are loaded (re-initialised) and refused below, with the shapes
        model, info = AutoModelForCausalLM.from_pretrained(
            str(path), ignore_mismatched_sizes=True, output_loading_info=True
        )
    except Exception as e:  # OSError, ValueError, KeyError, safetensors errors, ... on a damaged directory
        raise SpecError(f"cannot load the Hugging Face model in {path}: {' '.join(str(e).split())[:300]}") from None
    check_shapes(path, list(info.get("mismatched_keys") or ()))
    check_names(path, missing=list(info.get("missing_keys") or ()), unexpected=list(info.get("unexpected_keys") or ()))
    check_float_weights(path, parameters={name for name, _ in model.named_parameters()})
    check_tokenizer_fits(tokenizer, vocab=model.get_input_embeddings().weight.shape[0], where=path)
    model.eval()
    return Model(logits=lambda ids: model(ids).logits, context=context, tokenizer=tokenizer)


def check_names(path: Path, *, missing: list, unexpected: list) -> None:
    """Refuse weights that do not name the tensors config.json's model has (transformers' missing_keys, which it
    would draw at random, and unexpected_keys, which it would drop): one line with the first of each."""
    if not missing and not unexpected:
        return
    parts = [
        f"{len(names)} {what} (first {sorted(names)[0]})"
        for names, what in ((missing, "missing, which would be drawn at random"), (unexpected, "not in the model"))
        if names
    ]
    raise SpecError(
        f"{path}: the weights do not match {HF_CONFIG}'s model: tensors {'; '.join(parts)}; restore {HF_CONFIG} or "
        f"export the model again"
    )


def check_float_weights(path: Path, *, parameters: set[str]) -> None:
    """Refuse a stored parameter that is not floating point (transformers would cast an int32 or complex tensor to
    the model's dtype without a word); buffers (position ids, masks) may be any dtype. From the files' headers."""
    from dspipe.model.hf_weights import CheckpointTensors

    tensors = CheckpointTensors(path)
    for name in tensors:
        _, dtype, float_bytes = tensors.header(name)
        if not float_bytes and (name in parameters or any(p.endswith("." + name) for p in parameters)):
            raise SpecError(
                f"{tensors.source}: tensor {name} is stored as {dtype}, not a floating-point weight (F32, BF16, F16, "
                f"F64)"
            )


def check_tokenizer_fits(tokenizer, *, vocab: int, where) -> None:
    """Every id the tokenizer can produce must have a row in the model's embedding (an added token beyond it would
    index past the table)."""
    if len(tokenizer) > vocab:
        extra = f"id {vocab:,} has" if len(tokenizer) == vocab + 1 else f"ids {vocab:,}..{len(tokenizer) - 1:,} have"
        raise SpecError(
            f"{where}: the tokenizer has {len(tokenizer):,} tokens, more than the model's vocab {vocab:,} ({extra} "
            f"no embedding row)"
        )


def _transformers_config(path: Path) -> None:
    """config.json as transformers reads it (its own field checks), before the tokenizer reads it too."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(str(path))
    except Exception as e:  # ValueError, TypeError, KeyError, strict-dataclass validation errors, ...
        raise SpecError(f"{path / HF_CONFIG}: transformers cannot read it: {' '.join(str(e).split())[:300]}") from None


GENERATION_KEYS = {  # generation_config.json key -> (what it must be, the check)
    "do_sample": ("true or false", lambda v: isinstance(v, bool)),
    "use_cache": ("true or false", lambda v: isinstance(v, bool)),
    "temperature": ("a number >= 0", lambda v: is_number(v) and v >= 0),
    "top_p": ("a number in (0, 1]", lambda v: is_number(v) and 0 < v <= 1),
    "top_k": ("an integer >= 0", lambda v: is_int(v) and v >= 0),
    "max_length": ("an integer >= 1", lambda v: is_int(v) and v >= 1),
    "max_new_tokens": ("an integer >= 1", lambda v: is_int(v) and v >= 1),
}


def _check_generation_config(path: Path) -> None:
    """generation_config.json, when the directory has one (transformers reads it with the model): a JSON object whose
    token ids lie in config.json's vocabulary and whose sampling settings have their types and ranges."""
    from dspipe.jsonio import read_object, show

    source = path / "generation_config.json"
    if not os.path.lexists(source):
        return
    config, vocab = read_object(source), read_object(path / HF_CONFIG).get("vocab_size") or 2**24
    _check_token_ids(config, GENERATION_IDS, vocab=vocab, source=source)
    for key, (want, ok) in GENERATION_KEYS.items():
        if config.get(key) is not None and not ok(config[key]):
            raise SpecError(f"{source}: {key} must be {want}, got {show(config[key])}")


def check_eos(tokenizer, *, path: Path) -> None:
    """The tokenizer's end-of-text token must be one the model can produce (an id below config.json's vocab_size):
    an eos_token outside the vocabulary would be added as a new id no logit reaches, and generation never stops."""
    from dspipe.jsonio import read_object

    vocab = read_object(path / HF_CONFIG).get("vocab_size")
    eos = tokenizer.eos_token_id
    if eos is not None and isinstance(vocab, int) and not 0 <= eos < vocab:
        raise SpecError(
            f"{path}: the tokenizer's eos_token {tokenizer.eos_token!r} is id {eos:,}, outside the model's "
            f"vocabulary 0..{vocab - 1:,} (config.json vocab_size); fix eos_token in tokenizer_config.json"
        )


def check_shapes(path: Path, mismatched: list) -> None:
    """Refuse weights whose shapes differ from the ones config.json gives (transformers' mismatched_keys:
    (name, shape in the weights, shape by config.json)), naming the first and how many."""
    if not mismatched:
        return
    mismatched = sorted(mismatched, key=lambda m: str(m[0]))  # a set in transformers 5
    name, saved, wanted = mismatched[0]
    more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
    raise SpecError(
        f"{path / HF_CONFIG} does not match the weights: {name} is {list(saved)} in the weights but "
        f"{list(wanted)} by {HF_CONFIG}{more}; restore {HF_CONFIG} or export the model again"
    )


def hf_context(path: Path) -> int:
    """The context length in config.json (n_positions, else max_position_embeddings), after checking the file:
    a JSON object naming a model_type, the length a positive integer. One line naming the file otherwise."""
    from dspipe.jsonio import read_object, show

    source = path / HF_CONFIG
    config = read_object(source)
    if not isinstance(config.get("model_type"), str):
        raise SpecError(f"{source}: model_type must name a transformers model, got {show(config.get('model_type'))}")
    key = "n_positions" if "n_positions" in config else "max_position_embeddings"
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 2**24:
        raise SpecError(f"{source}: {key} must be a context length in 1..{2**24:,}, got {show(value)}")
    _check_shape(config, source=source)
    if _dspipe_reads(config):  # a model dspipe trains: the checks --init-from makes (eps, rope, windows, ...)
        from dspipe.model.hf import spec_from_hf_dir

        spec_from_hf_dir(path, dropout=0.0)  # dropout: generation runs none
    return value


def _dspipe_reads(config: dict) -> bool:
    """Whether config.json names an architecture dspipe imports (else transformers alone reads it)."""
    from dspipe.model.hf import MODEL_TYPES, SUPPORTED

    archs = config.get("architectures")
    if isinstance(archs, list) and archs:
        return archs[0] in SUPPORTED
    return config.get("model_type") in MODEL_TYPES


SHAPE_KEYS = {  # config.json key -> the ModelSpec field whose limit it keeps (GPT-2's names and the Llama family's)
    "num_hidden_layers": "layers",
    "n_layer": "layers",
    "hidden_size": "hidden",
    "n_embd": "hidden",
    "num_attention_heads": "heads",
    "n_head": "heads",
    "num_key_value_heads": "heads",
    "vocab_size": "vocab",
    "intermediate_size": "ffn",
}


GENERATION_IDS = ("eos_token_id", "bos_token_id", "pad_token_id", "decoder_start_token_id")
"""Token-id keys of config.json (the first three) and generation_config.json (all four)."""


def _check_token_ids(config: dict, keys: tuple[str, ...], *, vocab: int, source: Path) -> None:
    """Each of `keys` the file gives: a token id, or a list of them, in 0..vocab - 1."""
    from dspipe.jsonio import show

    for key in keys:
        value = config.get(key)
        ids = value if isinstance(value, list) else [value]
        if value is not None and not all(is_int(i) and 0 <= i < vocab for i in ids):
            raise SpecError(f"{source}: {key} must be a token id in 0..{vocab - 1:,}, got {show(value)}")


DROPOUT_KEYS = (
    "attention_dropout",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "hidden_dropout",
    "summary_first_dropout",
)
"""config.json's dropout probabilities (generation runs none, but a value outside [0, 1) is a damaged file)."""


def _check_shape(config: dict, *, source: Path) -> None:
    """The shape keys config.json gives (positive integers within dspipe's limits), `architectures` (a list of
    names), the eos/bos/pad token ids (an id, or a list of them, below the vocabulary), the dropout probabilities and
    pretraining_tp, before transformers builds or the tokenizer reads anything from the file."""
    from dspipe.jsonio import show
    from dspipe.spec.checks import limit

    for key, field in SHAPE_KEYS.items():
        if key not in config or (key == "num_key_value_heads" and config[key] is None):
            continue
        value, most = config[key], limit(field)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
            raise SpecError(f"{source}: {key} must be an integer in 1..{most:,}, got {show(value)}")
    archs = config.get("architectures")
    if archs is not None and not (isinstance(archs, list) and archs and all(isinstance(a, str) for a in archs)):
        raise SpecError(f"{source}: architectures must be a list of class names, got {show(archs)}")
    _check_token_ids(config, GENERATION_IDS[:3], vocab=config.get("vocab_size") or 2**24, source=source)
    for key in DROPOUT_KEYS:
        value = config.get(key)
        if value is not None and not (is_number(value) and 0 <= value < 1):
            raise SpecError(f"{source}: {key} must be a probability in [0, 1), got {show(value)}")
    tp = config.get("pretraining_tp")
    if tp is not None and not (is_int(tp) and 1 <= tp <= limit("heads")):
        raise SpecError(f"{source}: pretraining_tp must be an integer in 1..{limit('heads'):,}, got {show(tp)}")


def _load_checkpoint(path: Path) -> Model:
    from dspipe.tools.consolidate import load_gpt
    from dspipe.tools.export import load_tokenizer, read_checkpoint_meta, resolve_checkpoint, tokenizer_dir

    checkpoint = resolve_checkpoint(path)
    meta = read_checkpoint_meta(checkpoint)
    tokenizer = load_tokenizer(tokenizer_dir(checkpoint))
    gpt = load_gpt(checkpoint, meta=meta)
    check_tokenizer_fits(tokenizer, vocab=gpt.spec.vocab, where=f"tokenizer {tokenizer_dir(checkpoint)}")
    return Model(logits=gpt, context=gpt.spec.seq_len, tokenizer=tokenizer)


def check_prompt(prompt: str) -> str:
    """--prompt as UTF-8 text: bytes that are not UTF-8 reach Python as lone surrogates (from the command line),
    which no tokenizer encodes."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SpecError(
            f"--prompt holds bytes that are not UTF-8 text (at character {e.start + 1}: "
            f"{ascii(prompt[e.start : e.end])}); give the prompt as UTF-8"
        ) from None
    return prompt


def generate(*, source: str | Path, prompt: str, sampling: Sampling) -> str:
    """The prompt followed by the sampled continuation, decoded."""
    check_prompt(prompt)
    model = load_model(source)
    prompt_ids = model.tokenizer.encode(prompt, add_special_tokens=False)
    new = sample(model, prompt_ids, sampling=sampling)
    return prompt + model.tokenizer.decode(new)
