"""Offline resharding: rewrite a Megatron-layout checkpoint for another tensor/pipeline layout.

Contract
  reshard_checkpoint(ckpt_dir, out_dir, tp, pp, iteration=None) -> out_dir
    Reads one iteration (default: the tracker's) of ckpt_dir, merges it (merge.load_full_checkpoint),
    re-pads the vocabulary for the new TP (Megatron: multiple of make_vocab_size_divisible_by x tp;
    rows of real tokens untouched, padding rows dropped or zero-filled), splits it by Megatron's rules
    (merge.py header: QKV / MLP-in by rows = whole head groups, attention-out / MLP-out by columns,
    row-parallel biases and LayerNorms replicated, vocabulary rows split; stage-local layer numbers;
    the tied head copy on the last stage when pp > 1) and writes a new checkpoint dir through
    hpcmeg.train.checkpoint.save_checkpoint (manifest, tracker) under the same iteration name.
    Kept: args (tp/pp/padded vocab/world size updated), iteration, consumed samples, LR scheduler,
    the hpcmeg recipe (its parallel section updated) and data state. Dropped: optimizer and RNG
    state (their layout is tied to the old sharding); the trainer resumes with fresh Adam moments.
  write_checkpoint_layout(save_dir, iteration, states, tp, pp): every shard of one checkpoint from
    one process (also used by import_hf); iteration "release" -> release/ + tracker "release".
  cli_reshard(args) -> exit code (`hpcmeg reshard CKPT_DIR OUT_DIR --tp N --pp M [--iteration N]`).
All output goes to a staging dir renamed to out_dir at the end; out_dir must not exist (or be empty).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Any

from hpcmeg.convert.hf_tokenizer import TokenizerError, vocab_size_of
from hpcmeg.convert.merge import (
    WORD_EMB, CheckpointReadError, FullCheckpoint, atomic_output_dir, load_full_checkpoint, pad_vocab_size,
    repad_vocab, split_full,
)
from hpcmeg.train.checkpoint import (
    RELEASE_DIRNAME, TRACKER_FILENAME, iter_dirname, make_checkpoint_dict, save_checkpoint, write_text_atomic,
)


class ReshardError(ValueError):
    """The requested layout does not fit the model (message says why and what would)."""


def write_checkpoint_layout(save_dir: str, iteration: int | str, states: dict[tuple[int, int], dict[str, Any]],
                            tp: int, pp: int) -> None:
    """Write all tp x pp shard dicts of one checkpoint from a single process with save_checkpoint.

    save_checkpoint is a per-rank collective; here one process plays every rank: the rank-0 call is
    asynchronous (so it commits only in wait(), after the other shards are on disk), the others are
    synchronous non-committing writers, and the barrier is a no-op."""
    it = 0 if iteration == RELEASE_DIRNAME else iteration
    noop = lambda: None  # noqa: E731 - one process, nothing to wait for
    first = save_checkpoint(save_dir, it, states[(0, 0)], tp_rank=0, pp_rank=0, tp_size=tp, pp_size=pp,
                            is_shard_writer=True, barrier=noop, is_global_rank0=True, async_save=True)
    if first.thread is not None:
        first.thread.join()  # one shard in flight at a time bounds host memory
    for (t, p), state in states.items():
        if (t, p) != (0, 0):
            save_checkpoint(save_dir, it, state, tp_rank=t, pp_rank=p, tp_size=tp, pp_size=pp,
                            is_shard_writer=True, barrier=noop, is_global_rank0=False)
    first.wait()
    if iteration == RELEASE_DIRNAME:
        # save_checkpoint names integer iterations only; a release is the same files under release/
        os.rename(os.path.join(save_dir, iter_dirname(0)), os.path.join(save_dir, RELEASE_DIRNAME))
        write_text_atomic(os.path.join(save_dir, TRACKER_FILENAME), f"{RELEASE_DIRNAME}\n")


def true_vocab_size(ck: FullCheckpoint) -> int | None:
    """The unpadded vocabulary: args.orig_vocab_size when it differs from the padded size, else the
    recipe's model.vocab_size, else the size of the tokenizer files the recipe names; None if unknown."""
    args = ck.args
    orig, padded = getattr(args, "orig_vocab_size", None), getattr(args, "padded_vocab_size", None)
    if orig is not None and orig != padded:
        return int(orig)
    recipe = ck.recipe or {}
    if (recipe.get("model") or {}).get("vocab_size"):
        return int(recipe["model"]["vocab_size"])
    if recipe.get("data") is not None:
        from hpcmeg.convert.hf import tokenizer_source

        try:
            return vocab_size_of(tokenizer_source(args, recipe, None))
        except TokenizerError:
            return None
    return int(orig) if orig is not None else None


