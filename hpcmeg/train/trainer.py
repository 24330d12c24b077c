"""The training loop: steps, logging, evaluation, checkpoints, and the agreed stop.

Contract
- `Trainer(...)` receives every part already built (hpcmeg/train/build.py builds them): a narrow
  `LoopConfig` (the numbers the loop needs, nothing else of the recipe), model, optimizer, LR
  schedule, TrainStep, datasets, metrics logger, parallel context, and a `stop` callable returning
  a reason string when this rank wants to stop (exit signal, wall time).
  `run() -> Outcome` trains from `state.iteration` to config.train_iters.
- One iteration: schedule.apply -> TrainStep.launch(grad_accum_steps micro batches), queued
  without a host sync -> prefetch the next batches -> counters (iteration, consumed samples; the
  schedule advances only when the step was applied, as Megatron's) -> queue, on the device behind
  the step, this rank's code (2 = non-finite loss or grad norm on an applied step, 1 = stop
  requested, 0 = go on), its all-reduce MAX and the copy of loss, grad norm and agreed code to
  pinned host memory -> settle the PREVIOUS iteration (wait for its copy only: one step stays in
  flight, so the GPU never idles while the host decides, with NCCL too) -> every rank takes the
  same decision at the same iteration: 2 raises, 1 stops after the iteration already queued.
  Before a log, eval, save, exit interval, stop or the last iteration the current iteration is
  settled too, so nothing is logged or saved unchecked -> log (every log_interval; DP-averaged
  loss) -> eval (every eval_interval) -> save (every save_interval, or now when stopping).
  A stop signal is therefore acted on one or two steps after it arrives (the wall-time guard's
  margin counts two steps); an exit interval stops exactly there.
- Non-finite loss (bf16 / fp32, or fp16 on a step that was not skipped) raises TrainingDiverged
  naming the iteration; nothing is saved after it. fp16 overflow is TrainStep's: the step is skipped
  and the scale lowered; the loop only counts it.
- Checkpoints: Megatron legacy layout via hpcmeg/checkpoint/store.py (args namespace, nested model,
  optimizer {optimizer, grad_scaler} (gathered from every data-parallel shard: the same layout with
  or without the distributed optimizer, so a run resumes at any DP size), opt_param_scheduler,
  rng_state [one entry per shard file: all DP ranks share the seed, so dp rank 0's RNG state is
  everyone's; with TP each shard's entry carries its rank's TP stream in rng_tracker_states], the
  resolved recipe, consumed samples).
  `load_state(ckpt)` restores all of it; `load_weights(ckpt)` only the model (a 'release' start).
- Exactness on CPU: data order is a function of consumed samples, dropout draws come from the
  global torch RNG which is saved and restored, evaluation and data loading draw nothing from it.
- Progress (hang detection, hpcmeg/heartbeat.py): `progress(phase, iteration=None)` is told where the
  loop is: "init" with the iteration the run starts from, then per iteration N (in progress) "data"
  (its batches; also the next batches' prefetch, issued after the launch: a rank stuck reading is
  behind the ranks waiting for it), "forward-backward" (step.launch), "optimizer" (the step's own
  on_phase, at the start of TrainStep._apply), "sync" (the ranks' agreement and the wait for the
  step's numbers), then "eval" / "checkpoint" at the iteration just completed, "done" at the end.
  Each call is a few attribute stores (the heartbeat's thread does the I/O).
  Waits for the other ranks outside the step are reported with waiting=True (the heartbeat's
  `waiting`): the save's barriers (hpcmeg/train/waits.py SaveBarrier) and the evaluation's all-reduce.
  `fault(point, iteration)` (hpcmeg/train/faults.py, a test's injected hang; a no-op otherwise) is
  called in the data fetch of each iteration and at the save's barrier after the shard write.
- Collective timeout (hpcmeg/train/waits.py CollectiveTimeout): 30 minutes until this process's third
  completed iteration, then max(config.collective_timeout_factor x median step,
  config.collective_timeout_floor_s), and max(config.collective_timeout_long_s, that) while saving or
  evaluating (build.py: twice the recipe's cluster.hang_* allowances): a rank that stopped makes the
  others fail in minutes, not half an hour.
"""
from __future__ import annotations

import gc
import math
import time
from typing import Callable

import torch

