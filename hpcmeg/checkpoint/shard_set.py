"""What must agree across the shard files of one checkpoint iteration: the one place every reader checks it.

A Megatron-layout checkpoint is tp x pp shard files written by different ranks, and nothing in the
format ties them together: a shard copied in from another run (same architecture), or from another
iteration of the same run, loads as well as the right one and gives a mixed model. These rules
refuse such a set in one line naming the shard file, what disagrees, and the fix.

What agrees across the shards of one save (and what each reader can afford to check):
  iteration      every shard's state["iteration"] is its directory's (iter_XXXXXXX), and shard (0, 0)'s
  args           equal to shard (0, 0)'s, but for the per-process fields Megatron-LM stores (rank,
                 local_rank); hpcmeg's args are the same on every rank
  save id        hpcmeg's store writes one random id per save into every shard (state["hpcmeg"]["save_id"])
                 and into the manifest: equal across the shards and to the manifest's
  replicated tensors  what tp_split_dim calls replicated (LayerNorms, position embeddings, the
                 row-parallel biases) is bit-identical on every TP rank of a stage (their gradients are
                 all-reduced, their updates identical)
  tied embedding with pp > 1, TP rank t's rows of the first stage's word_embeddings equal its rows of
                 the last stage's word_embeddings_for_head (kept equal by the embedding group's all-reduce)

Contract
- ``new_save_id()`` / ``with_save_id(state, save_id)`` / ``save_id_of(state)``: the id of one save and
  where it lives in a shard dict (store.py writes it; `with_save_id` copies only the two dict levels it
  changes).
- ``ShardMismatchError(ValueError)``: the one-line refusal.
- ``own_shard_problem(state, path, iteration, manifest_save_id) -> str | None``: what a rank can check
  alone on the shard it loaded (resume: each rank reads only its own): iteration and manifest save id.
- ``fingerprint(state) -> int``: a non-negative 31-bit crc of (iteration, args less per-process fields,
  save id), equal on the ranks of one save: the resume path compares it across ranks with two MAX
  all-reduces (store.load_checkpoint), which also covers checkpoints without a manifest.
- ``check_shard_set(shards, tp, pp, iteration)``: every rule above, for readers that hold all shards
  (merge.load_full_checkpoint: reshard and convert); ``shards`` maps (tp_rank, pp_rank) to a
  ``ShardInfo`` (path, the dict's iteration/args/save id, the flat dict of each model chunk).
  Raises ShardMismatchError naming the first shard that disagrees with shard (0, 0).
"""
from __future__ import annotations

import argparse
import secrets
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from hpcmeg.megatron.layout import HEAD_KEY, WORD_EMB, tp_split_dim

SAVE_ID_KEY = "save_id"
# Megatron-LM's args namespace holds the saving process's own rank; nothing else differs between shards
PER_PROCESS_ARGS = frozenset({"rank", "local_rank"})
_FIX = "put back the shard written by the same save as the others (or use another iteration)"


class ShardMismatchError(ValueError):
    """The shard files of one iteration do not come from one save (message names the file)."""


def new_save_id() -> str:
    return secrets.token_hex(8)


def save_id_of(state: dict[str, Any]) -> str | None:
    hp = state.get("hpcmeg")
    return hp.get(SAVE_ID_KEY) if isinstance(hp, dict) else None


def with_save_id(state: dict[str, Any], save_id: str) -> dict[str, Any]:
    """`state` with hpcmeg.save_id set; the caller's dicts are left as they are (shallow copies)."""
    hp = state.get("hpcmeg")
    return {**state, "hpcmeg": {**(hp if isinstance(hp, dict) else {}), SAVE_ID_KEY: save_id}}


def _args_dict(args: Any) -> dict[str, Any] | None:
    """The args namespace as a dict without the per-process fields; None when the shard has none."""
    if args is None:
        return None
    if isinstance(args, argparse.Namespace):
        args = vars(args)
    if not isinstance(args, dict):
        return {"args": args}
    return {k: v for k, v in args.items() if k not in PER_PROCESS_ARGS}


def _iteration_problem(path: str, got: Any, iteration: int | str) -> str | None:
    if isinstance(iteration, int) and isinstance(got, int) and got != iteration:
        return (f"{path}: holds iteration {got} but sits in the directory of iteration {iteration}: it was "
                f"copied from another save; {_FIX}")
    return None


