"""Tokenizers for prepare-data: a Hugging Face tokenizer (name or local directory, through `transformers`) or a
byte-level BPE trained with `tokenizers`; saved in Hugging Face format; and the per-worker batch encoder."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path
from typing import Iterable

import numpy as np

from dspipe.errors import SpecError

EOS = "<|endoftext|>"
MIN_VOCAB, MAX_VOCAB = 257, 2**18  # 256 bytes + EOS .. a sane trained vocabulary
MAX_WORD_CHARS = 256
"""Longest run of non-whitespace characters the trained BPE sees as one pre-token (pre_tokenizer)."""


def check_vocab(vocab_size) -> None:
    """--train-tokenizer: MIN_VOCAB..MAX_VOCAB (256 bytes + EOS at least; beyond 2^18 a BPE trained on a sample
    of the input is absurd, and every token id still fits the uint32 shards)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise SpecError(f"--train-tokenizer {str(vocab_size)[:40]}: the vocabulary must hold at least {MIN_VOCAB} "
                        f"tokens (256 bytes + EOS) and at most {MAX_VOCAB:,} (allowed range {MIN_VOCAB}..{MAX_VOCAB})")


def pre_tokenizer():
    """GPT-2's byte-level pre-tokenizer, after cutting every run of MAX_WORD_CHARS non-whitespace characters
    into its own piece. BPE training time grows with the length of a pre-token (each merge rescans the words
    holding the pair): one 1 MiB word without whitespace ran for more than 5 minutes; cut, it takes seconds.
    Text without runs of MAX_WORD_CHARS non-whitespace characters splits exactly as GPT-2's pre-tokenizer
    splits it."""
    from tokenizers import Regex, pre_tokenizers

    cut = pre_tokenizers.Split(Regex(rf"\S{{{MAX_WORD_CHARS}}}"), behavior="isolated")
    return pre_tokenizers.Sequence([cut, pre_tokenizers.ByteLevel(add_prefix_space=False)])


def train_bpe(docs: Iterable[str], *, vocab_size: int):
    """A byte-level BPE (GPT-2 style pre-tokenizer, long words cut: pre_tokenizer) with EOS as its only special
    token, id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    check_vocab(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    return _hf_from_tokenizer(tok)


def _hf_from_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS)


def load_hf(name_or_dir: str):
    """AutoTokenizer.from_pretrained; offline, a hub name fails in seconds with one line instead of retrying."""
    from dspipe.data.sources import HUB_NAME

    path = Path(name_or_dir)
    if not path.exists() and not HUB_NAME.match(name_or_dir):
        raise SpecError(f"tokenizer directory {name_or_dir} does not exist")
    if path.is_file():
        return load_tokenizer_file(path)
    if path.is_dir() and (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        return load_tokenizer_file(path / "tokenizer.json")  # AutoTokenizer wants a config beside it
    offline = None
    if not path.exists():
        from dspipe.data.sources import go_offline_if_unreachable
        offline = go_offline_if_unreachable()
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(name_or_dir)
    except Exception as e:  # OSError, ValueError, HFValidationError, ... from transformers and huggingface_hub
        if offline:
            why = f"{offline}; not in the local cache either"
        else:
            why = " ".join(str(e).split())[:300]
        raise SpecError(f"cannot load tokenizer {name_or_dir!r}: {why}") from None
    if not tok.is_fast:
        raise SpecError(f"tokenizer {name_or_dir!r} has no fast (Rust) version; prepare-data needs one")
    if tok.eos_token_id is None:
        raise SpecError(f"tokenizer {name_or_dir!r} has no EOS token; documents are separated by EOS")
    return tok


EOS_NAMES = (EOS, "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "<|end|>")
"""Special tokens taken as EOS in a bare tokenizer.json (it has no tokenizer_config.json naming one), in order."""


def load_tokenizer_file(path: Path):
    """A bare tokenizer.json (the `tokenizers` format) from disk, offline: no hub lookup, no transformers
    config; its EOS is the first special token named in EOS_NAMES."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exceptions for unreadable or foreign JSON
        raise SpecError(f"cannot load tokenizer file {path}: {' '.join(str(e).split())[:200]}") from None
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    eos = next((name for name in EOS_NAMES if name in special), None)
    if eos is None:
        raise SpecError(f"tokenizer {path} has no EOS token (no special token {', '.join(EOS_NAMES)}); documents "
                        f"are separated by EOS: give its directory with a tokenizer_config.json naming eos_token")
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos)


def save_hf(tok, directory: Path) -> Path:
    """Save in Hugging Face format; returns the tokenizer.json the workers load."""
    tok.save_pretrained(str(directory))
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise SpecError(f"the tokenizer did not save a tokenizer.json in {directory}")
    return path


# ---- worker side: one Rust tokenizer per process, single-threaded (parallelism comes from processes) ----

_worker: dict = {}
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None)


def release_memory() -> None:
    """Hand freed heap back to the OS (glibc malloc_trim). Without it, the Rust tokenizer's per-batch allocations
    fragment the heap and a worker's RSS creeps up with the corpus (150 -> 450 MiB over 400 MB of text)."""
    trim = getattr(_libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


def warm_worker() -> None:
    """Pool initializer: import while the main process is still loading or training the tokenizer."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import tokenizers  # noqa: F401


def encode_batch(tokenizer_json: str, eos_id: int, dtype: str, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(token ids of the documents back to back, each followed by EOS; document lengths including EOS)."""
    if _worker.get("path") != tokenizer_json:
        from tokenizers import Tokenizer
        _worker.update(path=tokenizer_json, tok=Tokenizer.from_file(tokenizer_json))
    tok = _worker["tok"]
    # the same ids as encode_batch, without computing character offsets (~25% faster, less memory)
    encodings = (getattr(tok, "encode_batch_fast", None) or tok.encode_batch)(texts, add_special_tokens=False)
    lengths = np.fromiter((len(e) + 1 for e in encodings), dtype=np.int64, count=len(encodings))
    out = np.empty(int(lengths.sum()), dtype=dtype)
    pos = 0
    for e, n in zip(encodings, lengths):
        out[pos:pos + n - 1] = e.ids
        out[pos + n - 1] = eos_id
        pos += n
    del encodings
    release_memory()
    return out, lengths
