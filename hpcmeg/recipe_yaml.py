"""Typed YAML reading for recipes and profiles: line numbers for keys, and the conversion of plain
YAML data into the schema's dataclasses with one problem line per unknown key or wrong type.

Pure functions over ``yaml.safe_load`` output; no defaults live here (they live in
``hpcmeg.recipe_schema``).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any

import yaml


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

    def walk(node, prefix):
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = f"{prefix}.{k.value}" if prefix else str(k.value)
                out[key] = k.start_mark.line + 1
                walk(v, key)

    if root is not None:
        walk(root, "")
    return out


def read_yaml(path: Path) -> tuple[dict, dict[str, int]]:
    try:
        text = path.read_text()
    except OSError as e:
        raise RecipeError([f"{path}: cannot read: {e.strerror}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise RecipeError([f"{where}: invalid YAML: {getattr(e, 'problem', e)}"]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError([f"{path}: the top level must be a mapping of sections (run:, data:, ...)"])
    return data, line_map(text)


# ----------------------------------------------------------------------------- typed conversion


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " (or null)"
    if origin in (list, tuple):
        (inner,) = typing.get_args(tp)[:1] or (Any,)
        return f"list of {_type_name(inner)}"
    if origin is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


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
        problems.append(f"{where(key)}: expected a string, got {value!r}")
        return ""
    return value


def build(cls, data: dict, prefix: str, problems: list[str], where):
    """Build dataclass ``cls`` from a mapping, collecting unknown keys and type errors."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            guess = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = f"; did you mean '{guess[0]}'?" if guess else f"; known keys: {', '.join(fields)}"
            problems.append(f"{where(path)}: unknown key '{key}'{hint}")
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if value is None:
                value = {}
            if not isinstance(value, dict):
                problems.append(f"{where(path)}: expected a mapping of {key} settings, got {value!r}")
                continue
            kwargs[key] = build(tp, value, path, problems, where)
        else:
            kwargs[key] = _convert(value, tp, path, problems, where)
    return cls(**kwargs)
