"""Data pipeline benchmark: prepare-data throughput vs the raw tokenizer, scaling with workers, peak memory vs corpus
size, and loader speed vs what a training step consumes. Corpora are generated under /tmp, never in the repository.

    PYTHONPATH=. python benchmarks/bench_data.py                 # 100 MB and 400 MB corpora (~10 min on 2 cores)
    PYTHONPATH=. python benchmarks/bench_data.py --sizes 5 20    # a quick run

1. Corpora: the standard library's UTF-8 .py files as documents, repeated in a fresh seeded order until the text
   reaches SIZE MB, written as JSON lines ({"text": ...}).
2. Tokenizer: the demo's 4096-token byte-level BPE (prepare-data on 8 MiB of the standard library), saved in Hugging
   Face format; every measurement below uses that same tokenizer.json.
3. Raw: tokenizers.Tokenizer.encode_batch on the first corpus's documents in ~1 MiB batches, one thread
   (TOKENIZERS_PARALLELISM=false), in this process, timing the encode calls only; and the same with
   encode_batch_fast (same ids, no character offsets), which the prepare-data workers call.
4. prepare-data as a subprocess (`dspipe prepare-data CORPUS --tokenizer DIR --workers N --force`), its process
   tree sampled every 20 ms for peak RSS (main process + workers, summed) and CPU time per process.
5. Loader: TrainLoader micro-batches (seq_len 1024, micro-batch 8) from the 100 MB shards, vs the micro-batches/s
   one training step of the demo model consumes on this CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the raw baseline is one thread, like one worker


def make_corpus(path: Path, *, megabytes: int, seed: int = 0) -> dict:
    from dspipe.data.sources import first_bad_utf8, stdlib_sources

    if path.is_file() and path.with_suffix(".done").is_file():
        return json.loads(path.with_suffix(".done").read_text())
    docs = []
    for f in stdlib_sources():
        if first_bad_utf8(f) is None:
            text = f.read_text(encoding="utf-8")
            if text.strip():
                docs.append(text)
    rng, target, size, n = random.Random(seed), megabytes * 10**6, 0, 0
    with open(path, "w", encoding="utf-8") as out:
        while size < target:
            rng.shuffle(docs)
            for d in docs:
                out.write(json.dumps({"text": d}) + "\n")
                size += len(d.encode("utf-8"))
                n += 1
                if size >= target:
                    break
    info = {"path": str(path), "text_bytes": size, "documents": n, "file_bytes": path.stat().st_size}
    path.with_suffix(".done").write_text(json.dumps(info))
    return info


def dspipe(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dspipe", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def demo_tokenizer(work: Path) -> Path:
    out = work / "stdlib-4096"
    r = dspipe("prepare-data", "--out", out, "--train-tokenizer", 4096, "--max-mb", 8)
    if r.returncode:
        sys.exit(r.stderr)
    return out / "tokenizer"


def documents(corpus: Path, limit: int | None = None):
    """The texts of a JSON-lines corpus (or the lines of a text file), up to `limit` bytes of UTF-8."""
    size = 0
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"] if corpus.suffix in (".jsonl", ".json") else line
            yield text
            size += len(text.encode("utf-8"))
            if limit is not None and size >= limit:
                return


def raw_encode(corpus: Path, tokenizer_json: Path, *, method: str = "encode_batch", limit: int | None = None) -> dict:
    """The tokenizer alone on the corpus (its first `limit` bytes), ~1 MiB batches, timing the encode calls."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    encode = getattr(tok, method)
    tokens, seconds, cpu, size, batch, chars = 0, 0.0, 0.0, 0, [], 0

    def run(batch):
        nonlocal tokens, seconds, cpu
        t0, c0 = time.perf_counter(), time.thread_time()
        encodings = encode(batch, add_special_tokens=False)
        seconds += time.perf_counter() - t0
        cpu += time.thread_time() - c0
        tokens += sum(len(e) + 1 for e in encodings)  # + EOS, counted like prepare-data

    for d in documents(corpus, limit):
        batch.append(d)
        chars += len(d)
        size += len(d.encode("utf-8"))
        if chars >= 1 << 20:
            run(batch)
            batch, chars = [], 0
    if batch:
        run(batch)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "text_bytes": size,
        "cpu_s": cpu,
        "tokens_per_cpu_s": tokens / cpu,
    }


