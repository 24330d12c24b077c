"""AdamW over a ParamAndGradBuffer (fp32 master weights, optionally sharded: the distributed
optimizer), the parameter groups, and the fp16 loss scaler.

Owns:
  param_groups(model, weight_decay) -> two groups: decayed (matrices and embeddings) and not
    decayed (biases and LayerNorm weights: every tensor with ndim < 2), as Megatron does. Their
    order (group by group, model.parameters() order inside) is the checkpoint's optimizer order.
  build_optimizer(model, lr, ...) -> (buffer, optimizer): the model's parameters moved into a
    ParamAndGradBuffer (DP / TP / PP groups, distributed optimizer or not) and a FlatAdamW over it.
  FlatAdamW(buffer, groups, lr, betas, eps): Megatron's mixed-precision optimizer over the flat
    buffers of hpcmeg/parallel/grad_buffer.py (see its docstring below); the gradient norm's
    squares summed in fp64 (sum_of_squares_fp64, compiled on CUDA).
  adamw_master_update_: the update (plain PyTorch; on CUDA FlatAdamW runs it compiled by Inductor to
    one Triton kernel, and falls back to the plain one if compiling fails).
  DynamicLossScaler: Megatron-style dynamic loss scale for fp16 (initial 2**32, x0.5 on overflow
    after `hysteresis` overflows, x2 after `growth_interval` clean steps, floor `min_scale`).
The LR schedule is not here: the trainer writes param_group["lr"] before each step.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from hpcmeg.model import wgrad
from hpcmeg.parallel.grad_buffer import ParamAndGradBuffer


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split trainable params: weight decay for ndim >= 2 (matrices, embeddings), none otherwise."""
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() de-duplicates the tied embedding
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.1,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, *,
                    param_dtype: torch.dtype = torch.float32, grad_dtype: torch.dtype | None = None,
                    dp_size: int = 1, dp_rank: int = 0, dp_group=None, distributed: bool = False,
                    bucket_numel: int | None = None, compiled: bool | None = None,
                    replicated: frozenset = frozenset(), partial_grads: frozenset = frozenset(),
                    tp_size: int = 1, tp_rank: int = 0, tp_group=None, tied: frozenset = frozenset(),
                    embedding_group=None, count_tied_in_norm: bool = True, pp_size: int = 1, pp_group=None,
                    accumulate: str = "bucketed", wgrad_fusion: bool = False) -> tuple[ParamAndGradBuffer, "FlatAdamW"]:
    """The model's parameters moved into a ParamAndGradBuffer of `param_dtype` (gradients in
    `grad_dtype`, default fp32), and a FlatAdamW over it (sharded over the data-parallel group when
    `distributed`); `accumulate` is the buffer's gradient path (bucketed | per_param); `wgrad_fusion`:
    every nn.Linear weight is sunk (its GEMM accumulates into its main grad, hpcmeg/model/wgrad.py;
    the model must be a fused one). Call before torch.compile; do not move or re-cast the model afterwards.

    Tensor parallelism (hpcmeg/parallel/tensor.py's plan): `replicated` holds the ids of parameters
    every TP rank has whole (LayerNorms, row-parallel biases, position embeddings): they are counted
    in the gradient norm on tp_rank 0 only, and the norm's sum of squares is added up over
    `tp_group`. `partial_grads` (a subset: under sequence parallelism each rank's gradient of them is
    a partial sum) are all-reduced over `tp_group` after the data-parallel reduction. Each kind gets
    its own buffer classes, so both are contiguous runs of the buffer.

    Pipeline parallelism: `tied` holds the word embedding (first stage) or its head copy (last
    stage); they get a class of their own (the same buckets and slices on both stages, so their
    gradients can be summed over `embedding_group` after the data-parallel reduction, Megatron's
    embedding all-reduce) and the copy is left out of the norm where `count_tied_in_norm` is False
    (the last stage); the sum of squares is added up over `pp_group`."""
    from hpcmeg.parallel.grad_buffer import DEFAULT_BUCKET_NUMEL

    def kind(p) -> str:
        if id(p) in tied:
            return ".tied"
        return ".partial" if id(p) in partial_grads else ".replicated" if id(p) in replicated else ""

    groups = param_groups(model, weight_decay)
    classes, extra = [], []
    for g, name in zip(groups, ("decay", "no_decay")):
        g["classes"] = []
        for suffix in (".tied", "", ".replicated", ".partial"):
            members = [p for p in g["params"] if kind(p) == suffix]
            if members or not suffix:
                g["classes"].append(name + suffix)
                classes.append((name + suffix, members))
                if suffix == ".partial":
                    extra.append((name + suffix, tp_group))
                if suffix == ".tied":  # None: the default group (the embedding group spans the world)
                    extra.append((name + suffix, embedding_group))
    if wgrad_fusion and not getattr(getattr(model, "cfg", None), "fused", False):
        raise ValueError("build_optimizer: wgrad_fusion needs a fused model (only fused layers take sinks)")
    if not wgrad_fusion:
        sunk = frozenset()
    elif hasattr(model, "sinkable_weights"):  # GPT: its linears, and the tied word embedding when it can
        sunk = frozenset(id(w) for w in model.sinkable_weights())
    else:
        sunk = frozenset(id(m.weight) for m in model.modules() if isinstance(m, nn.Linear))
    buffer = ParamAndGradBuffer(classes, param_dtype=param_dtype, grad_dtype=grad_dtype or torch.float32,
                                dp_size=dp_size, dp_rank=dp_rank, dp_group=dp_group, shard=distributed,
                                bucket_numel=bucket_numel or DEFAULT_BUCKET_NUMEL, extra_reductions=tuple(extra),
                                accumulate=accumulate, sunk=sunk)
    if sunk:
        wgrad.attach_sinks(model, lambda w: buffer.sink_of(w) if buffer.is_sunk(w) else None)
    norm_skip = {c for c, _ in classes if c.endswith((".replicated", ".partial")) and tp_rank != 0}
    norm_skip |= {c for c, _ in classes if c.endswith(".tied") and not count_tied_in_norm}
    norm_groups = ((tp_group,) if tp_size > 1 else ()) + ((pp_group,) if pp_size > 1 else ())
    return buffer, FlatAdamW(buffer, groups, lr=lr, betas=betas, eps=eps, compiled=compiled,
                             norm_skip=frozenset(norm_skip), norm_groups=norm_groups)


