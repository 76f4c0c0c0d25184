"""Tokenizers for prepare-data: a Hugging Face tokenizer (name or local directory, through `transformers`) or a
byte-level BPE trained with `tokenizers`; saved in Hugging Face format; and the per-worker batch encoder."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import re
import signal
from collections import deque
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from dspipe.errors import SpecError
from dspipe.jsonio import read_object

EOS = "<|endoftext|>"
MIN_VOCAB, MAX_VOCAB = 257, 2**18  # 256 bytes + EOS .. a sane trained vocabulary
MAX_WORD_CHARS = 256
"""Longest run of non-whitespace characters the trained BPE sees as one pre-token (pre_tokenizer)."""
PIECE_CHARS = 1 << 16
"""Longest text (characters) the BPE trainer or a worker's encoder is handed at once: a longer document is cut into
pieces (pieces). Both take time and memory that grow with the length of one text: one 40 MB line took 20 s and
3.5 GiB to train on, 38 s and 6.8 GiB to encode; in pieces, 9 s and 0.14 GiB, 18 s and 0.24 GiB (2-core machine)."""
ENCODE_GROUP_CHARS = 2 << 20
"""Text a worker encodes in one call (documents or pieces of one), so its Rust-side memory stays bounded: a batch
prepare-data sends (about 1 MiB, the last document under 1 MiB) is one call."""


def check_vocab(vocab_size) -> None:
    """--train-tokenizer: MIN_VOCAB..MAX_VOCAB (256 bytes + EOS at least; beyond 2^18 a BPE trained on a sample
    of the input is absurd, and every token id still fits the uint32 shards)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise SpecError(
            f"--train-tokenizer {str(vocab_size)[:40]}: the vocabulary must hold at least {MIN_VOCAB} "
            f"tokens (256 bytes + EOS) and at most {MAX_VOCAB:,} (allowed range {MIN_VOCAB}..{MAX_VOCAB})"
        )


def pre_tokenizer():
    """GPT-2's byte-level pre-tokenizer, after cutting every run of MAX_WORD_CHARS non-whitespace characters
    into its own piece. BPE training time grows with the length of a pre-token (each merge rescans the words
    holding the pair): one 1 MiB word without whitespace ran for more than 5 minutes; cut, it takes seconds.
    Text without runs of MAX_WORD_CHARS non-whitespace characters splits exactly as GPT-2's pre-tokenizer
    splits it."""
    from tokenizers import Regex, pre_tokenizers

    cut = pre_tokenizers.Split(Regex(rf"\S{{{MAX_WORD_CHARS}}}"), behavior="isolated")
    return pre_tokenizers.Sequence([cut, pre_tokenizers.ByteLevel(add_prefix_space=False)])


_CUT = re.compile(r"(?<=[!-~\w]) (?=[!-~\w])")
"""A space between two characters that every whitespace definition calls non-whitespace (printable ASCII, letters,
digits): GPT-2's byte-level pre-tokenizer always ends a pre-token before such a space and starts the next with it."""


def _last_cut(text: str, *, start: int, end: int) -> int | None:
    """The last cut (_CUT) in text[start + 1:end + 1], searched from the end in widening windows, or None."""
    stop = min(len(text), end + 2)  # the character after a space at `end` decides it
    for back in (256, 8192, end - start):
        low = max(start + 1, end - back)
        last = next(iter(deque(_CUT.finditer(text, low, stop), maxlen=1)), None)  # the window's last match
        if last is not None and last.start() <= end:
            return last.start()
        if low == start + 1:
            return None
    return None


def pieces(text: str, *, size: int = PIECE_CHARS, exact: bool = True) -> Iterator[str]:
    """`text` in consecutive pieces of at most `size` characters, each cut before a space between two
    non-whitespace characters (_CUT: "word word" -> "word", " word"). GPT-2's byte-level pre-tokenizer, and
    pre_tokenizer, end a pre-token there whatever surrounds it, and a BPE encodes each pre-token alone: the
    pieces pre-tokenize into exactly the pre-tokens of the whole text and encode into exactly its ids
    (splits_exactly says which tokenizers). Where `size` characters hold no such space, exact=True goes on to the
    next one (the piece is longer), exact=False cuts at `size` (for training: one word cut in two)."""
    start = 0
    while len(text) - start > size:
        cut = _last_cut(text, start=start, end=start + size)
        if cut is None and exact:
            found = _CUT.search(text, start + size + 1)
            cut = found.start() if found else len(text)
        elif cut is None:
            cut = start + size
        yield text[start:cut]
        start = cut
    if start < len(text):
        yield text[start:]


