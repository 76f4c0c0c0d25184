"""`dspipe plan` output users read: the labelled batch equation, the token budget as given, the --top N table (the
chosen plan first), the tie and its reason, and the families and tp sizes not chosen with their best reason."""
import json

from tests.helpers import run_cli

GPT3 = ["plan", "--model", "gpt3-175b", "--gpu", "a100-80g", "--nodes", "128", "--gpus-per-node", "8",
        "--global-batch", "1536", "--tokens", "1.5T", "--host-memory-gib", "3072"]
"""On nodes with the 2,639 GiB host RAM the tp 8 plan's AutoTP start-up needs (a DGX A100's 2 TiB plans a pipeline:
tests/unit/planner/test_startup_plan.py)."""


def test_plan_text_shows_budget_as_given_top_table_and_reasons(capsys):
    assert run_cli(*GPT3, "--top", "3") == 0
    out = capsys.readouterr().out
    assert "global batch 1536 = micro_batch 2 x grad_accum 6 x dp 128" in out
    assert "training 1.5T tokens: " in out and "e+12" not in out
    assert "token budget: steps 476,838 = ceil(1.5T tokens / (1536 x 2048 tokens per step))" in out
    table = out.split("top 3 of ")[1].split("\n\n")[0].splitlines()
    assert len(table) == 1 + 1 + 3  # title rest, header, 3 rows
    assert table[2].split()[0] == "1" and table[2].endswith("tp 8, sp 1, dp 128, micro 2 x ga 6, recompute full")
    assert "tie: 3 plans within 2% of the fastest" in out and "for the roomier plan (74% vs 80% of GPU memory" in out
    assert "  tp 4: does not fit: needs 93.3 GiB per GPU" in out and "  tp 1: slower by" in out


def test_plan_json_has_the_top_list_and_top_is_range_checked(capsys):
    assert run_cli(*GPT3, "--json", "--top", "2") == 0
    out = json.loads(capsys.readouterr().out)
    assert [c["tp"] for c in out["top"]] == [8, 8] and out["top"][0]["plan"].startswith("ZeRO-2, bf16, pp 1, tp 8")
    assert out["top"][0]["step_time_s"] == out["step_time_s"]
    code = run_cli(*GPT3, "--top", "0")
    err = capsys.readouterr().err
    assert code == 2 and "--top must be in [1, 1000], got 0" in err and err.count("\n") == 1
