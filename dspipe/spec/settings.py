"""The one declaration of a setting: flag, help, kind, limit and YAML section, as metadata of its spec field.

`setting(...)` is dataclasses.field with a Setting in its metadata; dspipe.spec.options gathers them (with the few
options that are no spec field) into the option table that the click options, the --config sections, LIMITS and
--print-config are generated from. No click, no torch.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, TypeVar, overload

_T = TypeVar("_T")

AUTO = "auto"
"""The word that leaves a setting to the planner (an auto_* option, a preset's DeepSpeed key)."""
KINDS = ("int", "float", "str", "choice", "auto_int", "auto_choice", "flag", "bool", "tokens")
"""What the flag takes: int/float/str; choice (one of `choices`); auto_int/auto_choice (or 'auto': the planner
chooses); flag (--x, off by default); bool (--x/--no-x, unset: auto); tokens (a token budget, '300B')."""


def is_auto(value: object) -> bool:
    """Whether an asked-for value leaves the choice to the planner: None (not given) or 'auto'."""
    return value in (None, AUTO)


FIELD_DEFAULT = object()
"""Setting.cli_default: the flag's default is the spec field's default."""


@dataclass(frozen=True)
class Setting:
    """One option: where it lives in the --config file and how the command line takes it."""

    key: str
    """Its name in the file and in the command's options ('global_batch' for --global-batch)."""
    section: str
    """The --config section that holds it (the spec it sets: model, cluster, train, strategy; or data, logging)."""
    help: str | None
    """The flag's help text (None: none)."""
    kind: str = "str"
    """One of KINDS."""
    choices: tuple[object, ...] = ()
    """The values of a choice / auto_choice."""
    limit: int | float | None = None
    """Largest accepted value (LIMITS), None: no limit of its own."""
    cli_default: object = None
    """The flag's default; None: auto (the planner chooses) or derived (the rule is in the help)."""
    fallback: object = None
    """The value a derived option takes when neither a flag nor a preset sets it (steps: 1000)."""
    field: str | None = None
    """The spec field it sets (None: an option that sets no spec field, e.g. --hostfile)."""
    default: object = None
    """That field's default (MISSING: the spec requires it), for the help text's {default}."""
    after: str | None = None
    """The key it follows in its section, where the spec's field order is not the file's ('' = first)."""
    flag: str | None = None
    """The flag when it is not --key with '-' for '_' (--untied, --bias/--no-bias)."""
    metavar: str | None = None
    """The flag's metavar, when click's is not the clearest."""

    @property
    def flags(self) -> str:
        """The click declaration: '--global-batch', '--bias/--no-bias'."""
        return self.flag or f"--{self.key.replace('_', '-')}"

    @property
    def flag_name(self) -> str:
        """The flag as messages name it: '--global-batch', '--bias'."""
        return self.flags.split("/")[0]


@overload
def setting(default: _T, *, help: str | None, kind: str = "str", section: str | None = None, **more: object) -> _T: ...


@overload
def setting(*, help: str | None, kind: str = "str", section: str | None = None, **more: object) -> Any: ...


def setting(
    default: object = MISSING, *, help: str | None, kind: str = "str", section: str | None = None, **more: object
) -> Any:
    """A spec field declared with its option (keywords of Setting; the key is the field name unless given)."""
    if kind not in KINDS:
        raise AssertionError(f"unknown setting kind {kind!r}")
    meta = {"setting": dict(help=help, kind=kind, section=section, **more)}
    return field(default=default, metadata=meta)


def declared(cls: type, *, section: str) -> list[Setting]:
    """The settings of spec class `cls`, in field order; a field's section is `section` unless it names its own."""
    out = []
    for f in fields(cls):
        meta = dict(f.metadata.get("setting") or {})
        if not meta:
            continue
        own = meta.pop("section") or section
        cli_default = meta.pop("cli_default", None)
        if cli_default is FIELD_DEFAULT:
            cli_default = f.default
        out.append(
            Setting(
                key=meta.pop("key", f.name),
                section=own,
                field=f.name,
                default=f.default,
                cli_default=cli_default,
                **meta,
            )
        )
    return out


def arrange(settings: list[Setting], *, sections: tuple[str, ...]) -> dict[str, tuple[Setting, ...]]:
    """{section: its settings in file order}: declaration order, each `after` one moved behind the key it names."""
    table: dict[str, list[Setting]] = {name: [] for name in sections}
    for s in settings:
        if s.section not in table:
            raise AssertionError(f"{s.key}: unknown section {s.section!r}")
    for s in settings:
        if s.after is None:
            table[s.section].append(s)
    for s in settings:
        if s.after is not None:
            body = table[s.section]
            at = 0 if s.after == "" else [t.key for t in body].index(s.after) + 1
            body.insert(at, s)
    return {name: tuple(body) for name, body in table.items()}
