"""AdamW construction (param groups, fused implementation choice) and the fp16 loss scaler.

Owns:
  param_groups(model, weight_decay) -> two groups: decayed (matrices and embeddings) and not
    decayed (biases and LayerNorm weights: every tensor with ndim < 2), as Megatron does.
  build_optimizer(model, lr, weight_decay, betas, eps, impl, master_weights=False) -> (optimizer,
    impl name). Choice: apex.optimizers.FusedAdam(adam_w_mode=True) when apex imports and params
    are on CUDA (the NGC container), else torch.optim.AdamW(fused=True) on CUDA, AdamW(foreach=True)
    on CPU. master_weights=True: the model's params become bf16 and the optimizer is
    MasterWeightAdamW below (Megatron's bf16 optimizer semantics).
  DynamicLossScaler: Megatron-style dynamic loss scale for fp16 (initial 2**32, x0.5 on overflow
    after `hysteresis` overflows, x2 after `growth_interval` clean steps, floor `min_scale`).
The LR schedule is not here: the trainer writes param_group["lr"] before each step.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split trainable params: weight decay for ndim >= 2 (matrices, embeddings), none otherwise."""
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() de-duplicates the tied embedding
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.1,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                    impl: str = "auto", master_weights: bool = False) -> tuple[torch.optim.Optimizer, str]:
    """AdamW over `param_groups(model)`; impl 'auto' | 'apex' | 'fused' | 'foreach'.

    master_weights: cast the model's params to bf16 IN PLACE (views of one flat buffer) and keep
    fp32 masters + Adam states in the optimizer; call before wrapping the model in DDP. The caller
    then runs the model without autocast (TrainStep does when it sees bf16 params)."""
    groups = param_groups(model, weight_decay)
    if master_weights:
        opt = MasterWeightAdamW(model, groups, lr=lr, betas=betas, eps=eps)
        return opt, f"hpcmeg.MasterWeightAdamW({'compiled' if opt.compiled else 'plain'})"
    on_cuda = next(model.parameters()).is_cuda
    if impl == "auto":
        impl = "foreach"
        if on_cuda:
            impl = "fused"
            try:
                import apex.optimizers  # noqa: F401  (NGC containers ship apex)
                impl = "apex"
            except ImportError:
                pass
    if impl == "apex":
        from apex.optimizers import FusedAdam
        return FusedAdam(groups, lr=lr, betas=betas, eps=eps, adam_w_mode=True), "apex.FusedAdam"
    if impl == "fused":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True), "torch.AdamW(fused)"
    if impl == "foreach":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=True), "torch.AdamW(foreach)"
    raise ValueError(f"build_optimizer: impl={impl!r}; use auto, apex, fused or foreach")


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


# ---- bf16 params + fp32 master weights ------------------------------------------------------

def adamw_master_update_(p16, master, g16, m, v, hp):
    """One AdamW step on flat 1-D buffers, in place: fp32 master/m/v from a bf16 grad, then the
    bf16 copy of the master into p16. hp float32 [8] = lr, beta1, beta2, eps, weight_decay,
    1 - beta1**step, clip coefficient (grads are multiplied by it), sqrt(1 - beta2**step). Same math as torch.optim.AdamW
    (decoupled decay, bias-corrected moments, eps added after sqrt(v_hat)). Plain PyTorch; on CUDA
    MasterWeightAdamW runs torch.compile of this function, one Triton kernel that reads g16,
    master, m, v once and writes master, m, v, p16 once (28 bytes/param; the unfused chain of
    copy-grad-to-fp32 + fused AdamW + copy-back is ~40)."""
    lr, b1, b2, eps, wd, bc1, coef = hp[0], hp[1], hp[2], hp[3], hp[4], hp[5], hp[6]
    bc2_sqrt = hp[7]
    g = g16.float() * coef
    m.mul_(b1).add_(g * (1 - b1))
    v.mul_(b2).add_(g * g * (1 - b2))
    master.mul_(1 - lr * wd)
    master.sub_((lr / bc1) * m / (v.sqrt() / bc2_sqrt + eps))
    p16.copy_(master)


