"""A run directory: resolved specs, plan and DeepSpeed JSON, written whole or not at all. No torch."""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
from dataclasses import MISSING as NO_DEFAULT
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from dspipe import outputs
from dspipe.atomic import staged_dir, write_file
from dspipe.errors import SpecError, file_problem
from dspipe.jsonio import MISSING, dotted_get, leaves, read_object, show
from dspipe.log import get_logger
from dspipe.planner.plan import Plan, check_plan
from dspipe.run_estimate import RunEstimate
from dspipe.spec.checks import is_int, limit
from dspipe.spec.cluster import ClusterSpec
from dspipe.spec.core import from_dict
from dspipe.spec.kinds import Checkpointing, Precision
from dspipe.spec.model import ModelSpec
from dspipe.spec.profile import PROFILE_FILE, profile_to_dict
from dspipe.spec.strategy import ZERO3_KNOBS, StrategySpec
from dspipe.spec.train import TrainSpec

FORMAT_VERSION = 1
SPEC_FILE = "dspipe.json"
DS_CONFIG_FILE = "ds_config.json"
CHECKPOINTS_DIR = "checkpoints"
ENGINE_FILE = "engine.json"  # the live engine's settings, written by the runner's rank 0
VAL_FILE = "val_metrics.csv"  # validation rows (dspipe.planner.throughput.VAL_COLUMNS)
CONFIG_FILE = "config.yaml"  # gen-config's options as resolved (dspipe.cli.config_file): --config reproduces the run
EXTRA_FILES = (CONFIG_FILE, PROFILE_FILE)
"""Files besides the two configs that gen-config may write into a run directory (with them, whole or not at all)."""
_EXTRA: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("dspipe_run_files")


@contextlib.contextmanager
def also_writing(files: dict[str, str]):
    """Run directories written inside the block (write_run) also get `files` (name -> text; names from
    EXTRA_FILES), written with the two configs: into the temp directory of a new run, or each replaced whole under
    --force. gen-config passes its config.yaml this way through the shared prepare_run."""
    unknown = set(files) - set(EXTRA_FILES)
    if unknown:
        raise AssertionError(f"not a run directory file: {sorted(unknown)}")
    token = _EXTRA.set(dict(files))
    try:
        yield
    finally:
        _EXTRA.reset(token)


@dataclass(frozen=True)
class Run:
    """Everything a run directory holds, as read back."""

    path: Path
    model: ModelSpec
    cluster: ClusterSpec
    train: TrainSpec
    strategy: StrategySpec
    plan: Plan
    data: str
    """Prepared token directory the run trains on."""
    estimate: RunEstimate = field(default_factory=RunEstimate)
    """The planner's estimate as gen-config wrote it (dspipe.json's "estimate")."""
    ds_config: dict = field(default_factory=dict)
    """ds_config.json as read and checked against the plan."""

    @property
    def ds_config_path(self) -> Path:
        return self.path / DS_CONFIG_FILE

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / CHECKPOINTS_DIR

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.csv"

    @property
    def val_metrics_path(self) -> Path:
        return self.path / VAL_FILE

    @property
    def engine_path(self) -> Path:
        return self.path / ENGINE_FILE


def write_run(
    out: Path,
    *,
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
    strategy: StrategySpec,
    plan: Plan,
    data: str,
    ds_config: dict,
    command: str,
    estimate: RunEstimate,
    force: bool = False,
) -> None:
    """A new run directory is written into a sibling temp dir, then renamed: never half-written. An existing one
    is rewritten only with `force` and only if it is a run directory: its config files (ds_config.json, dspipe.json
    and the `also_writing` files) are replaced (each whole), everything else (checkpoints, metrics, TensorBoard
    logs, the user's files) is kept. A run that has trained is refused a config of another model, whose checkpoints
    it could not resume."""
    out = outputs.target(out, flag="--out", expect="dir")
    spec = {
        "format_version": FORMAT_VERSION,
        "model": asdict(model),
        "cluster": cluster_dict(cluster),
        "train": asdict(train),
        "strategy": asdict(strategy),
        "plan": asdict(plan),
        "estimate": estimate.to_dict(),
        "data": data,
        "command": command,
    }
    texts = {
        **_EXTRA.get({}),
        DS_CONFIG_FILE: _json_text(ds_config, DS_CONFIG_FILE),
        SPEC_FILE: _json_text(spec, SPEC_FILE),
    }  # dspipe.json (what readers open first) last
    if outputs.claim_run_dir(out, force=force):
        _check_same_model(out, model=spec["model"])
        with outputs.writing(out):
            for name, text in texts.items():  # in order: dspipe.json (what readers open first) last
                write_file(out / name, text)
        return
    with outputs.writing(out), staged_dir(out) as tmp:
        for name, text in texts.items():
            (tmp / name).write_text(text)


