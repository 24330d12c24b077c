"""Offline resharding: rewrite a Megatron-layout checkpoint for another tensor/pipeline layout.

Contract
  reshard_checkpoint(ckpt_dir, out_dir, tp, pp, iteration=None, vpp=1) -> out_dir (vpp > 1: the
    interleaved schedule's "model0" .. "model{V-1}" chunks per shard; any source vpp is read)
    Reads one iteration (default: the tracker's) of ckpt_dir, merges it (merge.load_full_checkpoint),
    re-pads the vocabulary for the new TP (Megatron: multiple of make_vocab_size_divisible_by x tp;
    rows of real tokens untouched, padding rows dropped or zero-filled), splits it by Megatron's rules
    (merge.py header: QKV / MLP-in by rows = whole head groups, attention-out / MLP-out by columns,
    row-parallel biases and LayerNorms replicated, vocabulary rows split; stage-local layer numbers;
    the tied head copy on the last stage when pp > 1) and writes a new checkpoint dir through
    hpcmeg.checkpoint.store.save_checkpoint (manifest, tracker) under the same iteration name.
    Kept: args (tp/pp/padded vocab/world size updated), iteration, consumed samples, LR scheduler,
    the hpcmeg recipe (its parallel section updated), data state, each rank's RNG state (see "RNG
    state" below: a shard keeps its own where the source has its (tp, pp) coordinate), and the
    optimizer when it is hpcmeg's trainer layout (AdamW moments and the fp32 masters
    `fp32_from_fp16_params` resharded with the weights' rules, bit for bit; zero moments and masters
    for new padding rows; `step` and group hyper-parameters copied). The distributed optimizer's
    checkpoint has the same layout (the trainer gathers it over data parallelism), so it reshards the
    same way and the data-parallel size stays. An identity reshard is therefore tensor for tensor the
    source, and training resumes exactly. Any other optimizer state is dropped (noted in
    hpcmeg.extra.optimizer_dropped and via `on_note`): start from it with checkpoint.load (weights
    only) then. Shards that do not come from one save are refused (hpcmeg/checkpoint/shard_set.py).
  write_checkpoint_layout(save_dir, iteration, states, tp, pp): every shard of one checkpoint from
    one process (also used by import_hf); iteration "release" -> release/ + tracker "release".
  cli_reshard(args) -> exit code (`hpcmeg reshard CKPT_DIR OUT_DIR --tp N --pp M [--iteration N]`).
All output goes to a staging dir renamed to out_dir at the end; out_dir must not exist (or be empty).
"""
from __future__ import annotations

import argparse
import copy
import os
import random
import sys
from typing import Any, Callable

import numpy as np
import torch

from hpcmeg.convert.hf_tokenizer import TokenizerError, vocab_size_of
from hpcmeg.errors import one_line
from hpcmeg.convert.merge import (CheckpointReadError, FullCheckpoint, load_full_checkpoint, merge_tp, repad_vocab,
                                  split_full, split_tp)
from hpcmeg.convert.output_dir import OutputDirError, atomic_output_dir, check_output_dir
from hpcmeg.megatron.layout import WORD_EMB, pad_vocab_size
from hpcmeg.checkpoint.store import save_checkpoint, write_text_atomic
from hpcmeg.megatron.args import make_checkpoint_dict
from hpcmeg.megatron.layout import HEAD_KEY, from_megatron_model, full_state_from_stages, stage_state_from_full
from hpcmeg.megatron.names import RELEASE_DIRNAME, TRACKER_FILENAME, iter_dirname
from hpcmeg.parallel.random import RNGStreams


class ReshardError(ValueError):
    """The requested layout does not fit the model (message says why and what would)."""


# ------------------------------------------------------------------------------ optimizer state
# hpcmeg's trainer saves optimizer = {"optimizer": torch AdamW state_dict, "grad_scaler": ...} with two
# param groups built by hpcmeg.train.optim.param_groups: tensors with ndim >= 2 (decayed), then the
# rest, each in the model's named_parameters order. Adam's moments have their parameter's shape, so
# they are resharded with exactly the weights' rules; `step` is the same for every parameter.

