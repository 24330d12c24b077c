"""One optimizer step over a list of micro batches: forward/backward, reduce, clip, step.

Contract:
  TrainStep(model, buffer, optimizer, precision="bf16"|"fp16"|"fp32", grad_clip=1.0,
            loss_scaler=DynamicLossScaler|None, compile=False, device="cuda", dp_size=1,
            compile_mode=None, compile_options=None, compile_layers=False, cuda_graphs=True)
    buffer: the ParamAndGradBuffer that owns the model's parameters and gradients
    (hpcmeg/parallel/grad_buffer.py); optimizer: the FlatAdamW over it (hpcmeg/train/flat_adamw.py).
  .launch(micro_batches) -> PendingStep: queues the whole step on the device and returns without a
    host sync (bf16/fp32); .result() later waits for just this step's two numbers (copied to pinned
    host memory behind the step; the caller may add its own device values to that copy with
    add_check). fp16 syncs once inside launch (the overflow check must decide whether to step), so
    its loss and skip are known at once.
  .run(micro_batches) = launch(...).result() -> StepResult(loss, grad_norm, skipped, loss_scale)
    micro_batches: list of (tokens [b,s], labels [b,s]) or (tokens, labels, loss_mask [b,s]).
    loss: mean per-token loss over ALL micro batches of this rank (masked tokens excluded).
    Gradients: each micro batch's backward is of its loss sum x scale / (this rank's step tokens x
    dp_size); the buffer sums micro batches and data-parallel ranks, so the reduced gradient is that
    of the global mean (equal token counts per rank, as Megatron assumes) and k micro batches of b
    equal one batch of k*b.
    grad_norm: global L2 norm of the (unscaled) gradients before clipping; nan on a skipped step.
    skipped: True when fp16 found inf/nan gradients (step skipped, scale lowered).
  The LR schedule is the caller's: set param_group["lr"] before launch(). NaN handling is the
  caller's too: the result holds the loss as computed. The trainer keeps one step in flight
  (it checks step k's numbers after queueing step k+1) so the GPU never waits for the host.
  .on_phase(phase): told "optimizer" when launch() reaches the optimizer half (_apply), so a rank
    stuck there is told from one stuck in its forward/backward; a no-op unless the trainer sets it
    (its progress report, hpcmeg/heartbeat.py's phases).
compile_layers: each transformer layer compiled on its own instead of the whole model
(hpcmeg/parallel/overlap.py: the data-parallel reduction then overlaps the backward); its CUDA
default is default_cuda_compile_options() without CUDA graphs (the buffer's collectives run between
the layers' regions). cuda_graphs False: the same default without CUDA graphs (rank_step's choice
wherever collectives run inside the compiled model: tensor parallelism).
compile_mode / compile_options go to torch.compile; with neither given on CUDA the default is
default_cuda_compile_options() (CUDA graphs: the buffer's gradient hooks run in eager autograd after
the graphed backward and copy the gradients out of the graph's memory; Inductor's mix-order
reduction off). Never max-autotune (compile time); coordinate_descent_tuning did not finish
compiling within the benchmark's budget.
Precision: the buffer's parameter dtype decides. bf16/fp16 parameters (fp32 masters in FlatAdamW)
run without autocast; fp32 parameters with precision bf16/fp16 run under autocast (CPU);
"fp16" adds dynamic loss scaling. Measurements: bench/results/train_throughput*.md.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn

from hpcmeg.parallel import overlap
from hpcmeg.train.loop_state import no_progress
from hpcmeg.train.loss_scale import DynamicLossScaler

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def default_cuda_compile_options() -> dict:
    """torch.compile options for a CUDA step when the caller gives none. Measured on the H200:
    * CUDA graphs: +4-8% tokens/s and less memory (bench/results/train_throughput_h200_124M.md);
    * Inductor's mix-order reduction off: with it, each LayerNorm backward writes [rows/16, h] fp32
      partials of dw and db and the wrapper sums them with two aten sums over dim 0, 14.4 us each at
      124M (~0.75 ms per micro batch); without it the same gradients are two-stage Triton reductions:
      ~12 us less per LayerNorm (bench/results/reduction_probe_h200_s7.json). Inductor's own
      environment variable TORCHINDUCTOR_MIX_ORDER_REDUCTION, when set, decides instead."""
    opts = {"triton.cudagraphs": True}
    if "TORCHINDUCTOR_MIX_ORDER_REDUCTION" not in os.environ:
        opts["triton.mix_order_reduction"] = False
    return opts


@dataclass
class StepResult:
    loss: float
    """Mean per-token loss over this step's micro batches (this rank only)."""
    grad_norm: float
    """Global L2 norm of the unscaled gradients before clipping (nan when skipped)."""
    skipped: bool
    """fp16 only: the step found inf/nan gradients and was not applied."""
    loss_scale: float | None
    """fp16: the loss scale used by this step; else None."""


