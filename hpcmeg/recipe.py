"""The recipe: one typed description of a run that every stage reads.

Owns reading a recipe: loading YAML with ``yaml.safe_load``, cluster profiles, ``--set
section.key=value`` overrides, ``read_recipe`` (the recipe with its problems, so ``submit``'s checks
can add theirs in the same run), ``load_recipe`` (raising them) and writing a recipe back
(``to_dict``, ``dump_yaml``, ``write_resolved``). The schema (nested dataclasses, one docstring per
field, the only place a default lives) is recipe_schema.py; turning YAML into it, recipe_yaml.py;
``validate`` (every problem at once, one line each, naming the ``--set`` item, the recipe or profile
line, or the bare key), recipe_checks.py; the derived values (``derive``: data-parallel size,
gradient accumulation, padded vocabulary, paths; ``data_plan``), recipe_plan.py. This module is
the recipe's public face: those names are importable from here.

Precedence, lowest first: dataclass defaults < cluster profile < recipe file < ``--set``.
This module never touches torch or the process environment (profiles are searched on paths
given explicitly or in the recipe); loading/validation is pure.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from hpcmeg.fsutil import write_text_atomic
from hpcmeg.recipe_checks import validate
# re-exported: with load_recipe, the names the stages import from the recipe
from hpcmeg.recipe_plan import (DataPlan, Derived, RunPaths, data_plan, dataset_blend, derive,  # noqa: F401
                                parse_blend, parse_split, recipe_dims, run_paths, vocab_size_from_files)
from hpcmeg.recipe_schema import Recipe
from hpcmeg.recipe_yaml import RecipeError, Where, build, read_yaml

PROFILE_DIR = Path(__file__).parent / "profiles"


# ----------------------------------------------------------------------------- merging inputs


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def parse_override(item: str) -> tuple[list[str], Any]:
    """``section.key=value`` -> (["section", "key"], value parsed as YAML: 3, 1e-4, true, [a, b])."""
    if "=" not in item:
        raise RecipeError([f"--set {item!r}: expected section.key=value"])
    key, raw = item.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if len(parts) < 2:
        raise RecipeError([f"--set {item!r}: the key needs a section, e.g. train.lr=3e-4"])
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = copy.deepcopy(data)  # plain YAML data; deepcopy keeps shared (aliased) nodes shared
    for item in overrides or []:
        parts, value = parse_override(item)
        node = data
        for p in parts[:-1]:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        node[parts[-1]] = value
    return data


def override_items(overrides: list[str] | None) -> dict[str, str]:
    """Dotted key -> the ``--set`` item that sets it (the last one wins, as in apply_overrides)."""
    return {".".join(parse_override(item)[0]): item for item in overrides or []}


def find_profile(name: str, search: list[Path]) -> Path:
    """A profile is a YAML file: a path, or a name looked up in ``search`` then the packaged ones."""
    p = Path(name).expanduser()
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    for d in [*search, PROFILE_DIR]:
        for ext in (".yaml", ".yml"):
            cand = Path(d).expanduser() / f"{name}{ext}"
            if cand.exists():
                return cand
    known = sorted({q.stem for d in [*search, PROFILE_DIR] if Path(d).is_dir() for q in Path(d).glob("*.y*ml")})
    guess = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean '{guess[0]}'?" if guess else ""
    raise RecipeError([f"cluster.profile: no profile named '{name}' (known: {', '.join(known)}){hint}"])


def profile_search_path(recipe_path: Optional[Path]) -> list[Path]:
    dirs = []
    if recipe_path is not None:
        dirs += [recipe_path.parent / "profiles", recipe_path.parent.parent / "slurm" / "profiles"]
    dirs += [Path("slurm/profiles"), Path("~/.config/hpcmeg/profiles")]
    extra = os.environ.get("HPCMEG_PROFILE_PATH", "")  # the CLI's one concession to the environment
    dirs = [Path(x) for x in extra.split(os.pathsep) if x] + dirs
    return dirs


# ----------------------------------------------------------------------------- public API


@dataclass(frozen=True)
class Loaded:
    """What reading a recipe found: the recipe (placeholders where a value was refused), one line per
    problem, the keys (or whole sections) refused, and where each value was set. ``hpcmeg validate``
    and ``submit`` go on to their own checks with it, skipping those that read a refused key, so every
    independent problem is reported in one run."""

    recipe: Recipe
    problems: tuple[str, ...]
    refused: frozenset[str]
    where: Where


def read_recipe(path: str | os.PathLike | None, overrides: list[str] | None = None,
                profile: str | None = None, data: dict | None = None) -> Loaded:
    """Load, merge (defaults < profile < recipe < overrides) and validate; problems are collected, not
    raised. Raises RecipeError only when nothing can be checked: an unreadable recipe or profile file,
    an unknown profile, a ``--set`` without ``=``."""
    rpath = Path(path) if path is not None else None
    lines: dict[str, int] = {}
    if data is None:
        data, lines = read_yaml(rpath) if rpath is not None else ({}, {})
        if rpath is not None and not data:
            raise RecipeError([f"{rpath}: the recipe is empty; a recipe has run:, data:, model: and train: "
                               f"sections (start from recipes/codeparrot_tiny.yaml)"])
    sets = override_items(overrides)
    data = apply_overrides(data, overrides or [])
    where = Where(sets=sets, recipe=rpath, lines=lines)

    # cluster profile: its keys fill in what the recipe leaves unset
    cluster = data.get("cluster")
    prof_name = profile or (cluster.get("profile") if isinstance(cluster, dict) else None) or "local"
    if not isinstance(prof_name, str):
        raise RecipeError([f"{where('cluster.profile')}: expected a profile name, got {prof_name!r}"])
    ppath = find_profile(prof_name, profile_search_path(rpath))
    pdata, plines = read_yaml(ppath, what="profile")
    where = dataclasses.replace(where, profile=ppath, plines=plines)
    bad = set(pdata) - {"cluster", "container", "description"}
    problems: list[str] = [f"{ppath}: unknown section '{k}' (a profile holds cluster: and container:)" for k in sorted(bad)]
    pdata = {k: v for k, v in pdata.items() if k in ("cluster", "container")}
    merged = _deep_merge(pdata, data)
    failed: set[str] = set()
    if not isinstance(merged.get("cluster"), (dict, type(None))):
        problems.append(f"{where('cluster')}: expected a mapping of cluster settings, got {merged['cluster']!r}")
        merged["cluster"] = {}
        failed.add("cluster")
    merged["cluster"] = dict(merged.get("cluster") or {}, profile=prof_name)

    recipe = build(Recipe, merged, "", problems, where, failed)
    recipe.source = str(rpath) if rpath is not None else None
    problems += validate(recipe, where, failed, refused=failed)
    return Loaded(recipe, tuple(problems), frozenset(failed), where)


def load_recipe(path: str | os.PathLike | None, overrides: list[str] | None = None,
                profile: str | None = None, data: dict | None = None) -> Recipe:
    """``read_recipe``, raising RecipeError with every problem found, one line each, each naming
    where the value came from: ``--set ITEM``, ``RECIPE:LINE: key``, ``PROFILE:LINE: key`` or the bare key."""
    loaded = read_recipe(path, overrides, profile, data)
    if loaded.problems:
        raise RecipeError(list(loaded.problems))
    return loaded.recipe


def to_dict(recipe: Recipe) -> dict:
    """The recipe as plain data, without the values of ``cluster.secret_env`` (every recipe copy hpcmeg
    writes, recipe.yaml, train_recipe.yaml and the one inside checkpoints, is made from this)."""
    from hpcmeg.jobenv import redact_recipe_dict

    out = dataclasses.asdict(recipe)
    out.pop("source", None)
    return redact_recipe_dict(out)


def from_dict(data: dict) -> Recipe:
    """Rebuild a Recipe from ``to_dict`` output (e.g. the copy stored in the run dir or a checkpoint)."""
    data = {k: v for k, v in data.items() if k != "source"}
    return load_recipe(None, data=data, profile=(data.get("cluster") or {}).get("profile"))


def dump_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(to_dict(recipe), sort_keys=False, default_flow_style=False)


def write_resolved(recipe: Recipe, path: str | os.PathLike) -> Path:
    """Write the resolved recipe atomically (hpcmeg.fsutil: temp name, fsync, rename), creating parent dirs."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, dump_yaml(recipe))
    return path