def _param_order(keys) -> list[str]:
    """A stage's flat keys in GPT's named_parameters order (read from the model code, meta device)."""
    from hpcmeg.model.config import GPTConfig
    from hpcmeg.model.gpt import GPT

    with torch.device("meta"):
        m = GPT(GPTConfig(num_layers=1, hidden_size=8, num_attention_heads=1, ffn_hidden_size=8,
                          max_position_embeddings=1, padded_vocab_size=8))
    names = [n for n, _ in m.named_parameters()]
    in_layer = {n[len("encoder.layers.0."):]: i for i, n in enumerate(names) if n.startswith("encoder.layers.0.")}
    top = {n: i for i, n in enumerate(names) if not n.startswith("encoder.layers.")}

    def rank(k: str) -> tuple[int, int, int]:
        if k in top and k.startswith("embedding."):
            return (0, top[k], 0)
        parts = k.split(".", 3)
        if len(parts) == 4 and parts[:2] == ["encoder", "layers"] and parts[3] in in_layer:
            return (1, int(parts[2]), in_layer[parts[3]])
        if k in top:
            return (2, top[k], 0)
        if k == HEAD_KEY:
            return (3, 0, 0)
        raise KeyError(k)
    return sorted(keys, key=rank)


def _opt_names(flats: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """(chunk, key) in the trainer's optimizer order: the chunks' parameters in chunk order, the
    decayed ones (ndim >= 2) first, then the rest (hpcmeg.train.optim.param_groups over the model)."""
    order = [(v, k) for v, flat in enumerate(flats) for k in _param_order(flat)]
    return [x for x in order if flats[x[0]][x[1]].ndim >= 2] + [x for x in order if flats[x[0]][x[1]].ndim < 2]


MASTERS = "fp32_from_fp16_params"  # FlatAdamW's fp32 masters: per group, in the group's parameter order


def _merge_optimizer(ck: FullCheckpoint) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Source shards' optimizer tensors -> ({"exp_avg": full flat, "exp_avg_sq": full flat[, "master": full
    flat]}, meta). The fp32 masters (MASTERS) have their parameter's shape, so they take the weights' rules
    like the moments; they are kept bit for bit (on a GPU the parameters are bf16 roundings of them).
    Raises ValueError(reason) when the optimizer state is absent or not in the trainer's layout."""
    moments: dict[str, dict[tuple[int, int], dict[str, Any]]] = {"exp_avg": {}, "exp_avg_sq": {}}
    inners = {}
    for (t, p), opt in sorted(ck.shard_optimizers.items()):
        inner = (opt or {}).get("optimizer") if isinstance(opt, dict) else None
        if not isinstance(inner, dict) or "state" not in inner or "param_groups" not in inner:
            raise ValueError(f"shard (tp={t}, pp={p}) has no torch optimizer state")
        inners[(t, p)] = inner
    with_masters = [k for k, inner in inners.items() if inner.get(MASTERS) is not None]
    if with_masters and len(with_masters) != len(inners):
        t, p = next(k for k in inners if k not in with_masters)
        raise ValueError(f"shard (tp={t}, pp={p}) has no {MASTERS} where shard {with_masters[0]} has them")
    if with_masters:
        moments["master"] = {}
    meta: dict[str, Any] = {}
    for (t, p), inner in inners.items():
        opt = ck.shard_optimizers[(t, p)]
        flats = [from_megatron_model(m) for m in ck.shard_models[(t, p)]]
        try:
            names = _opt_names(flats)
        except KeyError as e:
            raise ValueError(f"unknown parameter {e} in shard (tp={t}, pp={p})") from None
        groups = inner["param_groups"]
        ids = [i for g in groups for i in g["params"]]
        n_decay = sum(1 for v, k in names if flats[v][k].ndim >= 2)
        if len(ids) != len(names) or len(groups) != 2 or len(groups[0]["params"]) != n_decay:
            raise ValueError(f"shard (tp={t}, pp={p}): optimizer groups do not follow hpcmeg's param_groups layout")
        masters: list[Any] = []
        if with_masters:
            per_group = inner[MASTERS]
            if len(per_group) != len(groups) or any(len(m) != len(g["params"]) for m, g in zip(per_group, groups)):
                raise ValueError(f"shard (tp={t}, pp={p}): {MASTERS} do not match the optimizer's parameter groups")
            masters = [m for group in per_group for m in group]  # in `ids` order
        for key in moments:
            for v in range(len(flats)):
                moments[key][(t, v * ck.pp + p)] = {}
        for n, (i, (v, name)) in enumerate(zip(ids, names)):
            st = dict(inner["state"].get(i) or {})
            if with_masters:
                st["master"] = masters[n]
            if not inner["state"].get(i) or any(key not in st or tuple(st[key].shape) != tuple(flats[v][name].shape)
                                                 for key in moments):
                raise ValueError(f"shard (tp={t}, pp={p}): optimizer state of {name} is missing or has another shape")
            for key in moments:
                moments[key][(t, v * ck.pp + p)][name] = st[key]
            meta.setdefault("step", st.get("step"))
        meta.setdefault("groups", [{k: v for k, v in g.items() if k != "params"} for g in groups])
        meta.setdefault("grad_scaler", opt.get("grad_scaler"))
    full = {}
    stages = ck.pp * ck.vpp
    for key, shards in moments.items():
        merged = [merge_tp([shards[(t, s)] for t in range(ck.tp)]) for s in range(stages)]
        full[key] = full_state_from_stages(merged, ck.args.num_layers)
    return full, meta