def cluster_dict(cluster: ClusterSpec) -> dict:
    """dspipe.json's cluster: its fields, the calibration profile (if any) in its file form (profile.json's), so that
    load_run rebuilds the same time model from dspipe.json alone."""
    d = asdict(cluster)
    if cluster.profile is not None:
        d["profile"] = profile_to_dict(cluster.profile)
    return d


def _json_text(value: dict, name: str) -> str:
    from dspipe.jsonio import dumps  # a NaN or infinity is refused, naming its key

    return dumps(value, what=name)


def _check_same_model(out: Path, *, model: dict) -> None:
    """A run that has trained keeps its outputs under --force, so its model must stay the one they belong to."""
    kept = outputs.training_outputs(out)
    if not kept:
        return
    try:
        old = read_object(out / SPEC_FILE).get("model")
    except SpecError:
        old = None
    if old == model:
        return
    changed = (
        "its dspipe.json is unreadable"
        if not isinstance(old, dict)
        else ", ".join(
            f"{k} {old.get(k)} -> {model.get(k)}" for k in sorted(set(old) | set(model)) if old.get(k) != model.get(k)
        )
    )
    raise SpecError(
        f"run directory {out} holds training outputs ({', '.join(kept)}) of another model ({changed}); "
        f"--force keeps them, so it cannot give this run a new model: choose another --out "
        f"(nothing was changed)"
    )


def newest_checkpoint_step(ckpt_dir: Path) -> int | None:
    """The step of the newest complete checkpoint under `ckpt_dir`, None without one."""
    from dspipe.runtime.ckpt_tags import complete_checkpoints

    done = complete_checkpoints(ckpt_dir) if ckpt_dir.is_dir() else []
    return done[-1][0] if done else None


def _enclosing_run(path: Path) -> Path | None:
    """The run directory that holds `path` (its checkpoints/, monitor/ ...), or None."""
    for parent in path.absolute().parents:
        if outputs.is_run_dir(parent):
            return Path(os.path.relpath(parent)) if not path.is_absolute() else parent
    return None


