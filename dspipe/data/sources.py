"""Input documents for prepare-data: local files, globs, directories or a Hugging Face dataset, read by `datasets`.

Local files by extension: .jsonl/.json (one record per document, text in --text-field), .parquet (same), anything
else is UTF-8 text: one document per file, or one per blank-line-separated block (--txt-docs blank-line). Text is
read in text mode, so line endings become "\\n". Documents that are empty or only whitespace are skipped (counted).
A file that fails to read (an I/O error) is one line naming it, or under --skip-bad skipped and counted, like a file
that is not UTF-8.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import socket
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator
from urllib.parse import urlparse

from dspipe.data.limits import too_small
from dspipe.errors import SpecError, cannot_read, file_problem
from dspipe.log import get_logger

TEXT_DOCS = ("file", "blank-line")
STDLIB = "python-stdlib"
GROUP_FILES = 256  # text files per datasets.load_dataset call: UTF-8 checks stay ahead of reading, lazily
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_BATCH = 256


def stdlib_sources() -> list[Path]:
    """The standard library's .py files (not site-packages), sorted, so the corpus is the same on every run."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p for p in root.rglob("*.py") if p.relative_to(root).parts[0] not in ("site-packages", "dist-packages")
    )


def _builder(path: Path) -> str:
    suffix = path.suffix.lower()
    return {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(suffix, "text")


@dataclass(frozen=True)
class Inputs:
    """What to read, resolved: local files in order, or one hub dataset."""

    files: tuple[Path, ...] = ()
    hub: str | None = None
    config: str | None = None
    split: str = "train"
    text_field: str = "text"
    txt_docs: str = "file"
    streaming: bool = True
    skip_bad: bool = False
    label: str = ""
    stats: dict = field(default_factory=lambda: {"empty": 0, "bad_utf8": 0, "unreadable": 0})

    def fingerprint_items(self) -> list:
        """What identifies the input: hub name/config/split, or every file's path, size and mtime."""
        opts = [self.text_field, self.txt_docs, self.skip_bad]
        if self.hub:
            return ["hub", self.hub, self.config, self.split, *opts]
        items = ["files", *opts]
        for f in self.files:
            try:
                st = os.stat(f)
            except OSError as e:
                raise cannot_read(f, e) from None
            items.append([os.path.abspath(f), st.st_size, st.st_mtime_ns])
        return items


def _hub_options_need_a_hub(*, hub: str | None, config: str | None, split: str) -> None:
    """--config and --split choose a Hugging Face dataset's configuration and split: with local files they would be
    ignored."""
    if hub is None and (config is not None or split != "train"):
        given = " and ".join(
            f"{flag} {value!r}"
            for flag, value in (("--config", config), ("--split", split if split != "train" else None))
            if value is not None
        )
        raise SpecError(
            f"{given}: only a Hugging Face dataset has a configuration and split, and these inputs are local files"
        )


def resolve_inputs(
    specs: list[str],
    *,
    text_field: str = "text",
    txt_docs: str = "file",
    config: str | None = None,
    split: str = "train",
    streaming: bool = True,
    skip_bad: bool = False,
) -> Inputs:
    """Expand globs and directories (sorted, hidden files skipped); a name that is no local path is a hub dataset."""
    if txt_docs not in TEXT_DOCS:
        raise SpecError(f"--txt-docs {txt_docs!r} is not one of: {', '.join(TEXT_DOCS)}")
    common = dict(text_field=text_field, txt_docs=txt_docs, split=split, streaming=streaming, config=config)
    if not specs:
        _hub_options_need_a_hub(hub=None, config=config, split=split)
        files = tuple(stdlib_sources())
        # a few stdlib test files are deliberately not UTF-8: the built-in corpus skips them
        return Inputs(files=files, skip_bad=True, label=f"{STDLIB} ({len(files)} files)", **common)
    files: list[Path] = []
    hub = None
    for spec in specs:
        if not spec.strip():
            raise SpecError(
                f"input {spec!r} is empty: give a file, glob, directory or Hugging Face dataset name (an empty "
                f"string is not the current directory; pass . for that)"
            )
        path = Path(spec)
        if any(c in spec for c in "*?["):
            matches = sorted(Path(m) for m in glob.glob(spec, recursive=True))
            _refuse_unreadable(matches, skip_bad=skip_bad, within=f"matched by {spec!r}")
            matches = [m for m in matches if m.is_file()]
            if not matches:
                raise SpecError(f"no files match {spec!r}")
            files += matches
        elif path.is_dir():
            entries = sorted(
                p for p in path.rglob("*") if not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
            _refuse_unreadable(entries, skip_bad=skip_bad, within=f"under {spec}")
            found = [p for p in entries if p.is_file()]
            if not found:
                raise SpecError(f"empty input: no files under {spec}")
            files += found
        elif path.is_file():
            files.append(path)
        elif os.path.lexists(spec):  # there, but neither a file nor a directory: never a hub name
            raise _not_readable(spec)
        elif HUB_NAME.match(spec) and not spec.startswith("."):
            hub = spec
        else:
            raise SpecError(f"no such file or directory: {spec}")
    if hub and (files or len(specs) > 1):
        raise SpecError(f"give local files or one dataset name, not both ({hub!r} is not a local path)")
    _hub_options_need_a_hub(hub=hub, config=config, split=split)
    label = hub or (specs[0] if len(specs) == 1 else f"{specs[0]} + {len(specs) - 1} more")
    return Inputs(files=tuple(files), hub=hub, skip_bad=skip_bad, label=label, **common)


def _refuse_unreadable(paths: list[Path], *, skip_bad: bool, within: str) -> None:
    """An entry of a directory or glob that is neither a file nor a directory (a symbolic link that loops or points
    nowhere, a FIFO, a socket) is one SpecError, as the same path given alone is; with --skip-bad it is left out
    with a note."""
    odd = [p for p in paths if not p.is_file() and not p.is_dir()]
    if not odd:
        return
    if not skip_bad:
        raise SpecError(
            f"input {odd[0]} ({within}) {file_problem(str(odd[0]))}"
            + (f", and {len(odd) - 1} more such entr{'y' if len(odd) == 2 else 'ies'}" if len(odd) > 1 else "")
            + "; remove it or give --skip-bad"
        )
    get_logger(__name__).info(
        f"note: --skip-bad: left out {len(odd)} entr{'y' if len(odd) == 1 else 'ies'} {within} that "
        f"{'is' if len(odd) == 1 else 'are'} no file to read (first {odd[0]})"
    )


def _not_readable(spec: str) -> SpecError:
    """The one line for an input path that exists but is no file or directory to read (errors.file_problem: a
    symbolic link that loops or points nowhere, a socket, a device...)."""
    return SpecError(f"input {spec} {file_problem(spec)}; give a file, glob or directory (the real path)")


def check_out_apart(specs: list[str], inputs: Inputs, outs: list[Path], *, flag: str = "--out") -> None:
    """Refuse an output directory that is an input directory, lies inside one (a re-run would read its own output)
    or holds an input file (it is replaced); symbolic links resolved. outs: the output and any staging directory
    beside it."""
    if inputs.hub:
        return
    dirs = [(spec, Path(os.path.realpath(spec))) for spec in specs if Path(spec).is_dir()]
    for out in outs:
        real_out = Path(os.path.realpath(out))
        for spec, real in dirs:
            if real == real_out:
                raise SpecError(f"{flag} {outs[0]} is input directory {spec} itself; choose a {flag} outside the input")
            if real in real_out.parents:
                raise SpecError(
                    f"{flag} {outs[0]} lies inside input directory {spec}: a re-run would read its own output as "
                    f"input; choose a {flag} outside {spec}"
                )
        if not os.path.isdir(real_out):  # no input file can lie inside a directory that is not there
            continue
        parents: dict[str, str] = {}
        for f in inputs.files:  # the file's own name kept: a link inside --out is replaced with it
            parent = os.path.dirname(os.path.abspath(f))
            if parent not in parents:
                parents[parent] = os.path.realpath(parent)
            if Path(real_out) == Path(parents[parent]) or real_out in Path(parents[parent]).parents:
                raise SpecError(
                    f"input {f} lies inside {flag} {outs[0]}, which prepare-data replaces; choose another {flag}"
                )


def read_through(path: Path, chunk: int = 1 << 24) -> None:
    """Read a file to its end in bounded chunks: an OSError (an I/O error) before a library reads it."""
    with open(path, "rb") as f:
        while f.read(chunk):
            pass


def first_bad_utf8(path: Path, chunk: int = 1 << 24) -> tuple[int, int] | None:
    """(byte offset, byte value) of the first invalid UTF-8 sequence in a file, or None. Reads in bounded chunks."""
    offset, carry = 0, b""
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            data = carry + block
            if not block:
                cut = len(data)
            else:  # keep a possibly incomplete trailing sequence for the next block
                cut = len(data)
                for back in range(1, min(4, len(data)) + 1):
                    if data[-back] & 0xC0 != 0x80:
                        cut = len(data) - back
                        break
            try:
                data[:cut].decode("utf-8")
            except UnicodeDecodeError as e:
                return offset + e.start, data[e.start]
            if not block:
                return None
            offset += cut
            carry = data[cut:]


def hub_reachable() -> str | None:
    """None if the Hugging Face hub can be reached (or a proxy is configured); else why not. Takes at most ~3 s.

    Without this check, huggingface_hub retries for 25-50 s before failing offline."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=3).close()
    except OSError as e:
        return f"{url.hostname} is unreachable ({e.strerror or e})"
    return None


def go_offline_if_unreachable() -> str | None:
    """Switch huggingface_hub/datasets/transformers to their offline mode (cache only) when the hub is unreachable.

    Must run before those libraries are imported: they read the variables at import time."""
    reason = hub_reachable()
    if reason:
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
        try:  # already imported in this process (tests): flip their constants too
            import sys

            if "huggingface_hub" in sys.modules:
                sys.modules["huggingface_hub"].constants.HF_HUB_OFFLINE = True
            if "datasets" in sys.modules:
                sys.modules["datasets"].config.HF_HUB_OFFLINE = True
        except AttributeError:
            pass
    return reason


def _quiet_datasets():
    import datasets

    datasets.disable_progress_bars()
    # CRITICAL, not ERROR: its JSON builder logs 'Failed to load JSON from file ...' at error level before raising,
    # and every exception of a load is caught here and said in dspipe's one line
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)
    return datasets


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) < 300 else text[:297] + "..."


def _load(builder: str, inputs: Inputs, files: list[Path]):
    datasets = _quiet_datasets()
    kwargs = {}
    if builder == "text":
        kwargs["sample_by"] = "document" if inputs.txt_docs == "file" else "paragraph"
    try:
        return datasets.load_dataset(
            builder, data_files={"train": [str(f) for f in files]}, split="train", streaming=inputs.streaming, **kwargs
        )
    except Exception as e:  # datasets/pyarrow raise many types for unreadable files
        raise SpecError(
            f"cannot read {files[0] if len(files) == 1 else f'{files[0]} ...'} as {builder}: {_one_line(e)}"
        ) from None


def _load_hub(inputs: Inputs):
    offline = go_offline_if_unreachable()
    datasets = _quiet_datasets()
    try:
        return datasets.load_dataset(inputs.hub, inputs.config, split=inputs.split, streaming=inputs.streaming)
    except Exception as e:
        where = f"{offline}; not in the local cache either" if offline else _one_line(e)
        config = f"config {inputs.config}, " if inputs.config else ""
        raise SpecError(
            f"cannot load dataset {inputs.hub!r} ({config}split {inputs.split}; not a local path either): {where}"
        ) from None


JSON_KINDS = {
    list: "a JSON array",
    str: "a JSON string",
    int: "a JSON number",
    float: "a JSON number",
    bool: "a JSON true/false",
    type(None): "JSON null",
}


def _non_object(path: Path, field_: str) -> SpecError | None:
    """Why a .jsonl/.json file is not records (JSON objects), naming the first line or record that is not one (or a
    .jsonl line that is not JSON); None where every one is an object (or a .json file does not parse: datasets'
    message stands). Run only once reading the file failed, so a good file is never read twice."""
    import json

    want = f"not an object: each record must be a JSON object with its text in field {field_!r}"
    try:
        if path.suffix.lower() == ".jsonl":
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            value = json.loads(line)
                        except json.JSONDecodeError as e:  # numbered here: pyarrow's row counts from its block
                            return SpecError(
                                f"{path}: line {n} is not JSON ({e.msg}, column {e.colno}): each line must be one "
                                f"JSON object with its text in field {field_!r}"
                            )
                        if not isinstance(value, dict):
                            return SpecError(f"{path}: line {n} is {JSON_KINDS.get(type(value), 'not JSON')}, {want}")
            return None
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError, RecursionError):
        return None
    rows = value if isinstance(value, list) else [value]
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            where = f"record {i} of its top-level array" if isinstance(value, list) else "its top-level value"
            return SpecError(f"{path}: {where} is {JSON_KINDS.get(type(row), 'not JSON')}, {want}")
    return None


def _column_texts(ds, field_: str, source: str, files: list[Path] = ()) -> Iterator[str]:
    try:
        yield from _texts(ds, field_, source)
    except SpecError:
        for f in (f for f in files if _builder(f) == "json"):  # the first file that explains it, read only now
            better = _non_object(f, field_)
            if better is not None:
                raise better from None
        raise


def _texts(ds, field_: str, source: str) -> Iterator[str]:
    columns = ds.column_names
    if columns is not None and field_ not in columns:
        raise SpecError(f"no field {field_!r} in {source} (fields: {', '.join(columns)}); pass --text-field NAME")
    try:
        for batch in ds.select_columns([field_]).iter(batch_size=_BATCH):
            for text in batch[field_]:
                if text is not None and not isinstance(text, str):
                    raise SpecError(f"field {field_!r} in {source} holds {type(text).__name__}, not text")
                yield text
    except SpecError:
        raise
    except OSError as e:  # an I/O error under datasets' reader
        raise cannot_read(source, e) from None
    except ValueError as e:
        if "not in the dataset" in str(e):
            raise SpecError(f"no field {field_!r} in {source}; pass --text-field NAME") from None
        raise SpecError(f"cannot read {source}: {_one_line(e)}") from None
    except Exception as e:  # pyarrow parse errors, decoding errors from datasets' readers
        raise SpecError(f"cannot read {source}: {_one_line(e)}") from None


def _checked(files: list[Path], inputs: Inputs) -> list[Path]:
    """The files that read to their end (and, but parquet, are UTF-8); the others are one SpecError naming the
    file, or under --skip-bad skipped and counted (inputs.stats bad_utf8, unreadable)."""
    good = []
    for f in files:
        try:
            bad = first_bad_utf8(f) if _builder(f) != "parquet" else read_through(f)
        except OSError as e:
            if not inputs.skip_bad:
                raise cannot_read(f, e, tail=" (--skip-bad skips such files)") from None
            inputs.stats["unreadable"] += 1
            continue
        if bad is None:
            good.append(f)
        elif inputs.skip_bad:
            inputs.stats["bad_utf8"] += 1
        else:
            raise SpecError(f"{f} is not UTF-8: byte 0x{bad[1]:02x} at offset {bad[0]} (--skip-bad skips such files)")
    return good


def _file_groups(inputs: Inputs) -> Iterator[tuple[str, list[Path]]]:
    """Consecutive text files in groups of GROUP_FILES; each json/parquet file alone (errors name the file)."""
    group: list[Path] = []
    for f in inputs.files:
        if _builder(f) == "text":
            group.append(f)
            if len(group) == GROUP_FILES:
                yield "text", group
                group = []
            continue
        if group:
            yield "text", group
            group = []
        yield _builder(f), [f]
    if group:
        yield "text", group


def _first_with_text(files: list[Path], source: str) -> str:
    """Where a stream's first document comes from: its one file, or the first of a group of text files that holds
    any non-whitespace text (files are read in order; empty documents are skipped); else `source`."""
    if len(files) == 1:
        return str(files[0])
    for f in files:
        try:
            with open(f, encoding="utf-8") as text:
                if any(not chunk.isspace() for chunk in iter(lambda: text.read(1 << 20), "")):
                    return str(f)
        except (OSError, UnicodeDecodeError):
            break
    return source


def documents(inputs: Inputs, *, max_bytes: int | None = None, first_within: int | None = None) -> Iterator[str]:
    """Non-empty documents in input order, stopping once max_bytes of UTF-8 text have been yielded (documents are
    never cut: the one that reaches max_bytes is the last). first_within: the --max-mb limit, which must hold the
    first document (else one SpecError with its size and the smallest --max-mb that holds it).

    inputs.stats counts what this pass skipped (empty documents, non-UTF-8 and unreadable files under --skip-bad)."""
    inputs.stats.update(empty=0, bad_utf8=0, unreadable=0)
    total = 0

    def keep(text) -> bool:
        if not text or text.isspace():
            inputs.stats["empty"] += 1
            return False
        return True

    if inputs.hub:
        streams = [(_load_hub(inputs), inputs.text_field, inputs.hub, [])]
    else:  # plain text files always have the column "text"
        streams = (
            (
                _load(b, inputs, good),
                "text" if b == "text" else inputs.text_field,
                str(good[0]) if len(good) == 1 else f"{good[0]} ...",
                good,
            )
            for b, group in _file_groups(inputs)
            if (good := _checked(group, inputs))
        )
    for ds, field_, source, files in streams:
        for text in _column_texts(ds, field_, source, files):
            if keep(text):
                size = len(text.encode("utf-8")) if max_bytes is not None or first_within is not None else 0
                if first_within is not None and size > first_within:
                    where = _first_with_text(files, source)
                    raise too_small(
                        flag="--max-mb",
                        limit=first_within,
                        size=size,
                        what=f"the first document ({where}: {size:,} bytes; documents are never cut)",
                    )
                first_within = None
                yield text
                if max_bytes is not None:
                    total += size
                    if total >= max_bytes:
                        return


def fingerprint(items: list) -> str:
    return hashlib.sha256(repr(items).encode()).hexdigest()
