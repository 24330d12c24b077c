"""What each stage runs, in recipe terms, for either executor (Slurm's step scripts, the local chain).

Contract: ``hpcmeg_argv(python, stage, *args)`` is the command line of one stage and
``container_spec(recipe)`` the container it runs in; ``preprocess_flags(recipe)``
its preprocess flags (Megatron's preprocess_data.py names); ``shard_groups(files, shards)`` and
``shard_prefixes(data_prefix, n)`` the preprocess tasks' inputs and outputs (one task writes the dataset
itself; several write shards that the merge stage joins in order); ``dataset_outputs(prefix, recipe)``
the dataset files a prefix stands for (one per JSON key); ``tokenizer_settings(recipe)`` the recipe
values that change the tokenized output (part of the dataset's manifest, so a change reprocesses).
"""
from __future__ import annotations

from pathlib import Path

from hpcmeg.launch.container import ContainerSpec


def container_spec(recipe) -> ContainerSpec:
    """The recipe's container section as hpcmeg.launch.container takes it."""
    container = recipe.container
    return ContainerSpec(runtime=container.runtime, image=container.image, binds=tuple(container.binds),
                         python=container.python)


def hpcmeg_argv(python: list[str], stage: str, *args: str) -> list[str]:
    """``python -m hpcmeg.cli <stage> args``: no dependency on a console script being on PATH."""
    return [*python, "-u", "-m", "hpcmeg.cli", stage, *args]


def preprocess_flags(recipe) -> list[str]:
    """Recipe data settings as ``hpcmeg preprocess`` (= Megatron preprocess_data.py) flags."""
    data = recipe.data
    out = ["--json-keys", *data.json_keys, "--tokenizer-type", data.tokenizer_type, "--workers", str(data.workers)]
    if data.vocab_file:
        out += ["--vocab-file", data.vocab_file]
    if data.merge_file:
        out += ["--merge-file", data.merge_file]
    if data.tokenizer_model:
        out += ["--tokenizer-model", data.tokenizer_model]
    if data.append_eod:
        out.append("--append-eod")
    if data.split_sentences:
        out.append("--split-sentences")
    return out


def tokenizer_settings(recipe) -> dict:
    """The recipe values that change the tokenized output (part of the dataset manifest)."""
    data = recipe.data
    return {"tokenizer_type": data.tokenizer_type, "vocab_file": data.vocab_file, "merge_file": data.merge_file,
            "tokenizer_model": data.tokenizer_model, "append_eod": data.append_eod,
            "split_sentences": data.split_sentences, "json_keys": list(data.json_keys)}


def shard_groups(files: list[str], shards: int) -> list[list[str]]:
    """Contiguous groups of input files, one per array task (merging them in order keeps the order)."""
    n = len(files) if shards <= 0 else max(1, min(shards, len(files)))
    base, extra = divmod(len(files), n)
    out, i = [], 0
    for k in range(n):
        size = base + (1 if k < extra else 0)
        out.append(files[i:i + size])
        i += size
    return out


def shard_prefixes(data_prefix: str, n: int) -> list[str]:
    """Output prefixes of ``n`` preprocess tasks: the dataset's own for one, else one shard each under
    ``shards/`` beside it (the merge stage joins them into the dataset)."""
    if n == 1:
        return [data_prefix]
    shard_dir = Path(data_prefix).parent / "shards"
    return [str(shard_dir / f"{Path(data_prefix).name}.shard{i:05d}") for i in range(n)]


def dataset_outputs(prefix: str, recipe) -> list[str]:
    level = "sentence" if recipe.data.split_sentences else "document"
    return [f"{prefix}_{k}_{level}" for k in recipe.data.json_keys]
