"""`dspipe bench`: gen-config's options and planner, then real steps on this machine, optionally beside a
plain-PyTorch reference. torch is imported only when the command runs (to find the devices)."""

from __future__ import annotations

import shlex
import sys
import tempfile
from pathlib import Path

import click

from dspipe.cli.options import choose, spec_options
from dspipe.cli.prepare_run import prepare_run
from dspipe.errors import SpecError
from dspipe.spec.hardware import CPU_RANKS, names_text
from dspipe.tools.bench import REFERENCES

BENCH_OPTIONS = {"steps": (10, "measured steps"), "warmup": (3, "warm-up steps before measuring (not timed)")}
"""The shared options bench gives its own meaning: they count benchmark steps, not the run's optimizer steps and
lr warmup (the run dir trains warmup + steps optimizer steps with the usual derived lr warmup)."""


def _set_option(command: click.Command, name: str, *, default, help: str) -> None:
    """Give a shared spec option bench's own meaning (its --steps and --warmup count benchmark steps)."""
    for param in command.params:
        if param.name == name:
            param.default, param.help, param.show_default = default, help, True
            return
    raise AssertionError(f"no option {name}")


def _devices(o: dict) -> tuple[str, int]:
    """(catalog GPU type, ranks) of this machine; --gpu / --gpus-per-node given must match what is here."""
    import torch

    from dspipe.cluster.doctor import detect_gpu

    ctx = click.get_current_context()
    given = {k: ctx.get_parameter_source(k) == click.core.ParameterSource.COMMANDLINE for k in ("gpu", "gpus_per_node")}
    if o["hostfile"] or o["nodes"] != 1:
        raise SpecError(
            f"dspipe bench runs on this machine only (--nodes {o['nodes']}"
            f"{', --hostfile ' + o['hostfile'] if o['hostfile'] else ''}); drop the multi-node options"
        )
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        if given["gpu"] and o["gpu"] != "cpu":
            raise SpecError(f"--gpu {o['gpu']}: this machine has no CUDA GPU; use --gpu cpu (or leave it out)")
        return "cpu", o["gpus_per_node"] if given["gpus_per_node"] else CPU_RANKS
    found = detect_gpu()
    if given["gpu"]:
        if o["gpu"] == "cpu":
            raise SpecError(
                f"--gpu cpu: this machine has {count} CUDA GPU(s), which the ranks would use; leave --gpu out"
            )
        gpu = o["gpu"]
    elif found is None:
        raise SpecError(
            f"GPU {torch.cuda.get_device_name(0)!r} is not in the catalog: pass --gpu with the closest "
            f"type ({names_text(gpus_only=True)})"
        )
    else:
        gpu = found
    ranks = o["gpus_per_node"] if given["gpus_per_node"] else count
    if ranks > count:
        raise SpecError(f"--gpus-per-node {ranks}: this machine has {count} CUDA GPU(s)")
    return gpu, ranks


def bench_command(o: dict, *, command: str) -> dict:
    """Plan as gen-config does, write the run dir in a temp directory, launch the side(s), report."""
    from dspipe.cluster.doctor import versions
    from dspipe.tools import bench

    warmup, steps = o["warmup"], o["steps"]
    if warmup < 1 or steps < 1:
        raise SpecError(
            f"--warmup {warmup} --steps {steps}: both must be at least 1 (the first step allocates "
            f"and is never measured)"
        )
    if o["append"] is not None:
        if not o["append"].strip():
            raise SpecError(f"--append needs a markdown file's path, got {o['append']!r}")
        bench.existing_text(Path(o["append"]))  # before minutes of measuring
    gpu, ranks = _devices(o)
    # the run dir trains warmup + steps optimizer steps; its lr warmup is the usual default
    o = {**o, "gpu": gpu, "gpus_per_node": ranks, "steps": warmup + steps, "warmup": None}
    model, cluster, result, preset = choose(o)
    best = result.best
    plan = best.plan
    if o["compare"] and plan.layout.model_ranks > 1:
        raise SpecError(
            f"--compare needs pp 1, tp 1 and sp 1 (the reference is torch DDP), the plan has pp {plan.pp}, "
            f"tp {plan.tp}, sp {plan.sp}; pass --pp 1 --tp 1 --sp 1 or drop --compare"
        )
    sides_wanted = ("dspipe", *bench.REFERENCES[o["reference"]]) if o["compare"] else ("dspipe",)
    threads = bench.cpu_threads(ranks=ranks) if gpu == "cpu" else None
    say = click.echo
    setup = _setup_text(model=model, plan=plan, warmup=warmup, steps=steps, compiled=o["compile"])
    say(f"bench: {setup}")
    results = _run_sides(
        model=model,
        cluster=cluster,
        best=best,
        command=command,
        preset=preset,
        sides=sides_wanted,
        ranks=ranks,
        warmup=warmup,
        steps=steps,
        threads=threads,
    )
    device = results["dspipe"][0]["device_name"]
    sides = _summarize(results, device=device, model=model, plan=plan, steps=steps)
    engine = sides["dspipe"]["engine"]
    threads = sides["dspipe"]["threads"]  # as the ranks saw it
    setup += (
        f" | engine {engine['wrapper_optimizer']} + {engine['base_optimizer']}, {engine['backend']}"
        f" | {threads} torch thread(s) per rank"
    )
    word = bench.plan_word(best.est, on_host=cluster.gpu_type.host_is_device)
    say(bench.format_table(sides, header=f"device: {device} | {versions()}", plan=word))
    if o["append"]:
        section = bench.markdown_section(
            sides, date=bench.today(), device=device, versions=versions(), command=command, setup=setup, plan=word
        )
        bench.append_section(Path(o["append"]), section)
        say(f"appended to {o['append']}")
    return sides


