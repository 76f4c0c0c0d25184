"""dspipe.model.hf and hf_weights: Hugging Face GPT-2 and Llama directories read as ModelSpec + weights (dspipe's
forward equals transformers' in fp32), the exact inverse mapping back, parameter counts, the export of a Llama model,
the
pipeline-stage loader, `--init-from` on the command line, and the one-line refusals."""

import json

import pytest
import torch

from dspipe.errors import SpecError
from dspipe.spec.model import ModelSpec
from tests.helpers import edit_hf_config, perturb, run_cli

TOL = 1e-5
CPU2 = [
    "--gpu",
    "cpu",
    "--gpus-per-node",
    "2",
    "--global-batch",
    "8",
    "--micro-batch",
    "2",
    "--steps",
    "10",
    "--precision",
    "fp32",
]


def gpt2_model(*, tied=True, seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=96,
        n_positions=24,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_inner=80,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=tied,
    )
    return perturb(GPT2LMHeadModel(cfg).float().eval(), seed)


def llama_model(*, kv_heads=2, tied=False, seed=0, **extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=72,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=24,
        rope_theta=5000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        **extra,
    )
    return perturb(LlamaForCausalLM(cfg).float().eval(), seed)


CASES = {
    "gpt2-tied": lambda: gpt2_model(tied=True),
    "gpt2-untied": lambda: gpt2_model(tied=False),
    "llama-gqa-untied": lambda: llama_model(kv_heads=2, tied=False),
    "llama-mqa-tied": lambda: llama_model(kv_heads=1, tied=True),
    "llama-mha-tied": lambda: llama_model(kv_heads=4, tied=True),
}


def ids(vocab=96, seq=24, n=2):
    return torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(5))


def hf_state(model) -> dict:
    return {k: v for k, v in model.state_dict().items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}


@pytest.mark.parametrize("case", list(CASES))
def test_hf_directory_loads_into_dspipe_gpt_with_the_same_logits(case, tmp_path):
    from dspipe.model.gpt import GPT
    from dspipe.model.hf import spec_from_hf_dir
    from dspipe.model.hf_state import from_hf_state, to_hf_state
    from dspipe.model.hf_weights import HFWeights, load_into_module

    hf = CASES[case]()
    hf.save_pretrained(tmp_path / "hf")
    spec = spec_from_hf_dir(tmp_path / "hf")
    llama = case.startswith("llama")
    assert spec.name == "hf" and spec.tied_embeddings is hf.config.tie_word_embeddings
    assert (spec.norm, spec.mlp, spec.positions, spec.bias) == (
        ("rmsnorm", "swiglu", "rope", False) if llama else ("layernorm", "gelu", "learned", True)
    )
    if llama:
        assert (spec.kv_groups, spec.rope_theta, spec.norm_eps) == (hf.config.num_key_value_heads, 5000.0, 1e-5)
    assert spec.num_params == sum(p.numel() for p in hf.parameters())  # tied counted once on both sides

    gpt = GPT(spec, seed=1).eval()
    assert load_into_module(gpt, HFWeights(tmp_path / "hf", spec), spec=spec) == len(spec.model_tensors())
    x = ids()
    with torch.no_grad():
        diff = (gpt(x) - hf(x).logits).abs().max().item()
    assert diff < TOL, diff

    hf_sd = hf_state(hf)
    ours = from_hf_state(hf_sd, spec)
    assert sorted(ours) == sorted(n for n, _ in spec.model_tensors())
    back = to_hf_state(ours, spec)
    assert sorted(back) == sorted(hf_sd)
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)  # exact inverse, both ways
    again = from_hf_state(back, spec)
    assert all(torch.equal(again[k], ours[k]) for k in ours)