def watch_tree(pid: int, stop: threading.Event, result: dict) -> None:
    import psutil

    root = psutil.Process(pid)
    procs = {pid: root}
    peak_total = peak_main = 0
    cpu = {}
    while not stop.is_set():
        try:
            for c in root.children(recursive=True):
                procs.setdefault(c.pid, c)
        except psutil.NoSuchProcess:
            break
        total = 0
        for p_id, p in list(procs.items()):
            try:
                rss = p.memory_info().rss
                cpu[p_id] = sum(p.cpu_times()[:2])
            except psutil.NoSuchProcess:
                continue
            total += rss
            if p_id == pid:
                peak_main = max(peak_main, rss)
        peak_total = max(peak_total, total)
        time.sleep(0.02)
    result.update(
        peak_rss_tree=peak_total,
        peak_rss_main=peak_main,
        cpu_main=cpu.get(pid, 0.0),
        cpu_workers=sum(v for k, v in cpu.items() if k != pid),
    )


def run_prepare(corpus: Path, out: Path, tokenizer: Path, *, workers: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "dspipe",
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
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    stop, result = threading.Event(), {}
    watcher = threading.Thread(target=watch_tree, args=(proc.pid, stop, result))
    watcher.start()
    stdout, stderr = proc.communicate()
    stop.set()
    watcher.join()
    if proc.returncode:
        sys.exit(f"prepare-data failed: {stderr[-2000:]}")
    rate = float(re.search(r"tokenized at ([\d,]+) tokens/s", stdout).group(1).replace(",", ""))
    meta = json.loads((out / "meta.json").read_text())
    return {
        "workers": workers,
        "tokens": meta["num_tokens"],
        "text_bytes": meta["num_bytes"],
        "tokens_per_s": rate,
        "wall_s": time.perf_counter() - t0,
        **result,
    }


def loader_speed(data: Path, *, seq_len=1024, micro_batch=8, batches=3000) -> dict:
    from dspipe.data import TokenWindows, TrainLoader

    w = TokenWindows(data, seq_len=seq_len)
    ld = TrainLoader(windows=w, seed=0, micro_batch=micro_batch, dp=1, dp_rank=0)
    next(ld)
    t0 = time.perf_counter()
    for _ in range(batches):
        inputs, labels = next(ld)
    dt = time.perf_counter() - t0
    return {
        "seq_len": seq_len,
        "micro_batch": micro_batch,
        "batches_per_s": batches / dt,
        "tokens_per_s": batches * micro_batch * seq_len / dt,
    }


def training_need(*, seq_len=128, micro_batch=8, steps=10) -> dict:
    """Micro-batches/s one fwd+bwd+AdamW step of the demo model (4 x 128, seq 128, vocab 4096) consumes here."""
    import torch

    from dspipe.model.gpt import GPT
    from dspipe.spec.model import ModelSpec

    torch.set_num_threads(2)
    model = GPT(ModelSpec("demo", 4, 128, 4, 4096, seq_len, 512, 0.0, True), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 4096, (micro_batch, seq_len))
    for i in range(steps + 2):
        if i == 2:
            t0 = time.perf_counter()
        loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
    dt = (time.perf_counter() - t0) / steps
    return {"seq_len": seq_len, "micro_batch": micro_batch, "step_s": dt, "batches_per_s": 1 / dt}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs=2, default=[100, 400], metavar=("SMALL_MB", "LARGE_MB"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/dspipe-bench"))
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    small, large = args.sizes
    res: dict = {"cpus": os.cpu_count(), "load_avg_start": os.getloadavg()}
    print(f"corpora: {small} MB and {large} MB of text under {args.work}", flush=True)
    corpora = {mb: make_corpus(args.work / f"corpus-{mb}.jsonl", megabytes=mb) for mb in (small, large)}
    res["corpora"] = corpora
    tokenizer = demo_tokenizer(args.work)
    res["raw"] = raw = raw_encode(Path(corpora[small]["path"]), tokenizer / "tokenizer.json")
    print(f"raw encode_batch, 1 thread: {raw['tokens_per_s']:,.0f} tokens/s", flush=True)
    res["raw_fast"] = fast = raw_encode(
        Path(corpora[small]["path"]), tokenizer / "tokenizer.json", method="encode_batch_fast"
    )
    print(f"raw encode_batch_fast, 1 thread: {fast['tokens_per_s']:,.0f} tokens/s", flush=True)
    runs = {}
    for mb, workers in ((small, 1), (small, 2), (large, 2)):
        r = run_prepare(Path(corpora[mb]["path"]), args.work / f"out-{mb}", tokenizer, workers=workers)
        runs[f"{mb}MB-w{workers}"] = r
        print(
            f"prepare-data {mb} MB, {workers} worker(s): {r['tokens_per_s']:,.0f} tokens/s, peak RSS "
            f"{r['peak_rss_tree'] / 2**20:.0f} MiB (main {r['peak_rss_main'] / 2**20:.0f} MiB), "
            f"{r['wall_s']:.0f} s",
            flush=True,
        )
    res["prepare"] = runs
    res["loader"] = loader = loader_speed(args.work / f"out-{small}")
    res["training_need"] = need = training_need()
    res["load_avg_end"] = os.getloadavg()
    w1, w2, big = runs[f"{small}MB-w1"], runs[f"{small}MB-w2"], runs[f"{large}MB-w2"]
    print("\n| measure | value |\n|---|---|")
    print(f"| raw `encode_batch`, 1 thread ({small} MB) | {raw['tokens_per_s']:,.0f} tokens/s |")
    print(f"| raw `encode_batch_fast`, 1 thread ({small} MB) | {fast['tokens_per_s']:,.0f} tokens/s |")
    print(
        f"| prepare-data --workers 1 ({small} MB) | {w1['tokens_per_s']:,.0f} tokens/s "
        f"({w1['tokens_per_s'] / raw['tokens_per_s']:.2f}x raw) |"
    )
    print(
        f"| prepare-data --workers 2 ({small} MB) | {w2['tokens_per_s']:,.0f} tokens/s "
        f"({w2['tokens_per_s'] / w1['tokens_per_s']:.2f}x 1 worker, "
        f"{w2['tokens_per_s'] / 2 / raw['tokens_per_s']:.2f}x raw per worker) |"
    )
    print(
        f"| peak RSS, {small} MB vs {large} MB (--workers 2, all processes) | {w2['peak_rss_tree'] / 2**20:.0f} "
        f"vs {big['peak_rss_tree'] / 2**20:.0f} MiB ({big['peak_rss_tree'] / w2['peak_rss_tree'] - 1:+.1%}) |"
    )
    print(
        f"| peak RSS of the main process, {small} vs {large} MB | {w2['peak_rss_main'] / 2**20:.0f} vs "
        f"{big['peak_rss_main'] / 2**20:.0f} MiB |"
    )
    print(f"| CPU seconds main / workers ({small} MB, 2 workers) | {w2['cpu_main']:.0f} / {w2['cpu_workers']:.0f} |")
    print(
        f"| tokens per CPU-second: raw `encode_batch` / raw `encode_batch_fast` / prepare-data worker "
        f"({small} MB, 2 workers) | {raw['tokens_per_cpu_s']:,.0f} / {fast['tokens_per_cpu_s']:,.0f} / "
        f"{w2['tokens'] / w2['cpu_workers']:,.0f} |"
    )
    print(
        f"| CPU available to prepare-data (CPU-s / wall-s), 1 and 2 workers ({small} MB) | "
        f"{(w1['cpu_main'] + w1['cpu_workers']) / w1['wall_s']:.2f} / "
        f"{(w2['cpu_main'] + w2['cpu_workers']) / w2['wall_s']:.2f} cores |"
    )
    print(
        f"| loader, micro-batch {loader['micro_batch']} x seq {loader['seq_len']} | "
        f"{loader['batches_per_s']:,.0f} batches/s ({loader['tokens_per_s'] / 1e6:,.1f}M tokens/s) |"
    )
    print(
        f"| a training step of the demo model on this CPU (mb {need['micro_batch']} x seq {need['seq_len']}) | "
        f"needs {need['batches_per_s']:.1f} batches/s |"
    )
    print(f"| load average at start / end | {res['load_avg_start'][0]:.1f} / {res['load_avg_end'][0]:.1f} |")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
