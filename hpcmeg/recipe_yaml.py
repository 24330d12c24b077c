"""Typed YAML reading for recipes and profiles: line numbers for keys, where each value was set
(``Where``: a ``--set`` item, a recipe line, a profile line or the default), and the conversion of
plain YAML data into the schema's dataclasses with one problem line per unknown key or wrong type.

Pure functions over ``yaml.safe_load`` output; no defaults live here (they live in
``hpcmeg.recipe_schema``).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from hpcmeg.recipe_choices import CHOICES, RETIRED

# dotted keys whose choices include on and off: a YAML boolean there means the word
_ON_OFF = frozenset(f"{sec}.{key}" for (sec, key), allowed in CHOICES.items() if {"on", "off"} <= set(allowed))


class RecipeError(Exception):
    """Raised with every problem found; ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


# ----------------------------------------------------------------------------- YAML with lines


def line_map(text: str) -> dict[str, int]:
    """Map dotted key paths to 1-based line numbers of the YAML text (best effort)."""
    out: dict[str, int] = {}
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return out
    seen: set[int] = set()  # an alias re-uses its anchor's node: walk each node once (no blow-up)

    def walk(node, prefix):
        if isinstance(node, yaml.MappingNode) and id(node) not in seen:
            seen.add(id(node))
            for k, v in node.value:
                key = f"{prefix}.{k.value}" if prefix else str(k.value)
                out.setdefault(key, k.start_mark.line + 1)
                walk(v, key)

    if root is not None:
        walk(root, "")
    return out