@pytest.mark.parametrize("kv_heads,tied", [(2, False), (4, True)])
def test_dspipe_llama_exports_to_llama_for_causal_lm_with_the_same_logits(kv_heads, tied, tmp_path):
    from transformers import AutoModelForCausalLM

    from dspipe.model.gpt import GPT
    from dspipe.model.hf_state import hf_model

    spec = ModelSpec(
        "l",
        2,
        32,
        4,
        96,
        24,
        72,
        tied_embeddings=tied,
        norm="rmsnorm",
        mlp="swiglu",
        positions="rope",
        rope_theta=500000.0,
        kv_heads=kv_heads,
        bias=False,
        norm_eps=1e-5,
    )
    gpt = perturb(GPT(spec, seed=3).eval(), seed=3)
    model = hf_model(dict(gpt.state_dict()), spec, eos_id=0, source="test")
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_key_value_heads == kv_heads
    model.save_pretrained(tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    x = ids()
    with torch.no_grad():
        diff = (loaded(x).logits - gpt(x)).abs().max().item()
    assert diff < TOL, diff


def test_pipeline_stage_loads_only_its_own_parameters_by_pipeline_name(tmp_path):
    """A stand-in for one PipelineModule stage (layers 0-1 as DeepSpeed names them, and the tied embedding)."""
    from dspipe.model.hf import spec_from_hf_dir
    from dspipe.model.hf_state import from_hf_state
    from dspipe.model.hf_weights import HFWeights, load_into_module
    from dspipe.model.pipeline import layer_specs

    hf = gpt2_model(tied=True)
    hf.save_pretrained(tmp_path / "hf")
    spec = spec_from_hf_dir(tmp_path / "hf")
    specs = layer_specs(model=spec, seed=9)
    stage = torch.nn.Module()
    stage.add_module("1", specs[1].build())  # block 0
    stage.add_module("2", specs[2].build())  # block 1
    stage.tied_modules = torch.nn.ModuleDict({"embed": specs[0].build()})
    assert load_into_module(stage, HFWeights(tmp_path / "hf", spec), spec=spec) == 2 + 2 * 12  # wte, wpe, 12 per block
    full = from_hf_state(hf_state(hf), spec)
    got = dict(stage.named_parameters())
    assert torch.equal(got["1.attn.c_attn.weight"], full["h.0.attn.c_attn.weight"])
    assert torch.equal(got["2.mlp.c_proj.bias"], full["h.1.mlp.c_proj.bias"])
    assert torch.equal(got["tied_modules.embed.wte.weight"], full["embed.wte.weight"])
    assert torch.equal(got["tied_modules.embed.wpe.weight"], full["embed.wpe.weight"])


def test_base_model_checkpoint_names_and_a_shorter_context(tmp_path):
    """A checkpoint saved from GPT2Model (no 'transformer.' prefix, no lm_head, like the original gpt2 on the hub)
    loads; a run with a shorter context takes the first rows of the position table."""
    from safetensors.torch import save_file

    from dspipe.model.gpt import GPT
    from dspipe.model.hf import spec_from_hf_dir
    from dspipe.model.hf_weights import HFWeights, load_into_module

    hf = gpt2_model(tied=True)
    hf.save_pretrained(tmp_path / "hf")
    bare = {k[len("transformer.") :]: v.contiguous() for k, v in hf_state(hf).items() if k.startswith("transformer.")}
    (tmp_path / "hf" / "model.safetensors").unlink()
    save_file(bare, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    spec = spec_from_hf_dir(tmp_path / "hf")
    short = ModelSpec(**{**spec.__dict__, "seq_len": 16})
    gpt = GPT(short, seed=0).eval()
    assert load_into_module(gpt, HFWeights(tmp_path / "hf", short), spec=short) == len(short.model_tensors())
    x = ids(seq=16)
    with torch.no_grad():
        assert (gpt(x) - hf(x).logits).abs().max().item() < TOL


# ---- refusals: one line each, naming the directory and the field --------------------------------------------------


def _config(tmp_path, model, **edits):
    d = tmp_path / "hf"
    model.save_pretrained(d)
    edit_hf_config(d, **edits)
    return d


def _refusal(fn, *args, **kwargs) -> str:
    with pytest.raises(SpecError) as e:
        fn(*args, **kwargs)
    text = str(e.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize(
    "edit,expected",
    [
        (
            dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2"),
            "config.json: architecture Gemma2ForCausalLM is not supported "
            "(supported: GPT2LMHeadModel, LlamaForCausalLM, "
            "Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM)",
        ),
        (dict(architectures=..., model_type="gemma2"), "config.json: model_type 'gemma2' is not supported"),
        (
            dict(architectures=["LlamaForCausalLM"], model_type="mistral"),
            "config.json: model_type 'mistral' does not match architecture LlamaForCausalLM",
        ),
        (
            dict(architectures=["LlamaForCausalLM"], model_type=["llama"]),
            "config.json: model_type ['llama'] does not match architecture LlamaForCausalLM",
        ),
        (
            dict(architectures=["LlamaForCausalLM"], model_type={}),
            "config.json: model_type {} does not match architecture LlamaForCausalLM",
        ),
        (
            dict(rope_parameters=None, rope_theta=10000.0, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
            "config.json: rope_scaling: rope_type dynamic is not supported (supported: default, linear, llama3, yarn)",
        ),
        (
            dict(rope_parameters={"rope_type": "longrope", "rope_theta": 5e5, "factor": 8.0}),
            "config.json: rope_parameters: rope_type longrope is not supported",
        ),
        (
            dict(rope_parameters={"rope_type": "default", "rope_theta": 5e3, "factor": 8.0}),
            "config.json: rope_parameters: factor 8.0 is not supported with rope_type default",
        ),
        (
            dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e3, "factor": 8.0, "high_freq_factor": 4.0}),
            "config.json: rope_parameters: missing low_freq_factor",
        ),
        (dict(partial_rotary_factor=0.5), "config.json: partial_rotary_factor 0.5 is not supported"),
        (dict(attention_bias=1), "config.json: attention_bias must be true or false, got 1"),
        (dict(hidden_act="gelu"), "config.json: hidden_act 'gelu' is not supported"),
        (dict(head_dim=0), "config.json: head_dim must be a positive integer, got 0"),
        (
            dict(num_hidden_layers=10**12),
            "config.json: num_hidden_layers 1000000000000 is over dspipe's limit of 4,096",
        ),
        (dict(num_hidden_layers=4097), "config.json: num_hidden_layers 4097 is over dspipe's limit of 4,096 (layers)"),
        (dict(hidden_size=...), "config.json: missing hidden_size"),
        (dict(num_key_value_heads=3), "config.json: heads 4 is not divisible by kv_heads 3"),
    ],
)
def test_llama_configs_dspipe_cannot_compute_are_refused(tmp_path, edit, expected):
    from dspipe.model.hf import spec_from_hf_dir

    d = _config(tmp_path, llama_model(), **edit)
    text = _refusal(spec_from_hf_dir, d)
    assert text.startswith(str(d)) and expected in text, text


def test_other_refusals(tmp_path):
    from safetensors.torch import save_file

    from dspipe.model.hf import spec_from_hf_dir
    from dspipe.model.hf_arch import hf_config
    from dspipe.model.hf_weights import HFWeights

    assert "no such Hugging Face model directory" in _refusal(spec_from_hf_dir, tmp_path / "absent")
    (tmp_path / "file").write_text("x")
    assert "not a directory" in _refusal(spec_from_hf_dir, tmp_path / "file")
    (tmp_path / "empty").mkdir()
    assert (
        _refusal(spec_from_hf_dir, tmp_path / "empty") == f"{tmp_path / 'empty'}: no config.json (not a Hugging "
        f"Face model directory)"
    )
    (tmp_path / "empty" / "config.json").write_text("{not json")
    assert "config.json is not valid JSON" in _refusal(spec_from_hf_dir, tmp_path / "empty")
    d = _config(tmp_path, gpt2_model(), activation_function="relu")
    assert f"{d / 'config.json'}: activation_function 'relu' is not supported" in _refusal(spec_from_hf_dir, d)

    # a tensor missing from the weights
    hf = llama_model()
    d = tmp_path / "missing"
    hf.save_pretrained(d)
    spec = spec_from_hf_dir(d)
    sd = {k: v.contiguous() for k, v in hf_state(hf).items() if k != "model.layers.1.self_attn.k_proj.weight"}
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    assert (
        _refusal(HFWeights, d, spec)
        == f"{d / 'model.safetensors'}: missing tensor model.layers.1.self_attn.k_proj.weight"
    )
    # a directory with a config but no weights; weights of another model
    (d / "model.safetensors").unlink()
    assert "no weights" in _refusal(HFWeights, d, spec)
    other = ModelSpec(**{**spec.__dict__, "layers": 3})
    assert "describes another model than the run's: layers 2 (run: 3)" in _refusal(HFWeights, d, other)
    # a spec no supported architecture computes
    odd = ModelSpec("odd", 2, 32, 4, 96, 24, 72, norm="rmsnorm", mlp="gelu")
    assert "matches no Hugging Face architecture dspipe writes" in _refusal(hf_config, odd, eos_id=0)


# ---- the command line ----------------------------------------------------------------------------------------------


def test_init_from_on_the_command_line(tmp_path, capsys):
    from dspipe.rundir import load_run

    d = tmp_path / "tiny-llama-hf"
    llama_model(kv_heads=2).save_pretrained(d)
    capsys.readouterr()  # transformers' progress bar
    cases = [
        (["--layers", "3"], f"--layers 3 contradicts --init-from {d} (layers 2 in its config.json)"),
        (["--seq-len", "48"], f"--seq-len 48 exceeds the 24 positions of --init-from {d}"),
        (["--model", "tiny"], f"--model tiny and --init-from {d} both name the model"),
        (["--untied"], None),
    ]
    for flags, expected in cases:
        code = run_cli("plan", *CPU2, "--init-from", d, *flags)
        err = capsys.readouterr().err
        if expected is None:
            assert code == 0, err
        else:
            assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, err
    out = tmp_path / "run"
    assert (
        run_cli(
            "gen-config",
            *CPU2,
            "--init-from",
            d,
            "--seq-len",
            "16",
            "--zero",
            "1",
            "--pp",
            "1",
            "--data",
            tmp_path / "nodata",
            "--out",
            out,
        )
        == 0
    ), capsys.readouterr().err
    run = load_run(out)
    assert run.train.init_from == str(d.resolve()) and run.model.name == "tiny-llama-hf"
    assert (run.model.seq_len, run.model.kv_groups, run.model.norm) == (16, 2, "rmsnorm")
    spec = json.loads((out / "dspipe.json").read_text())
    del spec["train"]["init_from"]  # a run directory written before the field existed
    (out / "dspipe.json").write_text(json.dumps(spec))
    assert load_run(out).train.init_from is None


def test_tokenizer_note(tmp_path):
    from dspipe.cli.init_from import tokenizer_note

    def tokenizer(path, vocab):
        path.mkdir(parents=True, exist_ok=True)
        (path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}, "added_tokens": []}))

    hf, data = tmp_path / "hf", tmp_path / "data"
    tokenizer(hf, {"a": 0, "b": 1, "c": 2})
    tokenizer(data / "tokenizer", {"a": 0, "b": 1, "c": 2})
    (data / "meta.json").write_text(json.dumps({"vocab_size": 3}))
    assert tokenizer_note(str(hf), str(data)) == (
        f"note: {data}'s tokenizer has the same vocab size as {hf}'s (3 tokens)"
    )
    tokenizer(data / "tokenizer", {"a": 0, "c": 1, "b": 2})
    assert "same vocab size as" in tokenizer_note(str(hf), str(data)) and "but another vocabulary" in tokenizer_note(
        str(hf), str(data)
    )
    (data / "meta.json").write_text(json.dumps({"vocab_size": 1024}))
    note = tokenizer_note(str(hf), str(data))
    assert f"{data} was tokenized with a 1024-token tokenizer, {hf}'s has 3 tokens" in note
    assert tokenizer_note(str(hf), str(tmp_path / "unprepared")) is None


