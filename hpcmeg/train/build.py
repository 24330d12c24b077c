"""Build every part of a training run from a recipe: layout, context, model, optimizer, data, resume.

Contract
- `runtime_layout(recipe, world_size) -> (ParallelDims, Derived)`: the layout of the processes
  actually running (the recipe's global batch holds whatever the rank count: accumulation =
  global / (micro x dp)); RecipeError (one line per problem) when the layout cannot run.
- `build_trainer(recipe, env, ...) -> (Trainer, ParallelContext)`: each step below is one function,
  called in this order; the caller destroys the context.
    context      init_distributed from the launcher's rank/world (hpcmeg.procenv.DistEnv)
    threads      CPU ranks share the node's cores
    model        GPT built with the same seed on every rank (identical init, identical dropout);
                 model.attention_backend 'auto' resolved for the device (attention_backend_for)
    optimizer    ParamAndGradBuffer + FlatAdamW: bf16/fp16 parameters with fp32 masters on CUDA
                 (fp32 parameters + autocast on CPU), fp32 main gradients whenever gradients are
                 summed, the distributed optimizer when parallel.distributed_optimizer
    data         train dataset and the fixed evaluation batches
    resume       the latest valid checkpoint of derived.checkpoint_dir, else checkpoint.load's weights
- `megatron_args_fn(recipe, derived, ctx)`: the checkpoint's args namespace for a train state.
"""
from __future__ import annotations

import os
import random
from typing import NamedTuple

import numpy as np
import torch

from hpcmeg.megatron.parallel_dims import ParallelDims
from hpcmeg.procenv import DistEnv
from hpcmeg.recipe import Derived, Recipe, RecipeError, data_plan, derive, recipe_dims, to_dict, write_resolved
from hpcmeg.train.loop_state import no_fault, no_progress


def runtime_layout(recipe: Recipe, world_size: int) -> tuple[ParallelDims, Derived]:
    """ParallelDims and derive() for the processes actually running (not the recipe's cluster plan)."""
    dims = recipe_dims(recipe, world_size)
    problems = dims.problems() + dims.batch_problems(recipe.train.global_batch_size, recipe.train.micro_batch_size)
    if problems:
        raise RecipeError([f"{key}: {msg} ({world_size} processes are running)" for key, msg in problems])
    return dims, derive(recipe, world_size=world_size)


def _auto(flag: str, device: torch.device) -> bool:
    return flag == "on" or (flag == "auto" and device.type == "cuda")


def attention_backend_for(backend: str, device: torch.device, precision: str,
                          capability: tuple[int, int] | None = None) -> str:
    """The recipe's model.attention_backend on this device. 'auto' becomes 'triton' (hpcmeg's Triton
    attention; the model falls back to SDPA for shapes it does not take) on a Hopper GPU (compute
    capability 9.x: H100, H200, GH200) with bf16/fp16 training, where it was timed against cuDNN
    (forward + backward per layer at p = 0.1 on an H100: 0.395 vs 0.451 ms at 124M, bench/results/
    attention_probe_h100_s15.json; faster on the H200 too, attention_probe_h200_s13.json). Other
    GPUs, older or newer, were never timed, so 'auto' keeps GPTConfig's meaning there (flash-attn if
    installed, else SDPA, cuDNN first). capability: for the tests (default: the device's)."""
    if backend != "auto" or device.type != "cuda" or precision not in ("bf16", "fp16"):
        return backend
    from hpcmeg.kernels import attention as attention_kernel

    if attention_kernel.triton is None:
        return backend
    major, _ = capability or torch.cuda.get_device_capability(device)
    return "triton" if major == 9 else backend