class PendingStep:
    """A queued step. `skipped` / `loss_scale` are known at once; loss and grad norm, plus the
    values queued with add_check(), come from result() / checked(), which wait for this step only."""

    def __init__(self, skipped: bool, loss_scale: float | None, vals: torch.Tensor | None = None,
                 done: StepResult | None = None):
        self.skipped, self.loss_scale = skipped, loss_scale
        self.vals = vals  # device fp32 [2] (loss, grad norm); None when `done` is already known
        self._done, self._host, self._event = done, None, None
        self._queued = self._fetched = False
        self._n_extra, self._extra = 0, []

    def add_check(self, extra: torch.Tensor | None = None) -> None:
        """Queue the device->host copy of vals (+ extra, a few numbers computed on the device after
        the step, e.g. an agreed stop code): non-blocking into pinned memory, then an event. At most
        once per step, right after launch, so the copy sits behind this step and before the next."""
        if self._queued:
            raise RuntimeError("PendingStep.add_check: already queued")
        self._queued = True
        parts = [self.vals] if self.vals is not None else []
        if extra is not None:
            parts.append(extra.float().reshape(-1))
            self._n_extra = parts[-1].numel()
        if not parts:
            return
        flat = torch.cat(parts)
        if flat.is_cuda:
            self._host = torch.empty(flat.numel(), dtype=torch.float32, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = flat

    def _fetch(self) -> None:
        if self._fetched:
            return
        if not self._queued:
            self.add_check()
        if self._event is not None:
            self._event.synchronize()
        vals = self._host.tolist() if self._host is not None else []
        self._extra = vals[len(vals) - self._n_extra:] if self._n_extra else []
        if self._done is None:
            self._done = StepResult(vals[0], vals[1], self.skipped, self.loss_scale)
        self._host = self._event = None
        self._fetched = True

    def result(self) -> StepResult:
        self._fetch()
        return self._done

    def checked(self) -> list[float]:
        """The values queued with add_check(extra=...), as floats."""
        self._fetch()
        return self._extra


class TrainStep:
    def __init__(self, model: nn.Module, buffer, optimizer, precision: str = "bf16",
                 grad_clip: float = 1.0, loss_scaler: DynamicLossScaler | None = None,
                 compile: bool = False, device: str | torch.device = "cuda", dp_size: int = 1,
                 compile_mode: str | None = None, compile_options: dict | None = None,
                 compile_layers: bool = False, cuda_graphs: bool = True):
        if precision not in _AUTOCAST:
            raise ValueError(f"TrainStep: precision={precision!r}; use one of {list(_AUTOCAST)}")
        if precision == "fp16" and loss_scaler is None:
            loss_scaler = DynamicLossScaler()
        self.model, self.buffer, self.optimizer, self.precision = model, buffer, optimizer, precision
        self.grad_clip, self.loss_scaler = grad_clip, (loss_scaler if precision == "fp16" else None)
        self.device = torch.device(device)
        self.dp_size = dp_size
        # fused_ce 'backward_in_forward': the LM head runs its backward GEMMs in the forward on the
        # per-token loss weights this step will backpropagate, so the forward is given them
        cfg = getattr(model, "cfg", None)
        self.pass_loss_weights = bool(getattr(cfg, "fused", False)) and getattr(cfg, "fused_ce", "") == "backward_in_forward"
        if compile_mode and compile_options:
            raise ValueError("TrainStep: give compile_mode or compile_options, not both (torch.compile's rule)")
        if compile and not compile_mode and compile_options is None and self.device.type == "cuda":
            compile_options = default_cuda_compile_options()
            if compile_layers or not cuda_graphs:
                compile_options.pop("triton.cudagraphs")
        self.compile_layers = compile and compile_layers
        self.compile, self.compile_mode, self.compile_options = compile, compile_mode, compile_options
        self.cudagraphs = compile and bool((compile_mode and "overhead" in compile_mode)
                                           or (compile_options or {}).get("triton.cudagraphs"))
        self._compiled: nn.Module | None = None
        # low-precision parameters (fp32 masters in the optimizer) run as they are; fp32 parameters
        # with precision bf16/fp16 run under autocast
        self.autocast_dtype = _AUTOCAST[precision] if buffer.param_dtype == torch.float32 else None
        self.on_phase = no_progress

    def forward_module(self) -> nn.Module:
        """The module a step calls: the model, or its torch.compile wrapper (built once)."""
        if not self.compile:
            return self.model
        if self._compiled is None:
            kw = {"mode": self.compile_mode} if self.compile_mode else {"options": self.compile_options}
            if self.compile_layers:
                overlap.compile_layers(self.model, **kw)
                self._compiled = self.model
            else:
                self._compiled = torch.compile(self.model, **kw)
        return self._compiled

    def compile_scope(self) -> str:
        """What this step compiles, in the start line's words."""
        if not self.compile:
            return "eager"
        if self.compile_layers:
            return "per layer, the DP reduction overlapping the backward; no CUDA graphs"
        return "whole model, CUDA graphs" if self.cudagraphs else "whole model; no CUDA graphs"

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def run(self, micro_batches: list) -> StepResult:
        return self.launch(micro_batches).result()

    def launch(self, micro_batches: list) -> PendingStep:
        if not micro_batches:
            raise ValueError("TrainStep.run: micro_batches is empty")
        if self.cudagraphs:
            # CUDA graphs: the previous step's outputs are dead (loss read, grads moved to the buffer)
            torch.compiler.cudagraph_mark_step_begin()
        n_tok = self._token_count(micro_batches)
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        # 1/dp here and a SUM over ranks in the buffer = the mean over ranks (power-of-two dp sizes
        # scale exactly, so DP2 gradients equal DP1 with accumulation 2 bit for bit in fp32)
        factor = scale / (n_tok * self.dp_size)
        self.buffer.start_step(len(micro_batches))
        loss_sum = self._forward_backward(micro_batches, factor)
        self.buffer.finish_grads()
        return self._apply(loss_sum / n_tok, scale)

    def _token_count(self, micro_batches: list):
        """Tokens of this rank's step (masked ones excluded), so each micro batch's loss is a share of ONE mean."""
        masks = [mb[2] if len(mb) > 2 else None for mb in micro_batches]
        if all(m is None for m in masks):  # a plain number: no host->device copy (a sync) per step
            return float(sum(mb[1].numel() for mb in micro_batches))
        return sum((m.sum() if m is not None else torch.tensor(mb[1].numel()))
                   for m, mb in zip(masks, micro_batches)).to(self.device, torch.float32)

    def _micro_loss(self, per_tok: torch.Tensor, mb) -> torch.Tensor:
        """The fp32 sum of one micro batch's per-token losses, masked tokens excluded."""
        if len(mb) > 2 and mb[2] is not None:
            per_tok = per_tok * mb[2].to(self.device, per_tok.dtype)
        return per_tok.float().sum()

    def _loss_weights(self, mb, labels: torch.Tensor, factor) -> torch.Tensor:
        """d (micro loss sum x factor) / d per-token loss, fp32 [b, s], as autograd will compute it:
        factor rounded to fp32, times the loss mask (0 / 1, exact)."""
        if isinstance(factor, torch.Tensor):
            w = factor.to(self.device, torch.float32).expand(labels.shape).clone()
        else:
            w = torch.full(labels.shape, factor, dtype=torch.float32, device=self.device)
        if len(mb) > 2 and mb[2] is not None:
            w = w * mb[2].to(self.device, torch.float32)
        return w

    def _forward_backward(self, micro_batches: list, factor) -> torch.Tensor:
        """Every micro batch's forward and backward (the buffer's hooks take the gradients); returns the
        fp32 sum of this rank's per-token losses."""
        fwd = self.forward_module()
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        for mb in micro_batches:
            tokens = mb[0].to(self.device, non_blocking=True)
            labels = mb[1].to(self.device, non_blocking=True)
            with self.autocast():
                if self.pass_loss_weights:
                    per_tok = fwd(tokens, labels, loss_weights=self._loss_weights(mb, labels, factor))
                else:
                    per_tok = fwd(tokens, labels)
            mb_sum = self._micro_loss(per_tok, mb)
            (mb_sum * factor).backward()
            loss_sum += mb_sum.detach()
        return loss_sum

    @torch.no_grad()
    def eval_loss(self, tokens: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """fp64 [masked loss sum, token count] of one evaluation batch (the model in eval mode)."""
        with self.autocast():
            per_tok = self.model(tokens, labels)
        return torch.stack([(per_tok.float() * mask).sum().double(), mask.sum().double()])

    def _apply(self, mean_loss: torch.Tensor, scale: float) -> PendingStep:
        """Unscale and check (fp16), clip, step: the optimizer half of a step, queued on the device."""
        self.on_phase("optimizer")
        if self.loss_scaler is not None:
            found_inf = self.optimizer.unscale_and_check_(1.0 / scale)
            if found_inf.item() > 0:  # the one sync fp16 needs before stepping
                self.loss_scaler.update(True)
                return PendingStep(True, scale, done=StepResult(mean_loss.item(), math.nan, True, scale))
            self.loss_scaler.update(False)
        gnorm = self.optimizer.clip_grad_norm_(self.grad_clip)
        self.optimizer.step()
        vals = torch.stack([mean_loss, gnorm.float().to(self.device)])  # stays on the device: no sync
        return PendingStep(False, scale if self.loss_scaler is not None else None, vals)
