"""The YAML dialect of --config files: YAML 1.2 core scalars (`6e-4` is a number, `no`/`off` are strings; `010` is
refused, octal 8 to a YAML 1.1 reader), integers of more digits than a float holds kept as LongInt, duplicate keys
refused, every error one SpecError line naming the file (read_yaml); Dumper quotes a string either YAML reader would
misread. No torch, no click (dspipe.cli.config_file is the bridge to the commands' options)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from dspipe.digits import digits_text, too_many_digits
from dspipe.errors import SpecError, cannot_read, file_problem
from dspipe.spec.options import TABLE

MAX_BYTES = 1 << 20
"""The largest --config file read."""


# ---- YAML: 1.2 core scalars, no duplicate keys -------------------------------------------------------------------


class _Resolver(yaml.resolver.BaseResolver):
    """YAML 1.2 core schema scalars: true/false, null/~, decimal integers, floats with or without a dot."""


for _tag, _regex, _first in (
    ("bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    ("null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
    ("int", r"^[-+]?[0-9]+$", "-+0123456789"),
    (
        "float",
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)"
        r"|\.(?:nan|NaN|NAN))$",
        "-+0123456789.",
    ),
):
    _Resolver.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(_regex), list(_first))


class _Loader(
    yaml.reader.Reader,
    yaml.scanner.Scanner,
    yaml.parser.Parser,
    yaml.composer.Composer,
    yaml.constructor.SafeConstructor,
    _Resolver,
):
    def __init__(self, stream):
        yaml.reader.Reader.__init__(self, stream)
        yaml.scanner.Scanner.__init__(self)
        yaml.parser.Parser.__init__(self)
        yaml.composer.Composer.__init__(self)
        yaml.constructor.SafeConstructor.__init__(self)
        _Resolver.__init__(self)

    def construct_yaml_int(self, node):
        text = self.construct_scalar(node)
        if len(text.lstrip("+-")) > 1 and text.lstrip("+-").startswith("0"):
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"{text} has a leading zero: YAML 1.1 readers (PyYAML) take it as octal, YAML 1.2 as decimal; "
                f"write it without the zero",
                node.start_mark,
            )
        return LongInt(text) if too_many_digits(text) else int(text, 10)


class LongInt(str):
    """A YAML integer of more than MAX_DIGITS digits, kept as its text (int() refuses beyond 4,300 digits): an
    integer option's StrictInt refuses it in one line with the option's limit; anything else, as not its type."""


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)


def _duplicate(node, where: str = "", _seen: set | None = None) -> str | None:
    """'train.steps: duplicate key (line 4; first on line 2)' for the first key given twice in a mapping, or None.
    A node reached again through an alias is not walked twice (an alias may make the tree a cycle)."""
    _seen = set() if _seen is None else _seen
    if id(node) in _seen:
        return None
    _seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                key, line = key_node.value, key_node.start_mark.line + 1
                if key in seen:
                    what = f"{where}.{key}: duplicate key" if where else f"{key}: duplicate section"
                    return f"{what} (line {line}; first on line {seen[key]})"
                seen[key] = line
            found = _duplicate(value_node, f"{where}.{key_node.value}" if where else str(key_node.value), _seen)
            if found:
                return found
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found = _duplicate(item, f"{where}[{i}]", _seen)
            if found:
                return found
    return None


def _load_yaml(text: str):
    """The document, with a one-line SpecError-ready message (ValueError) for a key given twice."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        found = _duplicate(node)
        if found:
            raise ValueError(found)
        try:
            return loader.construct_document(node)
        except (ValueError, TypeError, OverflowError) as e:  # an explicit tag its value does not fit: !!float abc
            raise ValueError(_unconstructed(loader, node, e)) from None
    finally:
        loader.dispose()