def load_run(path: str | Path, *, extending: bool = False) -> Run:
    """The one validated reader of a run directory (every command that reads one comes here): dspipe.json and
    ds_config.json must be UTF-8 JSON objects of finite numbers with every key, each spec valid, the plan equal
    to what its specs derive, what dspipe.json restates of the cluster and plan (its deepspeed command's nodes x
    GPUs, the estimate's layout) agreeing with them (check_spec_agrees), and ds_config.json's batch, ZeRO stage,
    precision and pipeline agreeing with the plan, its optimizer and schedule with the train spec
    (check_ds_training). Anything else is one SpecError naming the file and the field. `extending`: `dspipe
    extend` reads it, which checks the schedule's total steps itself (an extend interrupted between its two files
    left the new total in ds_config.json: its rerun completes it)."""
    if not str(path).strip():  # Path("") is "."
        raise SpecError(f"the run directory {str(path)!r} is empty: give its path ('.' for the current directory)")
    path = Path(path)
    spec_file, ds_file = path / SPEC_FILE, path / DS_CONFIG_FILE
    for file in (spec_file, ds_file):
        problem = file_problem(file) if os.path.lexists(file) else None
        if problem:
            raise SpecError(f"{file} {problem}: a run directory holds {SPEC_FILE} and {DS_CONFIG_FILE} as files")
    if not spec_file.is_file() or not ds_file.is_file():
        inside = _enclosing_run(path)
        fix = (
            f"{path} is inside the run directory {inside}: pass {inside}"
            if inside is not None
            else f"create one with 'dspipe gen-config --out {path}'"
        )
        raise SpecError(f"{path} is not a run directory (no {SPEC_FILE} / {DS_CONFIG_FILE}); {fix}")
    d = read_object(spec_file)
    if isinstance(d.get("format_version"), bool) or d.get("format_version") != FORMAT_VERSION:
        raise SpecError(f"{spec_file}: format_version {d.get('format_version')!r} != {FORMAT_VERSION}")
    missing = [k for k in RUN_KEYS if k not in d]
    if missing:
        raise SpecError(f"{spec_file}: missing key {', '.join(missing)}")
    _fields_from_ds_config(d, spec_file=spec_file, ds_file=ds_file)
    specs = {
        key: _section(spec_file, key, cls, d[key])
        for key, cls in (
            ("model", ModelSpec),
            ("cluster", ClusterSpec),
            ("train", TrainSpec),
            ("strategy", StrategySpec),
            ("plan", Plan),
        )
    }
    data = d["data"]
    if not isinstance(data, str) or not data or "\0" in data or "\n" in data:
        raise SpecError(f"{spec_file}: data must be the prepared data directory (a one-line path), got {show(data)}")
    from dspipe.data.blend import parse as parse_data  # a path, or a blend a:0.7,b:0.3

    try:
        parse_data(data)
    except SpecError as e:
        raise SpecError(f"{spec_file}: data: {e}") from None
    try:
        check_plan(
            specs["plan"],
            model=specs["model"],
            cluster=specs["cluster"],
            train=specs["train"],
            strategy=specs["strategy"],
        )
    except SpecError as e:
        raise SpecError(f"{spec_file}: {e}") from None
    estimate = RunEstimate.from_dict(d.get("estimate", {}), source=spec_file)
    check_spec_agrees(
        spec_file, cluster=specs["cluster"], plan=specs["plan"], estimate=estimate, command=d.get("command")
    )
    ds_config = read_object(ds_file)
    check_ds_config(ds_config, plan=specs["plan"], source=ds_file)
    skip = ("scheduler.params.total_num_steps",) if extending else ()
    check_ds_training(ds_config, train=specs["train"], source=ds_file, skip=skip)
    check_ds_values(ds_config, source=ds_file)
    check_ds_keys(ds_config, model=specs["model"], train=specs["train"], plan=specs["plan"], source=ds_file)
    return Run(path=path, **specs, data=data, estimate=estimate, ds_config=ds_config)


RUN_KEYS = ("model", "cluster", "train", "strategy", "plan", "data")
FROM_DS_CONFIG = {"immediate_grad_update": "bf16.immediate_grad_update"}
"""Strategy and plan fields newer than some run directories, whose value such a run holds in its ds_config.json
already: read there (the run goes on training as it did) instead of taken at their default."""


def _fields_from_ds_config(d: dict, *, spec_file: Path, ds_file: Path) -> None:
    """A dspipe.json written before a FROM_DS_CONFIG field existed (lacking it in both its strategy and its plan)
    gets the run's ds_config.json value there, with a note; a value that is not a boolean is left to the checks."""
    sections = [d[key] for key in ("strategy", "plan")]
    for name, path in FROM_DS_CONFIG.items():
        if not all(isinstance(section, dict) and name not in section for section in sections):
            continue
        value = dotted_get(read_object(ds_file), path)
        if isinstance(value, bool):
            for section in sections:
                section[name] = value
            get_logger(__name__).info(
                f"note: {spec_file} lacks strategy.{name} and plan.{name} (a run written before the field existed): "
                f"{value} read from {ds_file}'s {path}"
            )


