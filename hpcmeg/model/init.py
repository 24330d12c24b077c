"""Parameter initialisation keyed by name: the same values whatever the parallel layout.

Why: with Megatron's rule of drawing every parameter from one global RNG in module order, a TP2 rank
(which holds half of some tensors) or a pipeline stage (which holds some layers) would draw
different numbers than the one-GPU model, so runs could not be compared across layouts. Here each
parameter's FULL tensor comes from its own generator, seeded by (seed, global parameter name), and a
shard is a slice of it: TP2 starts from exactly the slices of the TP1 initial weights, PP stages
from exactly their layers, for the same seed.

Contract
- `init_value(name, shape, cfg, seed) -> float32 CPU tensor` of the full parameter `name` (global
  Megatron legacy name, e.g. "encoder.layers.7.mlp.dense_4h_to_h.weight"), by Megatron's rules:
  LayerNorm weight 1 / bias 0, every other bias 0, N(0, init_method_std) for weights, and
  N(0, std / sqrt(2 * num_layers)) for the two output projections (self_attention.dense,
  mlp.dense_4h_to_h). The word embedding's rows of real tokens (cfg.vocab_size, when known) and its
  padding rows come from two generators, so real rows do not depend on the padded size (which grows
  with TP: 50304 rows at TP1, 50432 at TP2 for GPT-2).
- `param_seed(seed, name)`: the generator seed of one parameter (deterministic across processes and
  Python versions: crc32, not hash()).
- Values are drawn on the CPU (CPU and CUDA generators give different streams; the model is built
  on the CPU anyway) in float32.
"""
from __future__ import annotations

import math
import zlib

import torch

from hpcmeg.model.config import GPTConfig

_OUT_PROJ = ("self_attention.dense.weight", "mlp.dense_4h_to_h.weight")


def param_seed(seed: int, name: str) -> int:
    return (int(seed) * 0x9E3779B1 + zlib.crc32(name.encode())) % (2 ** 63)


def _normal(shape, std: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=g)


def init_value(name: str, shape, cfg: GPTConfig, seed: int) -> torch.Tensor:
    shape = tuple(shape)
    if "layernorm" in name:
        return torch.full(shape, 1.0 if name.endswith("weight") else 0.0)
    if name.endswith("bias"):
        return torch.zeros(shape)
    std = cfg.init_method_std
    if name.endswith(_OUT_PROJ):
        return _normal(shape, std / math.sqrt(2.0 * cfg.num_layers), param_seed(seed, name))
    if name.endswith("word_embeddings.weight") or name == "word_embeddings_for_head.weight":
        # the head copy of the last pipeline stage starts equal to the embedding (Megatron broadcasts it)
        real = min(cfg.vocab_size or shape[0], shape[0])
        key = "embedding.word_embeddings.weight"
        rows = [_normal((real, *shape[1:]), std, param_seed(seed, key))]
        if shape[0] > real:
            rows.append(_normal((shape[0] - real, *shape[1:]), std, param_seed(seed, key + "#padding")))
        return torch.cat(rows)
    return _normal(shape, std, param_seed(seed, name))
