"""Bad inputs to the commands that read a run directory or start one (launch, slurm-script, doctor, report,
calibrate --from-run, export-hf, generate): each is exactly one `dspipe: error:` line naming the value or file with
its numbers, exit code 2, and nothing written. Runs in this process (run_cli); no launch, no training."""

import json
import shutil

import pytest

from dspipe.errors import SpecError
from tests.helpers import edit_hf_config, hand_checkpoint, run_cli

CPU_RUN = [
    "--model",
    "tiny",
    "--vocab",
    "1024",
    "--gpu",
    "cpu",
    "--gpus-per-node",
    "2",
    "--global-batch",
    "16",
    "--micro-batch",
    "4",
    "--steps",
    "6",
    "--precision",
    "fp32",
    "--zero",
    "0",
    "--pp",
    "1",
    "--tp",
    "1",
    "--sp",
    "1",
    "--offload",
    "none",
    "--checkpointing",
    "none",
]
# the run's 6 steps of 1,024 tokens
METRICS = "step,tokens,loss\n" + "".join(f"{s},{s * 1024},{9 - s / 10}\n" for s in range(1, 7))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    """A 2-rank cpu run with metrics and one hand-built checkpoint (global_step6), and its export."""
    root = tmp_path_factory.mktemp("inputs")
    run = root / "run"
    assert run_cli("gen-config", *CPU_RUN, "--data", corpus, "--out", run) == 0
    hand_checkpoint(run)
    (run / "metrics.csv").write_text(METRICS)
    assert run_cli("export-hf", run, "--out", root / "hf") == 0
    return root


@pytest.fixture
def run(trained, tmp_path, monkeypatch):
    """A private copy of the run, at tmp_path/run (the working directory)."""
    shutil.copytree(trained / "run", tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    return tmp_path / "run"


def one_error(capsys, *args) -> str:
    capsys.readouterr()
    code = run_cli(*args)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, (args, err)
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("dspipe: error: "), (args, err)
    return lines[0]


# ---- 1. doctor's numbers -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,words",
    [
        (["--size-mb", "nan"], "--size-mb must be a finite number of MiB in 0.001..16384, got nan"),
        (["--size-mb", "-1"], "--size-mb must be a finite number of MiB in 0.001..16384, got -1"),
        (["--size-mb", "0"], "got 0"),
        (["--iters", "-1"], "--iters must be in 1..100,000, got -1"),
        (["--timeout-s", "-1"], "--timeout-s must be in 1..604,800 seconds, got -1"),
        (["--gpu", ""], "'--gpu': '' is empty: give a value, or leave the option out"),
    ],
)
def test_doctor_refuses_bad_values_even_when_skipping_the_all_reduce(capsys, args, words):
    assert words in one_error(capsys, "doctor", "--skip-allreduce", *args)


def test_doctor_refuses_all_reduce_settings_it_would_skip(capsys):
    """--size-mb, --iters and --timeout-s set the all-reduce that --skip-allreduce does not run: typed, they are
    refused in one line rather than ignored."""
    said = one_error(capsys, "doctor", "--skip-allreduce", "--size-mb", "128", "--iters", "3")
    assert said.endswith("--size-mb 128, --iters 3 would go unused: --skip-allreduce runs no all-reduce"), said


@pytest.mark.parametrize(
    "args,words",
    [
        (["--gpu", "bogus"], "unknown GPU type 'bogus'"),
        (["--gpu", "cpu", "--hostfile", "."], "hostfile . is a directory, not a file"),
    ],
)
def test_doctor_names_a_bad_gpu_or_hostfile_before_its_report(run, capsys, args, words):
    """The versions / devices / ops report took seconds (DeepSpeed's import) and then ended in the error."""
    capsys.readouterr()
    assert run_cli("doctor", "--skip-allreduce", *args) == 2
    out, err = capsys.readouterr()
    assert words in err and err.count("\n") == 1 and out == ""


# ---- 2. --resume names a checkpoint that exists -----------------------------------------------------------------


@pytest.mark.parametrize("resume", ["foo", "global_step999", "/nonexist"])
@pytest.mark.parametrize("command", [["launch", "--dry-run"], ["slurm-script"]])
def test_a_resume_that_names_no_checkpoint_is_refused(run, capsys, command, resume):
    line = one_error(capsys, command[0], "run", *command[1:], "--resume", resume)
    assert f"--resume {resume}: checkpoint {resume} not found" in line and "run/checkpoints" in line
    assert not (run / "slurm.sbatch").exists()