def kernels_of(cfg, device: torch.device | None = None) -> str:
    """What the model computes with on this device, in one phrase for the start line and record,
    e.g. 'attention triton, Triton LayerNorm/GELU/dropout/CE kernels, CE grad_in_forward' (what
    'auto' resolved to). Off CUDA the kernels' custom ops run their PyTorch twins and dropout is
    torch's. model.fused off: the plain ops of hpcmeg/model/ops.py."""
    if not cfg.fused:
        return "plain PyTorch ops (model.fused off)"
    recompute = f", GELU recomputed in {cfg.recompute_gelu_layers} layer(s)" if cfg.recompute_gelu_layers else ""
    attention = cfg.attention_backend if cfg.attention_backend == "triton" else f"SDPA {cfg.attention_backend}"
    kernels = ("Triton LayerNorm/GELU/dropout/CE kernels" if device is None or device.type == "cuda"
               else f"the Triton kernels' PyTorch twins on {device.type}")
    return f"attention {attention}, {kernels}, CE {cfg.fused_ce}{recompute}"


def share_cpu_threads(env: DistEnv, device: torch.device) -> None:
    """CPU ranks of one node share its cores: oversubscribed OpenMP threads spin and can make a CPU
    step 10x slower (measured on a 2-core box with 2 ranks). OMP_NUM_THREADS set by the user wins."""
    if device.type == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // max(1, env.local_world_size)))