def _split_optimizer(moments: dict[str, dict[str, Any]], meta: dict[str, Any], tp: int, pp: int, num_layers: int,
                     heads: int, orig: int, padded: int, vpp: int = 1) -> dict[tuple[int, int], dict[str, Any]]:
    stages = pp * vpp
    per_key = {}
    for key, full in moments.items():
        # new padding rows: zero moments like a fresh parameter, zero masters like the zero-filled weights
        full = repad_vocab(full, orig, padded)
        per_key[key] = {(t, s): sh for s in range(stages)
                        for t, sh in enumerate(split_tp(stage_state_from_full(full, s, stages, num_layers), tp, heads))}
    out = {}
    for p in range(pp):
        for t in range(tp):
            chunks = {key: [per_key[key][(t, v * pp + p)] for v in range(vpp)] for key in per_key}
            m1, m2 = chunks["exp_avg"], chunks["exp_avg_sq"]
            names = _opt_names(m1)
            n_decay = sum(1 for v, k in names if m1[v][k].ndim >= 2)
            state = {i: {"step": meta["step"].clone() if hasattr(meta["step"], "clone") else meta["step"],
                         "exp_avg": m1[v][k], "exp_avg_sq": m2[v][k]} for i, (v, k) in enumerate(names)}
            groups = [dict(meta["groups"][0], params=list(range(n_decay))),
                      dict(meta["groups"][1], params=list(range(n_decay, len(names))))]
            inner: dict[str, Any] = {"state": state, "param_groups": groups}
            if "master" in chunks:
                ms = chunks["master"]
                inner[MASTERS] = [[ms[v][k] for v, k in names[:n_decay]], [ms[v][k] for v, k in names[n_decay:]]]
            out[(t, p)] = {"optimizer": inner, "grad_scaler": meta["grad_scaler"]}
    return out


# ------------------------------------------------------------------------------------------- RNG state
# What each rank of a run saves (hpcmeg/train/trainer.py, hpcmeg/checkpoint/safe.py): rng_state = [one
# entry] holding the default stream (python, numpy, torch CPU and CUDA generators: seeded alike on every
# TP and DP rank of a stage, seed + 100 x pp_rank, by build.py's seed_everything) and, in
# rng_tracker_states, the TP stream (hpcmeg/parallel/random.py: seeded seed + 2718 + tp_rank, the same on
# every stage). A target shard keeps its source shard's entry where the source has the same (tp, pp)
# coordinate; otherwise the default stream comes from the same source stage (TP ranks of one stage must
# draw the same masks on replicated activations) or, for a stage the source lacks, is seeded as a fresh
# run seeds it, and the TP stream is seeded as a fresh run seeds it. CUDA states of fresh streams are
# left out: the trainer then keeps the ones its fresh start seeded, which is the same rule.

STAGE_SEED_STRIDE = 100  # build.py: seed_everything(train.seed + 100 * pp_rank)


