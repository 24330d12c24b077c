"""Merge the TP x PP shards of a Megatron-layout checkpoint into one full-model state dict, and split
one back into any (tp, pp) layout. Shared by `hpcmeg convert`, `hpcmeg reshard` and `hpcmeg import-hf`
(their output directories: hpcmeg/convert/output_dir.py).

Contract
  "full" state dict = hpcmeg's flat Megatron legacy names (see hpcmeg/model/gpt.py) with GLOBAL layer
  numbers, no tied-head copy, word embeddings padded to some multiple (rows beyond the true vocabulary
  are padding). A "stage" dict is the flat dict of one pipeline stage with stage-local layer numbers,
  as `ckpt_layout.from_megatron_model` returns it.

Tensor-parallel rules (interop doc §5.1, §6.3, §6.5), per key of one stage:
  split by rows (dim 0), contiguous chunks, rank r holds chunk r:
    embedding.word_embeddings.weight, word_embeddings_for_head.weight   vocabulary rows
    self_attention.query_key_value.weight / .bias   rows are per-head [q, k, v] (checkpoint_version 3),
        so a contiguous chunk of rows is exactly a group of whole heads
    mlp.dense_h_to_4h.weight / .bias                column-parallel: output features
  split by columns (dim 1):
    self_attention.dense.weight, mlp.dense_4h_to_h.weight   row-parallel: input features
  replicated (every rank holds the same tensor):
    LayerNorms, position embeddings, the biases of the row-parallel layers (added after the all-reduce)
Pipeline rules (§5.3) are hpcmeg.megatron.layout's stage_state_from_full / full_state_from_stages. A
virtual-pipeline checkpoint ("model0" .. "model{V-1}" per shard, the interleaved schedule's chunks) is
read as pp * V stages: chunk v of pipeline rank p is virtual stage v * pp + p, a contiguous run of layers
(Megatron's interleaved map), numbered from 0 inside its chunk; split_full writes the same.

The vocabulary must split evenly, so its padded size depends on TP (Megatron pads to a multiple of
make_vocab_size_divisible_by x tp). `repad_vocab` moves between paddings: rows past the true
vocabulary are dropped or zero rows appended; rows of real tokens are never touched, so
1 -> 2x2 -> 1 is an exact round trip.
"""
from __future__ import annotations

import argparse
import json
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch

# hpcmeg.convert.hf and import_hf still import the output-directory helpers from here
from hpcmeg.convert.output_dir import OutputDirError, atomic_output_dir, check_output_dir  # noqa: F401
from hpcmeg.checkpoint.shard_set import ShardInfo, ShardMismatchError, check_shard_set
from hpcmeg.checkpoint.store import CheckpointWarning, load_checkpoint
from hpcmeg.megatron.args import checkpoint_models
from hpcmeg.megatron.layout import (HEAD_KEY, WORD_EMB, from_megatron_model, full_state_from_stages,
                                    stage_state_from_full, to_megatron_model, tp_split_dim)
from hpcmeg.megatron.names import (MANIFEST_FILENAME, RELEASE_DIRNAME, TRACKER_FILENAME, checkpoint_path,
                                   committed_iterations, iter_dirname,
                                   parse_iter_dirname, parse_shard_dirname, read_tracker)