def read_yaml(path: Path, what: str = "recipe") -> tuple[dict, dict[str, int]]:
    """Parse a recipe or profile file: (mapping, key -> line). Every way it can be unreadable is one
    RecipeError line naming the file (and the line when the YAML parser knows it)."""
    try:
        raw = path.read_bytes()
    except IsADirectoryError:
        raise RecipeError([f"{path}: is a directory; give the {what} YAML file"]) from None
    except OSError as e:
        raise RecipeError([f"{path}: cannot read the {what}: {e.strerror or e}"]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise RecipeError([f"{path}:{line}: not a UTF-8 text file (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                           f"the {what} must be a YAML file"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        if mark is not None:
            where, problem = f"{path}:{mark.line + 1}", str(getattr(e, "problem", None) or e)
        elif isinstance(e, yaml.reader.ReaderError):  # a control character: a position, no mark
            where = f"{path}:{text.count(chr(10), 0, e.position) + 1}"
            problem = e.reason + (f" (#x{ord(e.character):04x})" if isinstance(e.character, str) else "")
        else:
            where, problem = str(path), " ".join(str(e).split())
        raise RecipeError([f"{where}: invalid YAML: {problem}; fix the syntax there"]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        sections = "cluster:, container:" if what == "profile" else "run:, data:, ..."
        raise RecipeError([f"{path}: the top level must be a mapping of sections ({sections}), "
                           f"not a {type(data).__name__}"])
    return data, line_map(text)


# ----------------------------------------------------------------------------- where a value was set

# a problem line that starts with a dotted recipe key (data.inputs[0]: ..., cluster.python '/x' ...)
_KEY_AT_START = re.compile(r"([a-z_]+(?:\.[a-z_][a-z_0-9]*)+)((?:\[\d+\])?)(?=[: ]|$)")


@dataclass(frozen=True)
class Where:
    """Where each value of a loaded recipe was set, highest precedence first: a ``--set`` item, a line
    of the recipe file, a line of the cluster profile, or nowhere (the schema's default).

    ``where(key)`` is the prefix of a problem line about ``key``; ``origin(key)`` ranks and names the
    place (for problems that span several keys: the one set most directly is blamed);
    ``attribute(line)`` prefixes a line that starts with a recipe key (the checks ``submit`` runs after
    loading) with the place that key was set."""

    sets: Mapping[str, str] = field(default_factory=dict)
    """dotted key -> the ``--set`` item that set it (the last one for a key given twice)."""
    recipe: Optional[Path] = None
    lines: Mapping[str, int] = field(default_factory=dict)
    """dotted key -> line in ``recipe``."""
    profile: Optional[Path] = None
    plines: Mapping[str, int] = field(default_factory=dict)
    """dotted key -> line in ``profile``."""

    SET, RECIPE, PROFILE, DEFAULT = 3, 2, 1, 0

    def origin(self, key: str) -> tuple[int, str]:
        """(precedence, place): (SET, '--set ITEM'), (RECIPE, 'FILE:LINE'), (PROFILE, 'FILE:LINE') or
        (DEFAULT, ''). ``key`` may carry a list index (data.inputs[0]): the list's line is used."""
        base = key.split("[")[0]
        if base in self.sets:
            return self.SET, f"--set {self.sets[base]}"
        for k, item in self.sets.items():  # a whole section set (--set train={...}), or a new key under one
            if base.startswith(k + ".") or k.startswith(base + "."):
                return self.SET, f"--set {item}"
        for rank, path, lines in ((self.RECIPE, self.recipe, self.lines), (self.PROFILE, self.profile, self.plines)):
            if path is not None and (key in lines or base in lines):
                return rank, f"{path}:{lines.get(key, lines.get(base))}"
        return self.DEFAULT, ""

    def __call__(self, key: str) -> str:
        """``--set ITEM`` (the item names the key), ``--set ITEM: key`` (a section set whole),
        ``FILE:LINE: key``, or the bare key."""
        rank, place = self.origin(key)
        if rank == self.SET and key.split("[")[0] in self.sets:
            return _printable(place)
        return _printable(f"{place}: {key}" if place else key)

    def describe(self, key: str, value) -> str:
        """``key=value`` and where it was set, for naming the other keys of a problem: 'cluster.nodes=1
        from hpcmeg/profiles/local.yaml:4', 'parallel.pipeline=1 by default'."""
        rank, place = self.origin(key)
        return f"{key}={value} " + (f"from {_printable(place)}" if place else "by default")

    def attribute(self, line: str) -> str:
        """A problem line that starts with a recipe key, prefixed with where that key was set; other lines
        (about a data file, --stages, Slurm's answer) and keys left at their default are returned as they are."""
        m = _KEY_AT_START.match(line)
        if not m:
            return line
        key = m.group(1) + m.group(2)
        rank, place = self.origin(key)
        if rank == self.DEFAULT:
            return line
        if rank == self.SET and m.group(1) in self.sets and line[m.end():].startswith(":") and not m.group(2):
            return _printable(place) + line[m.end():]  # '--set container.image=/x.sif: /x.sif does not exist'
        return f"{_printable(place)}: {line}"


def _printable(text: str) -> str:
    """A key or --set item with a newline or another control character, shown escaped: a problem
    stays one line whatever the user typed."""
    return text if text.isprintable() else repr(text)[1:-1]


# ----------------------------------------------------------------------------- typed conversion


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " (or null)"
    if origin in (list, tuple):
        (inner,) = typing.get_args(tp)[:1] or (Any,)
        return f"a list of {_type_name(inner).removeprefix('an ').removeprefix('a ')}s"
    if origin is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def _convert(value, tp, key: str, problems: list[str], where):
    """Check/convert one YAML value against a field type; append a problem on mismatch."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is typing.Union:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for a in inner:  # first alternative that accepts the value without complaint
            trial: list[str] = []
            out = _convert(value, a, key, trial, where)
            if not trial:
                return out
        problems.append(f"{where(key)}: expected {_type_name(tp)}, got {value!r}")
        return None
    if origin in (list, tuple):
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [value]  # a scalar where a list is expected: a one-element list
        if not isinstance(value, list):
            problems.append(f"{where(key)}: expected {_type_name(tp)}, got {value!r}")
            return []
        (inner,) = typing.get_args(tp)[:1] or (Any,)
        return [_convert(v, inner, f"{key}[{i}]", problems, where) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            problems.append(f"{where(key)}: expected a mapping, got {value!r}")
            return {}
        return {str(k): ("" if v is None else str(v)) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        problems.append(f"{where(key)}: expected true or false, got {value!r}")
        return False
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        problems.append(f"{where(key)}: expected an integer, got {value!r}")
        return 0
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "5e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
        problems.append(f"{where(key)}: expected a number, got {value!r}")
        return 0.0
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, bool) and key in _ON_OFF:  # YAML 1.1 reads on/off/yes/no as booleans
            return "on" if value else "off"
        problems.append(f"{where(key)}: expected a string, got {value!r}")
        return ""
    return value


def build(cls, data: dict, prefix: str, problems: list[str], where, failed: set[str] | None = None):
    """Build dataclass ``cls`` from a mapping, collecting unknown keys and type errors.

    ``failed`` (if given) receives the dotted path of every field whose value was refused (it then
    holds a placeholder default) and, for a misspelled key, the key it probably meant, so that
    checks spanning several fields can skip values nobody actually chose."""
    failed = set() if failed is None else failed
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields and path in RETIRED:
            problems.append(f"{where(path)}: no longer a recipe key ({RETIRED[path]}); delete it")
            continue
        if key not in fields:
            guess = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = f"; did you mean '{guess[0]}'?" if guess else f"; known keys: {', '.join(fields)}"
            problems.append(f"{where(path)}: unknown key {str(key)!r}{hint}")
            if guess:
                failed.add(f"{prefix}.{guess[0]}" if prefix else guess[0])
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if value is None:
                value = {}
            if not isinstance(value, dict):
                problems.append(f"{where(path)}: expected a mapping of {key} settings, got {value!r}")
                failed.add(path)
                continue
            kwargs[key] = build(tp, value, path, problems, where, failed)
        else:
            before = len(problems)
            kwargs[key] = _convert(value, tp, path, problems, where)
            if len(problems) > before:
                failed.add(path)
    return cls(**kwargs)