def seed_everything(seed: int) -> None:
    """Same seed on every rank (Megatron's default): identical init, identical dropout streams."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def gpt_config(recipe: Recipe, derived: Derived, device: torch.device):
    from hpcmeg.model.config import GPTConfig

    model_cfg = recipe.model
    return GPTConfig(num_layers=model_cfg.num_layers, hidden_size=model_cfg.hidden_size,
                     num_attention_heads=model_cfg.num_attention_heads, ffn_hidden_size=derived.ffn_hidden_size,
                     max_position_embeddings=model_cfg.max_position_embeddings,
                     padded_vocab_size=derived.padded_vocab_size, hidden_dropout=model_cfg.hidden_dropout,
                     attention_dropout=model_cfg.attention_dropout, layernorm_epsilon=model_cfg.layernorm_epsilon,
                     init_method_std=model_cfg.init_method_std, fused=_auto(model_cfg.fused, device),
                     vocab_size=derived.orig_vocab_size, fused_ce=model_cfg.cross_entropy,
                     attention_backend=attention_backend_for(model_cfg.attention_backend, device,
                                                             recipe.train.precision),
                     recompute_gelu_layers=model_cfg.recompute_gelu_layers,
                     recompute_granularity=model_cfg.recompute_granularity,
                     recompute_method=model_cfg.recompute_method, recompute_num_layers=model_cfg.recompute_num_layers)


def param_dtype_for(precision: str, device: torch.device) -> torch.dtype:
    """bf16/fp16 parameters with fp32 masters on CUDA (Megatron's mixed precision: measured 1.10x vs
    1.04x compiled nanoGPT with fp32 params + autocast, bench/results/train_throughput_h200_trainer.md);
    fp32 parameters + autocast on CPU, where low-precision matmuls are slow or missing."""
    if device.type == "cuda":
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    return torch.float32


def wgrad_fusion(model, param_dtype: torch.dtype) -> bool:
    """Whether the weight-gradient GEMMs accumulate into the main grads (Megatron's gradient-accumulation
    fusion): only a fused model's layers take the main grads, and only on CUDA with bf16/fp16
    parameters does it pay (the GEMM saves the separate bf16 -> fp32 pass; with fp32 parameters
    there is nothing to convert)."""
    return model.cfg.fused and param_dtype != torch.float32 and next(model.parameters()).is_cuda


def build_optimizer_for(recipe: Recipe, derived: Derived, dims: ParallelDims, ctx, model, plan):
    """(buffer, optimizer, loss scaler or None) for this rank."""
    from hpcmeg.parallel.grad_buffer import main_grad_dtype
    from hpcmeg.train.loss_scale import DynamicLossScaler
    from hpcmeg.train.optim import AdamWConfig
    from hpcmeg.train.rank_model import rank_optimizer

    train = recipe.train
    pdt = param_dtype_for(train.precision, ctx.device)
    # summed over micro batches, ranks or pipeline stages' shared embedding: fp32 (main_grad_dtype)
    summed = derived.grad_accum_steps * (2 if dims.pp > 1 else 1)
    hyper = AdamWConfig(lr=train.lr, weight_decay=train.weight_decay, betas=(train.adam_beta1, train.adam_beta2),
                        eps=train.adam_eps)
    buffer, optimizer = rank_optimizer(model, plan, ctx, hyper, param_dtype=pdt,
                                       grad_dtype=main_grad_dtype(pdt, dims.dp, summed),
                                       wgrad_fusion=wgrad_fusion(model, pdt))
    scaler = DynamicLossScaler(initial_scale=train.initial_loss_scale) if train.precision == "fp16" else None
    return buffer, optimizer, scaler


def activation_dtype(precision: str, param_dtype: torch.dtype, fp32_residual: bool) -> torch.dtype:
    """The dtype of the activations between pipeline stages (the residual stream): the parameters'
    dtype, or under autocast (fp32 parameters) the autocast dtype unless the model keeps an fp32
    residual stream (GPTConfig.fp32_residual_connection, hpcmeg/model/gpt.py)."""
    if param_dtype != torch.float32:
        return param_dtype
    if precision in ("bf16", "fp16") and not fp32_residual:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return torch.float32


def megatron_args_fn(recipe: Recipe, derived: Derived, dims: ParallelDims):
    from hpcmeg.megatron.args import make_megatron_args

    model_cfg, train = recipe.model, recipe.train

    def build(state):
        return make_megatron_args(
            padded_vocab_size=derived.padded_vocab_size, orig_vocab_size=derived.orig_vocab_size, hidden_size=model_cfg.hidden_size,
            num_layers=model_cfg.num_layers, num_attention_heads=model_cfg.num_attention_heads, ffn_hidden_size=derived.ffn_hidden_size,
            max_position_embeddings=model_cfg.max_position_embeddings, seq_length=recipe.data.seq_length,
            make_vocab_size_divisible_by=model_cfg.make_vocab_size_divisible_by, layernorm_epsilon=model_cfg.layernorm_epsilon,
            attention_dropout=model_cfg.attention_dropout, hidden_dropout=model_cfg.hidden_dropout, init_method_std=model_cfg.init_method_std,
            tokenizer_type=recipe.data.tokenizer_type, vocab_file=recipe.data.vocab_file, merge_file=recipe.data.merge_file,
            tokenizer_model=recipe.data.tokenizer_model, tensor_model_parallel_size=dims.tp,
            pipeline_model_parallel_size=dims.pp, virtual_pipeline_model_parallel_size=dims.vpp if dims.vpp > 1 else None, data_parallel_size=dims.dp, world_size=dims.world,
            use_distributed_optimizer=dims.distributed_optimizer, sequence_parallel=dims.sequence_parallel,
            micro_batch_size=train.micro_batch_size, global_batch_size=train.global_batch_size,
            fp16=train.precision == "fp16", bf16=train.precision == "bf16", seed=train.seed, lr=train.lr, min_lr=train.min_lr,
            lr_decay_style=train.lr_decay_style, weight_decay=train.weight_decay, clip_grad=train.clip_grad,
            adam_beta1=train.adam_beta1, adam_beta2=train.adam_beta2, adam_eps=train.adam_eps, train_iters=derived.train_iters,
            train_samples=derived.train_samples, consumed_train_samples=state.consumed_train_samples,
            recompute_granularity=model_cfg.recompute_granularity, recompute_method=model_cfg.recompute_method,
            recompute_num_layers=model_cfg.recompute_num_layers,
            consumed_valid_samples=state.consumed_valid_samples, iteration=state.iteration)
    return build


def check_checkpoint_args(args, derived: Derived, recipe: Recipe, where: str) -> None:
    """Megatron's check_checkpoint_args: the architecture must match the recipe's."""
    if args is None:
        return
    want = {"num_layers": recipe.model.num_layers, "hidden_size": recipe.model.hidden_size,
            "num_attention_heads": recipe.model.num_attention_heads, "ffn_hidden_size": derived.ffn_hidden_size,
            "max_position_embeddings": recipe.model.max_position_embeddings, "padded_vocab_size": derived.padded_vocab_size}
    bad = [f"{k}: checkpoint {getattr(args, k)} vs recipe {v}" for k, v in want.items()
           if getattr(args, k, v) is not None and getattr(args, k, v) != v]
    if bad:
        raise RecipeError([f"{where}: the checkpoint's model differs from the recipe's ({'; '.join(bad)}); "
                           f"fix the recipe's model section or use another checkpoint directory"])


def resume(trainer, recipe: Recipe, derived: Derived, ctx) -> str:
    """Load the latest valid checkpoint (full resume), else checkpoint.load's weights; says which."""
    from hpcmeg.checkpoint.store import load_checkpoint
    from hpcmeg.megatron.names import TRACKER_FILENAME

    kw = dict(tp_rank=ctx.tp_rank, pp_rank=ctx.pp_rank, tp_size=ctx.tp_size, pp_size=ctx.pp_size,
              all_reduce_max=ctx.all_reduce_max if ctx.distributed else None)
    loaded = load_checkpoint(derived.checkpoint_dir, **kw)
    if loaded is not None:
        check_checkpoint_args(loaded[1].get("args"), derived, recipe, derived.checkpoint_dir)
        try:
            trainer.load_state(loaded[1])
        except ValueError as e:  # schedule / model / optimizer do not fit this recipe
            raise RecipeError([f"{derived.checkpoint_dir}: {e}"]) from None
        return f"resumed from {derived.checkpoint_dir} at iteration {trainer.state.iteration}"
    if recipe.checkpoint.load:
        loaded = load_checkpoint(recipe.checkpoint.load, **kw)
        if loaded is None:
            raise RecipeError([f"checkpoint.load: no checkpoint in '{recipe.checkpoint.load}' "
                               f"(no {TRACKER_FILENAME} and no iter_* directory)"])
        check_checkpoint_args(loaded[1].get("args"), derived, recipe, recipe.checkpoint.load)
        try:
            trainer.load_weights(loaded[1])
        except ValueError as e:
            raise RecipeError([f"checkpoint.load: {recipe.checkpoint.load}: {e}"]) from None
        return f"weights from {recipe.checkpoint.load} (iteration 0)"
    return "fresh start"


