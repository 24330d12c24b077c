"""What a recipe means for the job that runs it: the derived values, computed in exactly one place.

Owns ``derive`` (recipe -> ``Derived``: the process count and data-parallel size, gradient
accumulation, the padded vocabulary, the run's sample and iteration counts, its paths), ``data_plan``
(recipe + Derived -> ``DataPlan``: everything training reads its data with, so hpcmeg/train/data.py
never reads the recipe), the recipe's parallel layout as a ParallelDims (``recipe_dims``), the run's
paths alone (``run_paths``, for checks that must run on a recipe with other problems), and the
parsing of ``data.split`` and ``data.data_path``.

``derive`` reads the tokenizer files (to count the vocabulary) unless model.vocab_size is set, so a
training start calls it once, for the processes actually running (``world_size``), and passes the
result down. Torch-free; reads no process environment.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from hpcmeg.megatron.layout import pad_vocab_size
from hpcmeg.megatron.parallel_dims import ParallelDims
from hpcmeg.recipe_schema import DataConfig, Recipe
from hpcmeg.recipe_yaml import RecipeError

GPT2_VOCAB_SIZE = 50257


def parse_split(split: str) -> list[float]:
    """'949,50,1' (any separators) -> normalized [0.949, 0.05, 0.001] (padded with zeros to 3)."""
    nums = [float(x) for x in re.findall(r"[.0-9]+", str(split))]
    if not nums or len(nums) > 3:
        raise ValueError(f"{split!r} must be up to three numbers like 949,50,1")
    nums += [0.0] * (3 - len(nums))
    total = sum(nums)
    if total <= 0:
        raise ValueError(f"{split!r} sums to zero")
    return [x / total for x in nums]


def parse_blend(items: list) -> list[tuple[float, str]]:
    """Megatron --data-path: [prefix] or [w1, prefix1, w2, prefix2, ...] -> [(w, prefix)]."""
    if len(items) == 1:
        return [(1.0, str(items[0]))]
    if len(items) % 2:
        raise ValueError("a weighted blend is a list of weight, prefix pairs: [0.3, a, 0.7, b]")
    out = []
    for weight, prefix in zip(items[0::2], items[1::2]):
        try:
            value = float(weight)
        except (TypeError, ValueError):
            raise ValueError(f"weight {weight!r} before {prefix!r} is not a number") from None
        if value < 0:
            raise ValueError(f"weight {weight!r} is negative")
        out.append((value, str(prefix)))
    if sum(w for w, _ in out) <= 0:
        raise ValueError("blend weights sum to zero")
    return out


@dataclass(frozen=True)
class Derived:
    """Values computed from the recipe in exactly one place (shown by ``submit --dry-run``): for the
    recipe's planned cluster, or (``derive(..., world_size=N)``) for the N processes running."""

    world_size: int
    data_parallel_size: int
    grad_accum_steps: int
    orig_vocab_size: int
    padded_vocab_size: int
    ffn_hidden_size: int
    train_samples: int
    train_iters: int
    tokens_per_iteration: int
    run_dir: str
    data_prefix: str
    checkpoint_dir: str


@dataclass(frozen=True)
class DataPlan:
    """Everything training reads its data with, derived from the recipe once (``data_plan``)."""

    blend: tuple[tuple[float, str], ...]
    """(weight, dataset prefix) pairs: data.data_path, else what the preprocess stage writes."""
    from_data_path: bool
    """Whether the blend is data.data_path (else the preprocess stage's output): errors name it."""
    split: str
    seq_length: int
    seed: int
    """train.seed: the dataset index shuffles and the data loaders' generators start from it."""
    cache_dir: str
    """data.index_cache_dir, else <run dir>/index-cache."""
    samples: tuple[int, int, int]
    """(train, valid, test) sample counts; they key the index cache, so ``hpcmeg prepare-cache`` and
    training, both taking them from here, always agree."""
    vocab_size: int
    """The unpadded vocabulary the model is built with: every token id must be below it."""
    vocab_set: bool
    """model.vocab_size gave vocab_size (else the tokenizer files)."""
    tokenizer: str
    """The tokenizer files the data should come from, for error lines."""


