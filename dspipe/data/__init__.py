"""Token data: prepare-data (inputs -> tokenizer -> memory-mapped token shards) and the distributed loader.

    sources.py    local files / globs / directories / hub datasets -> documents, through `datasets`
    tokenizer.py  Hugging Face tokenizer or a trained byte-level BPE; the per-worker batch encoder
    shards.py     the on-disk format: meta.json, token shards, document indexes; checked on open
    prepare.py    the preparation: parallel encoding, train/val split, atomic output, no-op re-runs
    loader.py     windows over the memory map, the dp-invariant seeded order, resumable per-rank micro-batches
    checks.py     data vs model (vocab, sequence length) from meta.json alone; blend sources share one tokenizer
    blend.py      --data a:0.7,b:0.3: the parser, the exact greedy blend order, the blend's loader and state
    megatron.py   Megatron / GPT-NeoX indexed datasets (PREFIX.bin + .idx): read as they are, checked, written
    convert.py    convert-data: a prepared directory <-> a Megatron dataset, token for token

Importing this package loads numpy only (no torch, datasets or transformers).
"""

from dspipe.data.blend import BlendLoader, BlendSpec
from dspipe.data.checks import check_data_for_model, padded_vocab
from dspipe.data.loader import (
    BatchOrder,
    Permutation,
    SampleOrder,
    TokenWindows,
    TrainLoader,
    micro_batches,
    val_batches,
)
from dspipe.data.shards import META_FILE, TOKENIZER_DIR, open_split, read_meta
from dspipe.data.sources import stdlib_sources

__all__ = [
    "BatchOrder",
    "BlendLoader",
    "BlendSpec",
    "META_FILE",
    "Permutation",
    "SampleOrder",
    "TOKENIZER_DIR",
    "TokenWindows",
    "TrainLoader",
    "check_data_for_model",
    "micro_batches",
    "open_split",
    "padded_vocab",
    "read_meta",
    "stdlib_sources",
    "val_batches",
]