def loop_config(recipe: Recipe, derived: Derived):
    from hpcmeg.train.trainer import LoopConfig

    train, ckpt, c = recipe.train, recipe.checkpoint, recipe.cluster
    # the ranks' own collective timeout is twice the supervisor's hang allowance (cluster.hang_*): on
    # Slurm the supervisor finds and names the culprit first; under torchrun it is the only limit
    return LoopConfig(train_iters=derived.train_iters, global_batch_size=train.global_batch_size,
                      micro_batch_size=train.micro_batch_size, grad_accum_steps=derived.grad_accum_steps,
                      log_interval=train.log_interval, eval_interval=train.eval_interval, eval_iters=train.eval_iters,
                      save_interval=ckpt.save_interval, keep_last=ckpt.keep_last, async_save=ckpt.async_save,
                      checkpoint_dir=derived.checkpoint_dir, precision=train.precision, seed=train.seed,
                      num_workers=recipe.data.num_workers, collective_timeout_factor=2 * c.hang_after_steps,
                      collective_timeout_floor_s=2 * c.hang_min_s, collective_timeout_long_s=2 * c.hang_checkpoint_s)


def _write_recipe_copies(recipe: Recipe, run_dir: str) -> None:
    """The recipe this train job runs (train_recipe.yaml, every start) and, for a run started without
    `hpcmeg submit`, the run's recipe.yaml."""
    write_resolved(recipe, os.path.join(run_dir, "train_recipe.yaml"))
    if not os.path.exists(os.path.join(run_dir, "recipe.yaml")):
        write_resolved(recipe, os.path.join(run_dir, "recipe.yaml"))