# ---- lazy reads and the weight check at gen-config ----------------------------------------------------------------


@pytest.mark.parametrize("case", ["gpt2-untied", "llama-gqa-untied"])
def test_lazy_reads_equal_the_whole_tensor(tmp_path, case):
    """HFWeights.rows/flat (what a pipeline stage and a ZeRO-3 partition read) are slices of the whole tensor, for
    GPT-2's transposed Conv1D weights and Llama's stacked q/k/v and gate/up alike, over a sharded checkpoint."""
    from dspipe.model.hf import spec_from_hf_dir
    from dspipe.model.hf_state import from_hf_state
    from dspipe.model.hf_weights import HFWeights

    hf = CASES[case]()
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    spec = spec_from_hf_dir(tmp_path / "hf")
    weights, full = HFWeights(tmp_path / "hf", spec), from_hf_state(hf_state(hf), spec)
    g = torch.Generator().manual_seed(0)
    for name, t in full.items():
        assert torch.equal(weights.full(name), t), name
        flat = t.reshape(-1)
        for _ in range(3):
            a, b = sorted(torch.randint(0, flat.numel() + 1, (2,), generator=g).tolist())
            assert torch.equal(weights.flat(name, a, b), flat[a:b]), (name, a, b)
        if t.dim() == 2 and t.shape[0] > 3:
            assert torch.equal(weights.rows(name, 1, 3), t[1:3]), name