def test_a_resume_that_names_a_checkpoint_launches(run, capsys):
    assert run_cli("launch", "run", "--dry-run", "--resume", "global_step6") == 0
    assert "--resume global_step6" in capsys.readouterr().out
    assert run_cli("slurm-script", "run", "--resume", str(run / "checkpoints/global_step6")) == 0


def test_an_incomplete_checkpoint_is_refused_before_the_launch(run, capsys):
    (run / "checkpoints/global_step6/dspipe.json").unlink()
    assert "is incomplete" in one_error(capsys, "launch", "run", "--dry-run", "--resume", "global_step6")


# ---- 3. Slurm's time limit ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "time,words",
    [
        ("25:99:99", "--time '25:99:99' (HH:MM:SS): minutes 99 must be below 60"),
        ("00:04:99", "seconds 99 must be below 60"),
        ("5:60", "--time '5:60' (MM:SS): seconds 60 must be below 60"),
        ("1-24", "hours 24 must be below 24"),
        ("1-23:60", "minutes 60 must be below 60"),
    ],
)
def test_slurm_time_fields_out_of_range_are_refused(run, capsys, time, words):
    line = one_error(capsys, "slurm-script", "run", "--time", time)
    assert words in line and "D-HH:MM:SS" in line
    assert not (run / "slurm.sbatch").exists()


def test_slurm_time_forms():
    from dspipe.cluster.slurm import time_limit_seconds

    assert time_limit_seconds("90") == 5400
    assert time_limit_seconds("90:30") == 5430
    assert time_limit_seconds("25:00:00") == 90000
    assert time_limit_seconds("1-23") == 169200
    assert time_limit_seconds("1-23:59:59") == 172799
    assert time_limit_seconds("0") is None
    with pytest.raises(SpecError, match="seconds 60 must be below 60"):
        time_limit_seconds("00:00:60")


# ---- 4. --env given twice -------------------------------------------------------------------------------------


def test_a_repeated_env_key_is_refused(run, capsys):
    line = one_error(capsys, "launch", "run", "--dry-run", "--env", "A=1", "--env", "A=2")
    assert "--env A is given twice (A=1 and A=2)" in line
    assert "--env A is given twice" in one_error(capsys, "slurm-script", "run", "--env", "A=1", "--env", "A=")


# ---- 5. empty arguments -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,words",
    [
        (
            ["launch", "run", "--dry-run", "--hostfile", ""],
            "'--hostfile': '' is empty: give a value, or leave the option out",
        ),
        (
            ["launch", "run", "--dry-run", "--include", ""],
            "'--include': '' is empty: give a value, or leave the option out",
        ),
        (
            ["launch", "run", "--dry-run", "--exclude", ""],
            "'--exclude': '' is empty: give a value, or leave the option out",
        ),
        (
            ["launch", "run", "--dry-run", "--ifname", ""],
            "'--ifname': '' is empty: give a value, or leave the option out",
        ),
        (["report", ""], "'RUN': '' is empty: give a value"),
        (["calibrate", "--from-run", ""], "'--from-run': '' is empty: give a value"),
    ],
)
def test_empty_arguments_are_refused(run, capsys, args, words):
    assert words in one_error(capsys, *args)
    assert not (run / "report").exists() and not (run.parent / "report").exists()


# ---- 6, 8. metrics.csv ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tail,words",
    [
        ("101,5\n", "run/metrics.csv:8: 2 field(s), the header has 3"),
        ("1,1024,9.0\n", "run/metrics.csv:8: step 1 after step 6 (line 7)"),
        ("6,6144,9.0\n", "run/metrics.csv:8: step 6 after step 6 (line 7)"),
    ],
)
@pytest.mark.parametrize("command", ["report", "calibrate"])
def test_damaged_metrics_rows_are_refused(run, capsys, tail, words, command):
    (run / "metrics.csv").write_text(METRICS + tail)
    args = ["report", "run"] if command == "report" else ["calibrate", "--from-run", "run"]
    assert words in one_error(capsys, *args)
    assert not (run / "report").exists()