def fresh_default_stream(seed: int) -> dict[str, Any]:
    """The rng_state entry seed_everything(seed) leaves (capture_rng_state's format), no CUDA state and
    no TP stream; computed without touching this process's generators."""
    kind, keys, pos, has_gauss, gauss = np.random.RandomState(seed).get_state()
    gen = torch.Generator()
    gen.manual_seed(seed)
    return {"random_rng_state": random.Random(seed).getstate(),
            "np_rng_state": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
            "torch_rng_state": gen.get_state(), "cuda_rng_state": None, "rng_tracker_states": {}}


def fresh_tp_stream(seed: int, tp_rank: int) -> dict[str, Any]:
    """The rng_tracker_states of TP rank `tp_rank` at a fresh start (CPU state only)."""
    return RNGStreams(seed, tp_rank, torch.device("cpu")).state_dict()


def target_rng_states(src: dict[tuple[int, int], Any], tp: int, pp: int, seed: int) -> dict[tuple[int, int], Any]:
    """{(tp, pp) of the target: its rng_state list} from the source shards' rng_state lists (the rules
    above). A source without any RNG state gives None everywhere (a resume then starts the streams fresh)."""
    if not any(src.values()):
        return {(t, p): None for p in range(pp) for t in range(tp)}
    out = {}
    for p in range(pp):
        for t in range(tp):
            own = src.get((t, p))
            if own:
                out[(t, p)] = own
                continue
            stage = [e for e in src.get((0, p)) or [] if isinstance(e, dict)]
            stage = stage or [fresh_default_stream(seed + STAGE_SEED_STRIDE * p)]
            out[(t, p)] = [dict(entry, rng_tracker_states=fresh_tp_stream(seed, t)) for entry in stage]
    return out


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


def reshard_checkpoint(ckpt_dir: str, out_dir: str, tp: int, pp: int, iteration: int | str | None = None,
                       on_note: Callable[[str], None] = lambda msg: None, vpp: int = 1) -> str:
    """See the file header."""
    if tp < 1 or pp < 1 or vpp < 1:
        raise ReshardError(f"--tp {tp} --pp {pp} --vpp {vpp}: sizes must be >= 1")
    if vpp > 1 and pp == 1:
        raise ReshardError(f"--vpp {vpp} needs --pp > 1 (virtual stages are chunks of pipeline stages)")
    check_output_dir(out_dir)  # before loading every shard, not after
    ck = load_full_checkpoint(ckpt_dir, iteration, keep_shards=True)
    source = ck.args
    if source.num_attention_heads % tp:
        raise ReshardError(f"num_attention_heads={source.num_attention_heads} is not divisible by --tp {tp}")
    if source.num_layers % (pp * vpp):
        raise ReshardError(f"num_layers={source.num_layers} is not divisible by --pp {pp}"
                           + (f" x --vpp {vpp}" if vpp > 1 else ""))
    rows = ck.full[WORD_EMB].shape[0]
    orig = true_vocab_size(ck) or rows
    padded = pad_vocab_size(orig, getattr(source, "make_vocab_size_divisible_by", None) or 128, tp)
    full = repad_vocab(ck.full, orig, padded)
    hp = dict(ck.base.get("hpcmeg") or {})
    extra = {"previous": hp.get("extra"),
             "resharded_from": {"checkpoint_dir": os.path.abspath(ckpt_dir), "iteration": ck.iteration,
                                "tp": ck.tp, "pp": ck.pp, "vpp": ck.vpp, "padded_vocab_size": rows}}
    optimizers = _resharded_optimizer(ck, tp, pp, vpp, orig, padded, extra, on_note)
    rngs = _resharded_rng(ck, tp, pp, on_note)
    ck.shard_models = ck.shard_optimizers = ck.shard_rng = None
    args, recipe = _target_args(source, tp, pp, vpp, orig, padded), _target_recipe(hp.get("recipe"), tp, pp, vpp)
    kept = {k: v for k, v in ck.base.items()
            if k not in ("args", "checkpoint_version", "iteration", "model", "optimizer", "opt_param_scheduler",
                         "rng_state", "hpcmeg")}
    iteration_value = 0 if ck.iteration == RELEASE_DIRNAME else int(ck.base.get("iteration", ck.iteration))
    states = {}
    for key, model in split_full(full, tp, pp, source.num_layers, source.num_attention_heads, vpp).items():
        state = make_checkpoint_dict(args=args, iteration=iteration_value, model=model, optimizer=optimizers.get(key),
                                     opt_param_scheduler=ck.base.get("opt_param_scheduler"), rng_state=rngs[key],
                                     recipe=recipe, data_state=hp.get("data_state"), extra=extra)
        state.update(kept)
        states[key] = state
    with atomic_output_dir(out_dir) as stage:
        write_checkpoint_layout(stage, ck.iteration, states, tp, pp)
    return os.path.abspath(out_dir)


