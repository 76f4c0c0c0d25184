"""Token data: build a memory-mapped corpus with a byte-level BPE tokenizer, and read fixed windows from it.

The default corpus is the Python standard library's source text: real text that exists offline on every machine.
"""
from __future__ import annotations

import json
import os
import shutil
import sysconfig
import tempfile
from pathlib import Path

import numpy as np

from dspipe.errors import SpecError

EOS = "<|endoftext|>"
META_FILE = "meta.json"
TOKENS_FILE = "tokens.bin"
TOKENIZER_DIR = "tokenizer"


def stdlib_sources() -> list[Path]:
    """The standard library's .py files, sorted, so the corpus is the same on every run."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))


def _read_documents(sources: list[Path], max_bytes: int) -> list[str]:
    docs, total = [], 0
    for path in sources:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        docs.append(text)
        total += len(text.encode("utf-8"))
        if total >= max_bytes:
            break
    return docs


def _train_tokenizer(docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def prepare_corpus(*, out: Path, sources: list[Path], vocab_size: int, max_bytes: int) -> dict:
    """Train a tokenizer on the sources, tokenize them (EOS between documents) into out/tokens.bin.

    Written to a temp dir and renamed, so `out` is complete or absent.
    """
    from transformers import PreTrainedTokenizerFast

    out = Path(out)
    if vocab_size < 257 or vocab_size > 65535:
        raise SpecError(f"vocab size {vocab_size} must be in [257, 65535] (256 bytes + EOS; uint16 ids)")
    docs = _read_documents(sources, max_bytes)
    if not docs:
        raise SpecError(f"no readable UTF-8 text in {len(sources)} source files")
    tok = _train_tokenizer(docs, vocab_size)
    eos_id = tok.token_to_id(EOS)
    ids = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eos_id)
    tokens = np.asarray(ids, dtype=np.uint16)
    meta = {"vocab_size": tok.get_vocab_size(), "dtype": "uint16", "num_tokens": int(tokens.size),
            "num_documents": len(docs), "num_bytes": sum(len(d.encode("utf-8")) for d in docs),
            "eos_id": eos_id, "tokenizer": TOKENIZER_DIR}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)
    try:
        PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS,
                                unk_token=EOS).save_pretrained(str(tmp / TOKENIZER_DIR))
        tokens.tofile(tmp / TOKENS_FILE)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def read_meta(data_dir: str | Path) -> dict:
    path = Path(data_dir) / META_FILE
    if not path.is_file():
        raise SpecError(f"{data_dir} is not a prepared data directory (no {META_FILE}); "
                        f"run 'dspipe prepare-data --out {data_dir}'")
    return json.loads(path.read_text())


class TokenWindows:
    """Non-overlapping windows of seq_len + 1 tokens over the memory-mapped corpus (no copy into RAM)."""

    def __init__(self, data_dir: str | Path, *, seq_len: int):
        meta = read_meta(data_dir)
        self.tokens = np.memmap(Path(data_dir) / TOKENS_FILE, dtype=np.dtype(meta["dtype"]), mode="r")
        if self.tokens.size != meta["num_tokens"]:
            raise SpecError(f"{data_dir}/{TOKENS_FILE} holds {self.tokens.size} tokens, meta.json says "
                            f"{meta['num_tokens']}: the file is truncated or foreign")
        self.seq_len = seq_len
        self.vocab_size = meta["vocab_size"]
        if len(self) == 0:
            raise SpecError(f"corpus of {self.tokens.size} tokens is shorter than one sequence of {seq_len + 1}")

    def __len__(self) -> int:
        return (self.tokens.size - 1) // self.seq_len

    def __getitem__(self, i: int) -> np.ndarray:
        start = i * self.seq_len
        return np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64)


class BatchOrder:
    """Global sample order: a seeded permutation per epoch, cut into steps and data-parallel shards.

    Sample k of the run is the same window whatever the dp size: step s, micro-batch m, rank r, slot j
    read global index s*global_batch + m*(dp*micro_batch) + r*micro_batch + j.
    """

    def __init__(self, *, num_samples: int, seed: int, dp: int, micro_batch: int, grad_accum: int):
        self.num_samples, self.seed = num_samples, seed
        self.dp, self.micro_batch, self.grad_accum = dp, micro_batch, grad_accum
        self._epoch, self._perm = -1, None

    def indices(self, *, step: int, micro: int, dp_rank: int) -> np.ndarray:
        first = (step * self.grad_accum + micro) * self.dp * self.micro_batch + dp_rank * self.micro_batch
        epochs, pos = np.divmod(np.arange(first, first + self.micro_batch), self.num_samples)
        return np.array([self.permutation(int(e))[p] for e, p in zip(epochs, pos)])

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        return self._perm


def micro_batches(*, windows: TokenWindows, order: BatchOrder, dp_rank: int, start_step: int = 0):
    """Endless (inputs, labels) int64 tensors for this data-parallel rank, in the global order."""
    import torch

    step = start_step
    while True:
        for m in range(order.grad_accum):
            rows = np.stack([windows[int(i)] for i in order.indices(step=step, micro=m, dp_rank=dp_rank)])
            t = torch.from_numpy(rows)
            yield t[:, :-1].contiguous(), t[:, 1:].contiguous()
        step += 1