@pytest.mark.parametrize(
    "name,text,words",
    [
        ("metrics.csv", METRICS + "7,7168,8.0\n", "run/metrics.csv: row 7: step 7 is outside the run's 1..6 steps"),
        ("metrics.csv", "step,tokens,loss\n0,0,9.0\n", "run/metrics.csv: row 1: step 0 is outside the run's 1..6"),
        (
            "metrics.csv",
            "step,tokens,loss\n1,1024,9.0\n2,4096,8.9\n",
            "run/metrics.csv: row 2: tokens 4,096 at step 2, the run's is step 2 x 1,024 tokens per step = 2,048",
        ),
        ("val_metrics.csv", "step,val_loss\n9,8.0\n", "run/val_metrics.csv: row 1: step 9 is outside the run's 1..6"),
        (
            "val_metrics.csv",
            "step,tokens,val_loss\n3,3000,8.0\n",
            "run/val_metrics.csv: row 1: tokens 3,000 at step 3, the run's is step 3 x 1,024 tokens per step = 3,072",
        ),
    ],
)
@pytest.mark.parametrize("command", ["report", "calibrate"])
def test_rows_that_are_not_the_runs_are_refused(run, capsys, name, text, words, command):
    """The global batch is fixed for a run and its steps only grow (dspipe extend): a step beyond them, or tokens
    other than step x tokens per step, is not this run's row."""
    (run / name).write_text(text)
    args = ["report", "run"] if command == "report" else ["calibrate", "--from-run", "run"]
    assert words in one_error(capsys, *args)
    assert not (run / "report").exists()


@pytest.mark.parametrize("command", ["report", "calibrate"])
def test_a_column_twice_in_the_header_is_refused(run, capsys, command):
    (run / "metrics.csv").write_text("step,tokens,loss,loss\n1,1024,9.0,8.0\n")
    args = ["report", "run"] if command == "report" else ["calibrate", "--from-run", "run"]
    assert "run/metrics.csv: column loss twice in the header" in one_error(capsys, *args)


def test_a_byte_order_mark_before_the_header_is_read_past(run, capsys):
    (run / "metrics.csv").write_bytes(b"\xef\xbb\xbf" + METRICS.encode())  # a spreadsheet's save
    capsys.readouterr()
    assert run_cli("report", "run") == 0
    assert "steps 1-6" in capsys.readouterr().out


@pytest.mark.parametrize("end", ["\r\n", "\r"])
def test_crlf_or_cr_line_ends_read_as_lines(run, capsys, end):
    """A spreadsheet's save: every row is read, not one torn line ('no rows yet' once)."""
    (run / "metrics.csv").write_bytes(METRICS.replace("\n", end).encode())
    capsys.readouterr()
    assert run_cli("report", "run") == 0
    assert "steps 1-6" in capsys.readouterr().out


def test_a_torn_last_line_is_left_out_with_a_note(run, capsys):
    (run / "metrics.csv").write_text(METRICS + "7,7168,8.")  # the runner's line, cut short: no newline
    capsys.readouterr()
    assert run_cli("report", "run") == 0
    out, err = capsys.readouterr()
    assert "steps 1-6" in out and "run/metrics.csv:8: the last line has no newline" in err and "left out" in err


def test_a_val_metrics_row_out_of_order_is_refused(run, capsys):
    (run / "val_metrics.csv").write_text("step,val_loss\n4,8.0\n2,8.1\n")
    assert "run/val_metrics.csv:3: step 2 after step 4 (line 2)" in one_error(capsys, "report", "run")


@pytest.mark.parametrize("name", ["metrics.csv", "val_metrics.csv"])
def test_a_metrics_directory_is_named_as_one(run, capsys, name):
    (run / name).unlink(missing_ok=True)
    (run / name).mkdir()
    assert f"run/{name} is a directory, not a CSV file" in one_error(capsys, "report", "run")


# ---- 7. engine.json ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,words",
    [
        ("{", "run/engine.json is not valid JSON: it ends early at line 1 column 2"),
        ('{\n "zero_stage": ', "run/engine.json is not valid JSON: it ends early at line 2 column 16"),
        ("", "run/engine.json is not valid JSON: it ends early at line 1 column 1"),
        ("[1]", "run/engine.json must hold a JSON object"),
        ('{"zero_stage": 9}', "run/engine.json: zero_stage 9 is not an integer in 0..3"),
        ('{"dp": "2"}', "run/engine.json: dp '2' is not an integer in 1..67108864"),
        ('{"world_size": 0}', "run/engine.json: world_size 0 is not an integer in 1..67108864"),
        ('{"pp": 1.5}', "run/engine.json: pp 1.5 is not an integer in 1..4096"),
        ('{"backend": "gl oo"}', "run/engine.json: backend 'gl oo' is not a name"),
        ('{"base_optimizer": ["x"]}', "run/engine.json: base_optimizer ['x'] is not a name"),
    ],
)
@pytest.mark.parametrize("command", ["report", "calibrate"])
def test_a_damaged_engine_json_is_refused(run, capsys, text, words, command):
    (run / "engine.json").write_text(text)
    args = ["report", "run"] if command == "report" else ["calibrate", "--from-run", "run"]
    assert words in one_error(capsys, *args)
    assert not (run / "report").exists()