def reshard_checkpoint(ckpt_dir: str, out_dir: str, tp: int, pp: int, iteration: int | str | None = None) -> str:
    """See the file header."""
    if tp < 1 or pp < 1:
        raise ReshardError(f"--tp {tp} --pp {pp}: sizes must be >= 1")
    ck = load_full_checkpoint(ckpt_dir, iteration)
    a = ck.args
    if a.num_attention_heads % tp:
        raise ReshardError(f"num_attention_heads={a.num_attention_heads} is not divisible by --tp {tp}")
    if a.num_layers % pp:
        raise ReshardError(f"num_layers={a.num_layers} is not divisible by --pp {pp}")
    rows = ck.full[WORD_EMB].shape[0]
    orig = true_vocab_size(ck) or rows
    div = getattr(a, "make_vocab_size_divisible_by", None) or 128
    padded = pad_vocab_size(orig, div, tp)
    full = repad_vocab(ck.full, orig, padded)

    args = argparse.Namespace(**vars(a))
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
    args.padded_vocab_size, args.orig_vocab_size = padded, orig
    dp = getattr(a, "data_parallel_size", None) or 1
    args.world_size = tp * pp * dp
    hp = dict(ck.base.get("hpcmeg") or {})
    recipe = copy.deepcopy(hp.get("recipe"))
    if isinstance(recipe, dict):
        recipe.setdefault("parallel", {}).update(tensor=tp, pipeline=pp)
    extra = {"previous": hp.get("extra"),
             "resharded_from": {"checkpoint_dir": os.path.abspath(ckpt_dir), "iteration": ck.iteration,
                                "tp": ck.tp, "pp": ck.pp, "padded_vocab_size": rows}}
    kept = {k: v for k, v in ck.base.items()
            if k not in ("args", "checkpoint_version", "iteration", "model", "optimizer", "opt_param_scheduler",
                         "rng_state", "hpcmeg")}
    iteration_value = 0 if ck.iteration == RELEASE_DIRNAME else int(ck.base.get("iteration", ck.iteration))
    states = {}
    for key, model in split_full(full, tp, pp, a.num_layers, a.num_attention_heads).items():
        st = make_checkpoint_dict(args=args, iteration=iteration_value, model=model, optimizer=None,
                                  opt_param_scheduler=ck.base.get("opt_param_scheduler"), rng_state=None,
                                  recipe=recipe, data_state=hp.get("data_state"), extra=extra)
        st.update(kept)
        states[key] = st
    with atomic_output_dir(out_dir) as stage:
        write_checkpoint_layout(stage, ck.iteration, states, tp, pp)
    return os.path.abspath(out_dir)


def cli_reshard(args: argparse.Namespace) -> int:
    try:
        out = reshard_checkpoint(args.ckpt_dir, args.out_dir, args.tp, args.pp, args.iteration)
    except (CheckpointReadError, ReshardError, FileExistsError) as e:
        print(f"hpcmeg reshard: {e}", file=sys.stderr)
        return 1
    print(f"hpcmeg reshard: wrote {out} (tp={args.tp}, pp={args.pp})")
    return 0
