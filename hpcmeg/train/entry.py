"""`hpcmeg train` and `hpcmeg prepare-cache`: build every part from a recipe and run the loop.

Contract
- `train(recipe, *, environ=None, exit_interval=None) -> int` (exit code) runs on one process, or on
  each of N processes started by torchrun / srun (ranks from hpcmeg.launch.env). Data parallel over
  all processes (tensor/pipeline parallel: a later issue; sizes > 1 are refused). The process count
  actually present decides data-parallel size and gradient accumulation:
  accumulation = global_batch / (micro_batch x DP), so the recipe's global batch holds whatever the
  rank count. Resumes from the latest valid checkpoint in derived.checkpoint_dir; with none there
  and checkpoint.load set, starts from that checkpoint's weights at iteration 0 (e.g. a 'release'
  import). `exit_interval` (library/test use, Megatron's --exit-interval): save and stop with
  EXIT_REQUEUE when iteration % exit_interval == 0.
- Exit codes (the Slurm supervisor keys on these):
      0 EXIT_OK        train_iters reached, final checkpoint saved
      1 EXIT_ERROR     any error, including a non-finite loss (the line names the iteration)
      2 EXIT_BAD_RECIPE the recipe (or its fit to the process count / the checkpoint) is wrong
      3 EXIT_REQUEUE   stopped early on SIGTERM/SIGUSR2, the wall-time guard, train.exit_duration_minutes
                       or exit_interval; every rank saved the SAME iteration: requeue and rerun the
                       same command to resume.
  `<run_dir>/train_status.json` (rank 0) records {status: finished|preempted|failed, iteration,
  exit_code, reason, time}: "preempted" means "resume me".
- Files: `<run_dir>/train_recipe.yaml` (the recipe as this run resolved it; `recipe.yaml` too when the
  run dir has none), metrics.jsonl + tensorboard/ (hpcmeg/train/metrics.py), checkpoints.
- Only global rank 0 prints metric lines; other ranks print errors only (prefixed with their rank).
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
import time
import traceback
import warnings

import numpy as np
import torch

from hpcmeg.fsutil import write_text_atomic
from hpcmeg.launch.env import DistEnv, dist_env
from hpcmeg.errors import one_line
from hpcmeg.recipe import Recipe, RecipeError, dataset_prefixes, derive, load_recipe, to_dict, write_resolved

EXIT_OK, EXIT_ERROR, EXIT_BAD_RECIPE, EXIT_REQUEUE = 0, 1, 2, 3
STATUS_FILE = "train_status.json"
WALLTIME_MARGIN_S = 60.0  # plus the measured longest save and step (WallTimeGuard)


def runtime_derived(r: Recipe, world_size: int):
    """derive(), with data-parallel size and accumulation from the processes actually running."""
    d = derive(r)
    tp, pp, t = r.parallel.tensor, r.parallel.pipeline, r.train
    if tp > 1 or pp > 1 or r.parallel.virtual_pipeline or r.parallel.distributed_optimizer:
        raise RecipeError(["parallel: tensor/pipeline parallelism and the distributed optimizer are not "
                           "implemented in hpcmeg train yet; set parallel.tensor=1, parallel.pipeline=1, "
                           "parallel.distributed_optimizer=false"])
    dp = world_size // (tp * pp)
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise RecipeError([f"train.global_batch_size: {t.global_batch_size} is not divisible by train.micro_batch_size="
                           f"{t.micro_batch_size} x data-parallel size {dp} (the {world_size} running processes); "
                           f"change the batch sizes or the process count"])
    return dataclasses.replace(d, world_size=world_size, data_parallel_size=dp,
                               grad_accum_steps=t.global_batch_size // (t.micro_batch_size * dp))


class TokenIdError(ValueError):
    """A token id in the data is not below the vocabulary size the model is built with."""


class _VocabChecked(torch.utils.data.Dataset):
    """A GPT dataset whose samples are refused when a token id is >= the vocabulary size.

    Without it such an id fails deep inside the embedding (a 45-line IndexError on CPU, a
    device-side assert that kills the process on CUDA). The check runs on the host-side numpy
    sample (L + L integer compares, microseconds) where it is read anyway, so it covers exactly
    the tokens the run consumes, costs no device sync, and needs no scan of the whole .bin."""

    def __init__(self, ds, vocab_size: int, fix: str):
        self.ds, self.vocab_size, self.fix = ds, vocab_size, fix

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict:
        item = self.ds[i]
        top = int(max(item["tokens"].max(initial=0), item["labels"].max(initial=0)))
        if top >= self.vocab_size:
            raise TokenIdError(f"the data holds token id {top} but the vocabulary has {self.vocab_size} tokens "
                               f"(ids 0..{self.vocab_size - 1}); {self.fix}")
        return item


def _vocab_checked(r: Recipe, d, ds):
    if ds is None:
        return None
    data = ", ".join(p for _, p in dataset_prefixes(r, d))
    if r.model.vocab_size is not None:
        fix = (f"model.vocab_size={r.model.vocab_size} is too small for {data}: raise it, or set it to null to "
               f"read it from the tokenizer files")
    else:
        tok = r.data.tokenizer_model or r.data.vocab_file or "the embedded GPT-2 vocabulary"
        fix = (f"{data} was tokenized with a larger vocabulary than {tok}: point data.vocab_file / "
               f"data.tokenizer_model at the tokenizer that wrote it, or set model.vocab_size")
    return _VocabChecked(ds, d.orig_vocab_size, fix)


def _auto(flag: str, device: torch.device) -> bool:
    return flag == "on" or (flag == "auto" and device.type == "cuda")


def megatron_args_fn(r: Recipe, d, ctx):
    from hpcmeg.train.checkpoint import make_megatron_args

    m, t = r.model, r.train

    def build(state):
        return make_megatron_args(
            padded_vocab_size=d.padded_vocab_size, orig_vocab_size=d.orig_vocab_size, hidden_size=m.hidden_size,
            num_layers=m.num_layers, num_attention_heads=m.num_attention_heads, ffn_hidden_size=d.ffn_hidden_size,
            max_position_embeddings=m.max_position_embeddings, seq_length=r.data.seq_length,
            make_vocab_size_divisible_by=m.make_vocab_size_divisible_by, layernorm_epsilon=m.layernorm_epsilon,
            attention_dropout=m.attention_dropout, hidden_dropout=m.hidden_dropout, init_method_std=m.init_method_std,
            tokenizer_type=r.data.tokenizer_type, vocab_file=r.data.vocab_file, merge_file=r.data.merge_file,
            tokenizer_model=r.data.tokenizer_model, tensor_model_parallel_size=ctx.tp_size,
            pipeline_model_parallel_size=ctx.pp_size, data_parallel_size=ctx.dp_size, world_size=ctx.world_size,
            micro_batch_size=t.micro_batch_size, global_batch_size=t.global_batch_size,
            fp16=t.precision == "fp16", bf16=t.precision == "bf16", seed=t.seed, lr=t.lr, min_lr=t.min_lr,
            lr_decay_style=t.lr_decay_style, weight_decay=t.weight_decay, clip_grad=t.clip_grad,
            adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, train_iters=d.train_iters,
            train_samples=d.train_samples, consumed_train_samples=state.consumed_train_samples,
            consumed_valid_samples=state.consumed_valid_samples, iteration=state.iteration)
    return build


def _check_ckpt_args(args, d, r: Recipe, where: str) -> None:
    """Megatron's check_checkpoint_args: the architecture must match the recipe's."""
    if args is None:
        return
    want = {"num_layers": r.model.num_layers, "hidden_size": r.model.hidden_size,
            "num_attention_heads": r.model.num_attention_heads, "ffn_hidden_size": d.ffn_hidden_size,
            "max_position_embeddings": r.model.max_position_embeddings, "padded_vocab_size": d.padded_vocab_size}
    bad = [f"{k}: checkpoint {getattr(args, k)} vs recipe {v}" for k, v in want.items()
           if getattr(args, k, v) is not None and getattr(args, k, v) != v]
    if bad:
        raise RecipeError([f"{where}: the checkpoint's model differs from the recipe's ({'; '.join(bad)}); "
                           f"fix the recipe's model section or use another checkpoint directory"])


def build_trainer(r: Recipe, env: DistEnv, *, stop=lambda: None, exit_interval=None, on_step_time=lambda s: None,
                  on_save_time=lambda s: None):
    """Everything from the recipe: context, model, optimizer, schedule, data, metrics; resumes if it can.
    Returns (trainer, ctx); the caller destroys ctx."""
    from hpcmeg.model.config import GPTConfig
    from hpcmeg.model.flops import flops_per_token
    from hpcmeg.model.gpt import GPT
    from hpcmeg.parallel.context import init_distributed
    from hpcmeg.train import checkpoint as ckpt
    from hpcmeg.train.data import build_datasets, eval_batches
    from hpcmeg.train.metrics import MetricsLogger, Throughput, peak_flops_for
    from hpcmeg.train.optim import DynamicLossScaler, build_optimizer
    from hpcmeg.train.schedule import schedule_from_recipe
    from hpcmeg.train.step import TrainStep
    from hpcmeg.train.trainer import Trainer

    d = runtime_derived(r, env.world_size)
    m, t = r.model, r.train
    ctx = init_distributed(env, tp=r.parallel.tensor, pp=r.parallel.pipeline, device=t.device)
    try:
        dev = ctx.device
        if dev.type == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
            # share the cores among this node's ranks: oversubscribed OpenMP threads spin and can
            # make a CPU step 10x slower (measured on a 2-core box with 2 ranks)
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            torch.set_num_threads(max(1, cores // max(1, env.local_world_size)))
        if ctx.is_rank0:
            write_resolved(r, os.path.join(d.run_dir, "train_recipe.yaml"))
            if not os.path.exists(os.path.join(d.run_dir, "recipe.yaml")):
                write_resolved(r, os.path.join(d.run_dir, "recipe.yaml"))
        # same seed on every DP rank (Megatron's default): identical init, identical dropout streams
        random.seed(t.seed)
        np.random.seed(t.seed)
        torch.manual_seed(t.seed)
        cfg = GPTConfig(num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
                        ffn_hidden_size=d.ffn_hidden_size, max_position_embeddings=m.max_position_embeddings,
                        padded_vocab_size=d.padded_vocab_size, hidden_dropout=m.hidden_dropout,
                        attention_dropout=m.attention_dropout, layernorm_epsilon=m.layernorm_epsilon,
                        init_method_std=m.init_method_std, fused=_auto(m.fused, dev))
        model = GPT(cfg).to(dev)
        # bf16 params + fp32 master weights (Megatron's Float16Optimizer semantics): measured 1.10x vs
        # 1.04x compiled nanoGPT on an H200 (bench/results/train_throughput_h200_trainer.md). Only with
        # one data-parallel rank for now: under DDP it would all-reduce bf16 grads (not yet measured).
        master = t.precision == "bf16" and dev.type == "cuda" and ctx.dp_size == 1
        optimizer, opt_impl = build_optimizer(model, lr=t.lr, weight_decay=t.weight_decay,
                                              betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                                              master_weights=master)
        scaler = DynamicLossScaler(initial_scale=t.initial_loss_scale) if t.precision == "fp16" else None
        ddp = None
        if ctx.dp_size > 1:
            ddp = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[dev.index] if dev.type == "cuda" else None, broadcast_buffers=False,
                gradient_as_bucket_view=True, process_group=ctx.dp_group)
        step = TrainStep(model, optimizer, precision=t.precision, grad_clip=t.clip_grad, loss_scaler=scaler,
                         compile=_auto(t.compile, dev), device=dev)
        train_ds, valid_ds, _ = (_vocab_checked(r, d, ds) for ds in
                                 build_datasets(r, d, barrier=ctx.barrier, is_rank0=ctx.is_rank0))
        evals = eval_batches(valid_ds, t.eval_iters if t.eval_interval else 0, t.micro_batch_size,
                             d.grad_accum_steps, ctx.dp_rank, ctx.dp_size, dev)
        n_params = model.num_params()
        fpt = flops_per_token(n_params, m.num_layers, m.hidden_size, r.data.seq_length)
        peak = peak_flops_for(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)  # the peak probe's matrices are not training memory
        try:
            schedule = schedule_from_recipe(t, t.global_batch_size, d.train_samples)
        except ValueError as e:
            raise RecipeError([f"train.lr_warmup_iters / train.lr_decay_iters: {e}; shorten the warmup or "
                               f"lengthen the decay"]) from None
        metrics = MetricsLogger(d.run_dir, enabled=ctx.is_rank0, train_iters=d.train_iters,
                                per="gpu" if dev.type == "cuda" else "rank")
        trainer = Trainer(recipe=r, derived=d, ctx=ctx, model=model, ddp_model=ddp, optimizer=optimizer,
                          schedule=schedule, loss_scaler=scaler,
                          step=step, train_dataset=train_ds, eval_set=evals, metrics=metrics,
                          throughput=Throughput(fpt, d.tokens_per_iteration, ctx.world_size, peak),
                          megatron_args=megatron_args_fn(r, d, ctx), recipe_dict=to_dict(r), stop=stop,
                          on_step_time=on_step_time, on_save_time=on_save_time, exit_interval=exit_interval)
        reduce = ctx.all_reduce_max if ctx.distributed else None
        kw = dict(tp_rank=ctx.tp_rank, pp_rank=ctx.pp_rank, tp_size=ctx.tp_size, pp_size=ctx.pp_size,
                  all_reduce_max=reduce)
        resumed = "fresh start"
        loaded = ckpt.load_checkpoint(d.checkpoint_dir, **kw)
        if loaded is not None:
            _check_ckpt_args(loaded[1].get("args"), d, r, d.checkpoint_dir)
            try:
                trainer.load_state(loaded[1])
            except ValueError as e:  # schedule / model / optimizer do not fit this recipe
                raise RecipeError([f"{d.checkpoint_dir}: {e}"]) from None
            resumed = f"resumed from {d.checkpoint_dir} at iteration {trainer.state.iteration}"
        elif r.checkpoint.load:
            loaded = ckpt.load_checkpoint(r.checkpoint.load, **kw)
            if loaded is None:
                raise RecipeError([f"checkpoint.load: no checkpoint in '{r.checkpoint.load}' "
                                   f"(no {ckpt.TRACKER_FILENAME} and no iter_* directory)"])
            _check_ckpt_args(loaded[1].get("args"), d, r, r.checkpoint.load)
            try:
                trainer.load_weights(loaded[1])
            except ValueError as e:
                raise RecipeError([f"checkpoint.load: {r.checkpoint.load}: {e}"]) from None
            resumed = f"weights from {r.checkpoint.load} (iteration 0)"
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        metrics.write({"kind": "start", "iteration": trainer.state.iteration, "world_size": ctx.world_size,
                       "data_parallel_size": ctx.dp_size, "grad_accum_steps": d.grad_accum_steps,
                       "device": name, "precision": t.precision, "fused": cfg.fused, "compile": step.compile,
                       "optimizer": opt_impl, "n_params": n_params, "flops_per_token": fpt,
                       "peak_tflops": peak / 1e12 if peak else None, "torch": torch.__version__,
                       "recipe": r.source, "start": resumed})
        metrics.print(f"hpcmeg train: {r.run.name} | {ctx.world_size} process(es) on {name} | DP {ctx.dp_size} x "
                      f"micro {t.micro_batch_size} x accum {d.grad_accum_steps} = global {t.global_batch_size} | "
                      f"{n_params / 1e6:.1f} M params | {t.precision} | fused {cfg.fused} | compile {step.compile} | "
                      f"{opt_impl} | {resumed}")
        planned = derive(r).world_size
        if planned != ctx.world_size:
            metrics.print(f"note: the recipe plans {planned} process(es) (cluster section), {ctx.world_size} are "
                          f"running; gradient accumulation {d.grad_accum_steps} keeps the global batch")
        return trainer, ctx
    except BaseException:
        ctx.destroy()
        raise


def _write_status(run_dir: str, status: str, iteration, code: int, reason: str = "") -> None:
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, STATUS_FILE)
    write_text_atomic(path, json.dumps({"status": status, "iteration": iteration, "exit_code": code,
                                        "reason": reason, "time": time.time()}))


def _show_warnings(caught: list, tag: str) -> None:
    """A skipped checkpoint is one line on stderr (not Python's two-line warning with a source
    line); any other warning recorded meanwhile is shown as Python would have shown it."""
    from hpcmeg.train.checkpoint import CheckpointWarning

    for w in caught:
        if issubclass(w.category, CheckpointWarning):
            print(f"{tag}: warning: {one_line(w.message)}", file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def _record_failure(run_dir: str, iteration, code: int, reason: str) -> None:
    """train_status.json for the supervisor, on a failure already reported on stderr. Only into an
    existing run directory (a run that failed before writing anything leaves nothing behind), and
    a status that cannot be written (the directory is what failed) must not replace that report."""
    if os.path.isdir(run_dir):
        try:
            _write_status(run_dir, "failed", iteration, code, reason)
        except OSError:
            pass


def _wall_clock_end(r: Recipe, ctx) -> float | None:
    """Earliest of the Slurm job's end time (asked once, by rank 0) and train.exit_duration_minutes."""
    from hpcmeg.train.signals import slurm_job_end_time

    end = slurm_job_end_time() if ctx.is_rank0 and os.environ.get("SLURM_JOB_ID") else None
    end = ctx.all_reduce_max(int(end) if end else -1)  # rank 0's answer reaches everyone
    ends = [float(end)] if end > 0 else []
    if r.train.exit_duration_minutes:
        ends.append(time.time() + 60.0 * r.train.exit_duration_minutes)
    return min(ends) if ends else None


