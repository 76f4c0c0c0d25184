"""One declaration of the architecture: for every shipped preset the module dspipe builds has exactly the tensors
ModelSpec.model_tensors() lists (names and shapes), so the planner's parameter counts (and everything derived:
FLOPs per token, model states, AutoTP splits) are the model's, the mixtures of experts' sparse blocks included;
Llama-family counts equal the published ones."""

import pytest

from dspipe.spec.presets import MODEL_PRESETS

PUBLISHED = {  # parameter counts of the released checkpoints (sum of numel of the Hugging Face weights)
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "tinyllama-1.1b": 1_100_048_384,
    "gpt2-124m": 124_439_808,
    "gpt2-355m": 354_823_168,
    "gpt2-774m": 774_030_080,
    "gpt2-1.5b": 1_557_611_200,
}


@pytest.mark.parametrize("name", list(MODEL_PRESETS))
def test_built_module_is_the_declared_tensors(name):
    torch = pytest.importorskip("torch")
    from dspipe.model.gpt import GPT

    spec = MODEL_PRESETS[name]
    with torch.device("meta"):  # shapes only, no values drawn: a 70B model costs no memory
        model = GPT(spec, seed=None)
    built = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert built == dict(spec.model_tensors())
    assert sum(p.numel() for p in model.parameters()) == spec.num_params
    if spec.experts:  # the routed experts (what expert parallelism divides) and the blocks that hold them
        routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
        assert routed == spec.routed_expert_params
        assert [i for i, b in enumerate(model.h) if type(b.mlp).__name__ == "SparseMLP"] == list(spec.sparse_layers)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_parameter_counts_equal_the_published_ones(name):
    assert MODEL_PRESETS[name].num_params == pytest.approx(PUBLISHED[name], rel=0.005)


def test_architecture_flags_build_the_llama_shape(tmp_path, capsys, monkeypatch):
    """A custom Llama from flags is the preset's declaration; bad values are one line, exit 2."""
    import json

    from tests.helpers import run_cli

    monkeypatch.chdir(tmp_path)
    flags = [
        "--layers",
        "2",
        "--hidden",
        "64",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--vocab",
        "4096",
        "--seq-len",
        "64",
        "--ffn",
        "160",
        "--untied",
        "--norm",
        "rmsnorm",
        "--mlp",
        "swiglu",
        "--positions",
        "rope",
        "--no-bias",
    ]
    assert run_cli("plan", "--json", "--gpu", "cpu", "--gpus-per-node", "2", "--global-batch", "16", *flags) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_params"] == MODEL_PRESETS["tiny-llama"].num_params
    for bad, message in (
        (["--kv-heads", "3"], "heads 4 is not divisible by kv_heads 3"),
        (["--rope-theta", "0"], "model.rope_theta must be in [1, 1e9], got 0"),
        (["--norm-eps", "1"], "model.norm_eps must be in (0, 1), got 1"),
    ):
        code = run_cli("plan", "--gpu", "cpu", "--gpus-per-node", "2", "--global-batch", "16", *flags, *bad)
        err = capsys.readouterr().err
        assert code == 2 and message in err and err.count("\n") == 1, err


def test_memory_headroom_is_the_share_plans_must_leave_free(capsys):
    from tests.helpers import run_cli

    base = ["plan", "--model", "gpt3-1.3b", "--gpu", "a100-80g", "--gpus-per-node", "8", "--global-batch", "64"]
    assert run_cli(*base, "--memory-headroom", "50") == 0
    assert "plans may use 50%" in capsys.readouterr().out
    code = run_cli(*base, "--memory-headroom", "100")
    err = capsys.readouterr().err
    assert code == 2 and "--memory-headroom must be a percentage in [0, 100), got 100" in err