def _setup_text(*, model, plan, warmup: int, steps: int, compiled: bool) -> str:
    """bench's line on the model, the plan and the steps measured."""
    return (
        f"{model.name} {plan.num_params / 1e6:,.2f}M params ({model.shape_text}) | {plan.layout.describe()} | "
        f"ZeRO-{plan.zero_stage} offload {plan.offload} | {plan.precision} | recompute {plan.recomputation} | "
        f"batch {plan.micro_batch} x ga {plan.grad_accum} x dp {plan.dp} = {plan.global_batch} seq "
        f"({plan.tokens_per_step:,} tokens/step) | {warmup} warm-up + {steps} measured steps"
        f"{' | blocks compiled' if compiled else ''}"
    )


def _run_sides(
    *, model, cluster, best, command: str, preset, sides: tuple[str, ...], ranks: int, warmup: int, steps: int, threads
) -> dict:
    """Write the run dir in a temp directory and run each side there in turn; each side's ranks' results."""
    from dspipe.tools import bench

    with tempfile.TemporaryDirectory(prefix="dspipe-bench-") as tmp:
        run_dir = Path(tmp) / "run"
        prepare_run(run_dir, model=model, cluster=cluster, best=best, data="synthetic", command=command, preset=preset)
        results = {}
        for side in sides:
            click.echo(f"bench: {side} on {ranks} rank(s) ...")
            results[side] = bench.run_side(
                ranks=ranks,
                run_dir=run_dir,
                side=side,
                warmup=warmup,
                steps=steps,
                out=Path(tmp) / side,
                threads=threads,
            )
    return results


def _summarize(results: dict, *, device: str, model, plan, steps: int) -> dict:
    """Each side's summary of its ranks' results, MFU against the peak of the ranks' device type."""
    from dspipe.planner.throughput import model_flops_per_token
    from dspipe.spec.hardware import match_device
    from dspipe.tools import bench

    gpu_type = match_device(device)  # the ranks' device name; detected above by the same rule
    peak = gpu_type.peak_tflops(plan.precision) if gpu_type else None
    return {
        side: bench.summarize(
            ranks_,
            tokens_per_step=plan.tokens_per_step,
            samples_per_step=plan.global_batch,
            steps=steps,
            flops_per_token=model_flops_per_token(model),
            world_size=plan.world_size,
            peak_tflops=peak,
        )
        for side, ranks_ in results.items()
    }


def _make_command() -> click.Command:
    @click.command("bench")
    @spec_options
    @click.option(
        "--compare",
        is_flag=True,
        default=False,
        help="also run the plain-PyTorch reference (DDP + fused AdamW + autocast + SDPA) and print the tokens/s ratio",
    )
    @click.option(
        "--reference",
        type=click.Choice(tuple(REFERENCES)),
        default="compiled",
        show_default=True,
        help="with --compare: the reference torch.compile'd (the strong step one would write), eager "
        "(no compile), or both (two columns)",
    )
    @click.option("--append", default=None, type=click.Path(), help="append a markdown section to this file")
    def bench(**o) -> None:
        """Measure tokens/s, TFLOP/s, MFU, memory and a step-time breakdown of the plan gen-config would write,
        on this machine's GPUs (or 2 CPU ranks), on random tokens; --compare runs plain PyTorch beside it."""
        bench_command(o, command=shlex.join(["dspipe", *sys.argv[1:]]))

    for name, (default, help_) in BENCH_OPTIONS.items():
        _set_option(bench, name, default=default, help=help_)
    return bench


bench = _make_command()
