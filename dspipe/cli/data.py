"""`dspipe prepare-data`: inputs -> tokenizer -> memory-mapped token shards. Imports no torch; the data libraries
(datasets, transformers, tokenizers) load only when the command runs."""

from __future__ import annotations

import os
from pathlib import Path

import click

from dspipe.cli.options import DEFAULT_DATA, FLOAT, INT

BUILTIN_MAX_MB = 8.0


@click.command("prepare-data")
@click.argument("inputs", nargs=-1)
@click.option(
    "--source",
    "sources",
    multiple=True,
    help="input (repeatable, same as INPUTS): file, glob, directory or Hugging Face dataset name",
)
@click.option(
    "--out",
    default=DEFAULT_DATA,
    show_default=True,
    metavar="DIR",
    help="output directory (replaced only if dspipe prepared it and it holds nothing else)",
)
@click.option("--text-field", default="text", show_default=True, help="text column of .jsonl/.json/.parquet/hub data")
@click.option(
    "--txt-docs",
    type=click.Choice(["file", "blank-line"]),
    default="file",
    show_default=True,
    help="plain-text files: one document per file, or per blank-line-separated block",
)
@click.option("--config", "hub_config", default=None, help="Hugging Face dataset configuration")
@click.option("--split", default="train", show_default=True, help="Hugging Face dataset split")
@click.option(
    "--streaming/--no-streaming",
    default=True,
    show_default=True,
    help="read inputs as a stream (memory independent of size); --no-streaming builds datasets' Arrow cache",
)
@click.option("--tokenizer", default=None, help="Hugging Face tokenizer name or local directory (transformers)")
@click.option(
    "--train-tokenizer",
    type=INT,
    default=None,
    metavar="VOCAB_SIZE",
    help="train a byte-level BPE of this size on the input [default: 4096 unless --tokenizer]",
)
@click.option(
    "--tokenizer-sample-mb",
    type=FLOAT,
    default=64.0,
    show_default=True,
    help="text the BPE is trained on (the start of the input, in pieces of at most 64Ki characters)",
)
@click.option(
    "--val-fraction", type=FLOAT, default=0.01, show_default=True, help="fraction of documents in the validation split"
)
@click.option(
    "--max-mb",
    type=FLOAT,
    default=None,
    help=f"stop after this much text [default: all; {BUILTIN_MAX_MB:g} for the built-in corpus]",
)
@click.option("--shard-tokens", type=INT, default=500_000_000, show_default=True, help="tokens per shard file")
@click.option("--workers", type=INT, default=None, help="tokenizer processes, 1-128 [default: usable CPUs, at most 32]")
@click.option(
    "--skip-bad",
    is_flag=True,
    default=False,
    help="skip non-UTF-8 files and files that fail to read (an I/O error), counted, instead of failing",
)
@click.option(
    "--format",
    "out_format",
    type=click.Choice(["dspipe", "megatron"]),
    default="dspipe",
    show_default=True,
    help="dspipe: token shards + meta.json; megatron: OUT/text_document.bin/.idx (Megatron / GPT-NeoX "
    "indexed dataset, --data-path OUT/text_document) and OUT/tokenizer",
)
@click.option(
    "--force",
    is_flag=True,
    default=False,
    help="rebuild even if --out already holds this preparation (only a directory dspipe prepared)",
)
def prepare_data(
    inputs,
    sources,
    out: Path,
    text_field,
    txt_docs,
    hub_config,
    split,
    streaming,
    tokenizer,
    train_tokenizer,
    tokenizer_sample_mb,
    val_fraction,
    max_mb,
    shard_tokens,
    workers,
    skip_bad,
    out_format,
    force,
) -> None:
    """Tokenize INPUTS (files, globs, directories, or a Hugging Face dataset name; default: the Python standard
    library's source) into memory-mapped token shards with a train/validation split, in parallel. Re-running
    with the same inputs and options is a no-op."""
    from dspipe.data.limits import mib_to_bytes
    from dspipe.data.prepare import prepare
    from dspipe.data.sources import check_out_apart, resolve_inputs
    from dspipe.outputs import target

    out = target(out, flag="--out", expect="dir")  # before reading any input
    final = out
    if out_format == "megatron":  # tokens prepared beside it (resumable), then written in Megatron's format
        out = _megatron_staging(out, force=force)
    specs = list(inputs) + list(sources)
    resolved = resolve_inputs(
        specs,
        text_field=text_field,
        txt_docs=txt_docs,
        config=hub_config,
        split=split,
        streaming=streaming,
        skip_bad=skip_bad,
    )
    check_out_apart(specs, resolved, [final, out])  # before anything is written or read
    if max_mb is None and not specs:
        max_mb = BUILTIN_MAX_MB
    workers = min(32, len(os.sched_getaffinity(0))) if workers is None else workers  # 0 is refused, not "auto"
    result = prepare(
        inputs=resolved,
        out=out,
        tokenizer=tokenizer,
        train_tokenizer=train_tokenizer,
        tokenizer_sample_bytes=mib_to_bytes(tokenizer_sample_mb, flag="--tokenizer-sample-mb"),
        val_fraction=val_fraction,
        max_bytes=None if max_mb is None else mib_to_bytes(max_mb, flag="--max-mb"),
        shard_tokens=shard_tokens,
        workers=workers,
        force=force,
        progress=True,
        log=click.echo,
    )
    _report(result, out=out, final=final, out_format=out_format, workers=workers)