def _target_args(source: argparse.Namespace, tp: int, pp: int, vpp: int, orig: int, padded: int) -> argparse.Namespace:
    """The source's args with the new layout, padded vocabulary and world size (same data parallelism)."""
    args = argparse.Namespace(**vars(source))
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
    args.virtual_pipeline_model_parallel_size = vpp if vpp > 1 else None
    args.padded_vocab_size, args.orig_vocab_size = padded, orig
    args.world_size = tp * pp * (getattr(source, "data_parallel_size", None) or 1)
    return args


def _target_recipe(source: Any, tp: int, pp: int, vpp: int) -> Any:
    """A copy of the checkpoint's recipe (when it has one) with the new layout in its parallel section."""
    recipe = copy.deepcopy(source)
    if isinstance(recipe, dict):
        par = recipe.setdefault("parallel", {})
        par.update(tensor=tp, pipeline=pp)
        if vpp > 1 or par.get("virtual_pipeline"):
            par["virtual_pipeline"] = vpp if vpp > 1 else None
    return recipe


def _resharded_optimizer(ck: FullCheckpoint, tp: int, pp: int, vpp: int, orig: int, padded: int, extra: dict,
                         on_note: Callable[[str], None]) -> dict[tuple[int, int], Any]:
    """The optimizer state of every target shard; {} (weights only, said in ``extra`` and by ``on_note``)
    when the source's is not hpcmeg's trainer layout."""
    try:
        moments, meta = _merge_optimizer(ck)
        heads = ck.args.num_attention_heads
        return _split_optimizer(moments, meta, tp, pp, ck.args.num_layers, heads, orig, padded, vpp)
    except ValueError as e:
        extra["optimizer_dropped"] = str(e)  # weights-only: start from it with checkpoint.load
        on_note(f"optimizer state not resharded ({e}); the new checkpoint holds weights, schedule and "
                f"counters: start from it with checkpoint.load")
        return {}


def _resharded_rng(ck: FullCheckpoint, tp: int, pp: int, on_note: Callable[[str], None]) -> dict[tuple[int, int], Any]:
    """Every target shard's rng_state (target_rng_states); ``on_note`` says how many start fresh."""
    seed = getattr(ck.args, "seed", None)
    if not isinstance(seed, int):
        seed = int(((ck.recipe or {}).get("train") or {}).get("seed", 1234))  # Megatron's default seed
    rngs = target_rng_states(ck.shard_rng or {}, tp, pp, seed)
    new_ranks = [k for k in rngs if rngs[k] is not None and not (ck.shard_rng or {}).get(k)]
    if new_ranks:
        on_note(f"{len(new_ranks)} shard(s) of the new layout have no source shard at their (tp, pp) rank, e.g. "
                f"{new_ranks[0]}: their RNG streams start as a fresh run's, so the resumed losses follow the old "
                f"run's closely, not bit for bit")
    return rngs


def cli_reshard(args: argparse.Namespace) -> int:
    try:
        out = reshard_checkpoint(args.ckpt_dir, args.out_dir, args.tp, args.pp, args.iteration,
                                 on_note=lambda msg: print(f"hpcmeg reshard: note: {msg}", file=sys.stderr),
                                 vpp=getattr(args, "vpp", 1))
    except (CheckpointReadError, ReshardError, OutputDirError, OSError) as e:
        print(f"hpcmeg reshard: {one_line(e)}", file=sys.stderr)
        return 1
    vpp = getattr(args, "vpp", 1)
    print(f"hpcmeg reshard: wrote {out} (tp={args.tp}, pp={args.pp}{f', vpp={vpp}' if vpp > 1 else ''})")
    return 0