def _section(source: Path, key: str, cls, value):
    """dspipe.json's section `key` as `cls`. gen-config and extend write every field; one a run directory lacks (a
    field newer than the dspipe that wrote it, or a deleted one) takes its default, and a note names it and the
    value, so no default is taken silently."""
    if isinstance(value, dict):
        missing = [f for f in fields(cls) if f.name not in value and f.default is not NO_DEFAULT]
        if missing:
            taken = ", ".join(f"{key}.{f.name} {f.default!r}" for f in missing[:4])
            more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
            get_logger(__name__).info(
                f"note: {source} lacks {taken}{more} (default{'s' if len(missing) > 1 else ''} used: a run written "
                f"before the field existed, or a deleted key)"
            )
    try:
        return from_dict(cls, value)
    except SpecError as e:
        text = str(e)
        raise SpecError(f"{source}: {text}" if text.startswith(f"{key}.") else f"{source}: {key}: {text}") from None
    except TypeError as e:  # a field the dataclass does not take as given (e.g. an unhashable value)
        raise SpecError(f"{source}: {key}: {' '.join(str(e).split())}") from None


def check_spec_agrees(source: Path, *, cluster: ClusterSpec, plan: Plan, estimate: RunEstimate, command) -> None:
    """The parts of dspipe.json that restate the cluster and the plan say the same: the estimate's layout figures
    and ranks per node, and the deepspeed command gen-config printed (its --num_nodes and --num_gpus). A run
    directory edited in one place only (cluster 2 x 1, command for 1 x 2) is refused instead of acted on."""
    if command is not None:  # run directories from before the command was kept have none
        _check_command(source, command=command, cluster=cluster, plan=plan)
    for key, value in estimate.layout().items():
        if value != getattr(plan, key) or type(value) is not type(getattr(plan, key)):
            raise SpecError(
                f"{source}: estimate.{key} {show(value)} disagrees with plan.{key} "
                f"{getattr(plan, key)!r}; regenerate with 'dspipe gen-config --force'"
            )
    startup = estimate.startup
    per_node = startup.get("ranks_per_node") if startup is not None else None
    if per_node is not None and per_node != cluster.gpus_per_node:
        raise SpecError(
            f"{source}: estimate.startup.ranks_per_node {show(per_node)} disagrees with "
            f"cluster.gpus_per_node {cluster.gpus_per_node}"
        )


def _check_command(source: Path, *, command, cluster: ClusterSpec, plan: Plan) -> None:
    if not isinstance(command, str) or "\n" in command:
        raise SpecError(f"{source}: command must be the one-line launch command, got {show(command)}")
    import shlex

    try:
        argv = shlex.split(command)
    except ValueError as e:
        raise SpecError(f"{source}: command is not a shell command line ({e})") from None
    if not argv or Path(argv[0]).name != "deepspeed":
        return  # e.g. bench's own command line: no launch layout in it
    given = {}
    for i, arg in enumerate(argv):  # --num_gpus 2 or --num_gpus=2, as DeepSpeed's launcher reads both
        flag, eq, value = arg.partition("=")
        if flag in ("--num_nodes", "--num_gpus"):
            given[flag] = value if eq else (argv[i + 1] if i + 1 < len(argv) else "?")
    nodes, gpus = given.get("--num_nodes", "1"), given.get("--num_gpus")
    if (nodes, gpus) != (str(cluster.nodes), str(cluster.gpus_per_node)):
        raise SpecError(
            f"{source}: command launches {nodes} node(s) x {gpus or '?'} rank(s) but cluster is "
            f"{cluster.nodes} node(s) x {cluster.gpus_per_node} GPU(s) (world size {plan.world_size}); "
            f"regenerate the run with 'dspipe gen-config --force'"
        )