@functools.cache
def _compiled_update():
    # built on first CUDA use (importing Inductor costs seconds); dynamic=False: one kernel per
    # group size, and the per-step scalars travel in the hp tensor so nothing recompiles
    return torch.compile(adamw_master_update_, dynamic=False)


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW with bf16 model params and fp32 master weights (Megatron's bf16 optimizer semantics).

    The model's trainable params are re-pointed into ONE flat bf16 buffer (ordered group by group);
    the optimizer owns flat fp32 buffers of master weights, exp_avg and exp_avg_sq, and a flat bf16
    grad buffer. Per step: clip_grad_norm_() copies the model grads into the flat buffer and takes
    the global norm in fp32; step() runs adamw_master_update_ per group (compiled on CUDA). With
    several micro batches per step, accumulate_grads_() after each backward but the last sums them
    in a flat fp32 buffer instead (TrainStep calls it), and step() reads that one.
    param_groups hold the fp32 masters (views), so schedules set group["lr"] as usual.
    state_dict() is torch AdamW's layout over the masters (state[i] = step, exp_avg, exp_avg_sq in
    each param's shape; param_groups with index lists) plus "fp32_from_fp16_params" (the masters,
    Megatron's key) so a resume is exact; load_state_dict() takes that, or a plain AdamW state
    (masters then come from the model). A load_state_dict on the model re-syncs the masters from it.
    Do not move or re-cast the model afterwards (it would break the views)."""

    def __init__(self, model: nn.Module, groups: list[dict], lr: float, betas=(0.9, 0.95), eps: float = 1e-8,
                 compiled: bool | None = None):
        model_params = [p for g in groups for p in g["params"]]
        dev = model_params[0].device
        n = sum(p.numel() for p in model_params)
        self._p16 = torch.empty(n, dtype=torch.bfloat16, device=dev)
        self._master = torch.empty(n, dtype=torch.float32, device=dev)
        self._g16 = torch.zeros(n, dtype=torch.bfloat16, device=dev)
        self._m, self._v = torch.zeros_like(self._master), torch.zeros_like(self._master)
        self._model_params, self._slices, masters, off = model_params, [], [], 0
        new_groups = []
        for g in groups:
            start, views = off, []
            for p in g["params"]:
                k = p.numel()
                with torch.no_grad():
                    self._master[off:off + k].copy_(p.detach().reshape(-1))
                    self._p16[off:off + k].copy_(self._master[off:off + k])
                p.data = self._p16[off:off + k].view(p.shape)  # the model now runs bf16
                views.append(self._master[off:off + k].view(p.shape))
                off += k
            masters += views
            self._slices.append((start, off))
            new_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": views})
        self._masters = masters
        self.compiled = dev.type == "cuda" if compiled is None else compiled
        self._step_count = 0
        self._coef = None  # clip coefficient tensor set by clip_grad_norm_ for the next step()
        # gradient accumulation over micro batches in fp32 (Megatron's default for bf16): allocated
        # on the first accumulate_grads_() call, i.e. only when a step has more than one micro batch
        self._g32, self._n_acc = None, 0
        self._g = self._g16  # the flat gradient the next step() reads (bf16, or fp32 after accumulation)
        self._g16_views, self._g32_views = self._flat_views(self._g16), None
        super().__init__(new_groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0))
        model.register_load_state_dict_post_hook(lambda module, keys: self._masters_from_model())

    @torch.no_grad()
    def _masters_from_model(self) -> None:
        self._master.copy_(self._p16)

    def _flat_views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Views of a flat buffer in the model params' shapes and order (built once per buffer)."""
        views, off = [], 0
        for p in self._model_params:
            views.append(buf[off:off + p.numel()].view(p.shape))
            off += p.numel()
        return views

    def _model_grads(self) -> list[torch.Tensor]:
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._model_params]

    def _accumulate(self) -> None:
        """fp32 accumulator (+)= the model's bf16 grads (mixed-dtype foreach: no fp32 copies)."""
        if self._g32 is None:
            self._g32 = torch.zeros(self._g16.numel(), dtype=torch.float32, device=self._g16.device)
            self._g32_views = self._flat_views(self._g32)
        (torch._foreach_add_ if self._n_acc else torch._foreach_copy_)(self._g32_views, self._model_grads())
        self._n_acc += 1

    @torch.no_grad()
    def accumulate_grads_(self) -> None:
        """Add the model's (bf16) grads into an fp32 flat buffer and drop them: call after each
        micro batch's backward except the last, so k micro batches sum in fp32, not in bf16
        (Megatron accumulates bf16 grads in fp32 main_grad buffers for the same reason)."""
        self._accumulate()
        self.zero_grad(set_to_none=True)

    @torch.no_grad()
    def _gather_grads(self) -> None:
        if self._n_acc:  # fp32 accumulator + the last micro batch's grads
            self._accumulate()
            self._g = self._g32
        else:
            torch._foreach_copy_(self._g16_views, self._model_grads())
            self._g = self._g16

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float | None) -> torch.Tensor:
        """Gather the model grads; return their global L2 norm (fp32 accumulation) and, when
        max_norm > 0, scale the next step's grads by min(1, max_norm / (norm + 1e-6)) (torch's rule)."""
        self._gather_grads()
        norm = torch.linalg.vector_norm(self._g, dtype=torch.float32)
        if max_norm and max_norm > 0:
            self._coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        else:
            self._coef = torch.ones((), device=norm.device)
        return norm

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MasterWeightAdamW.step: closures are not supported")
        if self._coef is None:  # step() without clip_grad_norm_(): gather now, no clipping
            self.clip_grad_norm_(None)
        self._step_count += 1
        fn = _compiled_update() if self.compiled else adamw_master_update_
        for g, (a, b) in zip(self.param_groups, self._slices):
            if a == b:
                continue
            b1, b2 = g["betas"]
            hp = torch.tensor([g["lr"], b1, b2, g["eps"], g["weight_decay"], 1 - b1 ** self._step_count, 0.0,
                               math.sqrt(1 - b2 ** self._step_count)], dtype=torch.float32)
            if self._master.is_cuda:  # async copy from pinned memory: no host sync per step
                hp = hp.pin_memory().to(self._master.device, non_blocking=True)
            hp[6:7].copy_(self._coef.reshape(1))
            args = (self._p16[a:b], self._master[a:b], self._g[a:b], self._m[a:b], self._v[a:b], hp)
            try:
                fn(*args)
            except Exception as ex:  # a compiler failure must not stop training: run the plain twin
                if fn is adamw_master_update_:
                    raise
                print(f"MasterWeightAdamW: compiled update failed ({type(ex).__name__}: {ex}); using the plain one",
                      flush=True)
                self.compiled, fn = False, adamw_master_update_
                fn(*args)
        self._coef = None
        self._n_acc, self._g = 0, self._g16

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._model_params:  # the model's grads; the flat buffer is overwritten per step
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    # -- checkpoint: torch AdamW's layout over the fp32 masters

    def state_dict(self) -> dict:
        state, groups, i = {}, [], 0
        for g in self.param_groups:
            idx = []
            for p in g["params"]:
                if self._step_count:
                    off = p.data_ptr() - self._master.data_ptr()
                    off //= self._master.element_size()
                    k = p.numel()
                    state[i] = {"step": torch.tensor(float(self._step_count)),
                                "exp_avg": self._m[off:off + k].view(p.shape).clone(),
                                "exp_avg_sq": self._v[off:off + k].view(p.shape).clone()}
                idx.append(i)
                i += 1
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": idx})
        return {"state": state, "param_groups": groups,
                "fp32_from_fp16_params": [[p.detach().clone() for p in g["params"]] for g in self.param_groups]}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        groups = sd["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)):
            raise ValueError("optimizer state does not match the model's parameter groups")
        masters = sd.get("fp32_from_fp16_params")
        steps = set()
        for gi, (saved, mine) in enumerate(zip(groups, self.param_groups)):
            for k, v in saved.items():
                if k != "params":
                    mine[k] = v
            for j, (pid, p) in enumerate(zip(saved["params"], mine["params"])):
                off = (p.data_ptr() - self._master.data_ptr()) // self._master.element_size()
                sl = slice(off, off + p.numel())
                st = sd["state"].get(pid, sd["state"].get(str(pid)))
                if st is not None:
                    steps.add(int(float(st["step"])))
                    self._m[sl].copy_(st["exp_avg"].reshape(-1))
                    self._v[sl].copy_(st["exp_avg_sq"].reshape(-1))
                else:
                    self._m[sl].zero_()
                    self._v[sl].zero_()
                if masters is not None:
                    p.copy_(masters[gi][j])
        if len(steps) > 1:
            raise ValueError(f"optimizer state has different step counts per parameter {sorted(steps)[:4]}")
        self._step_count = steps.pop() if steps else 0
        if masters is None:
            self._masters_from_model()
        else:
            self._p16.copy_(self._master)