def _megatron_staging(out: Path, *, force: bool) -> Path:
    """Claim `out` for --format megatron (refused before any tokenizing); the directory its tokens are prepared in."""
    from dspipe.outputs import claim_dir

    claim_dir(out, kind="data", replace=force)  # refused before any tokenizing
    return out.with_name(f".{out.name}.tokens")


def _report(result, *, out: Path, final: Path, out_format: str, workers: int) -> None:
    """prepare-data's lines on the prepared data (for --format megatron: written in Megatron's format first)."""
    m = result.meta
    train, val = m["splits"]["train"], m["splits"]["val"]
    if out_format == "megatron":
        _write_megatron(out, final=final, vocab_size=m["vocab_size"])
        return
    if result.reused:
        click.echo(
            f"{out} already prepared from the same inputs: {m['num_tokens']:,} tokens, vocab "
            f"{m['vocab_size']} (--force rebuilds)"
        )
        return
    skipped = m["skipped"]
    click.echo(
        f"wrote {out}: {m['num_documents']:,} documents, {m['num_bytes'] / 2**20:.1f} MiB text -> "
        f"{m['num_tokens']:,} {m['dtype']} tokens (train {train['num_tokens']:,} in "
        f"{len(train['shards'])} shards / val {val['num_tokens']:,}, {val['num_documents']} documents), "
        f"vocab {m['vocab_size']}"
        + (
            f", skipped {skipped['empty']} empty, {skipped['bad_utf8']} non-UTF-8 and "
            f"{skipped['unreadable']} unreadable"
            if any(skipped.values())
            else ""
        )
    )
    resumed = f", {result.resumed_documents:,} documents resumed" if result.resumed_documents else ""
    click.echo(
        f"tokenized at {result.encoded_tokens / max(result.encode_seconds, 1e-9):,.0f} tokens/s with "
        f"{workers} workers ({result.seconds:.1f} s in all{resumed})"
    )


def _write_megatron(out: Path, *, final: Path, vocab_size: int) -> None:
    """Write the tokens prepared in `out` to `final` in Megatron's format, `out` then removed."""
    import shutil

    from dspipe.data.convert import to_megatron

    done = to_megatron(source=out, out=final, force=True)
    shutil.rmtree(out, ignore_errors=True)
    click.echo(
        f"wrote {done['prefix']}.bin/.idx: {done['num_documents']:,} documents, {done['num_tokens']:,} "
        f"{done['dtype']} tokens (train then validation documents), vocab {vocab_size}, tokenizer in "
        f"{final / 'tokenizer'}; Megatron: --data-path {done['prefix']}"
    )


@click.command("convert-data")
@click.argument("source")
@click.option(
    "--out",
    required=True,
    metavar="DIR",
    help="output directory: a prepared directory (from a Megatron PREFIX) or a Megatron dataset "
    "DIR/text_document.bin/.idx with DIR/tokenizer (from a prepared directory)",
)
@click.option(
    "--tokenizer",
    default=None,
    metavar="DIR",
    help="Hugging Face tokenizer directory of a Megatron SOURCE [default: PREFIX's sibling tokenizer/]",
)
@click.option("--force", is_flag=True, default=False, help="replace an earlier output of convert-data/prepare-data")
def convert_data(source: str, out: str, tokenizer: str | None, force: bool) -> None:
    """Convert SOURCE between dspipe's format and Megatron's / GPT-NeoX's indexed dataset: a Megatron PREFIX
    (PREFIX.bin + PREFIX.idx) becomes a prepared directory, a prepared directory a Megatron dataset. Token-exact."""
    from dspipe.data.convert import convert

    direction, done = convert(source=source, out=out, tokenizer=tokenizer, force=force)
    if direction == "to-megatron":
        click.echo(
            f"wrote {done['prefix']}.bin/.idx: {done['num_documents']:,} documents, {done['num_tokens']:,} "
            f"{done['dtype']} tokens; Megatron: --data-path {done['prefix']}"
        )
    else:
        click.echo(
            f"wrote {out}: {done['num_documents']:,} documents, {done['num_tokens']:,} {done['dtype']} tokens "
            f"(train {done['splits']['train']['num_documents']:,} / val "
            f"{done['splits']['val']['num_documents']:,} documents), vocab {done['vocab_size']}, EOS "
            f"{done['eos_id']}"
        )
