"""One optimizer step of a pipeline-parallel rank: the schedule runs the micro batches, the rest is TrainStep's.

Contract
- `PipelineTrainStep(stage_model, buffer, optimizer, p2p, ctx, precision=..., ...)`: the same
  launch()/run() results as TrainStep (hpcmeg/train/step.py), for a rank holding a StageModel
  (hpcmeg/parallel/pipeline/stages.py). The micro-batch loop is the rank's action list
  (parallel/pipeline/schedule.py: 1F1B, or interleaved with virtual_pipeline) executed by
  run_schedule; the loss of each micro batch is computed on the last stage from the labels every
  rank has (the whole pipeline reads the same data), scaled by 1 / (this DP rank's step tokens x dp)
  as without PP, so the gradient is that of the global mean. The loss sum is all-reduced over the
  pipeline group (only the last stage holds it) before the mean is taken: every rank logs and
  checks the same number. Clipping, fp16 unscaling and the optimizer step are TrainStep's (the
  gradient norm is summed over the pipeline group by FlatAdamW's norm groups).
- `bubble`: the last step's measured bubble on this rank (idle / step, runner.StepTiming.bubble) and
  the schedule's (pp-1)/(vpp*M + pp-1) (schedule.bubble_fraction): both shares of the step in [0, 1].
- Without CUDA graphs (several forwards are in flight before their backwards).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hpcmeg.parallel.pipeline.runner import StepTimer, run_schedule
from hpcmeg.parallel.pipeline.schedule import bubble_fraction, make_schedule
from hpcmeg.train.step import TrainStep


class PipelineTrainStep(TrainStep):
    def __init__(self, stage_model, buffer, optimizer, p2p, ctx, *, vpp: int = 1, **kw):
        kw.pop("compile_options", None)
        super().__init__(stage_model, buffer, optimizer, compile_options={}, **kw)
        self.cudagraphs = False
        self.stage, self.p2p, self.ctx, self.vpp = stage_model, p2p, ctx, vpp
        self._fns = [stage_model.stage_fn(v) for v in range(len(stage_model.chunks))]
        if self.compile:
            self._fns = [torch.compile(f) for f in self._fns]
        self.bubble: tuple[float, float] | None = None

    def compile_scope(self) -> str:
        return "per pipeline chunk; no CUDA graphs" if self.compile else "eager"

    def _forward_backward(self, micro_batches: list, factor) -> torch.Tensor:
        pp, M = self.ctx.pp_size, len(micro_batches)
        actions = make_schedule(pp, self.ctx.pp_rank, M, self.vpp)
        dev = self.device

        def first_input(mb):
            return mb[0].to(dev, non_blocking=True)

        sums = []  # each micro batch's unscaled loss sum (last stage only)

        def loss_fn(h, mb):
            mb_sum = self._micro_loss(self.stage.loss(h, mb[1].to(dev, non_blocking=True)), mb)
            sums.append(mb_sum.detach())
            return mb_sum * factor

        timer = StepTimer(dev)
        with self.autocast():
            run_schedule(actions, self._fns, micro_batches, loss_fn, self.p2p, first_input=first_input,
                         on_action=timer)
        loss_sum = (torch.stack(sums).sum() if sums else torch.zeros((), device=dev)).float().reshape(1)
        if self.ctx.distributed and pp > 1:  # only the last stage computed it
            dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM, group=self.ctx.pp_group)
        t = timer.result()
        self.bubble = (t.bubble, bubble_fraction(pp, self.vpp, M))
        return loss_sum.reshape(())

    @torch.no_grad()
    def eval_loss(self, tokens: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Forward only through the pipeline: each rank runs its chunks in order, receiving from the
        previous virtual stage and sending to the next (a chain: it cannot deadlock); the last stage
        returns [masked loss sum, token count], the others zeros (the trainer sums over the PP group)."""
        pp, rank, n = self.ctx.pp_size, self.ctx.pp_rank, len(self._fns)
        x = None
        with self.autocast():
            for v, fn in enumerate(self._fns):
                first, last = rank == 0 and v == 0, rank == pp - 1 and v == n - 1
                x = fn(tokens) if first else fn(self.p2p.recv((rank - 1) % pp))
                if not last:
                    self.p2p.send(x, (rank + 1) % pp)
        if rank != pp - 1:
            return torch.zeros(2, dtype=torch.float64, device=self.device)
        per_tok = self.stage.loss(x, labels)
        return torch.stack([(per_tok.float() * mask).sum().double(), mask.sum().double()])
