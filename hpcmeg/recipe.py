"""The recipe: one typed description of a run that every stage reads.

Owns reading a recipe: loading YAML with ``yaml.safe_load``, cluster profiles, ``--set
section.key=value`` overrides, ``read_recipe`` (the recipe with its problems, so ``submit``'s checks
can add theirs in the same run), ``load_recipe`` (raising them) and writing a recipe back
(``to_dict``, ``dump_yaml``, ``write_resolved``). The schema (nested dataclasses, one docstring per
field, the only place a default lives) is recipe_schema.py; turning YAML into it, recipe_yaml.py;
``validate`` (every problem at once, one line each, naming the ``--set`` item, the recipe or profile
line, or the bare key) is here; the derived values (``derive``: data-parallel size,
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
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from hpcmeg.fsutil import write_text_atomic
from hpcmeg.megatron.lr_schedule import schedule_from_recipe
# re-exported: with load_recipe, the names the stages import from the recipe
from hpcmeg.recipe_plan import (DataPlan, Derived, RunPaths, data_plan, dataset_blend, derive,  # noqa: F401
                                parse_blend, parse_split, recipe_dims, run_paths, vocab_size_from_files)
from hpcmeg.recipe_schema import CHOICES, Recipe, field_range
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


def _ranged_fields(r: Recipe):
    """(dotted key, value, Range) of every field whose schema entry carries a range."""
    for sec in dataclasses.fields(r):
        obj = getattr(r, sec.name)
        if dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                rng = field_range(f)
                if rng is not None:
                    yield f"{sec.name}.{f.name}", getattr(obj, f.name), rng


def validate(r: Recipe, where=lambda k: k, failed: set[str] | frozenset = frozenset(),
             refused: set[str] | None = None) -> list[str]:
    """Range checks (the schema's `ranged` fields) and consistency checks that span fields.

    Returns one line per problem. ``failed`` holds keys (or whole sections) whose value was
    already refused while reading (type errors, typos): no check looks at them again, so one
    mistake is one line, never a cascade about the placeholder left in its place. ``refused`` (if
    given) receives those and every key refused here. A problem that spans several keys is blamed on
    the one set with the highest precedence (``--set``, then the recipe, then the profile: where
    ``where`` is a recipe_yaml.Where), naming the others' values."""
    p: list[str] = []
    bad = set(failed)
    origin = getattr(where, "origin", lambda key: (0, ""))

    def ok(*keys: str) -> bool:
        return not any(k in bad or k.split(".")[0] in bad for k in keys)

    def refuse(key: str, text: str, also: tuple[str, ...] = (), named: bool = False) -> None:
        """One line about ``key``, or, when one of ``also`` (the other keys the problem spans) was set
        with a higher precedence (the user's --set over a recipe or profile line), about that one.
        ``named``: the text already names every key with its value and origin."""
        blamed = max((key, *also), key=lambda k: origin(k)[0])  # ties: `key`, the problem's own
        if blamed == key or named:
            p.append(f"{where(blamed)}: {text}")
        else:
            p.append(f"{where(blamed)}: {key}: {text} ({_described(where, key, _value(r, key))})")
        bad.add(key)

    m, t, c = r.model, r.train, r.cluster
    for key, val, rng in _ranged_fields(r):
        if not ok(key) or val is None or isinstance(val, bool) or not isinstance(val, (int, float)):
            continue
        if not math.isfinite(val) or not rng.accepts(val):
            refuse(key, f"{val} is out of range; use a value {rng.describe()}")
    for (sec, key), allowed in CHOICES.items():
        val = getattr(getattr(r, sec), key)
        if ok(f"{sec}.{key}") and val not in allowed:
            guess = difflib.get_close_matches(str(val), allowed, n=1)
            hint = f"; did you mean '{guess[0]}'?" if guess else ""
            refuse(f"{sec}.{key}", f"{val!r} is not one of {', '.join(allowed)}{hint}")
    if ok("run.name"):
        name = r.run.name
        if not name:
            refuse("run.name", "a run needs a name")
        elif any(ch in name for ch in "/\0") or name in (".", ".."):
            refuse("run.name", f"{name!r} must be a plain name (no '/'): it names the run directory")
        elif any(ord(ch) < 32 or ord(ch) == 127 for ch in name):
            refuse("run.name", f"{name!r} contains a control character (a newline, tab...); use a plain name: "
                               f"it names the run directory and appears in job names")
    if ok("data.json_keys") and not r.data.json_keys:
        refuse("data.json_keys", "give at least one JSON key holding the text, e.g. [text]")
    if ok("model.hidden_size", "model.num_attention_heads") and m.hidden_size % m.num_attention_heads:
        refuse("model.hidden_size", f"{m.hidden_size} is not divisible by model.num_attention_heads={m.num_attention_heads}",
               also=("model.num_attention_heads",))
    if ok("model.recompute_gelu_layers", "model.num_layers") and m.recompute_gelu_layers > m.num_layers:
        refuse("model.recompute_gelu_layers", f"{m.recompute_gelu_layers} exceeds model.num_layers={m.num_layers}; "
               "use at most num_layers", also=("model.num_layers",))
    if ok("data.seq_length", "model.max_position_embeddings") and r.data.seq_length > m.max_position_embeddings:
        refuse("data.seq_length", f"{r.data.seq_length} exceeds model.max_position_embeddings={m.max_position_embeddings}",
               also=("model.max_position_embeddings",))
    # the parallel layout: sizes, then its fit to the batch and the model (hpcmeg/megatron/parallel_dims.py,
    # the one place these rules live; the train job checks the running processes with the same object)
    per_node = "cluster.gpus_per_node" if c.gpus_per_node > 0 else "cluster.cpu_tasks_per_node"
    layout = ("cluster.nodes", "cluster.gpus_per_node", "cluster.cpu_tasks_per_node", "parallel.tensor",
              "parallel.pipeline", "parallel.virtual_pipeline", "parallel.sequence_parallel")
    if ok(*layout):
        dims = recipe_dims(r)
        # the processes: nodes x ranks per node, each named with where it was set
        ranks = (f"ranks ({_described(where, 'cluster.nodes', c.nodes)} x "
                 f"{_described(where, per_node, getattr(c, per_node.split('.')[1]))})")
        sizes = dims.problems(check_implemented=False, ranks=ranks)
        for key, text in sizes:
            # the rank count against tensor x pipeline: blamed on whichever of the four was set most directly
            spans = key == "cluster.nodes" and dims.world >= 1
            refuse(key, text, also=("parallel.tensor", "parallel.pipeline", per_node) if spans else (), named=spans)
        if not sizes:
            fit = dims.model_problems(num_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                                      ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
                                      seq_length=r.data.seq_length)
            fit += dims.batch_problems(t.global_batch_size, t.micro_batch_size,
                                       "GPUs" if c.gpus_per_node > 0 else "CPU ranks")
            for key, text in fit:
                deps = {"model.num_attention_heads": ("model.num_attention_heads",),
                        "model.ffn_hidden_size": ("model.ffn_hidden_size", "model.hidden_size"),
                        "model.num_layers": ("model.num_layers",), "data.seq_length": ("data.seq_length",),
                        "train.global_batch_size": ("train.global_batch_size", "train.micro_batch_size")}[key]
                if ok(*deps):
                    # the layout keys the rule divides by can be what the user just changed (--set parallel.tensor=8)
                    spans = {"model.num_attention_heads": ("parallel.tensor",),
                             "model.ffn_hidden_size": ("parallel.tensor",),
                             "model.num_layers": ("parallel.pipeline", "parallel.virtual_pipeline"),
                             "data.seq_length": ("parallel.tensor",),
                             "train.global_batch_size": ("train.micro_batch_size", "parallel.tensor",
                                                         "parallel.pipeline", "cluster.nodes", per_node)}[key]
                    refuse(key, text, also=spans)
            for key, text in dims.problems():  # layouts the train job cannot run yet: said here, before
                refuse(key, text)              # anything is submitted (sizes are fine at this point)
    if ok("train.train_iters", "train.train_samples") and (t.train_iters is None) == (t.train_samples is None):
        refuse("train.train_iters", "set exactly one of train.train_iters and train.train_samples")
    if ok("train.min_lr", "train.lr") and t.min_lr > t.lr:
        refuse("train.min_lr", f"{t.min_lr} is above train.lr={t.lr}; lower train.min_lr", also=("train.lr",))
    sched = ("train.lr", "train.min_lr", "train.lr_decay_style", "train.lr_decay_iters", "train.lr_warmup_iters",
             "train.lr_warmup_fraction", "train.train_iters", "train.train_samples", "train.global_batch_size")
    if ok(*sched) and (t.train_iters is None) != (t.train_samples is None):
        try:
            schedule_from_recipe(t, t.global_batch_size, t.train_samples or t.train_iters * t.global_batch_size)
        except ValueError as e:
            refuse("train.lr_warmup_iters", f"{e}; shorten the warmup (train.lr_warmup_iters or "
                     f"train.lr_warmup_fraction) or lengthen the decay (train.lr_decay_iters)")
    if ok("data.split"):
        try:
            split = parse_split(r.data.split)
            if split[0] <= 0:
                refuse("data.split", f"the training share of {r.data.split!r} is zero")
        except ValueError as e:
            refuse("data.split", f"{e}")
    blend = r.data.data_path
    if ok("data.data_path") and blend and len(blend) > 1:
        try:
            parse_blend(blend)
        except ValueError as e:
            refuse("data.data_path", f"{e}")
    if ok("data.data_path", "data.inputs") and not blend and not r.data.inputs:
        refuse("data.inputs", "give JSONL inputs to preprocess (data.inputs) or existing datasets (data.data_path)")
    if ok("cluster.executor") and c.executor == "slurm":
        for key in ("time", "preprocess_time", "convert_time"):
            if ok(f"cluster.{key}") and c.time_limit_minutes(getattr(c, key)) is None:
                refuse(f"cluster.{key}", f"{getattr(c, key)!r} is not a Slurm time (MM, HH:MM:SS or D-HH:MM:SS)")
        limit = c.time_limit_minutes()
        if ok("cluster.time", "cluster.signal_lead_s") and limit is not None and c.signal_lead_s >= limit * 60:
            refuse("cluster.signal_lead_s", f"{c.signal_lead_s} s is not shorter than cluster.time={c.time}; "
                     f"lower it or raise cluster.time", also=("cluster.time",))
    if ok("container.runtime", "container.image") and r.container.runtime != "none" and not r.container.image:
        refuse("container.image", f"container.runtime={r.container.runtime} needs an image")
    if ok("convert.iterations"):
        it = str(r.convert.iterations).strip()
        if it not in ("last", "all") and not re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*,?\s*", it):
            refuse("convert.iterations", f"{it!r} must be last, all, or a comma list of iterations (100,200)")
    if refused is not None:
        refused |= bad
    return p


def _value(r: Recipe, key: str):
    sec, name = key.split(".", 1)
    return getattr(getattr(r, sec), name)


def _described(where, key: str, value) -> str:
    """'key=value (where it was set)' with a recipe_yaml.Where, plain 'key=value' otherwise."""
    describe = getattr(where, "describe", None)
    return describe(key, value) if describe else f"{key}={value}"


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