def _check_activation_checkpointing(ac: object, *, plan: Plan, source: Path | str) -> None:
    """ds_config.json's activation_checkpointing block: an object, with the keys the engine reads when it recomputes."""
    if not isinstance(ac, dict):
        raise SpecError(f"{source}: activation_checkpointing must be an object, got {type(ac).__name__}")
    if plan.checkpointing != Checkpointing.NONE:  # the engine passes these to deepspeed.checkpointing.configure
        for key in (
            "partition_activations",
            "contiguous_memory_optimization",
            "cpu_checkpointing",
            "synchronize_checkpoint_boundary",
            "profile",
        ):
            if not isinstance(ac.get(key), bool):
                raise SpecError(
                    f"{source}: activation_checkpointing.{key} must be true or false, got {show(ac.get(key))}"
                )
        n = ac.get("number_checkpoints")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise SpecError(
                f"{source}: activation_checkpointing.number_checkpoints must be a positive integer or "
                f"null, got {show(n)}"
            )


def check_ds_values(ds: dict, *, source: Path | str) -> None:
    """Every key of ds_config.json through the checks a --preset gets (dspipe.planner.ds_preset.import_preset: each
    value's type and range, the keys DeepSpeed 0.19 refuses and those dspipe does not render), and what a preset may
    hold but a rendered config may not: "auto" (gen-config resolves it, DeepSpeed does not) and a key DeepSpeed would
    ignore (a misspelt one: its setting would silently be DeepSpeed's default)."""
    from dspipe.planner.ds_preset import UNKNOWN_KEY, auto_keys, import_preset

    imp = import_preset(ds, source=str(source), label=str(source))
    unknown = next((note for note in imp.notes if UNKNOWN_KEY in note), None)
    if unknown is not None:
        said = unknown.removeprefix("preset: ").split(";")[0]
        close = unknown.partition(" (did you mean ")[2].rstrip(")?")
        raise SpecError(
            f"{source}: {said}; DeepSpeed would ignore it"
            + (f" (did you mean {close}?)" if close else "")
            + ": remove it, or regenerate with 'dspipe gen-config --force'"
        )
    auto = auto_keys(imp)
    if auto:
        raise SpecError(
            f'{source}: {auto[0]} is "auto", which gen-config resolves and DeepSpeed does not: give its value, or '
            f"regenerate with 'dspipe gen-config --force'"
        )


def check_ds_keys(ds: dict, *, model: ModelSpec, train: TrainSpec, plan: Plan, source: Path | str) -> None:
    """Every key gen-config renders for this plan is in ds_config.json (it writes the config in full, nothing left to
    DeepSpeed's defaults; a deleted key would be DeepSpeed's default, not the run's value). The scheduler's parameters
    depend on its type (a --preset's), which check_ds_training checks."""
    from types import SimpleNamespace

    from dspipe.planner.ds_preset import scheduler_block
    from dspipe.planner.ds_schema import LATER_KEYS, PLANNED, SCHEMA
    from dspipe.planner.render import render_ds_config

    rendered = render_ds_config(plan=plan, model=model, train=train, monitor_dir="monitor")
    kind = dotted_get(ds, "scheduler.type")  # a type check_ds_values let through: one of DeepSpeed's three
    _, params = scheduler_block(
        SimpleNamespace(scheduler_type=kind, scheduler_params={}),
        lr=train.lr,
        steps=train.steps,
        warmup=train.warmup_steps,
        min_lr_ratio=train.min_lr_ratio,
    )
    rendered["scheduler"]["params"] = params
    have = {k for k, _ in leaves({("bf16" if k == "bfloat16" else k): v for k, v in ds.items()})}  # its old name
    missing = sorted({k for k, _ in leaves(rendered)} - have)
    if "aio" not in ds and LATER_KEYS <= set(missing):  # written before the section (DeepSpeed's defaults: dspipe's)
        missing = [k for k in missing if k not in LATER_KEYS]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise SpecError(
            f"{source}: missing {missing[0]}{more}: gen-config writes every key, and without it DeepSpeed would use "
            f"its own default; regenerate with 'dspipe gen-config --force'"
        )
    for row in SCHEMA:  # the values the plan alone derives (a --preset's must equal them too), and the plan's options
        want, value = dotted_get(rendered, row.path), dotted_get(ds, row.path)
        planned = row.take == PLANNED or row.take in PLANNED_OPTIONS
        if planned and want is not MISSING and (value != want or type(value) is not type(want)):
            raise SpecError(
                f"{source}: {row.path} is {show(value)}, but dspipe renders {show(want)} for this run (it follows "
                f"from the plan in {SPEC_FILE}); regenerate with 'dspipe gen-config --force'"
            )


