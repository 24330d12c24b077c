"""A pipeline rank's model: its chunks of the GPT, how the schedule calls them, and their checkpoint form.

Contract
- `build_chunks(cfg, pp, vpp, pp_rank, init_seed) -> list[GPT]`: chunk v of pipeline rank p holds
  global layers chunk_layers(L, pp, vpp, p, v) (Megatron's interleaved map; contiguous runs at
  vpp = 1) as local layers 0..; the embedding lives on (p 0, v 0), the final LayerNorm and the
  output layer on (p pp-1, v vpp-1), which also holds word_embeddings_for_head (the tied weight's
  copy) when it is not the first stage. Initialised by name (hpcmeg/model/init.py): exactly the
  layers of the one-GPU model for the same seed, the head copy equal to the embedding.
- `StageModel(chunks, pp_rank, pp)`: an nn.Module over them (parameters in chunk order: the
  optimizer's order) with
    stage_fn(v)            what run_schedule calls for chunk v: tokens [b, s] (first virtual stage)
                           or the received activation [b, s(/tp), h] -> the chunk's output
                           activation, the final LayerNorm's output on the last one (the head is
                           applied by `loss`, which needs the labels)
    loss(h, labels)        per-token loss fp32 [b, s] from the last chunk's output
    megatron_models()      [nested Megatron model dict per chunk] (stage-local layer numbers)
    load_megatron_models() the inverse; the head copy is loaded, not re-tied
- `megatron_models(model)` / `load_megatron_models(model, models)`: the same for a GPT (PP 1) or a
  StageModel, what the trainer's checkpoints use. Loading refuses a tensor whose shape is not this
  rank's, or missing / unexpected tensors, with a one-line ValueError naming them.
  The tied weight on a rank that is both first and last stage (pp 1) is the embedding itself.
- `tied_parameters(model) -> list`: the word embedding (first stage) and/or the head copy (last
  stage) of this rank: their gradients are summed over the embedding group after the DP reduction.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from hpcmeg.megatron.layout import HEAD_KEY, from_megatron_model, to_megatron_model
from hpcmeg.model.config import GPTConfig
from hpcmeg.fused.model import build_gpt
from hpcmeg.model.gpt import GPT
from hpcmeg.parallel.pipeline.schedule import chunk_layers


def build_chunks(cfg: GPTConfig, pp: int, vpp: int, pp_rank: int, init_seed: int) -> list[GPT]:
    out = []
    for v in range(vpp):
        layers = chunk_layers(cfg.num_layers, pp, vpp, pp_rank, v)
        out.append(build_gpt(cfg, layers=layers, pre_process=pp_rank == 0 and v == 0,
                             post_process=pp_rank == pp - 1 and v == vpp - 1, init_seed=init_seed))
    return out


class StageModel(nn.Module):
    def __init__(self, chunks: list[GPT], pp_rank: int, pp: int):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.pp_rank, self.pp = pp_rank, pp
        self.cfg = chunks[0].cfg

    @property
    def is_first(self) -> bool:
        return self.chunks[0].embedding is not None

    @property
    def is_last(self) -> bool:
        return self.chunks[-1].head is not None

    def stage_fn(self, v: int):
        chunk = self.chunks[v]
        if chunk.embedding is not None:
            return lambda tokens: chunk.encoder(chunk.embed(tokens))
        return chunk.encoder

    def loss(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        last = self.chunks[-1]
        return last.head(h, last.output_weight(), labels)

    def num_params(self) -> int:
        return sum(c.num_params() for c in self.chunks)

    def megatron_models(self) -> list[dict]:
        return [to_megatron_model(c.state_dict(), is_last_stage=self.pp_rank == self.pp - 1 and v == len(self.chunks) - 1,
                                  pp_size=self.pp) for v, c in enumerate(self.chunks)]

    def load_megatron_models(self, models: list[dict]) -> None:
        if len(models) != len(self.chunks):
            raise ValueError(f"the checkpoint holds {len(models)} model chunk(s) per stage, this run {len(self.chunks)} "
                             f"(parallel.virtual_pipeline); reshard it or use the original layout")
        for c, m in zip(self.chunks, models):
            flat = from_megatron_model(m)
            if c.word_embeddings_for_head is None:
                flat.pop(HEAD_KEY, None)  # pp 1 or not the last stage: tied to the embedding
            _check_shapes(c, flat)
            missing, unexpected = c.load_state_dict(flat, strict=False)
            if missing or unexpected:
                raise ValueError(f"checkpoint model does not match the recipe's model: missing {missing[:4]}, "
                                 f"unexpected {unexpected[:4]}")


def tied_parameters(model: nn.Module) -> list[nn.Parameter]:
    chunks = model.chunks if isinstance(model, StageModel) else [model]
    out = []
    for c in chunks:
        if c.embedding is not None:
            out.append(c.embedding.word_embeddings.weight)
        if c.word_embeddings_for_head is not None:
            out.append(c.word_embeddings_for_head.weight)
    return out


def megatron_models(model: nn.Module, pp_rank: int = 0, pp: int = 1) -> list[dict]:
    """This rank's nested Megatron model dicts: one for a GPT, one per chunk for a StageModel."""
    if isinstance(model, StageModel):
        return model.megatron_models()
    return [to_megatron_model(model.state_dict(), is_last_stage=True, pp_size=1)]


def _check_shapes(module: nn.Module, flat: dict) -> None:
    """ValueError naming the first checkpoint tensor whose shape is not this rank's (load_state_dict's
    own RuntimeError lists every mismatch over many lines)."""
    own = module.state_dict()
    for k, v in flat.items():
        if k in own and hasattr(v, "shape") and tuple(v.shape) != tuple(own[k].shape):
            raise ValueError(f"the checkpoint's {k} has shape {list(v.shape)}, this rank's model "
                             f"{list(own[k].shape)}: the shard was saved by another model or layout")


def load_megatron_models(model: nn.Module, models: list[dict]) -> None:
    if isinstance(model, StageModel):
        model.load_megatron_models(models)
        return
    if len(models) != 1:
        raise ValueError(f"the checkpoint holds {len(models)} virtual-pipeline chunks; this run has none: reshard it")
    flat = from_megatron_model(models[0])
    flat.pop(HEAD_KEY, None)  # tied: equals the word embeddings
    _check_shapes(model, flat)
    missing, unexpected = model.load_state_dict(flat, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint model does not match the recipe's model: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")