def _int_iteration(state: dict[str, Any]) -> int | None:
    it = state.get("iteration")
    return int(it) if isinstance(it, int) and not isinstance(it, bool) else None


def own_shard_problem(state: dict[str, Any], path: str, iteration: int | str,
                      manifest_save_id: str | None) -> str | None:
    """See the file header. `iteration`: the directory's (an int, or "release": not compared)."""
    problem = _iteration_problem(path, _int_iteration(state), iteration)
    if problem is not None:
        return problem
    sid = save_id_of(state)
    if manifest_save_id is not None and sid != manifest_save_id:
        return (f"{path}: written by another save than the rest of its iteration (save id {sid or 'none'}, "
                f"the manifest's {manifest_save_id}); {_FIX}")
    return None


def fingerprint(state: dict[str, Any]) -> int:
    args = _args_dict(state.get("args"))
    text = repr((_int_iteration(state), sorted((args or {}).items()), save_id_of(state)))
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


@dataclass
class ShardInfo:
    path: str
    iteration: Any
    args: Any
    save_id: str | None
    chunks: list[dict[str, Any]] = field(default_factory=list)
    """Flat dict (hpcmeg names, chunk-local layers) of each model chunk, in chunk order."""

    @classmethod
    def of(cls, path: str, state: dict[str, Any], chunks: list[dict[str, Any]]) -> "ShardInfo":
        return cls(path, state.get("iteration"), state.get("args"), save_id_of(state), chunks)


def _first_args_difference(a: dict[str, Any] | None, b: dict[str, Any] | None) -> str | None:
    if a is None or b is None:
        return None if a is None and b is None else "args present in one shard only"
    for k in sorted(set(a) | set(b)):
        if k not in a or k not in b or type(a[k]) is not type(b[k]) or a[k] != b[k]:
            return f"args.{k}: {a.get(k, '<absent>')!r} vs {b.get(k, '<absent>')!r}"
    return None


def _tensor_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return True  # non-tensor extras (a foreign _extra_state): not ours to compare


def check_shard_set(shards: dict[tuple[int, int], ShardInfo], tp: int, pp: int, iteration: int | str) -> None:
    """See the file header."""
    ref = shards[(0, 0)]
    ref_args = _args_dict(ref.args)
    order = [(t, p) for p in range(pp) for t in range(tp)]
    for key in order:
        s = shards[key]
        problem = _iteration_problem(s.path, s.iteration, iteration)
        if problem is not None:
            raise ShardMismatchError(problem)
        if s.iteration != ref.iteration:
            raise ShardMismatchError(f"{s.path}: holds iteration {s.iteration}, {ref.path} iteration {ref.iteration}: "
                                     f"the shards come from different saves; {_FIX}")
        if s.save_id != ref.save_id:
            raise ShardMismatchError(f"{s.path}: written by another save than {ref.path} (save id {s.save_id or 'none'} "
                                     f"vs {ref.save_id or 'none'}); {_FIX}")
        diff = _first_args_difference(_args_dict(s.args), ref_args)
        if diff is not None:
            raise ShardMismatchError(f"{s.path}: its args differ from {ref.path}'s ({diff}): the shards come from "
                                     f"different saves; {_FIX}")
    for p in range(pp):
        base = shards[(0, p)]
        for t in range(1, tp):
            s = shards[(t, p)]
            for v, (mine, theirs) in enumerate(zip(s.chunks, base.chunks)):
                for k, x in mine.items():
                    if tp_split_dim(k) is None and k in theirs and not _tensor_equal(x, theirs[k]):
                        where = f" (model chunk {v})" if len(s.chunks) > 1 else ""
                        raise ShardMismatchError(
                            f"{s.path}: {k}{where} differs from tensor-parallel rank 0's ({base.path}), though every "
                            f"tensor-parallel rank holds the same copy: the shards come from different saves; {_FIX}")
    if pp > 1:
        for t in range(tp):
            first, last = shards[(t, 0)], shards[(t, pp - 1)]
            emb = first.chunks[0].get(WORD_EMB) if first.chunks else None
            head = last.chunks[-1].get(HEAD_KEY) if last.chunks else None
            if emb is not None and head is not None and not _tensor_equal(emb, head):
                raise ShardMismatchError(
                    f"{last.path}: word_embeddings_for_head differs from {first.path}'s word_embeddings (the two "
                    f"halves of the tied embedding): the shards come from different saves; {_FIX}")