def test_gen_config_checks_the_weights_from_their_headers(tmp_path, capsys):
    """A missing weights file, a tensor of the wrong shape or dtype, a truncated safetensors file or index: one
    line at gen-config, exit 2, nothing written."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "hf"
    llama_model(kv_heads=2).save_pretrained(d)
    capsys.readouterr()
    weights = d / "model.safetensors"
    good = weights.read_bytes()
    state = load_file(str(weights))

    def refused(expected):
        out = tmp_path / "run"
        code = run_cli(
            "gen-config",
            *CPU2,
            "--init-from",
            d,
            "--zero",
            "1",
            "--pp",
            "1",
            "--data",
            tmp_path / "nodata",
            "--out",
            out,
        )
        err = capsys.readouterr().err
        assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()

    weights.unlink()
    refused(f"{d}: no weights")
    save_file(
        {**state, "model.layers.0.mlp.gate_proj.weight": torch.zeros(70, 32)}, str(weights), metadata={"format": "pt"}
    )
    refused(f"{weights}: tensor model.layers.0.mlp.gate_proj.weight has shape [70, 32], the model needs [72, 32]")
    save_file(
        {**state, "model.norm.weight": torch.zeros(32, dtype=torch.int32)}, str(weights), metadata={"format": "pt"}
    )
    refused(f"{weights}: tensor model.norm.weight has dtype I32, not a floating-point type")
    weights.write_bytes(good[: len(good) - 64])
    refused(f"{weights}: cannot read the weights: Error while deserializing header")
    weights.unlink()
    llama_model(kv_heads=2).save_pretrained(d, max_shard_size="20KB")
    capsys.readouterr()
    index = d / "model.safetensors.index.json"
    index.write_text(index.read_text()[:40])
    refused(f"{index}")
    capsys.readouterr()


def test_one_pipeline_layer_is_read_under_its_own_gpt_names():
    """load_into_module(layer=True): a layer a LayerSpec made on its own (the stage builds of tp and ep make each
    layer themselves) reads its tensors under the GPT names of its place: embed., h.N., final., lm_head."""
    import torch

    from dspipe.model.gpt import GPT
    from dspipe.model.hf_weights import layer_prefix_of, load_into_module
    from dspipe.model.pipeline import layer_specs
    from dspipe.spec.presets import model_preset

    spec = model_preset("tiny-llama", tied_embeddings=False)
    whole = dict(GPT(spec, seed=3).named_parameters())

    class Weights:
        def full(self, name):
            return whole[name].detach() * 2

    got = {}
    for layer_spec in layer_specs(model=spec, seed=0):
        layer = layer_spec.build()
        load_into_module(layer, Weights(), spec=spec, layer=True)
        got.update({layer_prefix_of(layer) + n: p for n, p in layer.named_parameters()})
    assert got.keys() == whole.keys()
    assert all(torch.equal(p, whole[n] * 2) for n, p in got.items())
    with pytest.raises(TypeError, match="Linear is not a layer of dspipe's pipeline"):
        layer_prefix_of(torch.nn.Linear(2, 2))
