"""`dspipe plan` output users read: the labelled batch equation, the token budget as given, the --top N table (the
chosen plan first), the tie and its reason, and the families and tp sizes not chosen with their best reason."""

import json

from tests.helpers import run_cli

GPT3 = [
    "plan",
    "--model",
    "gpt3-175b",
    "--gpu",
    "a100-80g",
    "--nodes",
    "128",
    "--gpus-per-node",
    "8",
    "--global-batch",
    "1536",
    "--tokens",
    "1.5T",
]
"""The published GPT-3 175B request: the search's pick is ZeRO-1 with tp inside the node x pp across nodes x dp (the
case study's recipe); ZeRO-3 with tp 8 over dp 128 is 23% behind."""


def test_plan_text_shows_budget_as_given_top_table_and_reasons(capsys):
    assert run_cli(*GPT3, "--top", "3") == 0
    out = capsys.readouterr().out
    assert out.startswith("plan: ZeRO-1, bf16, pp 8, tp 4, sp 1, dp 32, micro 1 x ga 48, recompute none\n")
    assert "global batch 1536 = micro_batch 1 x grad_accum 48 x dp 32" in out
    assert "training 1.5T tokens: " in out and "e+12" not in out
    assert "token budget: steps 476,838 = ceil(1.5T tokens / (1536 x 2048 tokens per step))" in out
    table = out.split("top 3 of ")[1].split("\n\n")[0].splitlines()
    assert len(table) == 1 + 1 + 3  # title rest, header, 3 rows
    assert table[2].split()[0] == "1" and table[2].endswith("pp 8, tp 4, sp 1, dp 32, micro 1 x ga 48, recompute none")
    assert table[3].endswith("ZeRO-1, bf16, pp 8, tp 8, sp 1, dp 16, micro 1 x ga 96, recompute none")
    assert (
        "  ZeRO-3: slower by 23% at best (ZeRO-3, bf16, pp 1, tp 8, dp 128, micro 6 x ga 2, recompute none): its dp "
        "comm 7.12 s against 0.697 s"
    ) in out
    # ZeRO-2 at tp 8 without a pipeline fits recomputing 9 of its 96 blocks (--recompute-blocks), at 90% of the GPU
    assert (
        "  ZeRO-2: slower by 1.8% at best, a tie (within 2%) that went to the roomier plan (66% vs 90% of GPU memory; "
        "over 80% loses ties) (ZeRO-2, bf16, pp 1, tp 8, dp 128, micro 3 x ga 4, recompute full (first 9 blocks of "
        "each stage))"
    ) in out
    assert "  tp 2: slower by" in out and "  tp 1: slower by" in out


def test_plan_text_shows_the_tie_and_its_reason(capsys):
    """Pinned to ZeRO-1: tp 8 x pp 8 is 1.6% behind tp 4 x pp 8, a tie the recipe's order gives to less tensor
    parallelism (deeper pipelines lose more: their busiest stage, the head's or one beside the embedding's, does
    more than 1 / pp of the work)."""
    assert run_cli(*GPT3, "--zero", "1", "--top", "3") == 0
    out = capsys.readouterr().out
    assert out.startswith("plan: ZeRO-1, bf16, pp 8, tp 4, sp 1, dp 32, micro 1 x ga 48, recompute none\n")
    assert (
        "tie: 2 plans within 2% of the fastest (20.7 s/step); the tie-break (under 80% of GPU memory first, the "
        "recipe's order, the larger micro-batch up to 4,096 tokens, then the smaller memory) preferred it for less "
        "tensor parallelism over ZeRO-1, bf16, pp 8, tp 8, dp 16, micro 1 x ga 96, recompute none"
    ) in out
    assert (
        "  tp 8: slower by 1.6% at best, a tie (within 2%) that went to less tensor parallelism (ZeRO-1, bf16, "
        "pp 8, tp 8, dp 16, micro 1 x ga 96, recompute none)"
    ) in out
    assert "  tp 2: slower by" in out and "  tp 1: slower by" in out


def test_plan_json_has_the_top_list_and_top_is_range_checked(capsys):
    assert run_cli(*GPT3, "--json", "--top", "2") == 0
    out = json.loads(capsys.readouterr().out)
    assert [(c["zero_stage"], c["tp"], c["pp"], c["dp"]) for c in out["top"]] == [(1, 4, 8, 32), (1, 8, 8, 16)]
    assert out["top"][0]["plan"].startswith("ZeRO-1, bf16, pp 8, tp 4")
    assert out["top"][1]["plan"].startswith("ZeRO-1, bf16, pp 8, tp 8")
    assert out["top"][0]["step_time_s"] == out["step_time_s"]
    code = run_cli(*GPT3, "--top", "0")
    err = capsys.readouterr().err
    assert code == 2 and "--top must be in [1, 1000], got 0" in err and err.count("\n") == 1
