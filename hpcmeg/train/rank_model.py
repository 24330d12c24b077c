"""One rank's model, gradient buffer, optimizer and step for any layout (TP x PP x DP), from plain values.

Contract (build.py calls these with the recipe's values; the parallel tests call them directly):
- `rank_model(config, dims, ctx, init_seed, device) -> (model, plan, rng)`: at PP 1 the GPT (fused
  when config.fused: hpcmeg/fused/model.py), at PP > 1
  a StageModel of this pipeline rank's chunks (hpcmeg/parallel/pipeline/stages.py); built whole on
  the CPU with the name-keyed init (every layout starts from the same weights), cut into this rank's
  tensor-parallel shards (hpcmeg/parallel/tensor.py; `plan` says which parameters are replicated,
  which have partial gradients), given the config's activation recompute (hpcmeg/parallel/recompute.py),
  moved to `device`. `rng`: the TP RNG stream (None at TP 1).
- `rank_optimizer(model, plan, ctx, hyper, ...) -> (buffer, optimizer)`: ParamAndGradBuffer +
  FlatAdamW with this rank's groups (hpcmeg/train/optim.py's build_optimizer): DP (all-reduce or,
  with the distributed optimizer, reduce-scatter), the parameter roles from the TP plan and the
  tied embedding (summed over the embedding group: first and last stage), the norm summed over TP
  and PP and counting every parameter once.
- `rank_step(model, buffer, optimizer, dims, ctx, *, micro_batch, seq_length, act_dtype, **kw)`: a
  TrainStep at PP 1, else a PipelineTrainStep with its P2P sized [micro_batch, seq(/tp under SP), h].
  At PP 1 with DP > 1 the step compiles layer by layer and the backward reports the sunk weights
  (hpcmeg/parallel/overlap.py), so the data-parallel reduction overlaps the backward.
"""
from __future__ import annotations

import torch

from hpcmeg.megatron.parallel_dims import ParallelDims
from hpcmeg.model.config import GPTConfig
from hpcmeg.fused.model import build_gpt
from hpcmeg.parallel.overlap import report_sunk_weights
from hpcmeg.parallel.recompute import apply_recompute
from hpcmeg.parallel.tensor import TensorParallelPlan, parallelize_tensor


def rank_model(config: GPTConfig, dims: ParallelDims, ctx, init_seed: int, device):
    from hpcmeg.parallel.pipeline.stages import StageModel, build_chunks
    from hpcmeg.parallel.random import RNGStreams

    rng = RNGStreams(init_seed, ctx.tp_rank, device) if dims.tp > 1 else None
    if dims.pp == 1:
        model = build_gpt(config, init_seed=init_seed)
        plan = parallelize_tensor(model, ctx, sequence_parallel=dims.sequence_parallel, rng=rng)
        # after TP: its hooks, collectives and TP-stream dropout run again in the recompute
        apply_recompute(model, config.recompute_granularity, config.recompute_method, config.recompute_num_layers, rng)
        return model.to(device), plan, rng
    chunks = build_chunks(config, dims.pp, dims.vpp, ctx.pp_rank, init_seed)
    plans = [parallelize_tensor(c, ctx, sequence_parallel=dims.sequence_parallel, rng=rng) for c in chunks]
    plan = TensorParallelPlan(dims.tp, dims.sequence_parallel, frozenset().union(*(p.replicated for p in plans)),
                              frozenset().union(*(p.partial_grads for p in plans)))
    model = StageModel(chunks, ctx.pp_rank, dims.pp)
    apply_recompute(model, config.recompute_granularity, config.recompute_method, config.recompute_num_layers, rng)
    return model.to(device), plan, rng


def rank_optimizer(model, plan: TensorParallelPlan, ctx, hyper, *, param_dtype: torch.dtype,
                   grad_dtype: torch.dtype, bucket_numel: int | None = None, compiled: bool | None = None,
                   wgrad_fusion: bool = False):
    """hyper: an AdamWConfig (hpcmeg/train/optim.py); the keywords are build_optimizer's."""
    from hpcmeg.parallel.pipeline.stages import tied_parameters
    from hpcmeg.train.optim import build_optimizer, param_roles

    tied = [id(p) for p in tied_parameters(model)] if ctx.pp_size > 1 else []
    roles = param_roles(tied=tied, partial=plan.partial_grads, replicated=plan.replicated)
    return build_optimizer(model, hyper, ctx, roles, param_dtype=param_dtype, grad_dtype=grad_dtype,
                           bucket_numel=bucket_numel, compiled=compiled, wgrad_fusion=wgrad_fusion)


def rank_step(model, buffer, optimizer, dims: ParallelDims, ctx, *, micro_batch: int, seq_length: int,
              act_dtype: torch.dtype, **kw):
    """kw: TrainStep's (precision, grad_clip, loss_scaler, compile, device, dp_size is set here)."""
    from hpcmeg.train.step import TrainStep

    if dims.pp == 1:
        # data parallelism: each layer compiled on its own and the sunk weights reported from the
        # backward, so the buckets' reductions overlap it (hpcmeg/parallel/overlap.py; one process
        # keeps the whole-model compile and its CUDA graphs)
        per_layer = dims.dp > 1
        if per_layer:
            report_sunk_weights(model, buffer)
        # CUDA graphs only where no collective runs inside the compiled model (one process): the
        # tensor-parallel collectives were never captured and timed in a graph
        return TrainStep(model, buffer, optimizer, dp_size=dims.dp, compile_layers=per_layer,
                         cuda_graphs=dims.world == 1, **kw)
    from hpcmeg.parallel.pipeline.p2p import PipelineP2P
    from hpcmeg.train.pipeline_step import PipelineTrainStep

    seq = seq_length // dims.tp if dims.sequence_parallel else seq_length
    p2p = PipelineP2P.from_context(ctx, (micro_batch, seq, model.cfg.hidden_size), act_dtype)
    return PipelineTrainStep(model, buffer, optimizer, p2p, ctx, vpp=dims.vpp, dp_size=dims.dp, **kw)