PLANNED_OPTIONS = tuple(("opt", name) for name in ("reduce_bucket_size", *ZERO3_KNOBS, "partition_method"))
"""ds_config.json rows an option sets that dspipe.json's plan holds (a flag's or a preset's value, else the plan's):
the file must carry the plan's value."""


def check_ds_config(ds: dict, *, plan: Plan, source: Path | str) -> None:
    """ds_config.json against the plan: the batch equation, ZeRO stage, optimizer offload, precision, pipeline
    stages and the activation-checkpointing block the engine reads. A key DeepSpeed defaults (zero stage 0,
    bf16/fp16 off, no offload) may be absent; the batch keys may not (dspipe writes all three)."""

    def lookup(dotted: str, default=KeyError):
        node = ds
        for part in dotted.split("."):
            if not isinstance(node, dict):
                raise SpecError(f"{source}: {dotted.rsplit('.', 1)[0]} must be an object, got {type(node).__name__}")
            if part not in node:
                if default is KeyError:
                    raise SpecError(f"{source}: missing {dotted} (the plan in {SPEC_FILE} has {wanted[dotted]!r})")
                return default
            node = node[part]
        return node

    bf16 = "bfloat16" if "bfloat16" in ds and "bf16" not in ds else "bf16"  # DeepSpeed's alias
    wanted = {
        "train_batch_size": plan.ds_train_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "zero_optimization.stage": plan.zero_stage,
        f"{bf16}.enabled": plan.precision == Precision.BF16,
        "fp16.enabled": plan.precision == Precision.FP16,
        "pipeline.stages": plan.pp,
        "sequence_parallel_size": plan.sp,
        "data_types.grad_accum_dtype": plan.grad_accum_dtype,
    }
    defaults = {
        "zero_optimization.stage": 0,
        f"{bf16}.enabled": False,
        "fp16.enabled": False,
        "pipeline.stages": plan.pp,
        "sequence_parallel_size": 1,  # DeepSpeed's default
        "data_types.grad_accum_dtype": plan.grad_accum_dtype,  # a run rendered before the key: the training dtype's
    }
    for key, want in wanted.items():
        have = lookup(key, defaults.get(key, KeyError))
        if type(have) is not type(want) or have != want:
            raise SpecError(
                f"{source}: {key} is {show(have)} but the plan in {SPEC_FILE} has {want!r} "
                f"(global batch {plan.global_batch} = micro {plan.micro_batch} x grad_accum "
                f"{plan.grad_accum} x dp {plan.dp}, tp {plan.tp}, ZeRO-{plan.zero_stage}, "
                f"{plan.precision}, "
                f"pp {plan.pp}); regenerate both with 'dspipe gen-config --force'"
            )
    if plan.zero_stage:
        device = lookup("zero_optimization.offload_optimizer", {})
        device = device.get("device", "none") if isinstance(device, dict) else device
        if not isinstance(device, str) or device != plan.offload:  # null: DeepSpeed refuses it, not "none"
            raise SpecError(
                f"{source}: zero_optimization.offload_optimizer.device is {show(device)} but the "
                f"plan in {SPEC_FILE} has {plan.offload!r}"
            )
    ac = lookup("activation_checkpointing", {})
    _check_activation_checkpointing(ac, plan=plan, source=source)


TRAIN_KEYS = {  # ds_config.json key -> the TrainSpec field gen-config (and extend) render it from
    "optimizer.params.lr": "lr",
    "scheduler.params.warmup_max_lr": "lr",
    "optimizer.params.weight_decay": "weight_decay",
    "gradient_clipping": "grad_clip",
    "scheduler.params.total_num_steps": "steps",
    "scheduler.params.warmup_num_steps": "warmup_steps",
    "scheduler.params.cos_min_ratio": "min_lr_ratio",
}


