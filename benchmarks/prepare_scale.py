"""prepare-data at scale: tokens/s per worker against the raw tokenizer on the same text, peak memory of the main
process and of a worker, and the wall time. Corpora are generated under /tmp, never in the repository.

    PYTHONPATH=. python benchmarks/prepare_scale.py                          # 1024 MB corpus, usable CPUs as workers
    PYTHONPATH=. python benchmarks/prepare_scale.py --size-mb 64 --workers 2
    PYTHONPATH=. python benchmarks/prepare_scale.py --input /data/corpus.jsonl --workers 16

1. Corpus: --input, or the standard library's UTF-8 .py files as documents, repeated in a seeded order until the text
   reaches --size-mb MB, as JSON lines (benchmarks/bench_data.make_corpus).
2. Tokenizer: the demo's 4096-token byte-level BPE (bench_data.demo_tokenizer); both measurements use its
   tokenizer.json.
3. prepare-data --tokenizer DIR --workers N --force, run by the CLI in a child process, which then reports its own
   peak RSS (getrusage RUSAGE_SELF: the main process) and that of its largest reaped child (RUSAGE_CHILDREN: a
   tokenizer worker). Tokens/s is the CLI's (tokens over the encoding time); per worker, divided by N.
4. Raw: tokenizers.Tokenizer.encode_batch on the first --raw-mb MB of the same documents in ~1 MiB batches, one
   thread (TOKENIZERS_PARALLELISM=false), in this process, timing the encode calls only; and encode_batch_fast (the
   same ids without character offsets), which the workers call.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the raw baseline is one thread, like one worker

from benchmarks.bench_data import demo_tokenizer, make_corpus, raw_encode  # noqa: E402


def child(args: list[str]) -> None:
    """In the child process: the prepare-data CLI, then this process's and its largest worker's peak RSS."""
    from dspipe.cli.app import main

    t0 = time.perf_counter()
    try:
        main(args)
    except SystemExit as e:
        if e.code:
            raise
    usage = {
        "wall_s": time.perf_counter() - t0,
        "main_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "worker_maxrss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
    }
    print("USAGE " + json.dumps(usage), flush=True)


def run_prepare(corpus: Path, out: Path, tokenizer: Path, *, workers: int) -> dict:
    args = [
        "prepare-data",
        str(corpus),
        "--out",
        str(out),
        "--tokenizer",
        str(tokenizer),
        "--workers",
        str(workers),
        "--force",
        "--val-fraction",
        "0.01",
    ]
    r = subprocess.run(
        [sys.executable, __file__, "--child", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    if r.returncode:
        sys.exit(f"prepare-data failed: {r.stderr[-2000:]}")
    rate = float(re.search(r"tokenized at ([\d,]+) tokens/s", r.stdout).group(1).replace(",", ""))
    usage = json.loads(r.stdout.split("USAGE ", 1)[1])
    meta = json.loads((out / "meta.json").read_text())
    return {
        "tokens": meta["num_tokens"],
        "documents": meta["num_documents"],
        "text_bytes": meta["num_bytes"],
        "tokens_per_s": rate,
        **usage,
    }


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=1024, help="corpus to generate (MB of text)")
    parser.add_argument("--input", type=Path, default=None, help="a JSON-lines corpus ({'text': ...}) instead")
    parser.add_argument("--workers", type=int, default=min(32, len(os.sched_getaffinity(0))))
    parser.add_argument("--raw-mb", type=int, default=64, help="text the raw tokenizer encodes (the corpus's start)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/dspipe-bench"))
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    corpus = args.input or Path(make_corpus(args.work / f"corpus-{args.size_mb}.jsonl", megabytes=args.size_mb)["path"])
    print(f"corpus {corpus} ({corpus.stat().st_size / 1e6:,.0f} MB), {args.workers} workers", flush=True)
    tokenizer = demo_tokenizer(args.work)
    run = run_prepare(corpus, args.work / f"out-{corpus.stem}", tokenizer, workers=args.workers)
    raw = {
        m: raw_encode(corpus, tokenizer / "tokenizer.json", limit=args.raw_mb * 10**6, method=m)
        for m in ("encode_batch", "encode_batch_fast")
    }
    per_worker = run["tokens_per_s"] / args.workers
    print("\n| measure | value |\n|---|---|")
    print(
        f"| prepare-data, {run['text_bytes'] / 1e6:,.0f} MB of text, {run['documents']:,} documents -> "
        f"{run['tokens']:,} tokens | {run['tokens_per_s']:,.0f} tokens/s with {args.workers} workers |"
    )
    print(f"| per worker | {per_worker:,.0f} tokens/s |")
    for method, r in raw.items():
        print(
            f"| raw `{method}`, 1 thread, first {r['text_bytes'] / 1e6:,.0f} MB | {r['tokens_per_s']:,.0f} "
            f"tokens/s (per worker / raw: {per_worker / r['tokens_per_s']:.2f}) |"
        )
    print(f"| peak RSS, main process | {run['main_maxrss'] / 2**20:,.0f} MiB |")
    print(f"| peak RSS, largest worker | {run['worker_maxrss'] / 2**20:,.0f} MiB |")
    print(f"| wall time (prepare-data in the child, tokenizer given) | {run['wall_s']:,.1f} s |")
    if args.json:
        args.json.write_text(json.dumps({"workers": args.workers, "prepare": run, "raw": raw}, indent=2) + "\n")


if __name__ == "__main__":
    main()