from hpcmeg.checkpoint.safe import capture_rng_state, restore_rng_state
from hpcmeg.checkpoint.store import save_checkpoint
from hpcmeg.megatron.args import checkpoint_models, make_checkpoint_dict
from hpcmeg.parallel.pipeline.stages import load_megatron_models, megatron_models
from hpcmeg.train.data import TrainBatches
from hpcmeg.train.loop_state import (LogWindow, LoopConfig, LoopState, Outcome, TrainingDiverged,  # noqa: F401
                                     TrainState, no_fault, no_progress)
from hpcmeg.train.waits import CollectiveTimeout, SaveBarrier


class Trainer:
    def __init__(self, *, config: LoopConfig, ctx, model, optimizer, schedule, loss_scaler, step,
                 train_dataset, eval_set, metrics, throughput, megatron_args: Callable[[TrainState], object],
                 recipe_dict: dict, stop: Callable[[], str | None] = lambda: None,
                 on_step_time: Callable[[float], None] = lambda s: None,
                 on_save_time: Callable[[float], None] = lambda s: None, exit_interval: int | None = None,
                 rng_streams=None, progress: Callable[..., None] = no_progress,
                 fault: Callable[..., None] = no_fault):
        self.config, self.ctx = config, ctx
        self.model, self.optimizer = model, optimizer
        self.schedule, self.loss_scaler, self.step = schedule, loss_scaler, step
        self.train_dataset, self.eval_set = train_dataset, eval_set
        self.metrics, self.throughput = metrics, throughput
        self.megatron_args, self.recipe_dict = megatron_args, recipe_dict
        self.stop, self.on_step_time, self.on_save_time = stop, on_step_time, on_save_time
        self.exit_interval = exit_interval
        self.rng_streams = rng_streams  # the TP stream (hpcmeg/parallel/random.py), None at TP 1
        self.progress, self.fault = progress, fault  # the heartbeat, an injected fault (module docstring)
        step.on_phase = progress  # the step reports "optimizer" itself (TrainStep._apply)
        self.state = TrainState()
        self._pending = None  # async checkpoint handle
        self._last_saved = None
        self.timeout = CollectiveTimeout(ctx, config.collective_timeout_factor, config.collective_timeout_floor_s,
                                         config.collective_timeout_long_s)

    # --------------------------------------------------------------------------------- loop

    def run(self) -> Outcome:
        try:
            return self._run()
        finally:
            gc.unfreeze()  # give the frozen objects back to the collector (many runs in one process)

    def _run(self) -> Outcome:
        config, state = self.config, self.state
        n_iters = config.train_iters
        self.progress("init", state.iteration)  # where the run starts from (a resume is loaded by now)
        if state.iteration >= n_iters:
            self.metrics.print(f"already at iteration {state.iteration} of {n_iters}: nothing to train")
            self.progress("done", state.iteration)
            return Outcome("finished", state.iteration)
        batches = TrainBatches(self.train_dataset, state.consumed_train_samples, config.micro_batch_size,
                               config.grad_accum_steps, self.ctx.dp_rank, self.ctx.dp_size, self.ctx.device,
                               num_workers=config.num_workers, seed=config.seed)
        win = LogWindow(after_resume=state.iteration > 0)
        self.model.train()
        loop = LoopState(win=win, first=state.iteration, t_iter=time.perf_counter())
        while state.iteration < n_iters:
            handle, lr, at_exit_interval = self._launch_iteration(batches, loop)
            it = state.iteration
            do_log = it % config.log_interval == 0 or it == n_iters
            do_eval = bool(config.eval_interval and it % config.eval_interval == 0 and self.eval_set)
            do_save = bool(config.save_interval and it % config.save_interval == 0)
            stopping = self._settle_due(loop, (handle, it, lr), do_log or do_eval or do_save or at_exit_interval)
            if it == loop.first + 3:
                # compile, CUDA-graph capture and the loaders are built by now: move their objects
                # out of the collector's reach, so later GC passes stay short (a full collection
                # over Dynamo's caches can stall the host for tens of ms, longer than the queued step)
                gc.collect()
                gc.freeze()
            outcome = self._after_iteration(loop, stopping, do_log, do_eval, do_save)
            if outcome is not None:
                return outcome
        if self._last_saved != state.iteration:
            self.save()
        self.wait_for_save()
        self.progress("done", state.iteration)
        return Outcome("finished", state.iteration)

    def _launch_iteration(self, batches: TrainBatches, loop: LoopState) -> tuple:
        """Queue one iteration without a host sync: LR, the step, the next batches' prefetch, the
        counters, and behind the step this rank's agreement code (with its stop reason, if any).
        Returns (step handle, lr, whether this iteration is at the exit interval)."""
        state, gbs, progress = self.state, self.config.global_batch_size, self.progress
        it = state.iteration + 1
        lr = self.schedule.apply(self.optimizer)
        progress("data", it)
        self.fault("data", it)
        try:
            micro = next(batches)
        except StopIteration:
            raise RuntimeError(f"the training dataset ran out at iteration {state.iteration} "
                               f"({state.consumed_train_samples} samples consumed)") from None
        progress("forward-backward", it)
        handle = self.step.launch(micro)
        progress("data", it)  # a stuck read here holds iteration `it`'s agreement back: reported at `it`
        batches.prefetch()  # the next step's loads/copies overlap this step's GPU work
        state.iteration = it
        state.consumed_train_samples += gbs
        if not handle.skipped:  # known at launch: fp16 decides its skip inside launch()
            self.schedule.step(gbs)
        at_exit_interval = bool(self.exit_interval and state.iteration % self.exit_interval == 0)
        reason = self.stop()
        if reason is None and at_exit_interval:
            reason = f"exit interval {self.exit_interval}"
        loop.last_reason = reason or loop.last_reason
        progress("sync", it)
        self._queue_check(handle, reason)
        return handle, lr, at_exit_interval

    def _settle_due(self, loop: LoopState, current: tuple, check_now: bool) -> bool:
        """Settle the PREVIOUS iteration now that `current` (handle, iteration, lr) is queued behind
        it: the GPU stays busy while the host waits for its numbers and its agreed code (a one-step
        lag). `current` is settled too when check_now (a log, eval, save or exit interval comes next)
        or a rank asked to stop. Raises TrainingDiverged; True when every rank stops after `current`."""
        prev, loop.pending = loop.pending, current
        self.progress("sync", current[1])
        stopping = False
        if prev is not None:
            code = self._settle(prev, loop.win)
            if code >= 2:
                self._diverged(prev)
            stopping = code == 1  # a rank asked at it-1: everyone stops after `it`, already queued
        if stopping or check_now:
            # log, eval, save or stop next: this iteration must be checked first
            code = self._settle(current, loop.win)
            loop.pending = None
            if code >= 2:
                self._diverged(current)
            stopping = stopping or code == 1
        return stopping

    def _after_iteration(self, loop: LoopState, stopping: bool, do_log: bool, do_eval: bool,
                         do_save: bool) -> Outcome | None:
        """Report the iteration's time, then log, evaluate, stop (save first: the Outcome) or save as
        due; eval and save time stay out of the step timing."""
        state = self.state
        now = time.perf_counter()
        self._timed(now - loop.t_iter)
        if do_log:
            self._log(loop.win, now)
            loop.win = LogWindow()
            now = time.perf_counter()
        if do_eval:
            self.evaluate()
            now = time.perf_counter()
            loop.win.t0 = now
        if stopping and state.iteration < self.config.train_iters:  # a stop on the last step is just the end
            reason = loop.last_reason or "stop requested on another rank"
            self.save()
            self.metrics.write({"kind": "event", "what": "preempted", "iteration": state.iteration, "reason": reason})
            self.metrics.print(f"saved iteration {state.iteration} and stopping ({reason}): resume me")
            return Outcome("preempted", state.iteration, reason)
        if do_save:
            self.save()
            now = time.perf_counter()
            loop.win.t0 = now
        loop.t_iter = now
        return None

    def _timed(self, seconds: float) -> None:
        """One completed iteration's wall time: to the caller and the collective timeout."""
        self.on_step_time(seconds)
        shortened = self.timeout.timed(seconds)
        if shortened is not None:
            self.metrics.write({"kind": "event", "what": "collective_timeout", "iteration": self.state.iteration,
                                "seconds": shortened[0], "median_step_s": round(shortened[1], 6)})

    def _queue_check(self, handle, reason: str | None) -> None:
        """Queue, behind the step just launched, this iteration's agreement code: 2 when this rank's
        loss or grad norm is non-finite on an applied step, else 1 when it wants to stop, else 0;
        MAX over all ranks (an all-reduce in stream order: with NCCL nothing waits on the host);
        then the step's numbers and the agreed code are copied to the host (PendingStep.add_check)."""
        if handle.vals is not None and not handle.skipped:
            code = (~torch.isfinite(handle.vals).all()).to(torch.int64).reshape(1) * 2
        else:
            code = torch.zeros(1, dtype=torch.int64, device=self.ctx.device)
        if reason:
            code.clamp_(min=1)
        self.ctx.all_reduce_max_(code)
        handle.add_check(code)

    def _settle(self, pending, win: LogWindow) -> int:
        """Wait for a queued iteration's loss, grad norm and agreed code (0 go on, 1 stop, 2 a rank
        diverged); add the numbers to the log window."""
        handle, _, lr = pending
        res = handle.result()
        win.add(res, lr)
        return int(handle.checked()[0])

    def _diverged(self, pending):
        handle, iteration, _ = pending
        res = handle.result()
        mine = not res.skipped and not (math.isfinite(res.loss) and math.isfinite(res.grad_norm))
        what = f"loss {res.loss}, grad norm {res.grad_norm}" if mine else "on another rank"
        raise TrainingDiverged(f"non-finite loss or gradient at iteration {iteration} ({what}, "
                               f"{self.config.precision}); stopping without saving. Lower train.lr, raise "
                               f"train.lr_warmup_iters or try train.precision=fp32 to debug")

    def _log(self, win: LogWindow, now: float) -> None:
        # one small all-reduce per log interval: the loss is averaged over data-parallel ranks
        s = torch.tensor([win.loss_sum, float(win.n)], dtype=torch.float64,
                         device=self.ctx.device if self.ctx.backend == "nccl" else "cpu")
        self.ctx.dp_mean_(s)
        loss = float(s[0] / s[1]) if s[1] > 0 else math.nan
        from hpcmeg.train.metrics import peak_memory_gib

        # a window shorter than log_interval (the first after a resume that was not at a multiple of it,
        # or the last one) says how many iterations its loss averages
        n = win.n
        partial = win.steps < self.config.log_interval
        note = (f"avg of {n} iteration{'s' if n != 1 else ''}{' since resume' if win.after_resume else ''}"
                if partial else None)
        rec = {"iteration": self.state.iteration, "consumed_samples": self.state.consumed_train_samples,
               "loss": loss, "loss_iterations": n, "loss_note": note, "lr": win.lr, "grad_norm": win.grad_norm,
               "loss_scale": win.loss_scale,
               "skipped": win.skipped, **self.throughput.compute(win.steps, now - win.t0),
               "peak_mem_gib": peak_memory_gib(self.ctx.device)}
        bubble = getattr(self.step, "bubble", None)  # pipeline: the last step's measured and ideal idle share
        if bubble is not None:
            rec["pipeline_bubble"], rec["pipeline_bubble_ideal"] = bubble
        self.metrics.train(rec)

    # --------------------------------------------------------------------------------- eval

    def evaluate(self) -> float:
        """Mean per-token loss over the fixed evaluation set, averaged over data-parallel ranks."""
        self.progress("eval", self.state.iteration)
        with self.timeout.long():
            return self._evaluate()

    @torch.no_grad()
    def _evaluate(self) -> float:
        t0 = time.perf_counter()
        self.model.eval()
        dev = self.ctx.device
        total = torch.zeros(2, dtype=torch.float64, device=dev)
        for tokens, labels, mask in self.eval_set:
            tokens, labels = tokens.to(dev, non_blocking=True), labels.to(dev, non_blocking=True)
            mask = mask.to(dev, non_blocking=True)
            total += self.step.eval_loss(tokens, labels, mask)  # (masked loss sum, tokens) in fp64
        self.model.train()
        self.progress("eval", waiting=True)  # the loss's all-reduces: a wait for the slowest rank
        if self.ctx.distributed and self.ctx.pp_size > 1:  # only the last stage computed it
            torch.distributed.all_reduce(total, group=self.ctx.pp_group)
        if self.ctx.distributed and self.ctx.dp_size > 1:
            torch.distributed.all_reduce(total, group=self.ctx.dp_group)
        val = float(total[0] / total[1])
        self.state.consumed_valid_samples += self.config.eval_iters * self.config.global_batch_size
        self.metrics.eval({"iteration": self.state.iteration, "consumed_samples": self.state.consumed_train_samples,
                           "val_loss": val, "val_ppl": math.exp(val) if val < 50 else None,
                           "eval_time_s": time.perf_counter() - t0})
        return val

    # --------------------------------------------------------------------------------- checkpoints

    def checkpoint_state(self) -> dict | None:
        """This rank's checkpoint dict; None on ranks that do not write a shard (dp_rank != 0). Every
        rank must call it: with the distributed optimizer the optimizer state is gathered here."""
        state = self.state
        opt_state = self.optimizer.state_dict()  # collective when sharded; None off dp rank 0
        if self.ctx.dp_rank != 0:
            return None
        opt = {"optimizer": opt_state,
               "grad_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None}
        return make_checkpoint_dict(
            args=self.megatron_args(state), iteration=state.iteration,
            model=megatron_models(self.model),
            optimizer=opt, opt_param_scheduler=self.schedule.state_dict(), rng_state=[capture_rng_state(self.rng_streams.state_dict() if self.rng_streams else None)],
            recipe=self.recipe_dict,
            data_state={"consumed_train_samples": state.consumed_train_samples,
                        "consumed_valid_samples": state.consumed_valid_samples})

    def save(self) -> None:
        self.progress("checkpoint", self.state.iteration)
        with self.timeout.long():
            self._save()

    def _save(self) -> None:
        self.wait_for_save()
        t0 = time.perf_counter()
        ctx, it, config = self.ctx, self.state.iteration, self.config
        state = self.checkpoint_state()
        self._pending = save_checkpoint(
            config.checkpoint_dir, it, state or {}, tp_rank=ctx.tp_rank,
            pp_rank=ctx.pp_rank, tp_size=ctx.tp_size, pp_size=ctx.pp_size, is_shard_writer=state is not None,
            barrier=SaveBarrier(ctx.barrier, self.progress, self.fault, it), is_global_rank0=ctx.is_rank0,
            keep_last=config.keep_last, async_save=config.async_save)
        self._last_saved = it
        dt = time.perf_counter() - t0
        self.on_save_time(dt)
        self.metrics.write({"kind": "event", "what": "save", "iteration": it, "seconds": round(dt, 3),
                            "dir": config.checkpoint_dir})
        self.metrics.print(f"saved checkpoint iteration {it} to {config.checkpoint_dir} ({dt:.1f} s"
                           f"{', writing in background' if config.async_save else ''})")

    def wait_for_save(self) -> None:
        if self._pending is not None:
            self.progress("checkpoint")
            with self.timeout.long():
                self._pending.wait()
            self._pending = None

    def load_weights(self, state: dict) -> None:
        try:
            models = checkpoint_models(state)
        except KeyError as e:
            raise ValueError(str(e).strip("'\"")) from None
        load_megatron_models(self.model, models)
        self.optimizer.masters_from_params()  # the fp32 masters follow the loaded weights

    def load_state(self, state: dict) -> None:
        """Full resume: model, optimizer, loss scaler, schedule, RNG, counters."""
        self.load_weights(state)
        opt = state.get("optimizer") or {}
        if "optimizer" not in opt:
            raise ValueError("the checkpoint has no optimizer state (saved without it, or not by hpcmeg); "
                             "start from it with checkpoint.load instead (weights only)")
        self.optimizer.load_state_dict(opt["optimizer"])
        if self.loss_scaler is not None and opt.get("grad_scaler"):
            self.loss_scaler.load_state_dict(opt["grad_scaler"])
        self.schedule.load_state_dict(state["opt_param_scheduler"])
        rng = state.get("rng_state")
        if rng:
            tracker = restore_rng_state(rng[0])
            if self.rng_streams is not None:
                self.rng_streams.load_state_dict(tracker)
        data = (state.get("hpcmeg") or {}).get("data_state") or {}
        args = state.get("args")
        self.state = TrainState(
            iteration=int(state["iteration"]),
            consumed_train_samples=int(data.get("consumed_train_samples", getattr(args, "consumed_train_samples", 0))),
            consumed_valid_samples=int(data.get("consumed_valid_samples", getattr(args, "consumed_valid_samples", 0))))
        self._last_saved = self.state.iteration