def _datasets(recipe: Recipe, derived: Derived, ctx):
    """(train dataset, fixed evaluation batches) of this rank; the vocabulary checked against the model's."""
    from hpcmeg.train.data import build_datasets, eval_batches, vocab_checked

    train = recipe.train
    data = data_plan(recipe, derived)
    train_ds, valid_ds, _ = (vocab_checked(data, ds) for ds in
                             build_datasets(data, barrier=ctx.barrier, is_rank0=ctx.is_rank0))
    evals = eval_batches(valid_ds, train.eval_iters if train.eval_interval else 0, train.micro_batch_size,
                         derived.grad_accum_steps, ctx.dp_rank, ctx.dp_size, ctx.device)
    return train_ds, evals


class _Flops(NamedTuple):
    n_params: int
    """The whole model's parameters (this rank holds a TP/PP part of them)."""
    per_token: float
    peak: float | None
    """The device's peak FLOP/s for MFU, None where unknown."""


def _model_flops(recipe: Recipe, model, device: torch.device) -> _Flops:
    from hpcmeg.model.flops import flops_per_token
    from hpcmeg.model.gpt import GPT
    from hpcmeg.train.metrics import peak_flops_for

    with torch.device("meta"):  # the whole model's count (this rank holds a TP/PP part of it), for MFU
        n_params = GPT(model.cfg, init_seed=0).num_params()
    fpt = flops_per_token(n_params, recipe.model.num_layers, recipe.model.hidden_size, recipe.data.seq_length)
    peak = peak_flops_for(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # the peak probe's matrices are not training memory
    return _Flops(n_params, fpt, peak)


def _lr_schedule(recipe: Recipe, derived: Derived):
    from hpcmeg.megatron.lr_schedule import schedule_from_recipe

    try:
        return schedule_from_recipe(recipe.train, recipe.train.global_batch_size, derived.train_samples)
    except ValueError as e:
        raise RecipeError([f"train.lr_warmup_iters / train.lr_decay_iters: {e}; shorten the warmup or "
                           f"lengthen the decay"]) from None


def _announce(trainer, recipe: Recipe, derived: Derived, dims: ParallelDims, plan, buffer, flops: _Flops,
              resumed: str) -> None:
    """The start record (metrics.jsonl) and the start line: layout, device, sizes, what computes."""
    ctx, model, step, optimizer, train = trainer.ctx, trainer.model, trainer.step, trainer.optimizer, recipe.train
    from hpcmeg.parallel.recompute import describe_recompute

    dev, cfg = ctx.device, model.cfg
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    recompute = describe_recompute(cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers)
    trainer.metrics.write({
        "kind": "start", "iteration": trainer.state.iteration, "world_size": ctx.world_size,
        "data_parallel_size": ctx.dp_size, "tensor_parallel_size": ctx.tp_size,
        "pipeline_parallel_size": ctx.pp_size, "virtual_pipeline_size": dims.vpp,
        "sequence_parallel": plan.sequence_parallel, "grad_accum_steps": derived.grad_accum_steps,
        "device": name, "precision": train.precision, "param_dtype": str(buffer.param_dtype),
        "grad_dtype": str(buffer.grad_dtype), "distributed_optimizer": buffer.sharded,
        "fused": model.cfg.fused, "kernels": kernels_of(model.cfg, dev), "compile": step.compile,
        "compile_scope": step.compile_scope(), "recompute": recompute, "optimizer": optimizer.name,
        "n_params": flops.n_params, "flops_per_token": flops.per_token,
        "peak_tflops": flops.peak / 1e12 if flops.peak else None, "torch": torch.__version__,
        "recipe": recipe.source, "start": resumed})
    tp = "" if ctx.tp_size == 1 else f"TP {ctx.tp_size}{' + SP' if plan.sequence_parallel else ''} x "
    if ctx.pp_size > 1:
        tp += f"PP {ctx.pp_size}{f' (V {dims.vpp})' if dims.vpp > 1 else ''} x "
    trainer.metrics.print(
        f"hpcmeg train: {recipe.run.name} | {ctx.world_size} process(es) on {name} | {tp}DP {ctx.dp_size} x "
        f"micro {train.micro_batch_size} x accum {derived.grad_accum_steps} = global {train.global_batch_size} | "
        f"{flops.n_params / 1e6:.1f} M params | {train.precision} | fused {model.cfg.fused}"
        f"{' (' + kernels_of(model.cfg, dev) + ')' if model.cfg.fused else ''} | "
        f"compile {step.compile}{' (' + step.compile_scope() + ')' if step.compile else ''} | "
        f"{recompute + ' | ' if cfg.recompute_granularity else ''}{optimizer.name} | "
        f"{resumed}")


def build_trainer(recipe: Recipe, env: DistEnv, *, stop=lambda: None, exit_interval=None, on_step_time=lambda s: None,
                  on_save_time=lambda s: None, on_context=lambda ctx: None,
                  progress=no_progress, fault=no_fault):
    """Everything from the recipe (module docstring); resumes if it can. Returns (trainer, ctx).
    on_context(ctx) runs as soon as the process group exists (the caller's failure report uses it);
    progress(phase, iteration=None, waiting=False) is the trainer's progress report (a heartbeat,
    hpcmeg/heartbeat.py); fault(point, iteration=None) its injected fault (hpcmeg/train/faults.py)."""
    from hpcmeg.parallel.context import init_distributed
    from hpcmeg.train.metrics import MetricsLogger, Throughput
    from hpcmeg.train.rank_model import rank_model, rank_step
    from hpcmeg.train.trainer import Trainer

    dims, derived = runtime_layout(recipe, env.world_size)
    train = recipe.train
    ctx = init_distributed(dims, rank=env.rank, local_rank=env.local_rank, master_addr=env.master_addr,
                           master_port=env.master_port, device=train.device)
    try:
        on_context(ctx)
        dev = ctx.device
        share_cpu_threads(env, dev)
        if ctx.is_rank0:
            _write_recipe_copies(recipe, derived.run_dir)
        # Megatron's default stream: the same on every rank of a TP and DP group, one per pipeline stage
        seed_everything(train.seed + 100 * ctx.pp_rank)
        # init keyed by (train.seed, parameter name): the same initial weights whatever the layout
        cfg = gpt_config(recipe, derived, dev)
        model, plan, rng = rank_model(cfg, dims, ctx, train.seed, dev)
        buffer, optimizer, scaler = build_optimizer_for(recipe, derived, dims, ctx, model, plan)
        step = rank_step(model, buffer, optimizer, dims, ctx, micro_batch=train.micro_batch_size,
                         seq_length=recipe.data.seq_length, act_dtype=activation_dtype(
                             train.precision, buffer.param_dtype, cfg.fp32_residual_connection),
                         precision=train.precision, grad_clip=train.clip_grad, loss_scaler=scaler,
                         compile=_auto(train.compile, dev), device=dev)
        train_ds, evals = _datasets(recipe, derived, ctx)
        flops = _model_flops(recipe, model, dev)
        schedule = _lr_schedule(recipe, derived)
        metrics = MetricsLogger(derived.run_dir, enabled=ctx.is_rank0, train_iters=derived.train_iters,
                                per="gpu" if dev.type == "cuda" else "rank")
        trainer = Trainer(config=loop_config(recipe, derived), ctx=ctx, model=model, optimizer=optimizer,
                          schedule=schedule,
                          loss_scaler=scaler, step=step, train_dataset=train_ds, eval_set=evals, metrics=metrics,
                          throughput=Throughput(flops.per_token, derived.tokens_per_iteration, ctx.world_size,
                                                flops.peak),
                          megatron_args=megatron_args_fn(recipe, derived, dims), recipe_dict=to_dict(recipe), stop=stop,
                          on_step_time=on_step_time, on_save_time=on_save_time, exit_interval=exit_interval,
                          rng_streams=rng, progress=progress, fault=fault)
        resumed = resume(trainer, recipe, derived, ctx)
        _announce(trainer, recipe, derived, dims, plan, buffer, flops, resumed)
        return trainer, ctx
    except BaseException:
        ctx.destroy()
        raise