def train(r: Recipe, *, environ=None, exit_interval: int | None = None, on_built=None) -> int:
    """Train `r` in this process group; returns an exit code (see the module docstring).

    on_built(trainer) runs after everything is built and before the first step (hooks for fault
    injection in tests, or extra instrumentation)."""
    from hpcmeg.parallel.context import DeviceUnavailableError
    from hpcmeg.train.checkpoint import (CheckpointLoadError, CheckpointWarning, UnreadableCheckpointError,
                                         UnsafeCheckpointError)
    from hpcmeg.train.signals import ExitSignal, WallTimeGuard
    from hpcmeg.train.trainer import TrainingDiverged

    env = dist_env(environ)
    tag = f"hpcmeg train [rank {env.rank}]" if env.world_size > 1 else "hpcmeg train"
    run_dir = derive(r).run_dir
    sig = ExitSignal().install()  # first: a SIGTERM during start-up must not kill us half-way
    trainer = ctx = None
    guard = WallTimeGuard(None, WALLTIME_MARGIN_S)

    def stop():
        if sig.flag:
            return f"signal {sig.received.name}"
        if guard.should_stop():
            return f"wall-time guard ({guard.remaining_s():.0f} s left)"
        return None

    try:
        caught: list = []
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", CheckpointWarning)
                trainer, ctx = build_trainer(r, env, stop=stop, exit_interval=exit_interval,
                                             on_step_time=guard.record_step, on_save_time=guard.record_save)
        except (CheckpointLoadError, UnsafeCheckpointError, UnreadableCheckpointError):
            # the error line names the checkpoint files already: it alone is the report
            caught = [w for w in caught if not issubclass(w.category, CheckpointWarning)]
            raise
        finally:
            _show_warnings(caught, tag)
        guard.end_time = _wall_clock_end(r, ctx)
        if on_built is not None:
            on_built(trainer)
        out = trainer.run()
        code = EXIT_OK if out.status == "finished" else EXIT_REQUEUE
        if env.rank == 0:
            _write_status(run_dir, out.status, out.iteration, code, out.reason)
        return code
    except RecipeError as e:
        if env.rank == 0:
            for line in e.problems:
                print(f"{tag}: {line}", file=sys.stderr)
            _record_failure(run_dir, None, EXIT_BAD_RECIPE, e.problems[0])
        return EXIT_BAD_RECIPE
    except (TokenIdError, DeviceUnavailableError) as e:  # the recipe does not fit the data / the machine
        print(f"{tag}: {one_line(e)}", file=sys.stderr)
        if env.rank == 0:
            _record_failure(run_dir, trainer.state.iteration if trainer else None, EXIT_BAD_RECIPE, one_line(e))
        return EXIT_BAD_RECIPE
    except (TrainingDiverged, OSError, ValueError, CheckpointLoadError, UnsafeCheckpointError,
            UnreadableCheckpointError) as e:  # data and runtime faults whose message names the file and fix
        print(f"{tag}: {one_line(e)}", file=sys.stderr)
        if env.rank == 0:
            _record_failure(run_dir, trainer.state.iteration if trainer else None, EXIT_ERROR, one_line(e))
        return EXIT_ERROR
    except Exception as e:  # noqa: BLE001 - report, mark, exit non-zero
        traceback.print_exc()
        print(f"{tag}: error: {type(e).__name__}: {e}", file=sys.stderr)
        if env.rank == 0:
            _record_failure(run_dir, trainer.state.iteration if trainer else None, EXIT_ERROR, str(e))
        return EXIT_ERROR
    finally:
        try:
            if trainer is not None:
                trainer.wait_for_save()
                trainer.metrics.close()
        finally:
            if ctx is not None:
                ctx.destroy()
            sig.restore()


def cli_train(args) -> int:
    r = load_recipe(args.recipe, args.overrides, args.profile)
    return train(r)


def cli_prepare_cache(args) -> int:
    """Build the GPT dataset index cache the training run will load (run it on a login node)."""
    from hpcmeg.data.index_cache import prepare_cache
    from hpcmeg.train.data import blend_arg, check_inputs_exist, dataset_config, index_cache_dir, requested_samples

    r = load_recipe(args.recipe, args.overrides, args.profile)
    d = derive(r)
    try:
        check_inputs_exist(r, d)
        counts = requested_samples(r, d)
        t0 = time.time()
        out = prepare_cache(dataset_config(r, d), blend_arg(r, d), counts)
    except (OSError, ValueError) as e:
        print(f"hpcmeg prepare-cache: {one_line(e)}", file=sys.stderr)
        return EXIT_ERROR
    for name, n, ds in zip(("train", "valid", "test"), counts, out):
        print(f"{name}: requested {n} samples, built {len(ds) if ds is not None else 0}")
    print(f"index cache ready in {index_cache_dir(r, d)} ({time.time() - t0:.1f} s)")
    return EXIT_OK
