"""The option table: every option of gen-config, plan and bench that a --config file may set, by section in the
file's order. The settings declared on the spec fields (dspipe.spec.settings) and EXTRAS, the few options that set no
spec field; the click options, the --config sections, LIMITS and --print-config are generated from it. No click."""

from __future__ import annotations

from dspipe.spec.core import SPEC_SETTINGS
from dspipe.spec.settings import Setting, arrange

EXTRAS = (
    Setting("hostfile", "cluster", "hostfile: sets --nodes/--gpus-per-node (validated)", after="gpu"),
    Setting("pad_vocab", "model", "", kind="flag", after="untied"),
    Setting(
        "preset",
        "strategy",
        "DeepSpeed JSON to start from: a name from 'dspipe presets' or a .json path. Every "
        'key is honoured in ds_config.json, or reported ("auto" resolved), or refused; a flag that contradicts '
        "it is an error",
    ),
    Setting(
        "memory_headroom",
        "strategy",
        "GPU memory a plan must leave free, percent [{headroom:g}]",
        kind="float",
        metavar="PCT",
    ),
    Setting("data", "data", ""),
    Setting(
        "tokenizer",
        "data",
        "Hugging Face tokenizer directory of Megatron prefixes in --data that have no "
        "tokenizer/ beside them: checked against their ids, kept as RUN/tokenizer for generate and export-hf",
        metavar="DIR",
    ),
    *(
        Setting(key, "logging", "", kind=kind)
        for key, kind in (
            ("wall_clock_breakdown", "flag"),
            ("json", "flag"),
            ("top", "int"),
            ("compare", "flag"),
            ("append", "str"),
        )
    ),
    Setting("reference", "logging", "", kind="choice", choices=("compiled", "eager", "both"), after="compare"),
    Setting(
        "wandb_project",
        "logging",
        "log to Weights & Biases under this project (WANDB_MODE=offline: no network, sync later)",
    ),
    Setting("wandb_group", "logging", "W&B run group"),
    Setting("wandb_team", "logging", "W&B entity (team)"),
    Setting(
        "comet_project",
        "logging",
        "log to Comet under this project (COMET_API_KEY from the environment, never written)",
    ),
    Setting("comet_workspace", "logging", "Comet workspace"),
    Setting("comet_experiment", "logging", "Comet experiment name"),
    Setting("comet_offline", "logging", "Comet offline experiment (no network)", kind="flag"),
)
"""The options that set no spec field, in their --config section."""
BY_COMMAND = frozenset(
    {
        "tokens",
        "pad_vocab",
        "data",
        "data_order",
        "tokenizer",
        "wall_clock_breakdown",
        "json",
        "top",
        "compare",
        "reference",
        "append",
    }
)
"""Options of the table whose flag a command declares itself (its own help or default): --tokens, gen-config's
--data, plan's --json, bench's --compare, ..."""
MONITOR = (
    "wandb_project",
    "wandb_group",
    "wandb_team",
    "comet_project",
    "comet_workspace",
    "comet_experiment",
    "comet_offline",
)
"""The options of monitor_options (gen-config's only)."""

TABLE = arrange([*SPEC_SETTINGS, *EXTRAS], sections=("model", "cluster", "train", "strategy", "data", "logging"))
"""Every option a --config file may set, by section, in the file's order."""
SETTINGS = {s.key: s for body in TABLE.values() for s in body}