def vocab_size_from_files(data: DataConfig) -> int:
    """Unpadded vocabulary size: entries of vocab.json (the embedded GPT-2 file has 50,257)."""
    if data.vocab_file:
        try:
            with open(data.vocab_file, encoding="utf-8") as f:
                vocab = json.load(f)
            if not isinstance(vocab, dict) or not vocab:
                raise ValueError(f"a JSON {type(vocab).__name__}, not a token -> id mapping")
            return len(vocab)
        except (OSError, ValueError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise RecipeError([f"data.vocab_file: cannot read {data.vocab_file!r} as a vocabulary ({why}); point "
                               f"it at a GPT-2 style vocab.json, or null for the embedded GPT-2 one"]) from None
    if data.tokenizer_model:
        tj = Path(data.tokenizer_model) / "tokenizer.json"
        try:
            with open(tj, encoding="utf-8") as f:
                tok = json.load(f)
            return len(tok["model"]["vocab"]) + sum(1 for a in tok.get("added_tokens", []) if a["content"] not in tok["model"]["vocab"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
            raise RecipeError([f"data.tokenizer_model: cannot read {str(tj)!r} ({why}); point data.tokenizer_model "
                               f"at a Hugging Face tokenizer directory"]) from None
    return GPT2_VOCAB_SIZE


def recipe_dims(recipe: Recipe, world_size: int | None = None) -> ParallelDims:
    """The recipe's parallel layout as a ParallelDims (torch-free), for the planned cluster or for
    `world_size` processes actually running."""
    par = recipe.parallel
    return ParallelDims(world=recipe.cluster.world_size() if world_size is None else world_size, tp=par.tensor,
                        pp=par.pipeline, vpp=par.virtual_pipeline or 1, sequence_parallel=par.sequence_parallel,
                        distributed_optimizer=par.distributed_optimizer)


class RunPaths(NamedTuple):
    run_dir: str
    data_prefix: str
    checkpoint_dir: str


def run_paths(recipe: Recipe) -> RunPaths:
    """The run directory, the dataset prefix and the checkpoint directory (part of ``derive``; these
    need no layout or vocabulary, so the checks of a recipe with other problems can still use them)."""
    run_dir = str(Path(recipe.run.output_root) / recipe.run.name)
    prefix = recipe.data.output_prefix or str(Path(run_dir) / "data" / recipe.run.name)
    return RunPaths(run_dir, prefix, recipe.checkpoint.dir or str(Path(run_dir) / "checkpoints"))


def derive(recipe: Recipe, orig_vocab_size: int | None = None, *, world_size: int | None = None) -> Derived:
    """The derived values for the recipe's planned cluster, or for ``world_size`` processes running
    (data parallelism and gradient accumulation follow them; the global batch is kept). Reads the
    tokenizer files unless model.vocab_size or ``orig_vocab_size`` gives the vocabulary."""
    dims = recipe_dims(recipe, world_size)
    train = recipe.train
    accum = train.global_batch_size // (train.micro_batch_size * dims.dp)  # validate() made sure it divides
    orig = orig_vocab_size if orig_vocab_size is not None else (recipe.model.vocab_size
                                                                or vocab_size_from_files(recipe.data))
    samples = train.train_samples if train.train_samples is not None else train.train_iters * train.global_batch_size
    iters = train.train_iters if train.train_iters is not None else -(-samples // train.global_batch_size)
    run_dir, prefix, checkpoint_dir = run_paths(recipe)
    return Derived(
        world_size=dims.world, data_parallel_size=dims.dp, grad_accum_steps=accum, orig_vocab_size=orig,
        padded_vocab_size=pad_vocab_size(orig, recipe.model.make_vocab_size_divisible_by, recipe.parallel.tensor),
        ffn_hidden_size=recipe.model.ffn_hidden_size or 4 * recipe.model.hidden_size,
        train_samples=samples, train_iters=iters,
        tokens_per_iteration=train.global_batch_size * recipe.data.seq_length,
        run_dir=run_dir, data_prefix=prefix, checkpoint_dir=checkpoint_dir,
    )


def dataset_blend(data: DataConfig, data_prefix: str) -> list[tuple[float, str]]:
    """The (weight, prefix) list training reads: data.data_path, else what preprocessing writes under
    ``data_prefix`` (Derived.data_prefix / RunPaths.data_prefix)."""
    if data.data_path:
        return parse_blend(data.data_path)
    level = "sentence" if data.split_sentences else "document"
    return [(1.0, f"{data_prefix}_{data.json_keys[0]}_{level}")]


def data_plan(recipe: Recipe, derived: Derived) -> DataPlan:
    """What training reads (no file is opened here). The sample counts: train = derived.train_samples
    (Megatron). valid = eval_iters x global batch: hpcmeg evaluates on the SAME first eval_iters global
    batches of the validation split every time (Megatron walks on through fresh validation samples at
    each evaluation), so validation curves are smooth and comparable across runs and frameworks.
    test = eval_iters x global batch (Megatron)."""
    data, train = recipe.data, recipe.train
    per_eval = train.eval_iters * train.global_batch_size
    valid = per_eval if train.eval_interval and train.eval_iters else 0
    return DataPlan(
        blend=tuple(dataset_blend(data, derived.data_prefix)), from_data_path=bool(data.data_path),
        split=data.split, seq_length=data.seq_length, seed=train.seed,
        cache_dir=data.index_cache_dir or os.path.join(derived.run_dir, "index-cache"),
        samples=(derived.train_samples, valid, per_eval), vocab_size=derived.orig_vocab_size,
        vocab_set=recipe.model.vocab_size is not None,
        tokenizer=data.tokenizer_model or data.vocab_file or "the embedded GPT-2 vocabulary")