def _unconstructed(loader, root, error: Exception) -> str:
    """The message for a value the constructor could not build: the first scalar that fails on its own, with its tag,
    text and place."""
    stack = [root]
    while stack:
        node = stack.pop(0)
        if isinstance(node, yaml.ScalarNode):
            loader.constructed_objects, loader.recursive_objects, loader.state_generators = {}, {}, []
            try:
                loader.construct_object(node, deep=True)
            except (ValueError, TypeError, OverflowError) as e:
                tag = node.tag.replace("tag:yaml.org,2002:", "!!")
                mark = node.start_mark
                why = " ".join(str(e).split())
                return (
                    f"line {mark.line + 1}, column {mark.column + 1}: {tag} {node.value!r} is not a valid {tag[2:]} "
                    f"({why})"
                )
        elif isinstance(node, yaml.MappingNode):
            stack += [part for pair in node.value for part in pair]
        elif isinstance(node, yaml.SequenceNode):
            stack += list(node.value)
    return " ".join(str(error).split())


_YAML_1_1 = yaml.resolver.Resolver()


class Dumper(yaml.emitter.Emitter, yaml.serializer.Serializer, yaml.representer.SafeRepresenter, _Resolver):
    """Quotes a string when _Loader (YAML 1.2) or a YAML 1.1 reader (yaml.safe_load) would read it as something
    else ('1e3', 'true', 'null', 'no', '2024-01-01'): the printed file means the same to either."""

    def resolve(self, kind, value, implicit):
        tag = _Resolver.resolve(self, kind, value, implicit)
        if kind is yaml.ScalarNode and implicit[0] and tag == self.DEFAULT_SCALAR_TAG:
            return _YAML_1_1.resolve(kind, value, implicit)
        return tag

    def __init__(self, stream, **kw):
        yaml.emitter.Emitter.__init__(self, stream, width=kw.get("width"), allow_unicode=True)
        yaml.serializer.Serializer.__init__(self)
        yaml.representer.SafeRepresenter.__init__(self, default_flow_style=False, sort_keys=False)
        _Resolver.__init__(self)


def shown(value) -> str:
    """A YAML value as the message shows it."""
    if value is None:
        return "null"
    if isinstance(value, LongInt):
        return digits_text(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        text = repr(value)
        return (text if len(text) <= 40 else text[:37] + "...") + " (a string)"
    if isinstance(value, LongInt):
        return digits_text(value)
    if isinstance(value, (int, float)):
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    kinds = {list: "a list", dict: "a mapping", set: "a set", bytes: "binary data"}
    return kinds.get(type(value), f"a {type(value).__name__}")


def read_yaml(path: str) -> dict:
    """The file's top-level mapping; one-line SpecError for a missing, unreadable, oversized, non-UTF-8, unparsable,
    duplicate-keyed or non-mapping file."""
    p = Path(path)
    try:
        if p.is_symlink() and not p.exists():  # a loop or a broken link
            raise SpecError(f"{path}: {file_problem(p)} (--config)")
        if not p.exists():
            raise SpecError(f"{path}: no such file (--config)")
        if p.is_dir():
            raise SpecError(f"{path}: is a directory, not a YAML file (--config)")
        if not p.is_file():
            raise SpecError(f"{path}: not a regular file (--config)")
        with open(p, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise cannot_read(path, e, tail=" (--config)") from None
    if len(data) > MAX_BYTES:
        raise SpecError(f"{path}: larger than {MAX_BYTES >> 20} MiB: not a config file (--config)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None
    try:
        doc = _load_yaml(text)
    except ValueError as e:  # a duplicate key, a value its tag does not fit
        raise SpecError(f"{path}: {e}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        what = " ".join(str(e.problem or e.context or "").split())
        if e.context and e.problem and e.problem.startswith("but "):  # "expected X, but found Y"
            what = f"{' '.join(e.context.split())}, {what}"
        raise SpecError(f"{path}: not valid YAML: {what}{where}") from None
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    except RecursionError:  # the parser recurses once per level of nesting
        raise SpecError(f"{path}: not a config file: nested too deeply for the YAML parser (--config)") from None
    if not isinstance(doc, dict):
        empty = " (an empty file)" if doc is None else ""
        raise SpecError(f"{path}: expected a mapping of sections ({', '.join(TABLE)}), got {shown(doc)}{empty}")
    return doc
