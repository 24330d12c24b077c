"""FlatAdamW: AdamW with fp32 master weights over a ParamAndGradBuffer (Megatron's mixed-precision
optimizer; with a sharded buffer, Megatron's distributed optimizer), and its checkpoint layout.

Owns:
  FlatAdamW(buffer, groups, ...): the per-step work (gradient norm and clipping, fp16 unscaling,
    the update of this rank's pieces of the buffer, the parameters' all-gather) and the conversion
    between its flat fp32 state and torch AdamW's per-parameter checkpoint layout (class docstring).
The update and the norm's arithmetic are hpcmeg/train/adamw_update.py's; the buffer is
hpcmeg/parallel/grad_buffer.py's; hpcmeg/train/optim.py builds both for a model. The LR schedule is
not here: the trainer writes param_group["lr"] before each step.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from hpcmeg.parallel.grad_buffer import ParamAndGradBuffer
from hpcmeg.train.adamw_update import (adamw_master_update_, compiled_sum_of_squares, compiled_update,
                                       sum_of_squares_fp64)


class FlatAdamW:
    """AdamW with fp32 master weights over a ParamAndGradBuffer (Megatron's mixed-precision optimizer;
    with a sharded buffer, Megatron's distributed optimizer).

    State: fp32 `master`, `exp_avg`, `exp_avg_sq` of this rank's shard only (the whole model without
    sharding): 12 bytes per owned parameter. Per step: `clip_grad_norm_(max)` takes the global L2
    norm of the reduced gradients (squares summed in fp64 over the owned pieces, all-reduced over the
    data-parallel group when sharded: every element counted once, the result independent of the
    layout to the last fp32 bit in practice) and folds the clip coefficient into the
    next `step()`, which runs adamw_master_update_ over each piece the buffer says this rank owns
    (one per group without sharding, one per bucket with it), writing the updated parameters in
    place, and then lets the buffer all-gather them. With `compiled` (default: on CUDA) the update and
    the gradient norm's sum of squares run torch.compile'd (`update` 'compiled'), else plain
    (`update` 'plain'); a compiled one that fails runs its plain twin from then on.
    `unscale_and_check_(inv_scale)` (fp16) unscales the shard's gradients in place and returns a
    device flag, 1 when any was inf/nan on any rank.
    `param_groups` are plain dicts (lr, betas, eps, weight_decay, params): the LR schedule writes them.
    Checkpoints: `state_dict()` is torch AdamW's layout over the model's parameters in param_groups
    order (state[i] = step, exp_avg, exp_avg_sq in each parameter's shape; param_groups with index
    lists) plus "fp32_from_fp16_params" (the masters, Megatron's key), gathered from every shard: a
    COLLECTIVE over the data-parallel group when sharded (every rank calls it; ranks other than
    dp rank 0 get None). `load_state_dict(sd)` takes that layout (or a plain torch AdamW state, whose
    masters then come from the model) at any data-parallel size, sharded or not; every rank calls it.
    After loading model weights from outside, call `masters_from_params()`."""

    def __init__(self, buffer: ParamAndGradBuffer, groups: list[dict], *, compiled: bool | None = None,
                 norm_skip: frozenset = frozenset(), norm_groups: tuple = ()):
        """groups: dicts of lr, betas, eps, weight_decay, params and classes (the buffer class keys the
        group's parameters live in); hpcmeg/train/optim.py's build_optimizer makes them."""
        self.buffer = buffer
        # torch AdamW's keys in torch's order: state_dict() saves them as the checkpoint's param_groups
        self.param_groups = [{"lr": g["lr"], "betas": tuple(g["betas"]), "eps": g["eps"],
                              "weight_decay": g["weight_decay"], "params": list(g["params"]),
                              "classes": list(g["classes"])} for g in groups]
        # classes this rank leaves out of the gradient norm (TP-replicated ones off tp_rank 0), and the
        # groups over which the sum of squares is added up (beyond the DP group of a sharded buffer)
        self.norm_skip, self.norm_groups = frozenset(norm_skip), tuple(norm_groups)
        n = buffer.shard_numel
        self.master = buffer.take_fp32_shard()  # the fp32 values before the cast: exact masters
        self.exp_avg = torch.zeros(n, dtype=torch.float32, device=buffer.device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.compiled = buffer.device.type == "cuda" if compiled is None else compiled
        self.update = "compiled" if self.compiled else "plain"  # what step() runs (plain after a compiler failure)
        self.step_count = 0
        self._coef = None  # clip coefficient for the next step(), set by clip_grad_norm_
        self._sumsq_plain = False  # set when the compiled sum of squares failed once

    @property
    def name(self) -> str:
        kind = "distributed " if self.buffer.sharded else ""
        return f"hpcmeg.FlatAdamW({kind}{self.update})"

    def _owned_grads(self, skip: frozenset = frozenset()) -> list[torch.Tensor]:
        buf = self.buffer
        if not buf.sharded and not skip:
            return [buf.grad_data]
        return [buf.grad_data[a:b] for cls in buf.classes if cls not in skip for a, b, _ in buf.update_pieces(cls)]

    # -- per step

    @torch.no_grad()
    def unscale_and_check_(self, inv_scale: float) -> torch.Tensor:
        found = torch.zeros(1, device=self.buffer.device)
        inv = torch.full((1,), inv_scale, device=self.buffer.device)
        torch._amp_foreach_non_finite_check_and_unscale_(self._owned_grads(), found, inv)
        if self.buffer.sharded:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.buffer.dp_group)
        return found

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float | None) -> torch.Tensor:
        """Global L2 norm of the gradients; with max_norm > 0 the next step scales them by
        min(1, max_norm / (norm + 1e-6)) (torch's clip_grad_norm_ rule).

        The squares are summed in fp64 and the norm rounded to fp32 once: an fp32 sum over millions
        of elements is off by ~1e-5 relative in an order-dependent way (measured on CPU), which would
        make the clip coefficient, and so the weights, depend on the layout (DP size, sharding).
        In fp64 the order-dependent part is ~1e-16, far below one fp32 ulp. The reduction stays
        memory-bound (one read of the gradients)."""
        buf = self.buffer
        pieces = self._owned_grads(self.norm_skip)
        if pieces:
            sq = torch.stack([self._sumsq(g) for g in pieces]).sum()
        else:
            sq = torch.zeros((), dtype=torch.float64, device=buf.device)
        groups = ((buf.dp_group,) if buf.sharded else ()) + self.norm_groups
        if groups:  # each rank holds disjoint pieces: their squares add up over the groups
            sq = sq.reshape(1)
            for group in groups:
                dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
        norm = sq.sqrt().float().reshape(())
        if max_norm and max_norm > 0:
            self._coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        else:
            self._coef = torch.ones((), device=norm.device)
        return norm

    def _sumsq(self, g: torch.Tensor) -> torch.Tensor:
        if self.compiled and not self._sumsq_plain:
            try:
                return compiled_sum_of_squares()(g)
            except Exception as ex:  # a compiler failure must not stop training: the plain twin
                print(f"FlatAdamW: compiled sum of squares failed ({type(ex).__name__}: {ex}); using the plain one",
                      flush=True)
                self._sumsq_plain = True
        return sum_of_squares_fp64(g)

    @torch.no_grad()
    def step(self) -> None:
        if self._coef is None:  # step() without clip_grad_norm_(): no clipping
            self._coef = torch.ones((), device=self.buffer.device)
        self.step_count += 1
        fn = compiled_update() if self.update == "compiled" else adamw_master_update_
        buf = self.buffer
        for g in self.param_groups:
            pieces = [piece for cls in g["classes"] for piece in buf.update_pieces(cls)]
            if not pieces:
                continue
            b1, b2 = g["betas"]
            hp = torch.tensor([g["lr"], b1, b2, g["eps"], g["weight_decay"], 1 - b1 ** self.step_count, 0.0,
                               math.sqrt(1 - b2 ** self.step_count)], dtype=torch.float32)
            if buf.device.type == "cuda":  # async copy from pinned memory: no host sync per step
                hp = hp.pin_memory().to(buf.device, non_blocking=True)
            hp[6:7].copy_(self._coef.reshape(1))
            for a, b, s in pieces:
                e = s + b - a
                args = (buf.param_data[a:b], self.master[s:e], buf.grad_data[a:b], self.exp_avg[s:e],
                        self.exp_avg_sq[s:e], hp)
                try:
                    fn(*args)
                except Exception as ex:  # a compiler failure must not stop training: run the plain twin
                    if fn is adamw_master_update_:
                        raise
                    print(f"FlatAdamW: the compiled update failed ({type(ex).__name__}: {ex}); "
                          "using the plain one", flush=True)
                    self.update, fn = "plain", adamw_master_update_
                    fn(*args)
        self._coef = None
        buf.gather_params()

    # -- checkpoints

    def _ordered_params(self) -> list[tuple[int, torch.Tensor]]:
        return [(gi, p) for gi, g in enumerate(self.param_groups) for p in g["params"]]

    @torch.no_grad()
    def _gather(self, shard_tensors: list[torch.Tensor]) -> list[dict[int, torch.Tensor]] | None:
        """Per-parameter full values (CPU) of flat shard tensors, gathered bucket by bucket (peak
        extra memory: one bucket per tensor). Collective when sharded; None off dp rank 0."""
        buf = self.buffer
        index = {id(p): i for i, (_, p) in enumerate(self._ordered_params())}
        out: list[dict[int, torch.Tensor]] = [{} for _ in shard_tensors]
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        for bk in buf.buckets:
            n = buf.slice_numel(bk)
            for t, dest in zip(shard_tensors, out):
                local = t[bk.shard_start:bk.shard_start + n]
                if buf.sharded:
                    full = torch.empty(bk.end - bk.start, dtype=t.dtype, device=t.device)
                    gather(full, local.contiguous(), group=buf.dp_group)
                else:
                    full = local
                for p in bk.params:
                    a, b = buf.locate(p)
                    dest[index[id(p)]] = full[a - bk.start:b - bk.start].view(p.shape).to("cpu", copy=True)
        if buf.sharded and buf.dp_rank != 0:
            return None
        return out

    def state_dict(self) -> dict | None:
        got = self._gather([self.exp_avg, self.exp_avg_sq, self.master])
        if got is None:
            return None
        m, v, master = got
        state, groups, i = {}, [], 0
        for g in self.param_groups:
            idx = []
            for _ in g["params"]:
                if self.step_count:
                    state[i] = {"step": torch.tensor(float(self.step_count)), "exp_avg": m[i], "exp_avg_sq": v[i]}
                idx.append(i)
                i += 1
            groups.append({**{k: val for k, val in g.items() if k not in ("params", "classes")}, "params": idx})
        masters, i = [], 0
        for g in self.param_groups:
            masters.append([master[i + j] for j in range(len(g["params"]))])
            i += len(g["params"])
        return {"state": state, "param_groups": groups, "fp32_from_fp16_params": masters}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        groups = sd["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)):
            raise ValueError("optimizer state does not match the model's parameter groups")
        masters = sd.get("fp32_from_fp16_params")
        buf, steps = self.buffer, set()
        for gi, (saved, mine) in enumerate(zip(groups, self.param_groups)):
            for k, val in saved.items():
                if k not in ("params", "classes", "class"):
                    mine[k] = tuple(val) if k == "betas" else val
            for j, (pid, p) in enumerate(zip(saved["params"], mine["params"])):
                st = sd["state"].get(pid, sd["state"].get(str(pid)))
                if st is not None:
                    steps.add(int(float(st["step"])))
                a, b = buf.locate(p)
                for fa, fb, s in buf.shard_overlap(a, b):
                    dst = slice(s, s + fb - fa)
                    src = slice(fa - a, fb - a)
                    for target, key in ((self.exp_avg, "exp_avg"), (self.exp_avg_sq, "exp_avg_sq")):
                        if st is None:
                            target[dst].zero_()
                        else:
                            target[dst].copy_(st[key].reshape(-1)[src])
                    if masters is not None:
                        self.master[dst].copy_(masters[gi][j].reshape(-1)[src])
        if len(steps) > 1:
            raise ValueError(f"optimizer state has different step counts per parameter {sorted(steps)[:4]}")
        self.step_count = steps.pop() if steps else 0
        if masters is None:
            self.masters_from_params()
        else:  # the model's parameters are the masters rounded to their dtype, on every rank
            for cls in buf.classes:
                for a, b, s in buf.update_pieces(cls):
                    buf.param_data[a:b].copy_(self.master[s:s + b - a])
            buf.gather_params()

    @torch.no_grad()
    def masters_from_params(self) -> None:
        """The model's parameters were loaded from outside (weights-only start): masters follow them."""
        self.master.copy_(self.buffer.owned_params_fp32())