_ALWAYS = ("optimizer.params.lr", "optimizer.params.weight_decay", "gradient_clipping")
RENDERED_TRAIN_KEYS = {  # scheduler type -> the TRAIN_KEYS gen-config renders with it (ds_preset.scheduler_block)
    "WarmupCosineLR": (
        *_ALWAYS,
        "scheduler.params.total_num_steps",
        "scheduler.params.warmup_num_steps",
        "scheduler.params.cos_min_ratio",
    ),
    "WarmupLR": (*_ALWAYS, "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps"),
    "WarmupDecayLR": (
        *_ALWAYS,
        "scheduler.params.warmup_max_lr",
        "scheduler.params.warmup_num_steps",
        "scheduler.params.total_num_steps",
    ),
}
"""An unknown scheduler type is refused by check_ds_values (the --preset checks)."""


def check_ds_training(ds: dict, *, train: TrainSpec, source: Path | str, skip: tuple[str, ...] = ()) -> None:
    """ds_config.json's optimizer and schedule against dspipe.json's train spec (every key gen-config renders from
    it: a hand edit would train at values the run directory does not say, a negative learning rate included), and
    the optimizer's betas and eps in DeepSpeed's ranges (0 <= beta < 1, eps > 0)."""

    for section in ("optimizer", "scheduler"):
        if not isinstance(ds.get(section), dict) or not isinstance(ds[section].get("params"), dict):
            raise SpecError(
                f"{source}: {section} must be an object with params (gen-config renders both; without them DeepSpeed "
                f"would train with {'no optimizer' if section == 'optimizer' else 'a constant learning rate'}), got "
                f"{show(ds[section]) if section in ds else 'nothing'}; regenerate both with 'dspipe gen-config --force'"
            )
    kind = ds["scheduler"].get("type")
    rendered = RENDERED_TRAIN_KEYS.get(kind, ()) if isinstance(kind, str) else ()  # another: check_ds_values
    for key, name in TRAIN_KEYS.items():
        have, want = dotted_get(ds, key), getattr(train, name)
        if key in skip or (have is MISSING and key not in rendered):
            continue
        if have is MISSING:
            raise SpecError(
                f"{source}: missing {key} ({SPEC_FILE}'s train.{name} is {want!r}; without it DeepSpeed would use "
                f"its own default); regenerate both with 'dspipe gen-config --force' (its {_train_flag(name)} sets "
                f"both)"
            )
        number = isinstance(have, (int, float)) and not isinstance(have, bool)
        if not number or have != want or (isinstance(want, int) and not isinstance(have, int)):
            raise SpecError(
                f"{source}: {key} is {show(have)} but {SPEC_FILE}'s train.{name} is {want!r}; "
                f"regenerate both with 'dspipe gen-config --force' (its {_train_flag(name)} sets both)"
            )
    betas, eps = dotted_get(ds, "optimizer.params.betas"), dotted_get(ds, "optimizer.params.eps")
    if betas is not MISSING and not (
        isinstance(betas, list)
        and len(betas) == 2
        and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)
    ):
        raise SpecError(f"{source}: optimizer.params.betas must be two numbers in [0, 1), got {show(betas)}")
    if eps is not MISSING and not (
        isinstance(eps, (int, float)) and not isinstance(eps, bool) and 0 < eps < 1 and eps == eps
    ):
        raise SpecError(f"{source}: optimizer.params.eps must be a number in (0, 1), got {show(eps)}")


def _train_flag(name: str) -> str:
    """The gen-config flag that sets TrainSpec field `name` (its setting's declaration)."""
    from dspipe.spec.settings import declared

    s = next(s for s in declared(TrainSpec, section="train") if s.field == name)
    return s.flag or "--" + s.key.replace("_", "-")


