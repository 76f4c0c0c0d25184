"""bf16.immediate_grad_update as gen-config renders it: DeepSpeed's BF16_Optimizer (bf16 ZeRO-1) reads the rendered
value, frees every 16-bit gradient once it is added into the fp32 buffer, and trains bitwise as it does with the
flag off; the planner's peak drops by the 16-bit gradients, and --no-immediate-grad-update / a preset's false keep
them (fast: one in-process gloo rank, the tiny GPT)."""

import json

import pytest
import torch

from dspipe.model.gpt import GPT
from dspipe.planner.memory import stage_memory
from dspipe.planner.plan import make_plan
from dspipe.spec.presets import model_preset
from tests.helpers import deepspeed_one_rank, run_cli

FLAGS = ("--model", "tiny", "--gpu", "cpu", "--gpus-per-node", "1", "--global-batch", "4", "--micro-batch", "2")
FLAGS += ("--precision", "bf16", "--zero", "1", "--steps", "3", "--data", "/nonexistent/data")


@pytest.fixture(scope="module")
def one_rank():
    with deepspeed_one_rank():
        yield


def _out(tmp_path, *flags):
    return tmp_path / ("run" + "".join(flags))


def _rendered(tmp_path, *flags) -> dict:
    out = _out(tmp_path, *flags)
    assert run_cli("gen-config", *FLAGS, *flags, "--out", out) == 0
    return json.loads((out / "ds_config.json").read_text())


def _train(config: dict, *, run=None) -> tuple[list[float], list[float], torch.Tensor, list[int]]:
    """Three steps of 2 micro-batches through DeepSpeed's engine built from `config` (torch's AdamW: no JIT build):
    the losses, the gradient norms, the weights after, and the 16-bit gradient elements alive after each backward.
    With `run` (its run directory, loaded), the runner's engine check passes and, given the other value, refuses."""
    import dataclasses

    import deepspeed

    from dspipe.runtime.engine import check_engine, engine_settings

    config = {**config, "optimizer": {**config["optimizer"], "params": {**config["optimizer"]["params"]}}}
    config["optimizer"]["params"]["torch_adam"] = True
    config.pop("tensorboard", None), config.pop("csv_monitor", None)
    spec = model_preset("tiny")
    model = GPT(spec, seed=3)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert type(engine.optimizer).__name__ == "BF16_Optimizer"
    assert engine.optimizer.immediate_grad_update is config["bf16"]["immediate_grad_update"]
    settings = engine_settings(engine)
    assert settings["immediate_grad_update"] is config["bf16"]["immediate_grad_update"]
    if run is not None:
        check_engine(settings, run)
        flipped = dataclasses.replace(
            run, plan=dataclasses.replace(run.plan, immediate_grad_update=not settings["immediate_grad_update"])
        )
        with pytest.raises(RuntimeError, match="^engine does not use the planned settings: immediate_grad_update "):
            check_engine(settings, flipped)
    g = torch.Generator().manual_seed(7)
    losses, norms, alive = [], [], []
    for _ in range(3):
        for _ in range(2):
            idx = torch.randint(0, spec.vocab, (2, spec.seq_len + 1), generator=g)
            loss = engine(idx[:, :-1], idx[:, 1:])
            engine.backward(loss)
            alive.append(sum(p.grad.numel() for p in model.parameters() if p.grad is not None))
            engine.step()
            losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    weights = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    return losses, norms, weights, alive


def test_the_engine_frees_the_16bit_gradients_and_trains_bitwise_alike(one_rank, tmp_path):
    on = _rendered(tmp_path)
    off = _rendered(tmp_path, "--no-immediate-grad-update")
    assert on["bf16"]["immediate_grad_update"] is True and off["bf16"]["immediate_grad_update"] is False
    from dspipe.rundir import load_run

    losses_on, norms_on, weights_on, alive_on = _train(on, run=load_run(_out(tmp_path)))
    losses_off, norms_off, weights_off, alive_off = _train(off)
    params = sum(p.numel() for p in GPT(model_preset("tiny"), seed=3).parameters())
    assert alive_on == [0] * 6 and alive_off == [params] * 6
    assert losses_on == losses_off and norms_on == norms_off and torch.equal(weights_on, weights_off)
    assert losses_on[-1] < losses_on[0]


@pytest.mark.parametrize("tp", [1, 2])
def test_the_peak_holds_one_16bit_gradient_instead_of_all(tp):
    from dspipe.spec.cluster import ClusterSpec
    from dspipe.spec.strategy import StrategySpec
    from dspipe.spec.train import TrainSpec

    model = model_preset("gpt2-124m")
    cluster = ClusterSpec(nodes=1, gpus_per_node=8, gpu="h100-80g")
    train = TrainSpec(global_batch=64, micro_batch=2, precision="bf16", steps=1000)
    peaks = {}
    for on in (True, False):
        strategy = StrategySpec(zero=1, tp=tp, immediate_grad_update=on)
        plan = make_plan(model=model, cluster=cluster, train=train, strategy=strategy)
        assert plan.bf16_optimizer and plan.immediate_grad_update is on
        peaks[on] = stage_memory(model=model, cluster=cluster, plan=plan)[0]
    phi = peaks[True].params // 2  # the rank's 16-bit parameters
    from dspipe.planner.stages import largest_tensor_per_rank

    assert peaks[False].grads - peaks[True].grads == 2 * phi - 2 * largest_tensor_per_rank(model, tp)
    assert peaks[True].params == peaks[False].params and peaks[True].optimizer == peaks[False].optimizer


def test_a_presets_false_is_planned_and_contradicting_it_is_refused(tmp_path, capsys):
    preset = _rendered(tmp_path)
    preset["bf16"]["immediate_grad_update"] = False
    path = tmp_path / "preset.json"
    path.write_text(json.dumps(preset))
    assert _rendered(tmp_path, "--preset", str(path))["bf16"]["immediate_grad_update"] is False
    capsys.readouterr()
    out = tmp_path / "refused"
    code = run_cli("gen-config", *FLAGS, "--preset", path, "--immediate-grad-update", "--out", out)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not out.exists()
    assert len(err) == 1 and "--immediate-grad-update contradicts bf16.immediate_grad_update false" in err[0], err


@pytest.mark.parametrize("flag", ["--immediate-grad-update", "--no-immediate-grad-update"])
def test_a_run_written_before_the_field_keeps_its_ds_configs_value(tmp_path, flag, capsys):
    """A run directory whose dspipe.json predates the field (neither its strategy nor its plan has it) trains as its
    ds_config.json says, which the runner's engine check then holds it to."""
    from dspipe.rundir import load_run

    out = _out(tmp_path, flag)
    _rendered(tmp_path, flag)
    spec = json.loads((out / "dspipe.json").read_text())
    del spec["strategy"]["immediate_grad_update"], spec["plan"]["immediate_grad_update"]
    (out / "dspipe.json").write_text(json.dumps(spec))
    capsys.readouterr()
    run = load_run(out)
    on = flag == "--immediate-grad-update"
    assert run.strategy.immediate_grad_update is on and run.plan.immediate_grad_update is on
    note = "lacks strategy.immediate_grad_update and plan.immediate_grad_update (a run written before the field "
    assert note in capsys.readouterr().err
