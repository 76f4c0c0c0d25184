"""`dspipe extend RUN --steps N` (or `--tokens T`): continue a run, finished or not, to more optimizer steps.

The run directory's dspipe.json gets the new `train.steps` and its ds_config.json the values that the renderer
(dspipe.planner.render, the code gen-config uses) derives from the step count, found by rendering the run's plan for
the old and the new count and changing exactly the keys that differ (today the learning-rate scheduler's
`total_num_steps`); every other byte of both files stays. Checkpoints, metrics and TensorBoard logs are not touched:
the same launch command then resumes from the newest checkpoint and trains on to N. Each file is replaced whole
(temp file + rename), ds_config.json first; running the same command again after an interruption completes it.
Imports no torch (deepspeed only to parse the new config, as gen-config does)."""

from __future__ import annotations

import copy
import os
from dataclasses import replace
from pathlib import Path

import click

from dspipe.atomic import write_file
from dspipe.cli.options import INT, PathText, parse_tokens
from dspipe.errors import SpecError, file_problem
from dspipe.jsonio import MISSING, dotted_get, dumps, read_object
from dspipe.planner.render import render_ds_config
from dspipe.rundir import CONFIG_FILE, DS_CONFIG_FILE, SPEC_FILE, Run, load_run, newest_checkpoint_step
from dspipe.spec.values import steps_of_tokens


def _leaves(d, prefix: str = ""):
    if isinstance(d, dict):
        for key, value in d.items():
            yield from _leaves(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], d


def changed_keys(old: dict, new: dict) -> dict[str, tuple]:
    """{dotted key: (old value, new value)} of the leaves that differ between two configs of the same shape."""
    before, after = dict(_leaves(old)), dict(_leaves(new))
    return {
        k: (before.get(k, MISSING), after.get(k, MISSING))
        for k in sorted(set(before) | set(after))
        if before.get(k, MISSING) != after.get(k, MISSING)
    }


