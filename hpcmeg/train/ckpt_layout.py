"""Megatron legacy ("torch" format) checkpoint layout: names, dict contents, safe loading, RNG.

Owns everything about *what* a Megatron checkpoint looks like (spec: shared/docs/megatron-interop.md
§6.1-6.4); `checkpoint.py` owns *how* it is written and read atomically. Together they are the one
place in hpcmeg where the Megatron checkpoint format lives.

Layout (§6.1):
    <save>/latest_checkpointed_iteration.txt        "<int>" or "release"
    <save>/iter_{:07d}/ or <save>/release/
        mp_rank_{tp:02d}/model_optim_rng.pt         when pp_size == 1
        mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt when pp_size  > 1

Model state (§6.3): hpcmeg's GPT module has flat keys = Megatron legacy names without the
`language_model.` prefix ("embedding.word_embeddings.weight", "encoder.layers.{i}.mlp.dense_h_to_4h.bias",
"encoder.final_layernorm.weight", ...). Megatron nests them:
    {"language_model": {"embedding": {"word_embeddings": {"weight": t}, "position_embeddings": {...}},
                        "encoder": {"layers.0.input_layernorm.weight": t, ..., "final_layernorm.weight": t}},
     "word_embeddings_for_head": {"weight": t}}     # last pipeline stage, pp_size > 1 only
With pipeline parallelism, layer indices in a stage's dict are stage-local: 0 .. num_layers/pp - 1.

Everything saved must unpickle with torch.load(weights_only=True) plus argparse.Namespace allow-listed:
`args` is a plain argparse.Namespace of plain Python values, numpy RNG state is stored as a tensor.
"""
from __future__ import annotations

import argparse
import os
import pickle
import random
import re
from typing import Any

import numpy as np
import torch

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
SHARD_FILENAME = "model_optim_rng.pt"
RELEASE_DIRNAME = "release"
CHECKPOINT_VERSION = 3.0  # per-head [q, k, v] row order of query_key_value (§6.3)
_ITER_DIR_RE = re.compile(r"^iter_(\d{7})$")
_FLAT_LAYER_RE = re.compile(r"^encoder\.layers\.(\d+)\.(.+)$")
_NESTED_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
HEAD_KEY = "word_embeddings_for_head.weight"  # flat name hpcmeg uses for the last stage's tied head copy


# ------------------------------------------------------------------------------------------ names

def iter_dirname(iteration: int | str) -> str:
    """'iter_0000100' for 100; 'release' for the string "release"."""
    if iteration == RELEASE_DIRNAME:
        return RELEASE_DIRNAME
    if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
        raise ValueError(f"checkpoint iteration must be a non-negative int or 'release', got {iteration!r}")
    return f"iter_{iteration:07d}"


def parse_iter_dirname(name: str) -> int | None:
    """Inverse of iter_dirname for iteration dirs; None for anything else (tmp dirs, release, files)."""
    m = _ITER_DIR_RE.match(name)
    return int(m.group(1)) if m else None


