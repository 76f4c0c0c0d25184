"""prepare-data after a crash: a run killed (SIGKILL to its whole process group) at about half its documents, then
rerun with the same command, must resume and end in exactly the files of an uninterrupted run; the wall times of
both. Corpora are generated under /tmp, never in the repository.

    PYTHONPATH=. python benchmarks/prepare_resume.py                          # 200 MB corpus, 2 workers, dspipe
    PYTHONPATH=. python benchmarks/prepare_resume.py --size-mb 20 --format megatron --keep

1. Corpus and tokenizer as benchmarks/prepare_scale.py: bench_data.make_corpus (the standard library's UTF-8 .py
   files as JSON lines, until --size-mb MB of text) and bench_data.demo_tokenizer (the demo's 4096-token BPE), both
   kept under --work for later runs.
2. Whole: `python -m dspipe prepare-data CORPUS --out RUN/whole --tokenizer DIR --workers N --format F`,
   uninterrupted, timed (the CLI's start and, for megatron, the conversion included).
3. Killed: the same command into RUN/killed, in its own process group. Its progress is the journal of its work
   directory (`.OUT.tmp-partial-<fingerprint>/journal.json` beside OUT, or beside `.OUT.tokens` for megatron),
   rewritten at a document boundary every 5 s and when a shard closes; once it holds --at of the corpus's documents
   the group (the CLI and its tokenizer workers) gets SIGKILL. Documents done: the journal's after the kill.
4. Resumed: the same command again into RUN/killed, timed; it must print "resuming ...: N documents" with N the
   killed run's journal, and finish.
5. Every file under whole/ and killed/ compared byte for byte (same relative paths); no `.tmp-partial` work
   directory (nor any other hidden entry) may be left in RUN. Exit 1 if a file differs, the rerun did not resume
   or something is left. RUN is removed at the end unless --keep.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_data import demo_tokenizer, make_corpus  # noqa: E402
from dspipe.data.workdir import JOURNAL_FILE, WORK_TAG  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def run(cmd: list[str]) -> tuple[float, str]:
    """Run the CLI to its end: (wall seconds, stdout and stderr)."""
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=ENV)
    wall = time.perf_counter() - t0
    if r.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return wall, r.stdout + r.stderr


def journal_documents(run_dir: Path, out: Path) -> int | None:
    """num_documents in the journal of OUT's work directory (replaced atomically: read whole or not there)."""
    for p in run_dir.iterdir():
        if WORK_TAG in p.name and out.name in p.name and (p / JOURNAL_FILE).is_file():
            try:
                return json.loads((p / JOURNAL_FILE).read_text())["num_documents"]
            except (OSError, ValueError, KeyError):
                pass
    return None


def kill_at(cmd: list[str], run_dir: Path, out: Path, *, documents: int) -> tuple[int, float]:
    """Start `cmd` in its own process group and SIGKILL the group once its journal holds `documents`; (documents
    done, seconds it ran)."""
    with open(run_dir / "killed.log", "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        while proc.poll() is None:
            done = journal_documents(run_dir, out)
            if done is not None and done >= documents:
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.05)
        proc.wait()
        ran = time.perf_counter() - t0
    if proc.returncode != -signal.SIGKILL:
        sys.exit(
            f"the run to kill ended on its own (exit {proc.returncode}) before its journal held {documents:,} "
            f"documents (it is rewritten every 5 s: try a larger corpus or a smaller --at); see "
            f"{run_dir / 'killed.log'}"
        )
    for _ in range(100):  # the workers die with the group; wait until none is left
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    return journal_documents(run_dir, out), ran


def compare(a: Path, b: Path) -> tuple[int, list[str]]:
    """(files in either, the differences): names in one only, and files whose bytes differ."""

    def files(d: Path) -> set[str]:
        return {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()}

    fa, fb = files(a), files(b)
    diff = [f"only in {a.name}/: {n}" for n in sorted(fa - fb)] + [f"only in {b.name}/: {n}" for n in sorted(fb - fa)]
    diff += [f"bytes differ: {n}" for n in sorted(fa & fb) if not filecmp.cmp(a / n, b / n, shallow=False)]
    return len(fa | fb), diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=200, help="corpus to generate (MB of text)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--format", choices=["dspipe", "megatron"], default="dspipe")
    parser.add_argument("--at", type=float, default=0.5, help="kill once this fraction of the documents is done")
    parser.add_argument("--work", type=Path, default=Path("/tmp/dspipe-bench"))
    parser.add_argument("--keep", action="store_true", help="keep RUN/whole and RUN/killed")
    args = parser.parse_args()
    work = args.work.resolve()
    if work == ROOT or ROOT in work.parents:
        sys.exit(f"--work {work} is inside the repository; use a directory under /tmp")
    work.mkdir(parents=True, exist_ok=True)
    info = make_corpus(work / f"corpus-{args.size_mb}.jsonl", megabytes=args.size_mb)
    corpus, total = Path(info["path"]), info["documents"]
    tokenizer = demo_tokenizer(work)
    run_dir = work / f"resume-{args.size_mb}-{args.format}-w{args.workers}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir()
    whole, killed = run_dir / "whole", run_dir / "killed"

    def command(out: Path) -> list[str]:
        return [
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
            str(args.workers),
            "--format",
            args.format,
        ]

    print(
        f"corpus {corpus} ({info['text_bytes'] / 1e6:,.0f} MB, {total:,} documents), {args.workers} workers, "
        f"{args.format}; running into {run_dir}",
        flush=True,
    )
    whole_s, text = run(command(whole))
    wrote = re.search(r"wrote \S+: ([\d,]+) documents", text)
    if not wrote or int(wrote.group(1).replace(",", "")) != total:
        sys.exit(f"the uninterrupted run did not write the corpus's {total:,} documents:\n{text[-2000:]}")
    print(f"uninterrupted: {whole_s:.1f} s", flush=True)
    done, ran = kill_at(command(killed), run_dir, killed, documents=int(args.at * total))
    print(f"killed after {ran:.1f} s at {done:,} documents", flush=True)
    resumed_s, text = run(command(killed))
    said = re.search(r"resuming \S+: ([\d,]+) documents", text)
    resumed = said is not None and int(said.group(1).replace(",", "")) == done
    count, diff = compare(whole, killed)
    left = sorted(p.name for p in run_dir.iterdir() if p.name.startswith("."))
    identical, how = not diff, said.group(0) if resumed else "did NOT resume from the killed run's journal"
    print(
        f"\n== prepare-data resume after SIGKILL ==\n"
        f"corpus: {info['text_bytes'] / 1e6:,.0f} MB of text ({info['file_bytes'] / 1e6:,.0f} MB JSON lines), "
        f"{total:,} documents\n"
        f"workers: {args.workers}, format: {args.format}\n"
        f"uninterrupted wall: {whole_s:.1f} s\n"
        f"killed at docs {done:,} / {total:,} ({100 * done / total:.1f}%), after {ran:.1f} s\n"
        f"resumed wall: {resumed_s:.1f} s ({how})\n"
        f"ratio resumed/whole: {resumed_s / whole_s:.2f}\n"
        f"work directories left: {', '.join(left) or 'none'}\n"
        f"byte-identical: {'yes' if identical else 'no'} ({count} files)"
    )
    for d in diff:
        print(f"  {d}")
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    sys.exit(0 if identical and resumed and not left else 1)


if __name__ == "__main__":
    main()