@dataclass
class DynamicLossScaler:
    """fp16 dynamic loss scale; `update(found_inf)` after each step, which the caller skips on inf."""

    initial_scale: float = 2.0 ** 32
    """Starting scale (Megatron's --initial-loss-scale default)."""
    growth_interval: int = 1000
    """Clean steps in a row before the scale doubles (Megatron --loss-scale-window)."""
    hysteresis: int = 2
    """Overflows tolerated before the scale is lowered (Megatron --hysteresis)."""
    min_scale: float = 1.0
    """The scale never goes below this (Megatron --min-loss-scale)."""
    backoff_factor: float = 0.5
    growth_factor: float = 2.0

    def __post_init__(self) -> None:
        if self.initial_scale <= 0 or self.min_scale <= 0 or self.growth_interval < 1 or self.hysteresis < 1:
            raise ValueError(f"DynamicLossScaler: bad settings {self}")
        self.scale = float(self.initial_scale)
        self._good_steps = 0
        self._hysteresis_left = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._good_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._good_steps += 1
            if self._good_steps >= self.growth_interval:
                self._good_steps = 0
                self._hysteresis_left = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, sd: dict) -> None:
        self.scale, self._good_steps, self._hysteresis_left = sd["scale"], sd["good_steps"], sd["hysteresis_left"]


# ---- the update kernel ----------------------------------------------------------------------

def adamw_master_update_(p16, master, grad, m, v, hp):
    """One AdamW step on flat 1-D buffers, in place: fp32 master/m/v from a grad of any float dtype,
    then the copy of the master into p16 (the model's bf16/fp16/fp32 parameters). hp float32 [8] =
    lr, beta1, beta2, eps, weight_decay, 1 - beta1**step, clip coefficient (grads are multiplied by
    it), sqrt(1 - beta2**step). Same math as torch.optim.AdamW (decoupled decay, bias-corrected
    moments, eps added after sqrt(v_hat)). Plain PyTorch; on CUDA FlatAdamW runs torch.compile of
    this function: one Triton kernel that reads grad, master, m, v once and writes master, m, v, p16
    once (28 bytes/param with bf16 grads; the unfused chain of cast + fused AdamW + copy-back is ~40)."""
    lr, b1, b2, eps, wd, bc1, coef = hp[0], hp[1], hp[2], hp[3], hp[4], hp[5], hp[6]
    bc2_sqrt = hp[7]
    g = grad.float() * coef
    m.mul_(b1).add_(g * (1 - b1))
    v.mul_(b2).add_(g * g * (1 - b2))
    master.mul_(1 - lr * wd)
    master.sub_((lr / bc1) * m / (v.sqrt() / bc2_sqrt + eps))
    p16.copy_(master)


@functools.cache
def _compiled_update():
    # built on first CUDA use (importing Inductor costs seconds). The per-step scalars travel in the
    # hp tensor, so only a new length recompiles: the first length (the decay group, ~all the bytes)
    # gets a static kernel, the second one a dynamic-length kernel that every later length reuses
    # (the distributed optimizer updates one piece per bucket)
    return torch.compile(adamw_master_update_)


def sum_of_squares_fp64(g: torch.Tensor) -> torch.Tensor:
    """sum(g ** 2) in fp64 (an fp32 square is exact in fp64). Compiled on CUDA (_compiled_sumsq) the
    cast fuses into the reduction: one read of g. torch.linalg.vector_norm(g, dtype=float64) first
    wrote an fp64 copy of g (8 bytes per parameter, then read again): 12.7 ms per 1.3B step on the
    H200 (bench/results/profile_h200_s10_1.3B_gbs64.md: direct_copy + NormTwoOps<double>)."""
    return g.double().square().sum()


@functools.cache
def _compiled_sumsq():
    return torch.compile(sum_of_squares_fp64)


# ---- the optimizer ----------------------------------------------------------------------------

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
    (`update` 'plain'); a compiled one that fails runs its plain twin from then on. A hand-written
    update kernel cannot pay for itself: the whole update is under 2 % of a step at every size
    (1.3B on an H100: Inductor's 19.7 ms of a 1005 ms step, at 2.0 TB/s of the ~3 TB/s the card
    reaches; bench/results/user_path_h100_s19.md), short of the 1 % tokens/s a second fast path has to win.
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

    def __init__(self, buffer: ParamAndGradBuffer, groups: list[dict], lr: float, betas=(0.9, 0.95),
                 eps: float = 1e-8, compiled: bool | None = None, norm_skip: frozenset = frozenset(),
                 norm_groups: tuple = ()):
        self.buffer = buffer
        self.param_groups = []
        for i, g in enumerate(groups):
            self.param_groups.append({"lr": lr, "betas": tuple(betas), "eps": eps,
                                      "weight_decay": g.get("weight_decay", 0.0), "params": list(g["params"]),
                                      "classes": list(g.get("classes", [f"group{i}"]))})
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
                return _compiled_sumsq()(g)
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
        fn = _compiled_update() if self.update == "compiled" else adamw_master_update_
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
