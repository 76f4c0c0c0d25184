"""Planner vs. the real model's activations: predicted bytes per block, head/loss and peak for one micro-batch
against a saved-tensor census (benchmarks/census/activations.py) for two sizes x {bf16, fp32} x {none, selective, full},
tiny-llama, the stages of an uneven pp = 2 partition, and full recomputation of the first blocks only
(--recompute-blocks). One process, CPU, a few seconds.

    python benchmarks/activation_accuracy.py [--write]    # --write replaces the activations section of the doc
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dspipe.spec.presets import MODEL_PRESETS  # noqa: E402

DOC = ROOT / "docs" / "planner-accuracy.md"
BEGIN, END = "<!-- activations -->", "<!-- /activations -->"
TINY = MODEL_PRESETS["tiny"]
SMALL = replace(TINY, name="small", layers=4, hidden=128, heads=4, seq_len=128, ffn=512, vocab=512)
FIVE = replace(TINY, layers=5)
MICRO_BATCH = 2


def cases() -> list[tuple]:
    """(model, precision, recomputation, pp, stage, recompute_blocks) of every row."""
    rows = [(m, p, c, 1, 0, 0) for m in (TINY, SMALL) for p in ("bf16", "fp32") for c in ("none", "selective", "full")]
    rows += [(MODEL_PRESETS["tiny-llama"], p, c, 1, 0, 0) for p in ("bf16", "fp32") for c in ("none", "full")]
    rows += [(FIVE, "bf16", c, 2, s, 0) for c in ("none", "full") for s in (0, 1)]
    rows += [(SMALL, "bf16", "full", 1, 0, n) for n in (1, 3)]
    rows += [(FIVE, "bf16", "full", 2, 0, n) for n in (1, 2)]
    return rows


def table() -> str:
    from benchmarks.census.activations import compare

    lines = [
        "| model, precision, recomputation, stage | per block predicted / measured | ratio | head + loss "
        "predicted / measured | peak predicted / measured | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for model, precision, ckpt, pp, stage, blocks in cases():
        r = compare(
            model=model,
            micro_batch=MICRO_BATCH,
            checkpointing=ckpt,
            precision=precision,
            pp=pp,
            stage=stage,
            recompute_blocks=blocks,
        )
        head = f"{r.predicted_head:,} / {r.measured_head:,}" if r.measured_head or r.predicted_head else "-"
        lines.append(
            f"| {r.label} | {r.predicted_block:,.0f} / {r.measured_block:,.0f} | "
            f"{r.predicted_block / r.measured_block:.3f} | {head} | {r.predicted_peak:,} / "
            f"{r.measured_peak:,} | {r.predicted_peak / r.measured_peak:.3f} |"
        )
    return "\n".join(lines)


def write(text: str) -> None:
    doc = DOC.read_text()  # read just before writing: other sections of the file have other owners
    if BEGIN in doc and END in doc:
        head, rest = doc.split(BEGIN, 1)
        doc = f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}"
    else:
        doc = f"{doc.rstrip()}\n\n{BEGIN}\n{text}\n{END}\n"
    DOC.write_text(doc)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--write", action="store_true", help=f"replace the {BEGIN} section of {DOC.name}")
    args = parser.parse_args()
    text = table()
    print(text)
    if args.write:
        write(text)


if __name__ == "__main__":
    main()