def splits_exactly(tokenizer_json: Path) -> bool:
    """Whether the tokenizer encodes pieces (exact=True) of a text into exactly the ids of the whole text: no
    normalizer, a BPE model without dropout, GPT-2's byte-level pre-tokenizer without a prefix space (alone, or
    after pre_tokenizer's long-word cut), and no added token holding whitespace (one could span a cut)."""
    spec = read_object(tokenizer_json)
    model = spec.get("model") or {}
    bpe = model.get("type") == "BPE" and not model.get("dropout")
    spaced = any(re.search(r"\s", t.get("content", " ")) for t in spec.get("added_tokens") or [])
    return spec.get("normalizer") is None and bpe and _byte_level_gpt2(spec.get("pre_tokenizer")) and not spaced


def _byte_level_gpt2(pre: dict | None) -> bool:
    """GPT-2's byte-level pre-tokenizer (regex, no prefix space), alone or after pre_tokenizer's long-word cut."""

    def gpt2(p) -> bool:
        return (
            isinstance(p, dict)
            and p.get("type") == "ByteLevel"
            and p.get("add_prefix_space") is False
            and p.get("use_regex") is True
        )

    if gpt2(pre):
        return True
    steps = (pre or {}).get("pretokenizers") if (pre or {}).get("type") == "Sequence" else None
    return bool(steps) and len(steps) == 2 and steps[0] == _long_word_cut() and gpt2(steps[1])


def _long_word_cut() -> dict:
    """pre_tokenizer's first step as tokenizer.json writes it."""
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer()
    return json.loads(tok.to_str())["pre_tokenizer"]["pretokenizers"][0]


def train_bpe(docs: Iterable[str], *, vocab_size: int):
    """A byte-level BPE (GPT-2 style pre-tokenizer, long words cut: pre_tokenizer) with EOS as its only special
    token, id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    check_vocab(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
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
        raise SpecError(
            f"tokenizer {path} has no EOS token (no special token {', '.join(EOS_NAMES)}); documents "
            f"are separated by EOS: give its directory with a tokenizer_config.json naming eos_token"
        )
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
    """Pool initializer: import while the main process is still loading or training the tokenizer. A Ctrl-C is the
    main process's to handle (it stops the workers): a worker ignores it rather than print a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import tokenizers  # noqa: F401


def _worker_tokenizer(tokenizer_json: str):
    """This process's tokenizer, loaded once per file."""
    if _worker.get("path") != tokenizer_json:
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(tokenizer_json)
        except Exception as e:  # tokenizers raises plain Exceptions, an I/O error included
            raise SpecError(
                f"cannot load tokenizer file {tokenizer_json} in a worker: {' '.join(str(e).split())[:200]}"
            ) from None
        _worker.update(path=tokenizer_json, tok=tok)
    return _worker["tok"]


def _units(texts: list[str], piece_chars: int) -> Iterator[tuple[int, str]]:
    """(document index, text): each document whole, or in pieces (exact) when longer than piece_chars > 0."""
    for i, text in enumerate(texts):
        if piece_chars and len(text) > piece_chars:
            for piece in pieces(text, size=piece_chars, exact=True):
                yield i, piece
        else:
            yield i, text


def _groups(units: Iterator[tuple[int, str]], *, chars: int) -> Iterator[list[tuple[int, str]]]:
    """Consecutive units, about `chars` characters a group (one longer unit alone)."""
    group, total = [], 0
    for unit in units:
        if group and total + len(unit[1]) > chars:
            yield group
            group, total = [], 0
        group.append(unit)
        total += len(unit[1])
    if group:
        yield group


def encode_batch(
    texts: list[str], *, tokenizer_json: str, eos_id: int, dtype: str, piece_chars: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(token ids of the documents back to back, each followed by EOS; document lengths including EOS).

    Encoded ENCODE_GROUP_CHARS at a time; with piece_chars > 0 (a tokenizer that splits_exactly), a longer
    document is encoded in pieces: the same ids, in bounded time and memory."""
    tok = _worker_tokenizer(tokenizer_json)
    # the same ids as encode_batch, without computing character offsets (~25% faster, less memory)
    encode = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
    lengths = np.ones(len(texts), dtype=np.int64)  # the EOS
    chunks = []
    for group in _groups(_units(texts, piece_chars), chars=ENCODE_GROUP_CHARS):
        encodings = encode([text for _, text in group], add_special_tokens=False)
        for (i, _), e in zip(group, encodings, strict=False):
            ids = np.asarray(e.ids, dtype=dtype)
            lengths[i] += ids.size
            chunks.append((i, ids))
        del encodings
        release_memory()
    ends = np.cumsum(lengths)
    out = np.empty(int(ends[-1]) if texts else 0, dtype=dtype)
    pos = ends - lengths
    for i, ids in chunks:
        out[pos[i] : pos[i] + ids.size] = ids
        pos[i] += ids.size
    out[ends - 1] = eos_id
    return out, lengths
