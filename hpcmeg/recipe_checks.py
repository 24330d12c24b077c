"""``validate``: the checks of a recipe's values that the schema's types cannot express.

Owns the range checks (the schema's ``ranged`` fields), the choice lists (recipe_choices.CHOICES) and
every check that spans fields, one function per concern, run in a fixed order: ranges, choices,
names, the model's shape, the parallel layout (hpcmeg/megatron/parallel_dims.py holds its rules; the
train job checks the running processes with the same object), the activation recompute (its rules,
recompute_problem, are also hpcmeg/parallel/recompute.py's), the schedule, the data, the cluster
and container, convert. Each problem is one line naming the key, where it was set and the fix; a
problem spanning several keys is blamed on the one set most directly (``--set``, then the recipe,
then the profile). Pure: reads no file and no environment.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re

from hpcmeg.megatron.lr_schedule import schedule_from_recipe
from hpcmeg.recipe_plan import parse_blend, parse_split, recipe_dims
from hpcmeg.recipe_choices import CHOICES
from hpcmeg.recipe_schema import Recipe, field_range

_LAYOUT_KEYS = ("cluster.nodes", "cluster.gpus_per_node", "cluster.cpu_tasks_per_node", "parallel.tensor",
                "parallel.pipeline", "parallel.virtual_pipeline", "parallel.sequence_parallel")
_SCHEDULE_KEYS = ("train.lr", "train.min_lr", "train.lr_decay_style", "train.lr_decay_iters",
                  "train.lr_warmup_iters", "train.lr_warmup_fraction", "train.train_iters", "train.train_samples",
                  "train.global_batch_size")
# a layout-fit problem's key -> the keys its check reads (skipped when one of them was refused)
_FIT_READS = {"model.num_attention_heads": ("model.num_attention_heads",),
              "model.ffn_hidden_size": ("model.ffn_hidden_size", "model.hidden_size"),
              "model.num_layers": ("model.num_layers",), "data.seq_length": ("data.seq_length",),
              "train.global_batch_size": ("train.global_batch_size", "train.micro_batch_size")}
# ... and the layout keys the rule divides by: they can be what the user just changed (--set parallel.tensor=8)
_FIT_SPANS = {"model.num_attention_heads": ("parallel.tensor",), "model.ffn_hidden_size": ("parallel.tensor",),
              "model.num_layers": ("parallel.pipeline", "parallel.virtual_pipeline"),
              "data.seq_length": ("parallel.tensor",),
              "train.global_batch_size": ("train.micro_batch_size", "parallel.tensor", "parallel.pipeline",
                                          "cluster.nodes")}  # + the ranks-per-node key in use


def _value(recipe: Recipe, key: str):
    section, name = key.split(".", 1)
    return getattr(getattr(recipe, section), name)


def _described(where, key: str, value) -> str:
    """'key=value (where it was set)' with a recipe_yaml.Where, plain 'key=value' otherwise."""
    describe = getattr(where, "describe", None)
    return describe(key, value) if describe else f"{key}={value}"


class _Findings:
    """One validate() run: the recipe, where each key was set, the lines so far and the keys refused."""

    def __init__(self, recipe: Recipe, where, failed):
        self.recipe, self.where = recipe, where
        self.lines: list[str] = []
        self.bad = set(failed)
        self.origin = getattr(where, "origin", lambda key: (0, ""))

    def ok(self, *keys: str) -> bool:
        """None of ``keys`` (nor its section) was refused: a check may read them."""
        return not any(k in self.bad or k.split(".")[0] in self.bad for k in keys)

    def refuse(self, key: str, text: str, also: tuple[str, ...] = (), named: bool = False) -> None:
        """One line about ``key``, or, when one of ``also`` (the other keys the problem spans) was set
        with a higher precedence (the user's --set over a recipe or profile line), about that one.
        ``named``: the text already names every key with its value and origin."""
        blamed = max((key, *also), key=lambda k: self.origin(k)[0])  # ties: `key`, the problem's own
        if blamed == key or named:
            self.lines.append(f"{self.where(blamed)}: {text}")
        else:
            value = _described(self.where, key, _value(self.recipe, key))
            self.lines.append(f"{self.where(blamed)}: {key}: {text} ({value})")
        self.bad.add(key)


def _ranged_fields(recipe: Recipe):
    """(dotted key, value, Range) of every field whose schema entry carries a range."""
    for sec in dataclasses.fields(recipe):
        obj = getattr(recipe, sec.name)
        if dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                rng = field_range(f)
                if rng is not None:
                    yield f"{sec.name}.{f.name}", getattr(obj, f.name), rng


def _check_ranges(found: _Findings) -> None:
    for key, val, rng in _ranged_fields(found.recipe):
        if not found.ok(key) or val is None or isinstance(val, bool) or not isinstance(val, (int, float)):
            continue
        if not math.isfinite(val) or not rng.accepts(val):
            found.refuse(key, f"{val} is out of range; use a value {rng.describe()}")


def _check_choices(found: _Findings) -> None:
    for (sec, key), allowed in CHOICES.items():
        val = getattr(getattr(found.recipe, sec), key)
        if found.ok(f"{sec}.{key}") and val is not None and val not in allowed:  # None: a null default
            guess = difflib.get_close_matches(str(val), allowed, n=1)
            hint = f"; did you mean '{guess[0]}'?" if guess else ""
            found.refuse(f"{sec}.{key}", f"{val!r} is not one of {', '.join(allowed)}{hint}")


def _check_names(found: _Findings) -> None:
    """run.name names the run directory and the jobs; data.json_keys names the text."""
    recipe = found.recipe
    if found.ok("run.name"):
        name = recipe.run.name
        if not name:
            found.refuse("run.name", "a run needs a name")
        elif any(ch in name for ch in "/\0") or name in (".", ".."):
            found.refuse("run.name", f"{name!r} must be a plain name (no '/'): it names the run directory")
        elif any(ord(ch) < 32 or ord(ch) == 127 for ch in name):
            found.refuse("run.name", f"{name!r} contains a control character (a newline, tab...); use a plain "
                                     f"name: it names the run directory and appears in job names")
    if found.ok("data.json_keys") and not recipe.data.json_keys:
        found.refuse("data.json_keys", "give at least one JSON key holding the text, e.g. [text]")


def _check_model(found: _Findings) -> None:
    model, seq_length = found.recipe.model, found.recipe.data.seq_length
    if found.ok("model.hidden_size", "model.num_attention_heads") and model.hidden_size % model.num_attention_heads:
        found.refuse("model.hidden_size", f"{model.hidden_size} is not divisible by model.num_attention_heads="
                     f"{model.num_attention_heads}", also=("model.num_attention_heads",))
    if found.ok("model.recompute_gelu_layers", "model.num_layers") and model.recompute_gelu_layers > model.num_layers:
        found.refuse("model.recompute_gelu_layers", f"{model.recompute_gelu_layers} exceeds model.num_layers="
                     f"{model.num_layers}; use at most num_layers", also=("model.num_layers",))
    if found.ok("data.seq_length", "model.max_position_embeddings") and seq_length > model.max_position_embeddings:
        found.refuse("data.seq_length", f"{seq_length} exceeds model.max_position_embeddings="
                     f"{model.max_position_embeddings}", also=("model.max_position_embeddings",))


def recompute_problem(granularity: str | None, method: str | None, num_layers: int | None,
                      stage_layers: int | None) -> tuple[str, str] | None:
    """Megatron's rules for its recompute flags, as (the key to blame, one line with the fix), or None.
    stage_layers: the layers of each pipeline stage (virtual stage under interleaving), which
    recompute_num_layers counts in; None: not known (the layout was refused), not checked."""
    if granularity != "full":
        for key, val in (("model.recompute_method", method), ("model.recompute_num_layers", num_layers)):
            if val is not None and granularity == "selective":
                return key, (f"{val}: selective recompute (every layer's attention core) takes no {key}; leave "
                             f"it null, or use model.recompute_granularity: full")
            if val is not None:
                return key, f"{val} needs model.recompute_granularity: full (it is null); set that or leave {key} null"
        return None
    if method is None:
        return "model.recompute_method", "recompute_granularity full needs recompute_method: uniform or block"
    if num_layers is None:
        return "model.recompute_num_layers", ("recompute_granularity full needs recompute_num_layers (the group "
                                              "size for uniform, the layers recomputed per stage for block)")
    if stage_layers is not None and num_layers > stage_layers:
        return "model.recompute_num_layers", (f"{num_layers} exceeds the {stage_layers} layers of each pipeline "
                                              f"stage; use at most {stage_layers}")
    if stage_layers is not None and method == "uniform" and stage_layers % num_layers:
        divisors = [d for d in range(1, stage_layers + 1) if stage_layers % d == 0]
        return "model.recompute_num_layers", (f"{num_layers} does not divide the {stage_layers} layers of each "
                                              f"pipeline stage (recompute_method uniform recomputes them in groups "
                                              f"of this size); use one of {divisors}")
    return None


def _check_recompute(found: _Findings) -> None:
    """Megatron's recompute flags: a method and a count with full only, the count within a stage."""
    model, par = found.recipe.model, found.recipe.parallel
    keys = ("model.recompute_granularity", "model.recompute_method", "model.recompute_num_layers")
    if not found.ok(*keys):
        return
    stages = par.pipeline * (par.virtual_pipeline or 1)
    known = found.ok("model.num_layers", *_LAYOUT_KEYS) and model.num_layers % stages == 0
    problem = recompute_problem(model.recompute_granularity, model.recompute_method, model.recompute_num_layers,
                                model.num_layers // stages if known else None)
    if problem:
        # a count against the stage's layers: the layout keys may be what was just changed
        within = problem[0] == "model.recompute_num_layers" and model.recompute_num_layers is not None
        spans = ("model.num_layers", "parallel.pipeline", "parallel.virtual_pipeline") if within else ()
        found.refuse(problem[0], problem[1], also=keys[:1] + spans)


def _check_layout(found: _Findings) -> None:
    """The parallel layout: its sizes, then its fit to the model and the batch, then whether the train
    job can run it yet (said here, before anything is submitted)."""
    if not found.ok(*_LAYOUT_KEYS):
        return
    recipe, cluster = found.recipe, found.recipe.cluster
    per_node = "cluster.gpus_per_node" if cluster.gpus_per_node > 0 else "cluster.cpu_tasks_per_node"
    dims = recipe_dims(recipe)
    # the processes: nodes x ranks per node, each named with where it was set
    ranks = (f"ranks ({_described(found.where, 'cluster.nodes', cluster.nodes)} x "
             f"{_described(found.where, per_node, getattr(cluster, per_node.split('.')[1]))})")
    sizes = dims.problems(check_implemented=False, ranks=ranks)
    for key, text in sizes:
        # the rank count against tensor x pipeline: blamed on whichever of the four was set most directly
        spans = key == "cluster.nodes" and dims.world >= 1
        found.refuse(key, text, also=("parallel.tensor", "parallel.pipeline", per_node) if spans else (), named=spans)
    if sizes:
        return
    model = recipe.model
    fit = dims.model_problems(num_layers=model.num_layers, num_attention_heads=model.num_attention_heads,
                              ffn_hidden_size=model.ffn_hidden_size or 4 * model.hidden_size,
                              seq_length=recipe.data.seq_length)
    fit += dims.batch_problems(recipe.train.global_batch_size, recipe.train.micro_batch_size,
                               "GPUs" if cluster.gpus_per_node > 0 else "CPU ranks")
    for key, text in fit:
        if found.ok(*_FIT_READS[key]):
            spans = _FIT_SPANS[key] + ((per_node,) if key == "train.global_batch_size" else ())
            found.refuse(key, text, also=spans)
    for key, text in dims.problems():  # layouts the train job cannot run yet
        found.refuse(key, text)


def _check_schedule(found: _Findings) -> None:
    train = found.recipe.train
    if found.ok("train.train_iters", "train.train_samples") and (train.train_iters is None) == (train.train_samples is None):
        found.refuse("train.train_iters", "set exactly one of train.train_iters and train.train_samples")
    if found.ok("train.min_lr", "train.lr") and train.min_lr > train.lr:
        found.refuse("train.min_lr", f"{train.min_lr} is above train.lr={train.lr}; lower train.min_lr",
                     also=("train.lr",))
    if found.ok(*_SCHEDULE_KEYS) and (train.train_iters is None) != (train.train_samples is None):
        try:
            schedule_from_recipe(train, train.global_batch_size,
                                 train.train_samples or train.train_iters * train.global_batch_size)
        except ValueError as e:
            found.refuse("train.lr_warmup_iters", f"{e}; shorten the warmup (train.lr_warmup_iters or "
                         f"train.lr_warmup_fraction) or lengthen the decay (train.lr_decay_iters)")


def _check_data(found: _Findings) -> None:
    data = found.recipe.data
    if found.ok("data.split"):
        try:
            split = parse_split(data.split)
            if split[0] <= 0:
                found.refuse("data.split", f"the training share of {data.split!r} is zero")
        except ValueError as e:
            found.refuse("data.split", f"{e}")
    blend = data.data_path
    if found.ok("data.data_path") and blend and len(blend) > 1:
        try:
            parse_blend(blend)
        except ValueError as e:
            found.refuse("data.data_path", f"{e}")
    if found.ok("data.data_path", "data.inputs") and not blend and not data.inputs:
        found.refuse("data.inputs", "give JSONL inputs to preprocess (data.inputs) or existing datasets (data.data_path)")


def _check_cluster(found: _Findings) -> None:
    """Slurm's time strings and the signal lead; the container's image."""
    cluster, container = found.recipe.cluster, found.recipe.container
    if found.ok("cluster.executor") and cluster.executor == "slurm":
        for key in ("time", "preprocess_time", "convert_time"):
            if found.ok(f"cluster.{key}") and cluster.time_limit_minutes(getattr(cluster, key)) is None:
                found.refuse(f"cluster.{key}", f"{getattr(cluster, key)!r} is not a Slurm time (MM, HH:MM:SS or "
                             f"D-HH:MM:SS)")
        limit = cluster.time_limit_minutes()
        if found.ok("cluster.time", "cluster.signal_lead_s") and limit is not None and cluster.signal_lead_s >= limit * 60:
            found.refuse("cluster.signal_lead_s", f"{cluster.signal_lead_s} s is not shorter than cluster.time="
                         f"{cluster.time}; lower it or raise cluster.time", also=("cluster.time",))
    if found.ok("container.runtime", "container.image") and container.runtime != "none" and not container.image:
        found.refuse("container.image", f"container.runtime={container.runtime} needs an image")


def _check_convert(found: _Findings) -> None:
    if found.ok("convert.iterations"):
        its = str(found.recipe.convert.iterations).strip()
        if its not in ("last", "all") and not re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*,?\s*", its):
            found.refuse("convert.iterations", f"{its!r} must be last, all, or a comma list of iterations (100,200)")


_CHECKS = (_check_ranges, _check_choices, _check_names, _check_model, _check_layout, _check_recompute,
           _check_schedule, _check_data, _check_cluster, _check_convert)


def validate(recipe: Recipe, where=lambda k: k, failed: set[str] | frozenset = frozenset(),
             refused: set[str] | None = None) -> list[str]:
    """Range checks (the schema's `ranged` fields) and consistency checks that span fields.

    Returns one line per problem. ``failed`` holds keys (or whole sections) whose value was
    already refused while reading (type errors, typos): no check looks at them again, so one
    mistake is one line, never a cascade about the placeholder left in its place. ``refused`` (if
    given) receives those and every key refused here. A problem that spans several keys is blamed on
    the one set with the highest precedence (``--set``, then the recipe, then the profile: where
    ``where`` is a recipe_yaml.Where), naming the others' values."""
    found = _Findings(recipe, where, failed)
    for check in _CHECKS:
        check(found)
    if refused is not None:
        refused |= found.bad
    return found.lines