def _set(d: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        d = d[part]
    d[last] = value


def steps_for(*, steps: int | None, tokens: str | None, tokens_per_step: int) -> int:
    """The new step count from --steps or --tokens (rounded up to whole steps); exactly one must be given."""
    if (steps is None) == (tokens is None):
        raise SpecError("give exactly one of --steps N and --tokens T (the run's new length)")
    if steps is not None:
        return steps
    parse_tokens(tokens, flag="--tokens")  # one line for a budget that does not parse
    return steps_of_tokens(tokens, tokens_per_step=tokens_per_step)


def extended_ds_config(run: Run, ds_config: dict, *, steps: int) -> tuple[dict, dict[str, tuple]]:
    """(the run's ds_config with the step-derived keys set for `steps`, {key: (old, new)} changed). A key whose
    value is not what dspipe renders for the run's current step count was edited by hand: refused (a SpecError)
    rather than overwritten; a key the config does not have (a scheduler without a total step count) is left out."""
    monitor = str(run.path / "monitor")
    old = render_ds_config(plan=run.plan, model=run.model, train=run.train, monitor_dir=monitor)
    new = render_ds_config(plan=run.plan, model=run.model, train=replace(run.train, steps=steps), monitor_dir=monitor)
    out, changed = copy.deepcopy(ds_config), {}
    for key, (was, will) in changed_keys(old, new).items():
        have = dotted_get(out, key)
        if have is MISSING or will is MISSING:
            continue
        if have not in (was, will):
            raise SpecError(
                f"{run.path / DS_CONFIG_FILE}: {key} is {have!r}, not the {was!r} that dspipe renders for "
                f"the run's {run.train.steps} steps (edited by hand?); set it and train.steps in "
                f"{SPEC_FILE} yourself, nothing was changed"
            )
        _set(out, key, will)
        changed[key] = (have, will)
    return out, changed


def _extended_config(path: Path, *, steps: int | None, tokens: str | None, warmup: int) -> str | None:
    """The run's config.yaml (gen-config's resolved options) with the new run length and the warmup it keeps (no
    longer derived from the length), so that --config still reproduces the run; None when the run has none (made
    before config files)."""
    from dspipe.cli.config_file import dump
    from dspipe.cli.yaml_dialect import read_yaml

    if not os.path.lexists(path):
        return None
    if not path.is_file():  # a directory, a link that loops or points nowhere: not the file gen-config wrote
        raise SpecError(
            f"{path} {file_problem(str(path))}: extend rewrites the config file gen-config wrote; nothing was changed"
        )
    doc = read_yaml(str(path))
    train = doc.get("train")
    if not isinstance(train, dict):
        raise SpecError(f"{path}: train must be a mapping (edited by hand?); nothing was changed")
    train["steps"], train["tokens"], train["warmup"] = steps, tokens, warmup
    return dump(doc, command="gen-config")


def verify(ds_config: dict, *, dp: int, source: Path) -> None:
    from dspipe.cli.prepare_run import verify_with_deepspeed

    verify_with_deepspeed(ds_config, dp=dp, source=source)


@click.command("extend")
@click.argument("run_dir", metavar="RUN", type=PathText())
@click.option("--steps", type=INT, default=None, help="the run's new total of optimizer steps (more than it has)")
@click.option(
    "--tokens", default=None, help="or its new total of training tokens (300B, 1.5T, 2e9), rounded up to whole steps"
)
def extend(run_dir: Path, steps: int | None, tokens: str | None) -> None:
    """Continue RUN to more steps: rewrite its dspipe.json and ds_config.json for the new length (the lr schedule's
    total steps included), keeping its checkpoints and metrics; the same launch command then resumes and trains on."""
    from dspipe.runtime.ckpt_tags import complete_checkpoints

    run = load_run(run_dir, extending=True)
    old_steps, per_step = run.train.steps, run.plan.tokens_per_step
    new_steps = steps_for(steps=steps, tokens=tokens, tokens_per_step=per_step)
    if new_steps <= old_steps:
        given = (
            f"--steps {steps}" if steps is not None else f"--tokens {tokens} ({new_steps} steps x {per_step:,} tokens)"
        )
        raise SpecError(
            f"{given} must be more than the run's {old_steps} steps ({old_steps * per_step:,} tokens): "
            f"extend only lengthens a run (nothing was changed)"
        )
    newest = newest_checkpoint_step(run.checkpoint_dir)
    if newest is not None and new_steps <= newest:
        raise SpecError(
            f"{run.checkpoint_dir} has a checkpoint at step {newest:,}: the run's new length {new_steps:,} must be "
            f"more than that (a launch resumes there; nothing was changed)"
        )
    budget = tokens if steps is None else None  # the run length as given: a token budget, or steps
    train = replace(run.train, steps=new_steps, tokens=budget)  # validated as gen-config validates it
    spec = read_object(run.path / SPEC_FILE)
    spec["train"]["steps"] = train.steps
    if "tokens" in spec["train"] or budget is not None:
        spec["train"]["tokens"] = budget
    config_text = _extended_config(
        run.path / CONFIG_FILE, steps=None if budget else new_steps, tokens=budget, warmup=run.train.warmup_steps
    )
    ds_config, changed = extended_ds_config(run, run.ds_config, steps=new_steps)
    verify(ds_config, dp=run.plan.ds_batch_ranks, source=run.ds_config_path)  # its other keys: as the run has them
    spec_text = dumps(spec, what=str(run.path / SPEC_FILE))
    ds_text = dumps(ds_config, what=str(run.path / DS_CONFIG_FILE))
    write_file(run.path / DS_CONFIG_FILE, ds_text)  # first: a rerun after a crash between the two completes it
    write_file(run.path / SPEC_FILE, spec_text)
    if config_text is not None:
        write_file(run.path / CONFIG_FILE, config_text)
    done = complete_checkpoints(run.checkpoint_dir)
    click.echo(
        f"extended {run.path}: {old_steps} -> {new_steps} steps ({old_steps * per_step:,} -> "
        f"{new_steps * per_step:,} tokens); wrote {run.path / DS_CONFIG_FILE} and {run.path / SPEC_FILE}"
    )
    total = changed.get("scheduler.params.total_num_steps")
    if total:
        click.echo(
            f"lr schedule: {run.ds_config.get('scheduler', {}).get('type', 'scheduler')} total_num_steps "
            f"{total[0]} -> {total[1]}: the cosine decay is stretched to the new length; from the resumed "
            f"step on the lr follows the new curve (higher than the old one would have been)"
        )
    else:
        click.echo("lr schedule: unchanged (the run's scheduler has no total step count)")
    others = [k for k in changed if k != "scheduler.params.total_num_steps"]
    if others:
        click.echo(f"also changed in {DS_CONFIG_FILE}: {', '.join(others)}")
    kept = f"the newest checkpoint is step {done[-1][0]}" if done else "there is no checkpoint yet (it starts at 0)"
    click.echo(
        f"checkpoints and metrics kept ({kept}); continue with the same launch command, e.g. "
        f"'dspipe launch {run.path}' (it resumes from the newest checkpoint)"
    )
