"""The one guard for every path dspipe writes (gen-config, export-hf, prepare-data, report, slurm-script).

An output path is checked before any work starts (`target`): not empty, no control characters, not the root, not a
symbolic link, a directory where a directory is written and a file where a file is, inside a writable directory on
a writable file system, and not inside what a run directory writes itself (its checkpoints, metrics, TensorBoard
logs, config). An existing output is replaced only when dspipe wrote it (`claim_dir`, `claim_file`), as the same kind
of output, and only if it holds nothing dspipe did not write there:

    directory outputs   a marker file MARKER listing the kind and every file written (export-hf, data, report);
                        outputs written before the marker existed are recognised by their fixed file names
    run directories     dspipe.json (format_version, written by gen-config/bench) beside ds_config.json; they are
                        never replaced whole (dspipe.rundir.write_run rewrites only the config files)
    files               a marker line in the file (slurm-script: SCRIPT_MARKER)

Every refusal is one line (SpecError, exit code 2) and happens before anything is created, renamed or deleted; a
failure while writing removes the parent directories it created (`writing`). No torch."""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Callable, Iterator

from dspipe.errors import SpecError
from dspipe.jsonio import read_object

MARKER = ".dspipe-output"
"""JSON {"dspipe": KIND, "format_version": 1, "files": [relative paths]} in every directory output but a run's."""
MARKER_VERSION = 1
KINDS = {
    "run": "run directory",
    "data": "prepared data directory",
    "export-hf": "export-hf model directory",
    "report": "report directory",
}
RUN_SPEC, RUN_DS_CONFIG = "dspipe.json", "ds_config.json"  # dspipe.rundir's names (no import: rundir imports us)
TRAINING_OUTPUTS = ("checkpoints", "metrics.csv", "val_metrics.csv", "monitor", "engine.json")
"""What training writes into a run directory: never replaced or deleted by another command."""
RUN_OWN = (RUN_SPEC, RUN_DS_CONFIG, "config.yaml", ".deepspeed_env", *TRAINING_OUTPUTS)
"""Names inside a run directory that no other output may take (or be written inside)."""
LEGACY = {
    "data": re.compile(r"^(meta\.json|tokenizer/.+|(train|val)-\d{5}\.(bin|idx))$"),
    "report": re.compile(r"^(report\.md|loss\.png|throughput\.png|lr\.png)$"),
}
"""The files of outputs written before MARKER existed (export-hf directories had no fixed set: not recognised)."""
NAME_MAX = 200  # bytes of the last component: the temp siblings add ~40 to it and file systems allow 255
PATH_MAX = 4000


def _a(label: str) -> str:
    return ("an " if label[0] in "aeiou" else "a ") + label


def _shown(value) -> str:
    return ascii(str(value)) if any(ord(c) < 32 or ord(c) == 127 for c in str(value)) else str(value)


def target(value: str | os.PathLike | None, *, flag: str = "--out", expect: str = "dir") -> Path:
    """`value` as the Path of an output `expect` ('dir' or 'file'), refused in one line when it cannot or must not
    be written: empty, control characters, the root, a symbolic link, the wrong type, read-only (no write bit in
    its mode, also for root), a part of a run directory, a parent that is a file, not writable (by access or by
    mode) or on a read-only file system. Nothing is created."""
    text = "" if value is None else os.fspath(value)
    if text.strip() == "":
        raise SpecError(f"{flag} is empty: give a path")
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise SpecError(f"{flag} {ascii(text)} contains a control character (newline, tab, NUL...): give a plain path")
    path = Path(text)
    absolute = Path(os.path.abspath(text))
    if absolute.parent == absolute:
        raise SpecError(f"{flag} {text} is the file system root")
    if len(os.fsencode(absolute.name)) > NAME_MAX or len(os.fsencode(str(absolute))) > PATH_MAX:
        raise SpecError(
            f"{flag} is too long ({len(os.fsencode(absolute.name))} bytes in its last part, "
            f"{len(os.fsencode(str(absolute)))} in all; at most {NAME_MAX} and {PATH_MAX})"
        )
    if absolute.is_symlink():
        raise SpecError(f"{flag} {text} is a symbolic link (to {os.readlink(absolute)}); give the real path")
    if absolute.exists():
        if expect == "dir" and not absolute.is_dir():
            raise SpecError(f"{flag} {text} is a file, not a directory")
        if expect == "file" and absolute.is_dir():
            raise SpecError(f"{flag} {text} is a directory; give a file path")
        if expect == "file" and not absolute.is_file():
            raise SpecError(f"{flag} {text} is not a regular file")
        if not absolute.stat().st_mode & 0o222:  # read-only by its mode, which root could ignore: we do not
            raise SpecError(f"{flag} {text} is read-only (mode {absolute.stat().st_mode & 0o777:o})")
    _check_not_in_run(absolute, flag=flag, text=text)
    _check_parent(absolute, flag=flag, text=text)
    return path