def load_engine(run: Run) -> dict | None:
    """engine.json (the live engine's settings, written by the runner's rank 0 once its engine is up): None while
    absent; anything but a JSON object (a directory, an empty file, JSON cut short or damaged) is a SpecError
    naming the file and, for JSON, the parser's position."""
    path = run.engine_path
    if not path.exists() and not path.is_symlink():
        return None
    if path.is_dir():
        raise SpecError(f"{path} is a directory, not the JSON file the runner writes; move it away")
    engine = read_object(path, hint="a launch of the run writes it again")  # cut short or damaged: one line
    _check_engine_settings(engine, where=str(path))
    return engine


def engine_disagreement(run: Run, engine: dict | None) -> str | None:
    """Why engine.json is not the record of a launch of this run's plan (None: it is): its ZeRO stage, pp, tp or sp
    differ from dspipe.json's (a launch refuses to train on such drift, so the file is damaged, or from a launch
    before the run was regenerated), or its world size is not dp x pp x tp x sp. dp and the world may differ from
    the plan's: an elastic restart on fewer nodes runs at a smaller dp."""
    if not engine:
        return None
    plan = run.plan
    wanted = {"zero_stage": plan.zero_stage, "pp": plan.pp, "tp": plan.tp, "sp": plan.sp}
    off = [f"{k} {engine[k]} (dspipe.json: {v})" for k, v in wanted.items() if k in engine and engine[k] != v]
    axes = [engine.get(k, 1 if k in ("tp", "sp") else None) for k in ("world_size", "dp", "pp", "tp", "sp")]
    if not off and all(is_int(a) for a in axes) and axes[0] != axes[1] * axes[2] * axes[3] * axes[4]:
        off.append(f"world_size {axes[0]} is not dp {axes[1]} x pp {axes[2]} x tp {axes[3]} x sp {axes[4]}")
    startup = engine.get("startup")
    if not off and is_int(axes[0]) and isinstance(startup, dict):  # one figure per rank
        from dspipe.runtime.engine_file import STARTUP_LISTS

        lists = {k: startup[k] for k in STARTUP_LISTS if isinstance(startup.get(k), list)}
        counts = {len(v) for v in lists.values()}
        if len(counts) == 1 and counts != {axes[0]}:  # lists of unequal lengths: the start-up reader names them
            k = next(iter(lists))
            off.append(f"startup.{k} lists {len(lists[k])} ranks, world_size {axes[0]}")
    if not off:
        return None
    return (
        f"{run.engine_path} is not a launch of this run's plan: {', '.join(off)}; a launch of the run writes it again"
    )


ENGINE_NAMES = ("backend", "wrapper_optimizer", "base_optimizer", "scheduler", "param_dtype", "grad_accum_dtype")
"""engine.json's settings that readers show by name (dspipe.runtime.engine.engine_settings writes them)."""


def _engine_ranges() -> dict[str, tuple[int, int]]:
    """engine.json's integer settings that readers show or compute with, and the range each may take: the specs'
    own limits (a world of at most nodes x gpus_per_node ranks)."""
    world = int(limit("nodes") * limit("gpus_per_node"))
    batch = int(limit("global_batch"))
    ranges = {k: (1, int(limit(k))) for k in ("pp", "tp", "sp", "ep", "micro_batch")}
    ranges |= {"dp": (1, world), "world_size": (1, world), "grad_accum": (1, batch), "train_batch_size": (1, batch)}
    return {"zero_stage": (0, 3), **ranges}


def _check_engine_settings(engine: dict, *, where: str) -> None:
    """One SpecError for an integer setting out of _engine_ranges or an ENGINE_NAMES value that is not a name."""
    for key, (low, high) in _engine_ranges().items():
        value = engine.get(key)
        if value is not None and not (is_int(value) and low <= value <= high):
            raise SpecError(
                f"{where}: {key} {show(value)} is not an integer in {low}..{high} (the runner writes the live "
                f"engine's value); a launch of the run writes it again"
            )
    for key in ENGINE_NAMES:
        value = engine.get(key)
        if value is not None and not (isinstance(value, str) and re.fullmatch(r"[A-Za-z0-9_.]{1,64}", value)):
            raise SpecError(
                f"{where}: {key} {show(value)} is not a name (letters, digits, '_', '.'; as the runner writes "
                f"it); a launch of the run writes it again"
            )
