"""Issue 26: reading a checkpoint never runs code; damaged checkpoint files, generate's edge values, host names, run
specs that contradict themselves and library log lines each end in one line (exit 2), never a traceback, never a
change on disk. Checkpoints are built by hand in DeepSpeed's file formats (tests.helpers.hand_checkpoint): no
launch."""

import builtins
import hashlib
import json
import os
import shutil
from dataclasses import replace

import pytest
import torch

from dspipe.errors import SpecError
from dspipe.runtime import checkpoint as ckpt
from dspipe.runtime import ckpt_meta, rng, safeload
from tests.helpers import hand_checkpoint, run_cli

MODEL_FILE = "mp_rank_00_model_states.pt"


class CreatesFile:
    """A pickle that, loaded unsafely, calls open(marker, 'w'): the file appears. Loaded weights-only it must not."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.open, (self.marker, "w")


def snapshot(root):
    return {
        str(p): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir" for p in sorted(root.rglob("*"))
    }


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("dspipe: error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    """A 2-rank fp32 ZeRO-0 run directory with one hand-built checkpoint (global_step6) and its export."""
    root = tmp_path_factory.mktemp("trust")
    run = root / "run"
    assert (
        run_cli(
            "gen-config",
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
            "--warmup",
            "1",
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
            "--data",
            corpus,
            "--out",
            run,
        )
        == 0
    )
    tag = hand_checkpoint(run)
    assert run_cli("export-hf", run, "--out", root / "hf") == 0
    return {"root": root, "run": run, "tag": tag, "hf": root / "hf"}


@pytest.fixture()
def copy(trained, tmp_path):
    """A private copy of the run (checkpoint included) to damage."""
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    return run, run / "checkpoints" / "global_step6"


# ---- the allowlist: one table, every type DeepSpeed's files hold, nothing else ---------------------------------


def test_the_allowlist_loads_what_deepspeed_and_dspipe_write(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    state = {
        "loss_scaler": LossScaler(1.0),
        "dynamic": DynamicLossScaler(
            init_scale=2.0**16, scale_window=1000, min_scale=1, delayed_shift=2, consecutive_hysteresis=False
        ),
        "zero_stage": ZeroStageEnum.gradients,
        "param_slice_mappings": [{"w": fragment_address(numel=6, start=2)}],
        "rng": rng.rng_state(),
        "t": torch.arange(4.0),
    }
    torch.save(state, tmp_path / "f.pt")
    loaded = safeload.load(tmp_path / "f.pt")
    assert loaded["zero_stage"] is ZeroStageEnum.gradients and loaded["loss_scaler"].cur_scale == 1.0
    assert loaded["dynamic"].cur_scale == 2.0**16 and loaded["dynamic"].scale_window == 1000
    assert loaded["param_slice_mappings"][0]["w"] == fragment_address(numel=6, start=2)
    assert torch.equal(loaded["t"], torch.arange(4.0)) and loaded["rng"]["python"] == state["rng"]["python"]
    # nothing of the table leaks out of a read, and the forcing variable is restored
    assert os.environ.get(safeload.FORCE_ENV) is None
    assert not {id(g) for g in safeload.allowed_globals()} & {id(g) for g in torch.serialization.get_safe_globals()}


def test_a_pickle_that_would_create_a_file_is_refused_by_every_load(tmp_path):
    marker = tmp_path / "PWNED"
    torch.save({"module": CreatesFile(marker)}, tmp_path / "evil.pt")
    torch.load(tmp_path / "evil.pt", weights_only=False)["module"].close()  # the proof: loaded unsafely, it creates
    assert marker.is_file()
    marker.unlink()
    with pytest.raises(
        SpecError,
        match=r"evil.pt names io.open, which is not a type a checkpoint "
        r"holds .* refused without loading it",
    ):
        safeload.load(tmp_path / "evil.pt")
    with safeload.weights_only_loads(), pytest.raises(Exception, match="io.open"):
        torch.load(tmp_path / "evil.pt", weights_only=False)  # how DeepSpeed's loaders call it: forced weights-only
    with safeload.weights_only_loads(), safeload.weights_only_loads():  # nested: the outer block keeps the table
        pass
    assert not marker.exists() and os.environ.get(safeload.FORCE_ENV) is None


@pytest.mark.parametrize("reader", ["export-hf", "generate", "resume"])
@pytest.mark.parametrize("where", [MODEL_FILE, "rng-rank1.pt"])
def test_no_reader_runs_the_code_of_a_checkpoint(copy, tmp_path, capsys, reader, where):
    run, tag = copy
    marker = tmp_path / "PWNED"
    state = torch.load(tag / where, weights_only=False)
    state["python" if where.startswith("rng") else "lr_scheduler"] = CreatesFile(marker)
    torch.save(state, tag / where)
    before = snapshot(run)
    if reader == "resume":
        from dspipe.rundir import load_run

        with pytest.raises(SpecError) as e:
            ckpt.resume_point(load_run(run))
        message = str(e.value)
    else:
        args = ["--out", tmp_path / "hf"] if reader == "export-hf" else ["--prompt", "def"]
        assert run_cli(reader, run, *args) == 2
        message = one_error_line(capsys)
    assert f"{tag / where} names io.open, which is not a type a checkpoint holds" in message
    assert not marker.exists() and snapshot(run) == before and not (tmp_path / "hf").exists()


def test_resharding_reads_the_universal_optimizer_state_weights_only(tmp_path):
    from dspipe.runtime.reshard import saved_param_groups

    (tmp_path / "zero").mkdir()
    torch.save(
        {"optimizer_state_dict": {"param_groups": [{"lr": 0.1, "params": [0]}]}},
        tmp_path / "zero" / "optimizer_state.pt",
    )
    assert saved_param_groups(tmp_path) == [{"lr": 0.1, "params": [0]}]
    torch.save({"optimizer_state_dict": CreatesFile(tmp_path / "PWNED")}, tmp_path / "zero" / "optimizer_state.pt")
    with pytest.raises(SpecError, match="names io.open"):
        saved_param_groups(tmp_path)
    torch.save({"optimizer_state_dict": {}}, tmp_path / "zero" / "optimizer_state.pt")
    with pytest.raises(SpecError, match="no optimizer param_groups"):
        saved_param_groups(tmp_path)
    assert not (tmp_path / "PWNED").exists()


# ---- damaged checkpoint files: one line naming the file, for every reader ----------------------------------------


def _module(tag):
    return torch.load(tag / MODEL_FILE, weights_only=False)


def _edit_module(tag, fn):
    sd = _module(tag)
    fn(sd)
    torch.save(sd, tag / MODEL_FILE)


def _reshape(sd):
    sd["module"]["h.0.attn.c_attn.weight"] = torch.zeros(10, 64)


DAMAGES = {
    "garbage bytes": (
        MODEL_FILE,
        lambda tag: (tag / MODEL_FILE).write_bytes(b"\x13\x37 not a checkpoint" * 30),
        "is not a torch checkpoint file",
    ),
    "empty": (MODEL_FILE, lambda tag: (tag / MODEL_FILE).write_bytes(b""), "is empty (0 bytes)"),
    "truncated": (
        MODEL_FILE,
        lambda tag: (tag / MODEL_FILE).write_bytes((tag / MODEL_FILE).read_bytes()[:-100]),
        "is truncated or damaged",
    ),
    "a pickled list": (MODEL_FILE, lambda tag: torch.save([1, 2], tag / MODEL_FILE), "holds a list, not the dict"),
    "no module key": (MODEL_FILE, lambda tag: torch.save({"optimizer": None}, tag / MODEL_FILE), "no 'module' key"),
    "module not a dict": (
        MODEL_FILE,
        lambda tag: _edit_module(tag, lambda sd: sd.update(module=[1])),
        "module must be a dict of tensors, got list",
    ),
    "a wrong shape": (
        MODEL_FILE,
        lambda tag: _edit_module(tag, _reshape),
        "h.0.attn.c_attn.weight has shape [10, 64], the checkpoint's model has [192, 64]",
    ),
    "a foreign tensor": (
        MODEL_FILE,
        lambda tag: _edit_module(tag, lambda sd: sd["module"].update(x=torch.ones(1))),
        "'x' is not a parameter of the checkpoint's model",
    ),
    "a missing tensor": (
        MODEL_FILE,
        lambda tag: _edit_module(tag, lambda sd: sd["module"].pop("final.ln_f.weight")),
        "holds no weights for final.ln_f.weight",
    ),
    "a non-tensor": (
        MODEL_FILE,
        lambda tag: _edit_module(tag, lambda sd: sd["module"].update({"h.0.ln_1.bias": 3})),
        "'h.0.ln_1.bias' holds a int, not a tensor",
    ),
    "another step": (
        MODEL_FILE,
        lambda tag: _edit_module(tag, lambda sd: sd.update(step=3)),
        "was saved at step 3, but the checkpoint's dspipe.json is at step 6",
    ),
    "missing file": (MODEL_FILE, lambda tag: (tag / MODEL_FILE).unlink(), f"is missing {MODEL_FILE}"),
    "rng garbage": (
        "rng-rank1.pt",
        lambda tag: (tag / "rng-rank1.pt").write_bytes(b"\x80\x02garbage"),
        "is not a torch checkpoint file",
    ),
    "rng wrong state": (
        "rng-rank1.pt",
        lambda tag: torch.save(
            {"python": (3, (1, 2), None), "numpy": (), "torch": torch.zeros(3)}, tag / "rng-rank1.pt"
        ),
        "not a valid RNG state",
    ),
    "rng missing": ("rng-rank1.pt", lambda tag: (tag / "rng-rank1.pt").unlink(), "is missing rng-rank1.pt"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_checkpoint_files_are_one_line_for_every_reader(copy, tmp_path, capsys, damage):
    from dspipe.rundir import load_run

    run, tag = copy
    name, how, expected = DAMAGES[damage]
    how(tag)
    before = snapshot(run)
    for reader in ("export-hf", "generate"):
        args = ["--out", tmp_path / "hf"] if reader == "export-hf" else ["--prompt", "def"]
        assert run_cli(reader, run, *args) == 2, (damage, reader)
        line = one_error_line(capsys)
        assert expected in line and (str(tag / name) in line or str(tag) in line), (reader, line)
    with pytest.raises(SpecError) as e:  # the ranks' reader, before DeepSpeed loads anything
        ckpt.resume_point(load_run(run))
    assert expected in str(e.value) and "\n" not in str(e.value)
    assert snapshot(run) == before and not (tmp_path / "hf").exists()


def test_the_healthy_checkpoint_passes_every_check(trained):
    from dspipe.rundir import load_run

    assert ckpt.resume_point(load_run(trained["run"])) == trained["tag"]
    meta = ckpt_meta.read_meta(trained["tag"])
    from dspipe.runtime.ckptfiles import expected_files

    assert expected_files(meta) == [MODEL_FILE, "rng-rank0.pt", "rng-rank1.pt"]
    assert expected_files(replace(meta, zero_stage=3)) == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt",
        "zero_pp_rank_1_mp_rank_00_model_states.pt",
        "rng-rank0.pt",
        "rng-rank1.pt",
    ]
    assert expected_files(replace(meta, pp=2, dp=1))[:2] == ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    # experts over 2 tp groups (ep 4 = tp 2 x 2: DeepSpeed's layer): each expert's file by its holder's tp rank
    moe = {**meta.model, "experts": 4, "expert_ffn": 32, "layers": 1}
    over = replace(meta, model=moe, tp=2, dp=2, ep=4, world_size=4)
    experts = [n for n in expected_files(over) if "_expert_" in n]
    assert experts == [f"layer_0_expert_{e}_mp_rank_{e % 2:02d}_model_states.pt" for e in range(4)]
    assert not [n for n in expected_files(replace(over, ep=2)) if "_expert_" in n]  # spread over the tp group
    assert len([n for n in expected_files(replace(over, tp=1)) if "_expert_" in n]) == 4  # tp 1: all mp_rank_00


# ---- generate: edge values handled exactly, bad text and a missing tokenizer refused -------------------------------


def test_a_tiny_temperature_is_greedy_not_nan(trained, capsys):
    outs = {}
    for t in ("0", "1e-45", "5e-324", "1e-300"):
        assert run_cli("generate", trained["hf"], "--prompt", "def ", "--max-tokens", "8", "--temperature", t) == 0
        outs[t] = capsys.readouterr().out
    assert len(set(outs.values())) == 1 and outs["0"].startswith("def "), outs
    runs = []
    for t in ("0", "1e-45"):  # from the checkpoint too, with top-k beyond the vocabulary
        assert (
            run_cli(
                "generate",
                trained["run"],
                "--prompt",
                "def ",
                "--max-tokens",
                "8",
                "--temperature",
                t,
                "--top-k",
                "100000",
            )
            == 0
        )
        runs.append(capsys.readouterr().out)
    assert runs[0] == runs[1] and runs[0].startswith("def ")
    for t in ("100", "1"):
        assert run_cli("generate", trained["hf"], "--prompt", "def ", "--max-tokens", "8", "--temperature", t) == 0
    assert run_cli("generate", trained["hf"], "--prompt", "x", "--temperature", "100.5") == 2
    assert "--temperature must be >= 0 (0 = greedy), got 100.5 (allowed: finite, [0, 100])" in one_error_line(capsys)


def test_next_token_is_exact_at_the_edges():
    from dspipe.tools.generate import Sampling, next_token

    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([1e30, -1e30, 3.0, 1e30 - 1e24])
    for t in (1e-45, 5e-324, 1e-300):
        assert next_token(logits, sampling=Sampling(temperature=t, top_k=0), generator=g) == 0
    tied = torch.tensor([2.0, 5.0, 5.0, -1.0])  # a tiny temperature keeps both maxima, nothing else
    picks = {next_token(tied, sampling=Sampling(temperature=1e-45, top_k=0), generator=g) for _ in range(50)}
    assert picks == {1, 2}
    assert next_token(tied, sampling=Sampling(temperature=1.0, top_k=1), generator=g) in (1, 2)
    with pytest.raises(SpecError, match="the model computed 1 non-finite logits"):
        next_token(torch.tensor([0.0, float("nan")]), sampling=Sampling(), generator=g)


def test_a_prompt_that_is_not_utf8_is_one_line(trained, capsys):
    bad = b"def \xff\xfe x".decode("utf-8", "surrogateescape")  # what Python makes of such argv bytes
    assert run_cli("generate", trained["hf"], "--prompt", bad) == 2
    assert "--prompt holds bytes that are not UTF-8 text (at character 5: '\\udcff\\udcfe')" in one_error_line(capsys)


def test_an_export_without_its_tokenizer_is_refused(trained, tmp_path, capsys):
    hf = tmp_path / "hf"
    shutil.copytree(trained["hf"], hf)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (hf / name).unlink()
    assert run_cli("generate", hf, "--prompt", "def ") == 2
    assert f"{hf} holds no tokenizer (none of tokenizer.json, vocab.json" in one_error_line(capsys)
    assert capsys.readouterr().out == ""


# ---- host names --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,ok",
    [
        ("node-1", True),
        ("gpu01.cluster.example.org", True),
        ("a", True),
        ("10.0.0.1", True),
        ("localhost", True),
        ("-oProxyCommand", False),
        ("-", False),
        ("a b", False),
        ("a;b", False),
        ("node_1", False),
        ("node-", False),
        ("", False),
        ("256.1.1.1", False),
        ("1.2.3", False),
        ("a" * 64, False),
        ("x." * 127 + "x", False),
        ("$(touch x)", False),
        ("n\u00e9", False),
        ("node:1", False),
        ("::1", False),
    ],
)
def test_hostfile_hosts_are_rfc1123_names_or_ipv4(name, ok):
    from dspipe.cluster.hostname import host_problem

    assert (host_problem(name, ipv6=False) is None) is ok, host_problem(name, ipv6=False)


def test_master_addr_takes_names_and_ip_literals_only(trained, tmp_path, capsys):
    run = trained["run"]
    for addr in ("node-1", "10.1.2.3", "::1", "fe80::1", "[::1]"):
        assert run_cli("launch", run, "--master-addr", addr, "--dry-run") == 0
        assert f"--master_addr {addr}" in capsys.readouterr().out.replace("'", "")
    for addr, why in (
        ("a b", "it is not an RFC 1123 host name"),
        ("-oProxyCommand=x", "it starts with '-'"),
        ("1::2::3", "':' is neither"),
        ("", "it is empty"),
    ):
        assert run_cli("launch", run, "--master-addr", addr, "--dry-run") == 2
        assert f"--master-addr {ascii(addr)} is not a host name or address: {why}" in one_error_line(capsys)


def test_a_hostfile_host_starting_with_a_dash_never_reaches_ssh(trained, tmp_path, capsys):
    hosts = tmp_path / "hosts"
    hosts.write_text("-oProxyCommand slots=2\n")
    for argv in (
        ["launch", trained["run"], "--hostfile", hosts, "--dry-run"],
        ["doctor", "--hostfile", hosts, "--skip-allreduce", "--gpu", "cpu"],
    ):
        assert run_cli(*argv) == 2
        assert (
            f"{hosts}:1: '-oProxyCommand slots=2': host '-oProxyCommand' is not a host name or address: it "
            f"starts with '-', which ssh and pdsh would take as an option"
        ) in one_error_line(capsys)


# ---- a run directory that contradicts itself -----------------------------------------------------------------------


def test_a_cluster_that_contradicts_the_launch_layout_is_refused_by_every_reader(trained, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run, ignore=shutil.ignore_patterns("checkpoints"))
    spec = json.loads((run / "dspipe.json").read_text())
    spec["cluster"].update(nodes=2, gpus_per_node=1)  # world size still 2: the plan alone cannot tell
    (run / "dspipe.json").write_text(json.dumps(spec))
    before = snapshot(run)
    for argv in (
        ["slurm-script", run],
        ["report", run],
        ["launch", run, "--dry-run"],
        ["extend", run, "--steps", "9"],
        ["export-hf", run, "--out", tmp_path / "hf"],
    ):
        assert run_cli(*argv) == 2, argv
        line = one_error_line(capsys)
        assert f"{run / 'dspipe.json'}: " in line and (
            "command launches 1 node(s) x 2 rank(s) but cluster is 2 node(s) x 1 GPU(s)" in line
            or "disagrees with cluster.gpus_per_node 1" in line
        ), line
    assert snapshot(run) == before and not (tmp_path / "hf").exists()
    spec = json.loads((trained["run"] / "dspipe.json").read_text())
    spec["estimate"]["zero_stage"] = 3
    (run / "dspipe.json").write_text(json.dumps(spec))
    assert run_cli("report", run) == 2
    assert "estimate.zero_stage 3 disagrees with plan.zero_stage 0" in one_error_line(capsys)


# ---- library log lines ------------------------------------------------------------------------------------------


def test_prepare_data_on_malformed_jsonl_prints_only_dspipe_s_line(tmp_path, capfd):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "hello"}\n{bad json\n')
    assert run_cli("prepare-data", bad, "--out", tmp_path / "out", "--train-tokenizer", "260", "--workers", "1") == 2
    err = capfd.readouterr().err
    assert "Failed to load JSON" not in err and "Traceback" not in err
    assert [line for line in err.splitlines() if "error" in line.lower()] == [
        f"dspipe: error: {bad}: line 2 is not JSON (Expecting property name enclosed in double quotes, column 2): "
        "each line must be one JSON object with its text in field 'text'"
    ]
    assert not (tmp_path / "out").exists()


def test_a_pipeline_stages_expert_files_follow_its_routers():
    """A pipeline of experts: each stage's expert files are named by its sparse blocks counted from 0 in layer order
    (their routers under DeepSpeed's gate name in the stage's mp_rank module) and by the stage's model-parallel
    rank; a name that is not a pipeline layer's adds none (it is refused as not the model's afterwards)."""
    from dspipe.runtime.ckptfiles import stage_expert_files

    gate = "mlp.moe.deepspeed_moe.gate.wg.weight"
    module = {f"4.{gate}": 0, f"3.{gate}": 0, "3.ln_1.weight": 0, f"x.{gate}": 0, "5.ln_f.weight": 0}
    assert stage_expert_files(module, mp_rank=1, experts=2) == [
        "layer_0_expert_0_mp_rank_01_model_states.pt",
        "layer_0_expert_1_mp_rank_01_model_states.pt",
        "layer_1_expert_0_mp_rank_01_model_states.pt",
        "layer_1_expert_1_mp_rank_01_model_states.pt",
    ]
    assert stage_expert_files({"0.wte.weight": 0}, mp_rank=0, experts=4) == []