def _check_not_in_run(absolute: Path, *, flag: str, text: str) -> None:
    for part in (absolute, *absolute.parents):
        if part.name in RUN_OWN and is_run_dir(part.parent):
            what = "is" if part == absolute else "is inside"
            raise SpecError(
                f"{flag} {text} {what} {part}, which run directory {part.parent} writes itself; "
                f"choose a path outside it"
            )


def _check_parent(absolute: Path, *, flag: str, text: str) -> None:
    existing = absolute.parent
    while not existing.exists() and not existing.is_symlink():
        existing = existing.parent
    if not existing.is_dir():
        raise SpecError(f"{flag} {text}: {existing} is not a directory")
    try:
        read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        raise SpecError(f"{flag} {text}: {existing} is on a read-only file system")
    if not os.access(existing, os.W_OK | os.X_OK) or not existing.stat().st_mode & 0o222:  # root too: mode 555
        raise SpecError(f"{flag} {text}: {existing} is not writable (mode {existing.stat().st_mode & 0o777:o})")


# ---- recognising dspipe's outputs ---------------------------------------------------------------------------------


def is_run_dir(path: Path) -> bool:
    """dspipe.json (a JSON object with format_version) beside ds_config.json: a run directory gen-config wrote."""
    spec = Path(path) / RUN_SPEC
    if not spec.is_file() or not (Path(path) / RUN_DS_CONFIG).is_file():
        return False
    try:
        return "format_version" in read_object(spec)
    except SpecError:
        return False


def read_marker(path: Path) -> dict | None:
    """The marker of a directory output, or None when there is none (or it is not dspipe's)."""
    try:
        marker = read_object(Path(path) / MARKER)
    except SpecError:
        return None
    if (
        not isinstance(marker, dict)
        or marker.get("dspipe") not in KINDS
        or not isinstance(marker.get("files"), list)
        or not all(isinstance(f, str) for f in marker["files"])
    ):
        return None
    return marker


def owner(path: Path) -> str | None:
    """The kind of dspipe output `path` is (a key of KINDS), or None: not recognisably written by dspipe."""
    path = Path(path)
    marker = read_marker(path)
    if marker is not None:
        return marker["dspipe"]
    if is_run_dir(path):
        return "run"
    files = _files(path)
    if "meta.json" in files and all(LEGACY["data"].match(f) for f in files) and _legacy_meta(path):
        return "data"
    if "report.md" in files and all(LEGACY["report"].match(f) for f in files):
        return "report"
    return None


def _legacy_meta(path: Path) -> bool:
    try:
        return read_object(path / "meta.json").get("format") == "dspipe-tokens"
    except SpecError:
        return False


def _files(path: Path) -> list[str]:
    """Every file (and symbolic link) under `path`, relative, without following links."""
    out = []
    for root, dirs, files in os.walk(path, followlinks=False):
        rel = Path(root).relative_to(path)
        out += [(rel / f).as_posix() for f in files]
        out += [(rel / d).as_posix() for d in dirs if (Path(root) / d).is_symlink()]
    return sorted(out)


def foreign_files(path: Path, *, kind: str) -> list[str]:
    """Files under the dspipe output `path` that dspipe did not write there (not in its marker's list)."""
    marker = read_marker(path)
    files = [f for f in _files(path) if f != MARKER]
    if marker is not None:
        written = set(marker["files"])
        return [f for f in files if f not in written]
    pattern = LEGACY.get(kind)
    return [f for f in files if pattern is None or not pattern.match(f)]


def write_marker(directory: Path, *, kind: str) -> None:
    """Record `directory` (complete, not yet in place) as a `kind` output and the files in it."""
    files = [f for f in _files(directory) if f != MARKER]
    text = json.dumps({"dspipe": kind, "format_version": MARKER_VERSION, "files": files}, indent=1) + "\n"
    (Path(directory) / MARKER).write_text(text, encoding="utf-8")
    (Path(directory) / MARKER).chmod(0o644)