def merge_tp(shards: list[dict[str, torch.Tensor]], where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """TP shards of one stage (in tp-rank order) -> that stage's unsharded flat dict."""
    keys = list(shards[0])
    for r, s in enumerate(shards[1:], 1):
        if set(s) != set(keys):
            diff = sorted(set(s) ^ set(keys))[:3]
            raise ValueError(f"{where}: tensor-parallel rank {r} has different keys than rank 0 (e.g. {diff})")
    out = {}
    for k in keys:
        dim = tp_split_dim(k)
        if dim is None or len(shards) == 1:
            out[k] = shards[0][k]
        else:
            out[k] = torch.cat([s[k] for s in shards], dim=dim)
    return out


def split_tp(stage: dict[str, torch.Tensor], tp: int, num_attention_heads: int) -> list[dict[str, torch.Tensor]]:
    """One stage's unsharded flat dict -> `tp` shards (contiguous chunks; clones, so each shard
    serializes only its own part). Checks heads and every split dimension divide evenly."""
    if num_attention_heads % tp:
        raise ValueError(f"num_attention_heads={num_attention_heads} is not divisible by tp={tp}")
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for k, v in stage.items():
        dim = tp_split_dim(k)
        if dim is None:
            for s in shards:
                s[k] = v
            continue
        if v.shape[dim] % tp:
            raise ValueError(f"{k}: dimension {dim} of size {v.shape[dim]} does not split into tp={tp} parts"
                             + (" (re-pad the vocabulary with repad_vocab first)" if k in (WORD_EMB, HEAD_KEY) else ""))
        for s, chunk in zip(shards, torch.chunk(v, tp, dim=dim)):
            s[k] = chunk.clone()
    return shards


def repad_vocab(full: dict[str, torch.Tensor], orig_vocab_size: int, padded_vocab_size: int) -> dict[str, torch.Tensor]:
    """Change the padded row count of the word embeddings to `padded_vocab_size` (>= orig_vocab_size):
    extra rows are dropped, missing ones appended as zeros. Real-token rows are untouched."""
    w = full[WORD_EMB]
    if padded_vocab_size < orig_vocab_size:
        raise ValueError(f"padded vocabulary {padded_vocab_size} < true vocabulary {orig_vocab_size}")
    if w.shape[0] < orig_vocab_size:
        raise ValueError(f"{WORD_EMB} has {w.shape[0]} rows but the vocabulary has {orig_vocab_size} tokens")
    if w.shape[0] == padded_vocab_size:
        return full
    if w.shape[0] > padded_vocab_size:
        new = w[:padded_vocab_size].clone()
    else:
        new = torch.cat([w, w.new_zeros(padded_vocab_size - w.shape[0], w.shape[1])])
    return {**full, WORD_EMB: new}


def merge_shards(shards: dict[tuple[int, int], dict[str, Any]], tp: int, pp: int, num_layers: int,
                 where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """{(tp_rank, pp_rank): nested Megatron `model` dict} -> full flat state dict (global layers).

    With PP > 1 the last stage's tied head copy must equal the first stage's embedding (Megatron
    keeps them in sync by all-reducing their gradients); a mismatch means the shards are from
    different saves and is an error."""
    missing = [(t, p) for p in range(pp) for t in range(tp) if (t, p) not in shards]
    if missing:
        raise ValueError(f"{where}: missing shard(s) (tp, pp) = {missing}")
    stages = []
    for p in range(pp):
        stage = merge_tp([from_megatron_model(shards[(t, p)]) for t in range(tp)], f"{where} stage {p}")
        stages.append(stage)
    if pp > 1:
        head = stages[-1].get(HEAD_KEY)
        emb = stages[0].get(WORD_EMB)
        if head is not None and emb is not None and not torch.equal(head, emb):
            raise ValueError(f"{where}: the last stage's word_embeddings_for_head differs from the first stage's "
                             f"word_embeddings (shards from different saves?)")
    full = full_state_from_stages(stages, num_layers)
    _check_full(full, num_layers, where)
    return full


def _check_full(full: dict[str, torch.Tensor], num_layers: int, where: str) -> None:
    needed = [WORD_EMB, "embedding.position_embeddings.weight", "encoder.final_layernorm.weight"]
    needed += [f"encoder.layers.{num_layers - 1}.mlp.dense_4h_to_h.weight", "encoder.layers.0.input_layernorm.weight"]
    absent = [k for k in needed if k not in full]
    if absent:
        raise ValueError(f"{where}: merged model lacks {absent} (wrong num_layers in args, or shards missing)")


def split_full(full: dict[str, torch.Tensor], tp: int, pp: int, num_layers: int,
               num_attention_heads: int, vpp: int = 1) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """Full flat dict (vocab already padded for `tp`) -> {(tp_rank, pp_rank): [nested Megatron model of
    each virtual-pipeline chunk]} (one chunk at vpp 1). Chunk v of pipeline rank p is virtual stage
    v * pp + p of pp * vpp contiguous runs of layers (Megatron's interleaved map), numbered from 0."""
    stages = pp * vpp
    out: dict[tuple[int, int], list[dict[str, Any]]] = {(t, p): [] for p in range(pp) for t in range(tp)}
    for v in range(vpp):
        for p in range(pp):
            s = v * pp + p
            stage = stage_state_from_full(full, s, stages, num_layers)
            for t, shard in enumerate(split_tp(stage, tp, num_attention_heads)):
                out[(t, p)].append(to_megatron_model(shard, is_last_stage=s == stages - 1, pp_size=stages))
    return out


def virtual_stages(shards: dict[tuple[int, int], list[Any]], pp: int) -> dict[tuple[int, int], Any]:
    """{(tp, pp rank): [chunk 0, chunk 1, ...]} -> {(tp, virtual stage v * pp + p): chunk v}."""
    return {(t, v * pp + p): chunk for (t, p), chunks in shards.items() for v, chunk in enumerate(chunks)}


# ------------------------------------------------------------------------ reading a whole checkpoint

class CheckpointReadError(RuntimeError):
    """A checkpoint cannot be merged: missing/corrupt shard, unknown iteration (message names the file)."""


@dataclass
class FullCheckpoint:
    """A checkpoint merged into one model: `full` (global layers, padded vocab as saved), the `args`
    Namespace and the rest of shard (0, 0)'s dict (`base`: iteration, scheduler, hpcmeg recipe...)."""
    full: dict[str, torch.Tensor]
    args: argparse.Namespace
    base: dict[str, Any]
    iteration: int | str
    tp: int
    pp: int
    iter_dir: str
    shard_models: dict[tuple[int, int], list[dict[str, Any]]] | None = None  # with keep_shards=True: per chunk
    shard_optimizers: dict[tuple[int, int], Any] | None = None              # with keep_shards=True
    shard_rng: dict[tuple[int, int], Any] | None = None                     # with keep_shards=True: rng_state
    vpp: int = 1
    """Model chunks per pipeline rank ("model0", "model1", ... of the interleaved schedule)."""

    @property
    def recipe(self) -> dict[str, Any] | None:
        return (self.base.get("hpcmeg") or {}).get("recipe")


def _tracker(ckpt_dir: str) -> int | str | None:
    try:
        return read_tracker(ckpt_dir)
    except ValueError as e:  # garbage in the tracker file: the message names it and the fix
        raise CheckpointReadError(str(e)) from None
    except OSError as e:
        raise CheckpointReadError(f"{os.path.join(ckpt_dir, TRACKER_FILENAME)}: cannot read it ({e.strerror})") from None


def readable_iterations(ckpt_dir: str) -> list[int | str]:
    """Iterations a reader may use: 'release' when that dir exists, then the committed iterations
    (hpcmeg/megatron/names.committed_iterations: dirs up to the tracker's; newer ones are uncommitted
    saves), or every iteration dir under a 'release' tracker. Ascending, release first. Unlike the
    resume's list, a missing directory or an unreadable tracker is an error naming the fix."""
    if not os.path.isdir(ckpt_dir):
        what = "is not a directory" if os.path.exists(ckpt_dir) else "does not exist"
        raise CheckpointReadError(f"{ckpt_dir}: checkpoint directory {what}; give the directory that holds "
                                  f"{TRACKER_FILENAME}")
    tracker = _tracker(ckpt_dir)
    if isinstance(tracker, int):
        found: list[int] = committed_iterations(ckpt_dir)
    else:
        found = sorted(i for i in map(parse_iter_dirname, os.listdir(ckpt_dir)) if i is not None)
    out: list[int | str] = [RELEASE_DIRNAME] if os.path.isdir(os.path.join(ckpt_dir, RELEASE_DIRNAME)) else []
    return out + found


def resolve_iteration(ckpt_dir: str, iteration: int | str | None) -> int | str:
    """The iteration to read: the given one (must exist) or the tracker's."""
    available = readable_iterations(ckpt_dir)
    if iteration is None:
        iteration = _tracker(ckpt_dir)
        if iteration is None:
            raise CheckpointReadError(f"{ckpt_dir}: no {TRACKER_FILENAME} (no checkpoint was committed); "
                                      f"pass --iteration N (found: {available or 'none'})")
    if iteration != RELEASE_DIRNAME and (not isinstance(iteration, int) or iteration < 0):
        raise CheckpointReadError(f"--iteration {iteration}: an iteration is a number >= 0 (available: "
                                  f"{available or 'none'})")
    if not os.path.isdir(os.path.join(ckpt_dir, iter_dirname(iteration))):
        raise CheckpointReadError(f"{os.path.join(ckpt_dir, iter_dirname(iteration))}: iteration {iteration} does not "
                                  f"exist in {ckpt_dir} (available: {available or 'none'})")
    return iteration


def _layout_of(iter_dir: str) -> tuple[int, int]:
    """(tp, pp) of an iteration dir: from hpcmeg's manifest, else from the mp_rank_* dir names."""
    mpath = os.path.join(iter_dir, MANIFEST_FILENAME)
    if os.path.isfile(mpath):
        try:
            with open(mpath) as f:
                m = json.load(f)
            return int(m["tp_size"]), int(m["pp_size"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointReadError(f"{mpath}: unreadable manifest ({e})") from None
    tps, pps = set(), set()
    for e in os.listdir(iter_dir):
        m = parse_shard_dirname(e)
        if m:
            tps.add(m[0])
            pps.add(m[1] or 0)
    if not tps:
        raise CheckpointReadError(f"{iter_dir}: no mp_rank_* shard directories (not a Megatron torch-format "
                                  f"checkpoint; torch_dist checkpoints need Megatron's converter first)")
    return max(tps) + 1, max(pps) + 1


def load_full_checkpoint(ckpt_dir: str, iteration: int | str | None = None,
                         keep_shards: bool = False) -> FullCheckpoint:
    """Load every shard of one iteration (verified against hpcmeg's manifest when present) and merge.

    Peak memory: one shard's whole dict (optimizer included) plus the model weights merged so far;
    other shards' optimizer state is dropped as soon as each shard is read, unless keep_shards
    (then every shard's nested model, optimizer and rng_state entries are kept, for resharding them).
    Shards that do not come from one save are refused (hpcmeg/checkpoint/shard_set.py's rules)."""
    iteration = resolve_iteration(ckpt_dir, iteration)
    iter_dir = os.path.join(ckpt_dir, iter_dirname(iteration))
    tp, pp = _layout_of(iter_dir)
    shards = _read_shards(ckpt_dir, iteration, tp, pp, keep_shards)
    args = _model_args(shards.base, checkpoint_path(ckpt_dir, iteration, 0, 0, pp), iter_dir, tp, pp)
    vpp = len(shards.models[(0, 0)])
    try:
        check_shard_set(shards.infos, tp, pp, iteration)
    except ShardMismatchError as e:
        raise CheckpointReadError(str(e)) from None
    try:
        full = merge_shards(virtual_stages(shards.models, pp), tp, pp * vpp, args.num_layers, where=iter_dir)
    except ValueError as e:
        raise CheckpointReadError(str(e)) from None
    except KeyError as e:  # a foreign or damaged model dict
        text = str(e.args[0]) if e.args else ""
        raise CheckpointReadError(f"{iter_dir}: {text}" if " " in text else f"{iter_dir}: the model lacks {text!r}; "
                                  f"not a legacy Megatron GPT checkpoint") from None
    return FullCheckpoint(full=full, args=args, base=shards.base, iteration=iteration, tp=tp, pp=pp, iter_dir=iter_dir,
                          shard_models=shards.models if keep_shards else None,
                          shard_optimizers=shards.optimizers if keep_shards else None,
                          shard_rng=shards.rngs if keep_shards else None, vpp=vpp)


@dataclass
class _Shards:
    """What `_read_shards` keeps of every (tp, pp) shard; `base` is shard (0, 0)'s dict without its model."""
    models: dict[tuple[int, int], list[dict[str, Any]]]
    infos: dict[tuple[int, int], ShardInfo]
    optimizers: dict[tuple[int, int], Any]
    rngs: dict[tuple[int, int], Any]
    base: dict[str, Any]


def _read_shards(ckpt_dir: str, iteration: int | str, tp: int, pp: int, keep_shards: bool) -> _Shards:
    """Every shard's model chunks and ShardInfo, one shard in memory at a time; optimizer and RNG state
    only with keep_shards."""
    shards = _Shards(models={}, infos={}, optimizers={}, rngs={}, base={})
    for p in range(pp):
        for t in range(tp):
            path = checkpoint_path(ckpt_dir, iteration, t, p, pp)
            state = _load_shard(ckpt_dir, iteration, t, p, tp, pp)
            try:
                chunks = checkpoint_models(state)
            except KeyError:
                raise CheckpointReadError(f"{path}: no 'model' entry (nor 'model0', 'model1', ... of a virtual "
                                          f"pipeline): not a Megatron GPT checkpoint") from None
            if not all(isinstance(c, dict) for c in chunks):
                raise CheckpointReadError(f"{path}: its model entry is not a dict of tensors")
            if shards.models and len(chunks) != len(shards.models[(0, 0)]):
                raise CheckpointReadError(f"{path}: holds {len(chunks)} model chunk(s) where shard (0, 0) holds "
                                          f"{len(shards.models[(0, 0)])}")
            shards.models[(t, p)] = chunks
            try:
                shards.infos[(t, p)] = ShardInfo.of(path, state, [from_megatron_model(c) for c in chunks])
            except KeyError as e:  # a foreign or damaged model dict: the message says what it lacks
                raise CheckpointReadError(f"{path}: {e.args[0] if e.args else e}") from None
            for k in [k for k in state if k == "model" or (k.startswith("model") and k[5:].isdigit())]:
                del state[k]
            if keep_shards:
                shards.optimizers[(t, p)] = state.get("optimizer")
                shards.rngs[(t, p)] = state.get("rng_state")
            if (t, p) == (0, 0):
                shards.base = state
    return shards


def _load_shard(ckpt_dir: str, iteration: int | str, t: int, p: int, tp: int, pp: int) -> dict[str, Any]:
    """The whole dict of shard (t, p); CheckpointReadError naming the file where it cannot be read."""
    with warnings.catch_warnings():
        # a foreign (non-hpcmeg) checkpoint has no manifest: loading it unverified is expected here
        warnings.simplefilter("ignore", CheckpointWarning)
        try:
            got = load_checkpoint(ckpt_dir, tp_rank=t, pp_rank=p, tp_size=tp, pp_size=pp, iteration=iteration)
        except (RuntimeError, ValueError) as e:
            raise CheckpointReadError(str(e).replace("requested checkpoint unusable: ", "")) from None
    if got is None:
        raise CheckpointReadError(f"{checkpoint_path(ckpt_dir, iteration, t, p, pp)}: cannot be read")
    return got[1]


def _model_args(base: dict[str, Any], first_shard: str, iter_dir: str, tp: int, pp: int) -> argparse.Namespace:
    """Shard (0, 0)'s args, with the model sizes hpcmeg needs and the layout the shards have."""
    args = base.get("args")
    if not isinstance(args, argparse.Namespace):
        raise CheckpointReadError(f"{first_shard}: no 'args' entry; hpcmeg needs the model sizes from it")
    absent = [k for k in ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings")
              if not isinstance(getattr(args, k, None), int)]
    if absent:
        raise CheckpointReadError(f"{first_shard}: its args lack {', '.join(absent)}; not a Megatron GPT checkpoint "
                                  f"hpcmeg can read")
    a_tp = getattr(args, "tensor_model_parallel_size", tp)
    a_pp = getattr(args, "pipeline_model_parallel_size", pp)
    if (a_tp, a_pp) != (tp, pp):
        raise CheckpointReadError(f"{iter_dir}: holds tp={tp} x pp={pp} shards but its args say tp={a_tp} pp={a_pp}")
    return args