def shard_dirname(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """mp_rank_TT when pp_size == 1 else mp_rank_TT_PPP (Megatron's get_checkpoint_name)."""
    if pp_size == 1:
        if pp_rank != 0:
            raise ValueError(f"pp_rank {pp_rank} with pp_size 1")
        return f"mp_rank_{tp_rank:02d}"
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def shard_relpath(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """Path of one shard file relative to an iteration dir."""
    return f"{shard_dirname(tp_rank, pp_rank, pp_size)}/{SHARD_FILENAME}"


def all_shard_relpaths(tp_size: int, pp_size: int) -> list[str]:
    """Every shard a complete (tp_size x pp_size) checkpoint must contain."""
    return [shard_relpath(t, p, pp_size) for p in range(pp_size) for t in range(tp_size)]


def checkpoint_path(save_dir: str, iteration: int | str, tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return os.path.join(save_dir, iter_dirname(iteration), shard_relpath(tp_rank, pp_rank, pp_size))


def read_tracker(save_dir: str) -> int | str | None:
    """Iteration named by latest_checkpointed_iteration.txt: an int, "release", or None if absent.

    Raises ValueError naming the file when its content is neither (a hand-edited or foreign file)."""
    path = os.path.join(save_dir, TRACKER_FILENAME)
    try:
        with open(path) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    if text == RELEASE_DIRNAME:
        return RELEASE_DIRNAME
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{path}: expected an iteration number or 'release', found {text[:40]!r}; "
                         f"fix or delete the file") from None


# ----------------------------------------------------------------------- layer index renumbering

def layers_per_stage(num_layers: int, pp_size: int) -> int:
    if num_layers % pp_size:
        raise ValueError(f"num_layers={num_layers} is not divisible by pipeline size {pp_size}")
    return num_layers // pp_size


def global_to_local_layer(i: int, pp_rank: int, num_layers: int, pp_size: int) -> int:
    """Global layer i -> index inside stage pp_rank; raises if i is not on that stage."""
    n = layers_per_stage(num_layers, pp_size)
    local = i - pp_rank * n
    if not 0 <= local < n:
        raise ValueError(f"layer {i} is not on pipeline stage {pp_rank} (layers {pp_rank * n}..{pp_rank * n + n - 1})")
    return local


def local_to_global_layer(i: int, pp_rank: int, num_layers: int, pp_size: int) -> int:
    n = layers_per_stage(num_layers, pp_size)
    if not 0 <= i < n:
        raise ValueError(f"stage-local layer {i} out of range 0..{n - 1}")
    return pp_rank * n + i


def shift_layers(flat: dict[str, Any], offset: int) -> dict[str, Any]:
    """Add `offset` to every encoder.layers.{i} index of a flat dict (negative offset: global->local)."""
    out = {}
    for k, v in flat.items():
        m = _FLAT_LAYER_RE.match(k)
        if m:
            j = int(m.group(1)) + offset
            if j < 0:
                raise ValueError(f"{k}: layer index would become {j}")
            k = f"encoder.layers.{j}.{m.group(2)}"
        out[k] = v
    return out


def stage_state_from_full(full: dict[str, Any], pp_rank: int, pp_size: int, num_layers: int) -> dict[str, Any]:
    """Cut a full-model flat dict (global layer numbers) into pipeline stage pp_rank's flat dict.

    First stage keeps the embeddings, last stage the final layernorm and (pp_size > 1) a copy of the
    word embeddings as the tied output head under HEAD_KEY, as Megatron's last stage does."""
    n = layers_per_stage(num_layers, pp_size)
    lo, first, last = pp_rank * n, pp_rank == 0, pp_rank == pp_size - 1
    out = {}
    for k, v in full.items():
        m = _FLAT_LAYER_RE.match(k)
        if m:
            if lo <= int(m.group(1)) < lo + n:
                out[f"encoder.layers.{int(m.group(1)) - lo}.{m.group(2)}"] = v
        elif k.startswith("embedding."):
            if first:
                out[k] = v
        elif k.startswith("encoder.final_layernorm."):
            if last:
                out[k] = v
        elif k != HEAD_KEY:
            raise ValueError(f"unknown model key {k!r}: not an embedding/encoder key of the legacy GPT layout")
    if last and pp_size > 1:
        out[HEAD_KEY] = full["embedding.word_embeddings.weight"]
    return out


def full_state_from_stages(stages: list[dict[str, Any]], num_layers: int) -> dict[str, Any]:
    """Inverse of stage_state_from_full: stage flats (in pp order) -> full flat with global numbering.

    The head copy is dropped: with tied embeddings it equals embedding.word_embeddings.weight."""
    out: dict[str, Any] = {}
    for pp_rank, st in enumerate(stages):
        n = layers_per_stage(num_layers, len(stages))
        for k, v in shift_layers(st, pp_rank * n).items():
            if k != HEAD_KEY:
                out[k] = v
    return out


# -------------------------------------------------------------------------- flat <-> nested model

def to_megatron_model(flat: dict[str, Any], is_last_stage: bool, pp_size: int) -> dict[str, Any]:
    """hpcmeg flat state dict (one stage, stage-local layers) -> Megatron's nested `model` entry."""
    embedding: dict[str, dict[str, Any]] = {}
    encoder: dict[str, Any] = {}
    head = None
    for k, v in flat.items():
        if k == HEAD_KEY:
            head = v
        elif k.startswith("embedding."):
            parts = k.split(".")
            if len(parts) != 3:
                raise ValueError(f"unexpected embedding key {k!r} (want embedding.<table>.<param>)")
            embedding.setdefault(parts[1], {})[parts[2]] = v
        elif k.startswith("encoder."):
            encoder[k[len("encoder."):]] = v
        else:
            raise ValueError(f"unknown model key {k!r}: not an embedding/encoder key of the legacy GPT layout")
    lm: dict[str, Any] = {}
    if embedding:
        lm["embedding"] = embedding
    # layers before final_layernorm: the transformers reshaping script's layer regex stops at the
    # first non-layer key, so key order matters (§6.5).
    lm["encoder"] = dict(sorted(encoder.items(), key=_encoder_sort_key))
    model: dict[str, Any] = {"language_model": lm}
    if is_last_stage and pp_size > 1:
        if head is None:
            head = flat.get("embedding.word_embeddings.weight")
        if head is None:
            raise ValueError(f"last pipeline stage (pp_size={pp_size}) needs {HEAD_KEY!r} for word_embeddings_for_head")
        model["word_embeddings_for_head"] = {"weight": head}
    return model


def _encoder_sort_key(item: tuple[str, Any]) -> tuple[int, int, str]:
    m = _NESTED_LAYER_RE.match(item[0])
    return (0, int(m.group(1)), m.group(2)) if m else (1, 0, item[0])


def from_megatron_model(model: dict[str, Any]) -> dict[str, Any]:
    """Megatron nested `model` entry -> hpcmeg flat dict. Accepts the very old 'transformer' name."""
    lm = model.get("language_model")
    if lm is None:
        raise KeyError("checkpoint 'model' has no 'language_model' entry: not a legacy Megatron GPT checkpoint "
                       "(mcore/torch_dist checkpoints need Megatron's own converter first)")
    flat: dict[str, Any] = {}
    for table, params in lm.get("embedding", {}).items():
        for p, v in params.items():
            flat[f"embedding.{table}.{p}"] = v
    encoder = lm.get("encoder", lm.get("transformer", {}))
    for k, v in encoder.items():
        flat[f"encoder.{k}"] = v
    if "word_embeddings_for_head" in model:
        flat[HEAD_KEY] = model["word_embeddings_for_head"]["weight"]
    return flat


# --------------------------------------------------------------------------------- args namespace

# What Megatron's check_checkpoint_args and transformers' converters read (§6.2, §6.4, §6.5), with the
# defaults of hpcmeg's GPT-2 architecture: learned positions, LayerNorm, tanh-GELU, biases, tied head.
_ARGS_DEFAULTS: dict[str, Any] = dict(
    orig_vocab_size=None, kv_channels=None, ffn_hidden_size=None, seq_length=None,
    tokenizer_type="GPT2BPETokenizer", tokenizer_name_or_path=None, vocab_file=None, merge_file=None,
    tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=1, world_size=1,
    virtual_pipeline_model_parallel_size=None, sequence_parallel=False, use_distributed_optimizer=False,
    bias_gelu_fusion=True, openai_gelu=False, make_vocab_size_divisible_by=128,
    position_embedding_type="learned_absolute", add_position_embedding=True, normalization="LayerNorm",
    layernorm_epsilon=1e-5, apply_residual_connection_post_layernorm=False,
    untie_embeddings_and_output_weights=False, add_bias_linear=True, swiglu=False,
    group_query_attention=False, num_query_groups=None, attention_dropout=0.1, hidden_dropout=0.1,
    consumed_train_samples=0, consumed_valid_samples=0, iteration=0, micro_batch_size=None,
    global_batch_size=None, fp16=False, bf16=False, seed=1234, ckpt_format="torch",
)
_ARGS_REQUIRED = ("padded_vocab_size", "hidden_size", "num_layers", "num_attention_heads", "max_position_embeddings")
_PLAIN = (type(None), bool, int, float, str)


def make_megatron_args(**fields: Any) -> argparse.Namespace:
    """Build the plain argparse.Namespace stored as checkpoint['args'].

    Required: padded_vocab_size, hidden_size, num_layers, num_attention_heads, max_position_embeddings.
    Derived when not given: ffn_hidden_size = 4h, kv_channels = h/heads, seq_length = max positions,
    orig_vocab_size = padded_vocab_size. Extra fields pass through. Values must be plain Python
    (None/bool/int/float/str and lists/tuples/dicts of those) so weights_only loading never needs hpcmeg."""
    missing = [k for k in _ARGS_REQUIRED if fields.get(k) is None]
    if missing:
        raise ValueError(f"make_megatron_args: missing required field(s) {missing}")
    a = {**_ARGS_DEFAULTS, **fields}
    h = a["hidden_size"]
    if a["ffn_hidden_size"] is None:
        a["ffn_hidden_size"] = 4 * h
    if a["kv_channels"] is None:
        a["kv_channels"] = h // a["num_attention_heads"]
    if a["seq_length"] is None:
        a["seq_length"] = a["max_position_embeddings"]
    if a["orig_vocab_size"] is None:
        a["orig_vocab_size"] = a["padded_vocab_size"]
    for k, v in a.items():
        _check_plain(v, f"args.{k}")
    return argparse.Namespace(**a)


def _check_plain(v: Any, where: str) -> None:
    if isinstance(v, _PLAIN):
        return
    if isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            _check_plain(x, f"{where}[{i}]")
        return
    if isinstance(v, dict):
        for k, x in v.items():
            _check_plain(k, f"{where} key")
            _check_plain(x, f"{where}[{k!r}]")
        return
    raise TypeError(f"{where} is a {type(v).__name__}; checkpoint args must be plain Python values "
                    f"so they unpickle with weights_only=True")


_SCHED_KEYS = ("max_lr", "lr_warmup_steps", "num_steps", "lr_decay_style", "lr_decay_steps", "min_lr",
               "start_wd", "end_wd", "wd_incr_style", "wd_incr_steps")


def make_scheduler_state(**fields: Any) -> dict[str, Any]:
    """Megatron's opt_param_scheduler dict (§6.2/§7.2). All step counts are in *samples*."""
    missing = [k for k in _SCHED_KEYS if k not in fields]
    unknown = [k for k in fields if k not in _SCHED_KEYS]
    if missing or unknown:
        raise ValueError(f"opt_param_scheduler: missing {missing}, unknown {unknown}")
    return {k: fields[k] for k in _SCHED_KEYS}


def make_checkpoint_dict(*, args: argparse.Namespace, iteration: int, model: dict[str, Any],
                         optimizer: dict[str, Any] | None, opt_param_scheduler: dict[str, Any] | None,
                         rng_state: list[dict[str, Any]] | None, recipe: dict[str, Any] | None = None,
                         data_state: Any = None, extra: Any = None) -> dict[str, Any]:
    """The dict saved as model_optim_rng.pt; `model` is the nested dict from to_megatron_model."""
    if "language_model" not in model:
        raise ValueError("model must be the nested Megatron dict (use to_megatron_model on the flat state dict)")
    ckpt: dict[str, Any] = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": int(iteration),
                            "model": model}
    if optimizer is not None:
        ckpt["optimizer"] = optimizer
    if opt_param_scheduler is not None:
        ckpt["opt_param_scheduler"] = opt_param_scheduler
    if rng_state is not None:
        ckpt["rng_state"] = rng_state
    ckpt["hpcmeg"] = {"recipe": recipe, "data_state": data_state, "extra": extra}
    return ckpt


# ------------------------------------------------------------------------------------ safe loading

class UnsafeCheckpointError(RuntimeError):
    """The file's pickle references a global outside the weights_only allow-list."""


class UnreadableCheckpointError(RuntimeError):
    """The file is not a torch checkpoint that weights_only loading can read (corrupt, truncated, or
    a pickle using opcodes the safe unpickler does not run); nothing in it was executed."""


_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


def safe_torch_load(path: str) -> Any:
    """torch.load(map_location="cpu", weights_only=True) with argparse.Namespace allow-listed.

    Raises UnsafeCheckpointError naming the global when the pickle needs arbitrary code, and
    UnreadableCheckpointError when the safe unpickler rejects the bytes for another reason (random
    bytes, a truncated pickle): a corrupt file must not be reported as an attack, nor vice versa."""
    try:
        with _allow_namespace():
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        m = _GLOBAL_RE.search(str(e))
        if m is None:
            detail = next((ln.strip() for ln in str(e).split("WeightsUnpickler error:")[-1].splitlines() if ln.strip()),
                          type(e).__name__)
            raise UnreadableCheckpointError(
                f"{path}: not a readable torch checkpoint ({detail[:120]}); the file is corrupt or was not "
                f"written by torch.save") from None
        raise UnsafeCheckpointError(
            f"{path}: this checkpoint needs arbitrary code to unpickle ({m.group(1)}); hpcmeg refuses to load it. "
            f"Re-save it with plain tensors/containers and an argparse.Namespace args, or load it yourself "
            f"with weights_only=False if you trust its origin") from None
    except (RuntimeError, EOFError) as e:  # a truncated or damaged zip container, an empty file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0][:160]
        raise UnreadableCheckpointError(f"{path}: not a readable torch checkpoint ({first}); the file is corrupt "
                                        f"or truncated") from None


def _allow_namespace():
    ser = torch.serialization
    if hasattr(ser, "safe_globals"):  # torch >= 2.5: scoped allow-list
        return ser.safe_globals([argparse.Namespace])
    ser.add_safe_globals([argparse.Namespace])  # torch 2.4: process-wide, harmless for Namespace
    import contextlib
    return contextlib.nullcontext()


# --------------------------------------------------------------------------------------------- RNG

def capture_rng_state(rng_tracker_states: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Megatron's per-rank rng_state entry. numpy's key array becomes an int64 tensor so the
    checkpoint stays weights_only-loadable; python's state is a tuple of ints (already safe)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "rng_tracker_states": dict(rng_tracker_states or {}),
    }


def restore_rng_state(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Inverse of capture_rng_state; returns the rng_tracker_states for the TP RNG tracker."""
    random.setstate(_to_tuple(state["random_rng_state"]))
    kind, keys, pos, has_gauss, gauss = state["np_rng_state"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state((kind, keys.astype(np.uint32), int(pos), int(has_gauss), float(gauss)))
    torch.set_rng_state(state["torch_rng_state"])
    if state.get("cuda_rng_state") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    return dict(state.get("rng_tracker_states") or {})


def _to_tuple(x: Any) -> Any:
    # random.setstate insists on tuples; a state that went through JSON or a list-based writer has lists
    return tuple(_to_tuple(i) for i in x) if isinstance(x, (list, tuple)) else x