def training_outputs(run_dir: Path) -> list[str]:
    """The training outputs a run directory holds (TRAINING_OUTPUTS that exist and are not empty directories)."""
    found = []
    for name in TRAINING_OUTPUTS:
        p = Path(run_dir) / name
        if p.is_symlink() or p.is_file() or (p.is_dir() and any(p.iterdir())):
            found.append(name + ("/" if p.is_dir() else ""))
    return found


# ---- claiming an output -------------------------------------------------------------------------------------------


def _is_empty_dir(path: Path) -> bool:
    try:
        return path.is_dir() and not any(path.iterdir())
    except OSError as e:
        raise SpecError(f"cannot read {path}: {e.strerror}") from None


def claim_dir(out: Path, *, kind: str, replace: bool, flag: str = "--out") -> bool:
    """Whether `out` (checked by `target`) exists and is to be replaced by a new `kind` output. Refused: a non-empty
    `out` dspipe did not write, one of another kind, one holding files dspipe did not write there, and any other
    without `replace` (--force). An empty directory is taken as is."""
    out = Path(out)
    if not out.exists():
        return False
    if _is_empty_dir(out):
        return True
    label = KINDS[kind]
    found = owner(out)
    if found is None:
        raise SpecError(
            f"{flag} {out} exists and is not {_a(label)} written by dspipe (no {MARKER}); dspipe "
            f"replaces only its own output: choose another {flag}"
        )
    if found != kind:
        raise SpecError(f"{flag} {out} is {_a(KINDS[found])} written by dspipe, not {_a(label)}; choose another {flag}")
    extra = foreign_files(out, kind=kind)
    if extra:
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        raise SpecError(
            f"{flag} {out} holds files dspipe did not write there ({', '.join(map(_shown, extra[:3]))}"
            f"{more}); move them out or choose another {flag}"
        )
    if not replace:
        raise SpecError(f"{out} already exists (pass --force to replace it)")
    return True


def claim_run_dir(out: Path, *, force: bool) -> bool:
    """Whether `out` (checked by `target`) is an existing run directory whose config is to be rewritten in place
    (with `force`; its other contents stay). False: absent or empty, to be written whole. Refused: anything else."""
    out = Path(out)
    if not out.exists() or _is_empty_dir(out):
        return False
    if not force:
        raise SpecError(
            f"run directory {out} already exists (pass --force to replace its config; its checkpoints "
            f"and metrics are kept)"
        )
    found = owner(out)
    if found != "run":
        what = (
            "not a run directory (no dspipe.json / ds_config.json)"
            if found is None
            else f"{_a(KINDS[found])} written by dspipe, not a run directory"
        )
        raise SpecError(
            f"--out {out} exists and is {what}; --force rewrites only a run directory's config: choose another --out"
        )
    return True


def claim_file(out: Path, *, replace: bool, owned: Callable[[Path], bool], label: str, flag: str = "--out") -> bool:
    """Whether the file `out` (checked by `target`) exists and is to be replaced: only with `replace` (--force) and
    only when `owned` says dspipe wrote it as a `label`."""
    out = Path(out)
    if not out.exists():
        return False
    if not replace:
        raise SpecError(f"{flag} {out} already exists (pass --force to replace it)")
    if not owned(out):
        raise SpecError(
            f"{flag} {out} exists and is not {_a(label)} written by dspipe; --force replaces only "
            f"that: choose another {flag}"
        )
    return True


# ---- writing --------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def parents(out: Path, *, flag: str = "--out") -> Iterator[None]:
    """Create the missing parent directories of `out` for the block; if the block fails, remove those it created."""
    out = Path(os.path.abspath(out))
    created = []
    parent = out.parent
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    try:
        for d in reversed(created):
            with write_errors(out, flag=flag):
                d.mkdir()
        yield
    except BaseException:
        for d in created:  # deepest first; a directory something else wrote into stays
            with contextlib.suppress(OSError):
                d.rmdir()
        raise


@contextlib.contextmanager
def write_errors(out: Path, *, flag: str = "--out") -> Iterator[None]:
    """An OSError in the block (disk full, permission, name too long) becomes one line naming `out`."""
    try:
        yield
    except OSError as e:
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        raise SpecError(f"cannot write {flag} {out}: {e.strerror or e}{_shown(where)}") from None


@contextlib.contextmanager
def writing(out: Path, *, flag: str = "--out") -> Iterator[None]:
    """`parents` and `write_errors` together: for a block that only writes `out`."""
    with parents(out, flag=flag), write_errors(out, flag=flag):
        yield