@pytest.mark.parametrize(
    "engine,words",
    [
        ({"zero_stage": 3, "world_size": 2, "dp": 2, "pp": 1}, "zero_stage 3 (dspipe.json: 0)"),
        ({"zero_stage": 0, "world_size": 4, "dp": 4, "pp": 2}, "pp 2 (dspipe.json: 1)"),
        ({"zero_stage": 0, "world_size": 4, "dp": 2, "pp": 1}, "world_size 4 is not dp 2 x pp 1 x tp 1 x sp 1"),
        (
            {"zero_stage": 0, "world_size": 2, "dp": 2, "pp": 1, "startup": {"peak_rss_mib": [400.0] * 8}},
            "startup.peak_rss_mib lists 8 ranks, world_size 2",
        ),
    ],
)
def test_an_engine_json_of_another_layout_is_not_this_runs(run, capsys, engine, words):
    """A launch refuses to train on drift from the plan, so an engine.json whose ZeRO stage or axes differ from
    dspipe.json's (or do not multiply to its world) is damaged or from before the run was regenerated: calibrate
    refuses to fold it, report leaves it out with a note."""
    (run / "engine.json").write_text(json.dumps(engine))
    line = one_error(capsys, "calibrate", "--from-run", "run")
    assert "run/engine.json is not a launch of this run's plan: " + words in line
    assert run_cli("report", "run") == 0
    err = capsys.readouterr().err
    assert words in err and "the report leaves it out" in err


# ---- 9, 11. generate --------------------------------------------------------------------------------------------


def test_generate_notes_a_top_k_above_the_vocabulary(trained, capsys):
    capsys.readouterr()
    assert run_cli("generate", trained / "hf", "--prompt", "def", "--top-k", "99999999", "--max-tokens", "2") == 0
    err = capsys.readouterr().err
    assert "note: --top-k 99,999,999 is more than the model's vocabulary of 1,024 tokens: sampling from all" in err


def test_generate_refuses_a_prompt_longer_than_the_context(trained, capsys):
    context = json.loads((trained / "hf/config.json").read_text())["n_positions"]
    line = one_error(capsys, "generate", trained / "hf", "--prompt", "def foo(): return 1\n" * context)
    assert f"more than the model's context of {context}" in line and "nothing is truncated" in line


def test_generate_past_the_context_says_so(trained, capsys):
    context = json.loads((trained / "hf/config.json").read_text())["n_positions"]
    capsys.readouterr()
    assert run_cli("generate", trained / "hf", "--prompt", "def", "--max-tokens", context, "--temperature", 0) == 0
    assert f"exceed the model's context of {context}: past it" in capsys.readouterr().err


def test_generate_names_the_shapes_config_json_does_not_match(trained, tmp_path, capsys):
    hf = tmp_path / "hf"
    shutil.copytree(trained / "hf", hf)
    edit_hf_config(hf, vocab_size=10)
    line = one_error(capsys, "generate", hf, "--prompt", "def", "--max-tokens", "2")
    assert f"{hf}/config.json does not match the weights: transformer.wte.weight is [1024, " in line
    assert "but [10, " in line and "ignore_mismatched_sizes" not in line


def _edit_weights(hf, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(hf / "model.safetensors")
    edit(tensors)
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    "edit,words",
    [
        (  # transformers would draw the renamed tensors at random and drop the stored ones
            lambda t: t.update({"xformer.ln_f.weight": t.pop("transformer.ln_f.weight")}),
            "the weights do not match config.json's model: tensors 1 missing, which would be drawn at random (first "
            "transformer.ln_f.weight); 1 not in the model (first xformer.ln_f.weight)",
        ),
        (  # transformers would cast it to fp32 without a word
            lambda t: t.update({"transformer.ln_f.bias": t["transformer.ln_f.bias"].to(__import__("torch").int32)}),
            "model.safetensors: tensor transformer.ln_f.bias is stored as I32, not a floating-point weight",
        ),
    ],
)
def test_generate_refuses_weights_that_are_not_config_jsons_model(trained, tmp_path, capsys, edit, words):
    hf = tmp_path / "hf"
    shutil.copytree(trained / "hf", hf)
    _edit_weights(hf, edit)
    assert words in one_error(capsys, "generate", hf, "--prompt", "def", "--max-tokens", "2")


