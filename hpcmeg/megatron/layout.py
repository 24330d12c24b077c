"""Megatron legacy GPT layout rules: model keys, tensor-parallel split dims, pipeline stages and layer
numbering, vocabulary padding. Pure and torch-free (values are whatever tensors the caller holds).

Spec: shared/docs/megatron-interop.md sections 5.1-5.3 and 6.3. One definition for training,
`hpcmeg reshard`, `hpcmeg convert` and `hpcmeg import-hf`.

Model state: hpcmeg's GPT module has flat keys = Megatron legacy names without the `language_model.`
prefix ("embedding.word_embeddings.weight", "encoder.layers.{i}.mlp.dense_h_to_4h.bias",
"encoder.final_layernorm.weight", ...). Megatron nests them:
    {"language_model": {"embedding": {"word_embeddings": {"weight": t}, "position_embeddings": {...}},
                        "encoder": {"layers.0.input_layernorm.weight": t, ..., "final_layernorm.weight": t}},
     "word_embeddings_for_head": {"weight": t}}     # last pipeline stage, pp_size > 1 only
With pipeline parallelism, layer indices in a stage's dict are stage-local: 0 .. num_layers/pp - 1.

Tensor-parallel split rules (`tp_split_dim`), per key of one stage:
  dim 0 (contiguous row chunks, rank r holds chunk r): embedding.word_embeddings.weight and
    word_embeddings_for_head.weight (vocabulary rows); self_attention.query_key_value.weight/.bias
    (rows are per-head [q, k, v], so a row chunk is a set of whole heads); mlp.dense_h_to_4h.weight/.bias
  dim 1: self_attention.dense.weight, mlp.dense_4h_to_h.weight (row-parallel: input features)
  replicated: LayerNorms, position embeddings, the biases of the row-parallel layers.
Vocabulary padding (`pad_vocab_size`, Megatron's _vocab_size_with_padding): the vocabulary rounded up
to a multiple of make_vocab_size_divisible_by x tp, so it splits evenly (GPT-2: 50257 -> 50304 at TP1).
"""
from __future__ import annotations

import re
from typing import Any

_FLAT_LAYER_RE = re.compile(r"^encoder\.layers\.(\d+)\.(.+)$")
_NESTED_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
HEAD_KEY = "word_embeddings_for_head.weight"  # flat name hpcmeg uses for the last stage's tied head copy
WORD_EMB = "embedding.word_embeddings.weight"
_ROW_SUFFIXES = ("self_attention.query_key_value.weight", "self_attention.query_key_value.bias",
                 "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias")
_COL_SUFFIXES = ("self_attention.dense.weight", "mlp.dense_4h_to_h.weight")


def tp_split_dim(key: str) -> int | None:
    """Dimension along which `key` is sharded across tensor-parallel ranks; None = replicated."""
    if key in (WORD_EMB, HEAD_KEY) or key.endswith(_ROW_SUFFIXES):
        return 0
    if key.endswith(_COL_SUFFIXES):
        return 1
    return None


def pad_vocab_size(orig: int, multiple: int = 128, tp: int = 1) -> int:
    """Megatron's padded vocabulary size: `orig` rounded up to a multiple of (multiple * tp)."""
    if orig < 1 or multiple < 1 or tp < 1:
        raise ValueError(f"pad_vocab_size: orig={orig}, multiple={multiple}, tp={tp} must all be >= 1")
    step = multiple * tp
    return -(-orig // step) * step


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