def test_generate_refuses_a_tokenizer_larger_than_the_model(trained, tmp_path, capsys):
    """An added token beyond the embedding would index past it (an IndexError once), from an export and from a
    run's checkpoint alike (export-hf refuses it too)."""
    hf = tmp_path / "hf"
    shutil.copytree(trained / "hf", hf)
    tok = json.loads((hf / "tokenizer.json").read_text())
    tok["added_tokens"].append(
        {"id": 1024, "content": "<|zz|>", "single_word": False, "lstrip": False, "rstrip": False}
        | {"normalized": False, "special": True}
    )
    (hf / "tokenizer.json").write_text(json.dumps(tok))
    line = one_error(capsys, "generate", hf, "--prompt", "def <|zz|>", "--max-tokens", "2")
    assert "the tokenizer has 1,025 tokens, more than the model's vocab 1,024 (id 1,024 has no embedding row)" in line


def test_a_checkpoint_weight_that_is_not_floating_point_is_refused(run, tmp_path, capsys):
    import torch

    path = run / "checkpoints/global_step6/mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=False)
    name = next(iter(state["module"]))
    state["module"][name] = state["module"][name].to(torch.complex64)  # its imaginary part would be dropped
    torch.save(state, path)
    for args in (["generate", "run", "--prompt", "def"], ["export-hf", "run", "--out", tmp_path / "out"]):
        line = one_error(capsys, *args)
        assert f"tensor {name} is torch.complex64, not a floating-point weight" in line
    assert not (tmp_path / "out").exists()


# ---- 10. checkpoints/latest -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "damage,words",
    [
        (lambda latest: latest.write_text(""), "names '', not a checkpoint tag"),
        (lambda latest: latest.write_bytes(b"\xff\xfe"), "names bytes that are not UTF-8"),
        (lambda latest: (latest.unlink(), latest.mkdir()), "latest is a directory, not the file naming"),
        (lambda latest: latest.write_text("global_step999"), "names 'global_step999', which is missing"),
    ],
)
@pytest.mark.parametrize("command", ["export-hf", "generate"])
def test_a_bad_latest_names_what_these_commands_take(run, tmp_path, capsys, damage, words, command):
    damage(run / "checkpoints/latest")
    args = ["--out", tmp_path / "out"] if command == "export-hf" else ["--prompt", "def"]
    line = one_error(capsys, command, "run", *args)
    assert words in line and "--resume" not in line
    assert (
        "give a complete checkpoint directory instead of the run directory, e.g. run/checkpoints/global_step6" in line
    )
    assert not (tmp_path / "out").exists()


def test_gen_config_refuses_a_data_file_naming_what_to_give(corpus, tmp_path, capsys):
    """--data names a prepared directory or a Megatron prefix: one of the directory's files is refused (it was taken
    for a directory still to prepare, and the note told to prepare-data into the file), a Megatron .bin/.idx with
    its prefix named."""
    megatron = tmp_path / "web_text_document"
    megatron.with_suffix(".idx").write_bytes(b"MMIDIDX\x00\x00" + bytes(25))
    megatron.with_suffix(".bin").write_bytes(bytes(8))
    base = ["gen-config", "--model", "tiny", "--gpu", "cpu", "--gpus-per-node", "2", "--global-batch", "16"]
    for data, words in (
        (corpus / "meta.json", "is a file: give the prepared data directory (the one holding meta.json)"),
        (corpus / "train-00000.bin", "(the one holding meta.json)"),
        (megatron.with_suffix(".bin"), f"or the Megatron prefix {megatron}"),
    ):
        assert run_cli(*base, "--data", data, "--out", tmp_path / "run", "--measure", "never") == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--data {data} is a file" in err and words in err, err
        assert not (tmp_path / "run").exists()


# ---- gen-config values a reader of the run would refuse, refused where they are typed -------------------------------


@pytest.mark.parametrize(
    "args,words",
    [
        (
            ["--data", "data/std\nlib"],
            "--data 'data/std\\nlib' holds the control character '\\n': give a one-line path",
        ),
        (["--data", "a:0.5,b\r:0.5"], "holds the control character '\\r'"),
        (["--lr", "10"], "train.lr must be at most 1, got 10.0 (allowed: finite, (0, 1])"),
        (["--lr", "-1"], "train.lr must be positive, got -1.0"),
    ],
)
def test_gen_config_refuses_what_its_run_could_not_hold(tmp_path, monkeypatch, capsys, args, words):
    monkeypatch.chdir(tmp_path)
    line = one_error(
        capsys, "gen-config", "--model", "tiny", "--gpu", "cpu", "--gpus-per-node", "2", *args, "--out", "r"
    )
    assert words in line, line
    assert list(tmp_path.iterdir()) == []
