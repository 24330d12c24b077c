"""ParamAndGradBuffer: the one owner of a model's parameter and gradient storage (Megatron's design).

Why: torch DDP keeps gradients in the parameters' dtype, so with bf16 parameters it would sum
micro batches and all-reduce in bf16; Megatron's rule for bf16 is "accumulate and all-reduce in
fp32". Here the parameters become views of ONE flat buffer, gradients land in a flat "main grad"
buffer of `grad_dtype`, and the optimizer (hpcmeg/train/flat_adamw.py FlatAdamW) updates this rank's
pieces of both in place. Design and sources: shared/docs/parallel-design.md B.4.

Contract
- ``ParamAndGradBuffer(classes, *, param_dtype, grad_dtype, dp_size=1, dp_rank=0, dp_group=None,
  shard=False, bucket_numel=10M, align=64)``. ``classes`` is an ordered list of ``(key, [params])``
  (any hashable keys: the optimizer's decay / no-decay groups, split by parameter role). Every
  parameter's storage moves into ``param_data`` (dtype ``param_dtype``, values copied; a Parameter
  keeps its identity, so modules, the optimizer and torch.compile keep working): do not move or
  re-cast the model afterwards.
- Layout (hpcmeg/parallel/grad_layout.py): class by class, in reverse registration order, each
  parameter aligned to ``align`` elements, each class cut into buckets of about ``bucket_numel``
  (a parameter never split, a bucket never spanning classes), each bucket padded to a multiple of
  ``align * dp_size`` so every data-parallel rank's slice of it has the same length.
- Gradients: a post-accumulate-grad hook per parameter moves ``p.grad`` into its main-grad view
  (copy on the first micro batch of a step, add after: micro batches sum in ``grad_dtype``) and
  frees it. ``accumulate="bucketed"`` (default) does that a bucket at a time: the hook only takes
  the gradient; when a bucket has all of its parameters' gradients of this micro batch (or the
  backward ends: an autograd end-of-backward callback) they go in with one multi-tensor copy into a
  staging buffer of the gradients' dtype laid out like the bucket, then ONE flat copy/add into the
  bucket's main grads. Why: per parameter that is 2 kernels per bucket instead of one unvectorised
  mixed-dtype kernel per parameter (~150 per micro batch at 124M, 5-6 us each on the H200: ~0.9 ms
  per micro batch, bench/results/user_path_h200_s5.md). ``accumulate="per_param"`` is the plain
  twin (one copy_/add_ per parameter in the hook); both give bit-identical main grads (a bf16 ->
  fp32 conversion is exact, and each element sees the same fp32 additions in the same order).
  ``start_step(n)`` arms the hooks for n micro batches; when every parameter of a bucket has its
  n-th gradient the bucket's reduction over ``dp_group`` starts asynchronously (buckets
  start strictly in index order, so every rank issues the same collectives in the same order): an
  all-reduce SUM, or with ``shard=True`` (the distributed optimizer) a reduce-scatter SUM whose
  output is this rank's slice of the same bucket (in place: no second gradient buffer).
  ``finish_grads()`` zeroes the gradients of parameters that got none this step, starts what has
  not started and waits, then all-reduces each ``extra_reductions`` class over its group (this
  rank's pieces of it: the sequence-parallel LayerNorm/bias gradients over the TP group).
  Reductions SUM: the caller scales each rank's loss by 1/dp (TrainStep does).
- ``sunk``: ids of weights whose GEMMs accumulate their gradients straight into their main grads
  (gradient-accumulation fusion, hpcmeg/fused/wgrad.py; wgrad.attach_sinks gives each nn.Linear its
  ``sink_of(weight)``). They get no hook and buckets of their own (a bucket never mixes sunk and
  other parameters), ``start_step`` zeroes their main grads, and their buckets (with every bucket
  after them: launches stay in index order) reduce in ``finish_grads``, when the backward that
  wrote them is over, unless ``expect_sunk_reports()`` was called: then the backward reports each
  sunk weight's micro batch as done (``sunk_done(params)``, hpcmeg/parallel/overlap.py) and its
  bucket starts like any other. A sunk weight that still gets a ``.grad`` is an error there.
- Shards: with sharding this rank owns slice ``dp_rank`` of every bucket, without it everything.
  ``shard_numel`` counts the owned elements; "shard coordinates" number them contiguously in bucket
  order (the optimizer's fp32 state lives there). ``update_pieces(cls)`` lists a class's owned
  pieces as ``(full_start, full_end, shard_start)``: without sharding one piece per class (shard
  coordinates = full coordinates), with sharding one per bucket. ``gather_params()`` all-gathers
  every bucket's updated slices into ``param_data`` in place (a no-op without sharding).
- ``locate(p)`` -> (start, end) of a parameter in the full buffers; ``shard_overlap(start, end)`` ->
  the owned pieces of any full range: the optimizer gathers and scatters its state per parameter
  with them for checkpoints. ``take_fp32_shard()`` -> the owned elements in fp32 as they were
  before the cast (the optimizer's exact initial masters).
"""
from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.distributed as dist
import torch.nn as nn

from hpcmeg.parallel.grad_layout import Bucket, bucket_gaps, main_grad_dtype, plan_layout, sunk_ranges  # noqa: F401

DEFAULT_BUCKET_NUMEL = 10_000_000  # 40 MB of fp32 gradients: Megatron's default bucket size
ACCUMULATE = ("bucketed", "per_param")


def _collective(name_2_13: str, name_2_11: str):
    """torch 2.13 renamed the flat collectives (the old names warn); 2.11 (the GPU image) has the old."""
    return getattr(dist, name_2_13, None) or getattr(dist, name_2_11)


class ParamAndGradBuffer:
    def __init__(self, classes: list[tuple[Hashable, list[nn.Parameter]]], *, param_dtype: torch.dtype,
                 grad_dtype: torch.dtype, dp_size: int = 1, dp_rank: int = 0, dp_group=None,
                 shard: bool = False, bucket_numel: int = DEFAULT_BUCKET_NUMEL, align: int = 64,
                 extra_reductions: tuple = (), accumulate: str = "bucketed", sunk: frozenset = frozenset()):
        if accumulate not in ACCUMULATE:
            raise ValueError(f"ParamAndGradBuffer: accumulate={accumulate!r}; use one of {ACCUMULATE}")
        self.accumulate = accumulate
        params = [p for _, ps in classes for p in ps]
        if len({id(p) for p in params}) != len(params):
            raise ValueError("ParamAndGradBuffer: a parameter appears twice (tied weights must be passed once)")
        if not params:
            raise ValueError("ParamAndGradBuffer: no parameters")
        self.dp_size, self.dp_rank, self.dp_group = dp_size, dp_rank, dp_group
        self.sharded = shard and dp_size > 1
        self.param_dtype, self.grad_dtype = param_dtype, grad_dtype
        self.device = params[0].device
        self.params = params
        self.classes = [name for name, _ in classes]
        self.extra_reductions = tuple(extra_reductions)  # ((class, group), ...) summed after the DP reduction
        self._sunk = frozenset(sunk) & {id(p) for p in params}  # weights whose GEMM accumulates itself

        layout = plan_layout(classes, sunk=self._sunk, align=align, dp_size=dp_size, sharded=self.sharded,
                             bucket_numel=bucket_numel)
        self._offset, self.buckets = layout.offset, layout.buckets
        self._class_buckets, self._class_range = layout.class_buckets, layout.class_range
        self.numel, self.shard_numel = layout.numel, layout.shard_numel
        self._adopt_storage(params)
        self._init_step_state(params)

    def _adopt_storage(self, params: list[nn.Parameter]) -> None:
        """Every parameter becomes a view of param_data (values copied, identity kept), its main grad
        a view of grad_data; the fp32 values from before the cast are kept for the optimizer."""
        self.param_data = torch.zeros(self.numel, dtype=self.param_dtype, device=self.device)
        self.grad_data = torch.zeros(self.numel, dtype=self.grad_dtype, device=self.device)
        self._grad_views: dict[int, torch.Tensor] = {}
        fp32 = {id(p): p.detach().float() for p in params} if self.param_dtype != torch.float32 else None
        with torch.no_grad():
            for p in params:
                a, b = self._offset[id(p)]
                self.param_data[a:b].copy_(p.detach().reshape(-1))
                p.data = self.param_data[a:b].view(p.shape)
                self._grad_views[id(p)] = self.grad_data[a:b].view(p.shape)
        self._fp32_shard = self._shard_of(fp32) if fp32 is not None else None

    def _init_step_state(self, params: list[nn.Parameter]) -> None:
        """The per-step counters and queues the gradient hooks use, and the hooks themselves."""
        self._bucket_of = {id(p): i for i, bk in enumerate(self.buckets) for p in bk.params}
        self._sunk_reported = False  # expect_sunk_reports: the backward says when sunk weights are done
        self._sunk_ranges = sunk_ranges(self.buckets)  # zeroed at each step's start (GEMMs only add)
        self._left = self._fresh_left()
        self._count = {id(p): 0 for p in params}
        self._n_micro = 1
        self._next_launch = 0
        self._handles: list = []
        # bucketed accumulation: this micro batch's gradients not yet moved, per bucket, id(param) -> (param, grad)
        self._pending: list[dict[int, tuple]] = [{} for _ in self.buckets]
        self._flush_queued = False
        self._staging: torch.Tensor | None = None  # [largest multi-parameter bucket], the grads' dtype
        self._bucket_gaps = [bucket_gaps(bk, self._offset) for bk in self.buckets]
        hook = self._on_grad if self.accumulate == "per_param" else self._take_grad
        self._hooks = [p.register_post_accumulate_grad_hook(hook) for p in params if id(p) not in self._sunk]

    def slice_numel(self, bucket: Bucket) -> int:
        return (bucket.end - bucket.start) // (self.dp_size if self.sharded else 1)

    def _my_slice(self, bucket: Bucket) -> tuple[int, int]:
        """This rank's [start, end) of a bucket in the full buffers."""
        n = self.slice_numel(bucket)
        rank = self.dp_rank if self.sharded else 0
        return bucket.start + rank * n, bucket.start + (rank + 1) * n

    # --------------------------------------------------------------------------- gradients

    def _fresh_left(self) -> list[int]:
        """Per bucket, the parameters still to get this step's last gradient. A sunk bucket's GEMMs
        write it during the backward: unless the backward reports when they are done
        (report_sunk_done), it gets 1 that nothing takes away, so it and every bucket after it start
        their reduction in finish_grads."""
        if self._sunk_reported:
            return [len(bk.params) for bk in self.buckets]
        return [1 if bk.sunk else len(bk.params) for bk in self.buckets]

    def expect_sunk_reports(self) -> None:
        """From the next step on, the backward calls sunk_done for every sunk weight once per micro
        batch, after its last GEMM of that micro batch (hpcmeg/parallel/overlap.py's markers), so a
        sunk bucket's reduction starts as soon as its layers' backward is over."""
        if self._handles or self._next_launch:
            raise RuntimeError("ParamAndGradBuffer.expect_sunk_reports: call it between steps")
        self._sunk_reported = True
        self._left = self._fresh_left()

    def sunk_done(self, params: list[torch.Tensor]) -> None:
        """These sunk weights' GEMMs of this micro batch have all been issued (called from the backward)."""
        for p in params:
            if id(p) not in self._sunk:
                raise ValueError("ParamAndGradBuffer.sunk_done: a parameter that is not sunk")
            self._counted(id(p))

    def is_sunk(self, p: torch.Tensor) -> bool:
        return id(p) in self._sunk

    def sink_of(self, p: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(grad_data, offset) of a sunk parameter: hpcmeg/fused/wgrad.py's sink for its GEMM."""
        if id(p) not in self._sunk:
            raise ValueError("ParamAndGradBuffer.sink_of: this parameter was not given in `sunk`")
        return self.grad_data, self._offset[id(p)][0]

    def start_step(self, n_micro: int) -> None:
        """Arm the hooks: the coming backward passes are the n micro batches of one step. The sunk
        main grads are zeroed (their GEMMs only add)."""
        if self._handles or self._next_launch:
            raise RuntimeError("ParamAndGradBuffer.start_step: the previous step's finish_grads() was not called")
        self._n_micro = n_micro
        for a, b in self._sunk_ranges:
            self.grad_data[a:b].zero_()

    @torch.no_grad()
    def _on_grad(self, p: torch.Tensor) -> None:
        """accumulate="per_param": move this parameter's gradient now (the plain twin)."""
        key = id(p)
        view = self._grad_views[key]
        if self._count[key] == 0:
            view.copy_(p.grad)  # no zeroing pass: the first micro batch overwrites
        else:
            view.add_(p.grad)
        p.grad = None
        self._counted(key)

    def _counted(self, key: int) -> None:
        """One more gradient of parameter `key` is in its main grad: start the reductions now due."""
        self._count[key] += 1
        if self._count[key] == self._n_micro:
            self._left[self._bucket_of[key]] -= 1
            while self._next_launch < len(self.buckets) and self._left[self._next_launch] == 0:
                self._launch(self._next_launch)

    @torch.no_grad()
    def _take_grad(self, p: torch.Tensor) -> None:
        """accumulate="bucketed": keep the gradient until its bucket is complete for this micro batch."""
        b = self._bucket_of[id(p)]
        if id(p) in self._pending[b]:  # a second gradient before the bucket filled: move the first
            self._flush(b)
        pending = self._pending[b]
        pending[id(p)] = (p, p.grad)
        p.grad = None
        if not self._flush_queued:  # whatever is still pending when this backward ends goes in then
            self._flush_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._flush_all)
        if len(pending) == len(self.buckets[b].params):
            self._flush(b)

    def _flush_all(self) -> None:
        self._flush_queued = False
        for b in range(len(self.buckets)):
            if self._pending[b]:
                self._flush(b)

    @torch.no_grad()
    def _flush(self, b: int) -> None:
        """Move bucket b's pending gradients into its main grads: first gradients of the step are
        copied, later ones added (micro batches sum in grad_dtype)."""
        items, self._pending[b] = list(self._pending[b].values()), {}
        bk = self.buckets[b]
        firsts = {self._count[id(p)] == 0 for p, _ in items}
        if len(items) == len(bk.params) > 1 and len(firsts) == 1:
            self._flush_whole(b, items, first=firsts.pop())
        else:  # a partial bucket (unused parameters, a repeated one) or a one-parameter bucket
            for p, g in items:
                view = self._grad_views[id(p)]
                view.copy_(g) if self._count[id(p)] == 0 else view.add_(g)
        for p, _ in items:
            self._counted(id(p))

    def _flush_whole(self, b: int, items: list, first: bool) -> None:
        bk = self.buckets[b]
        grads = [g for _, g in items]
        if grads[0].dtype == self.grad_dtype:  # nothing to convert: multi-tensor copy/add straight in
            views = [self._grad_views[id(p)] for p, _ in items]
            (torch._foreach_copy_ if first else torch._foreach_add_)(views, grads)
            return
        # a staging buffer in the gradients' dtype laid out like the bucket: one same-dtype
        # multi-tensor copy (a few launches) and a multi-tensor zero of the alignment gaps (the
        # staging is shared by all buckets, so a gap may hold another bucket's values), then ONE
        # flat converting copy/add over the whole bucket (its padding gets zeros: stays zero)
        n = bk.end - bk.start
        if self._staging is None or self._staging.dtype != grads[0].dtype:
            size = max(k.end - k.start for k in self.buckets if len(k.params) > 1 and not k.sunk)
            self._staging = torch.zeros(size, dtype=grads[0].dtype, device=self.device)
        stage = self._staging[:n]
        views = [stage[a - bk.start:e - bk.start].view(p.shape) for p, _ in items
                 for a, e in (self._offset[id(p)],)]
        torch._foreach_copy_(views, grads)
        gaps = self._bucket_gaps[b]
        if gaps:
            torch._foreach_zero_([stage[a:e] for a, e in gaps])
        full = self.grad_data[bk.start:bk.end]
        full.copy_(stage) if first else full.add_(stage)

    def _launch(self, b: int) -> None:
        self._next_launch = b + 1
        if self.dp_size == 1:
            return
        bk = self.buckets[b]
        full = self.grad_data[bk.start:bk.end]
        if self.sharded:
            lo, hi = self._my_slice(bk)
            scatter = _collective("reduce_scatter_single", "reduce_scatter_tensor")
            self._handles.append(scatter(self.grad_data[lo:hi], full, op=dist.ReduceOp.SUM, group=self.dp_group,
                                         async_op=True))
        else:
            self._handles.append(dist.all_reduce(full, op=dist.ReduceOp.SUM, group=self.dp_group, async_op=True))

    @torch.no_grad()
    def finish_grads(self) -> None:
        """Zero what got no gradient, start the remaining reductions in order, wait for all."""
        self._flush_all()  # normally done by the end-of-backward callback already
        for p in self.params:
            if id(p) in self._sunk:
                if p.grad is not None:  # autograd produced it: the GEMM did not take it (plain ops?)
                    raise RuntimeError("ParamAndGradBuffer: a sunk weight got a .grad; its layer must call "
                                       "hpcmeg.fused.wgrad.linear with the buffer's sink (a fused model)")
            elif self._count[id(p)] == 0:  # unused this step: its view still holds the last step's
                self._grad_views[id(p)].zero_()
        for b in range(self._next_launch, len(self.buckets)):
            self._launch(b)
        for h in self._handles:
            h.wait()
        for cls, group in self.extra_reductions:  # e.g. sequence-parallel LayerNorm grads over the TP group
            for a, b, _ in self.update_pieces(cls):
                dist.all_reduce(self.grad_data[a:b], op=dist.ReduceOp.SUM, group=group)
        self._handles = []
        self._next_launch = 0
        self._left = self._fresh_left()
        self._count = dict.fromkeys(self._count, 0)
        self._n_micro = 1

    # --------------------------------------------------------------------------- parameters

    @torch.no_grad()
    def gather_params(self) -> None:
        """Distributed optimizer: every rank's updated slices -> every rank's full param_data, in
        place (each rank's input is its own slice of the output)."""
        if not self.sharded:
            return
        gather = _collective("all_gather_single", "all_gather_into_tensor")
        handles = []
        for bk in self.buckets:
            lo, hi = self._my_slice(bk)
            handles.append(gather(self.param_data[bk.start:bk.end], self.param_data[lo:hi], group=self.dp_group,
                                  async_op=True))
        for h in handles:
            h.wait()

    # --------------------------------------------------------------------------- geometry

    def update_pieces(self, cls: Hashable) -> list[tuple[int, int, int]]:
        """(full_start, full_end, shard_start) of what this rank updates in class `cls`."""
        if not self.sharded:
            a, b = self._class_range[cls]
            return [(a, b, a)] if a < b else []
        out = []
        for bk in self._class_buckets[cls]:
            lo, hi = self._my_slice(bk)
            out.append((lo, hi, bk.shard_start))
        return out

    def locate(self, p: torch.Tensor) -> tuple[int, int]:
        return self._offset[id(p)]

    def shard_overlap(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """Pieces (full_start, full_end, shard_start) of the full range [start, end) this rank owns
        (without sharding: the whole range, at the same offset)."""
        if not self.sharded:
            return [(start, end, start)]
        out = []
        for bk in self.buckets:
            if bk.end <= start or bk.start >= end:
                continue
            a, b = self._my_slice(bk)
            lo, hi = max(a, start), min(b, end)
            if lo < hi:
                out.append((lo, hi, bk.shard_start + lo - a))
        return out

    def owned(self, data: torch.Tensor) -> list[torch.Tensor]:
        """Views of `data` (param_data or grad_data) over every piece this rank owns."""
        return [data[a:b] for cls in self.classes for a, b, _ in self.update_pieces(cls)]

    def _shard_of(self, values: dict[int, torch.Tensor]) -> torch.Tensor:
        """fp32 tensor in shard coordinates of per-parameter values (padding zero)."""
        out = torch.zeros(self.shard_numel, dtype=torch.float32, device=self.device)
        for p in self.params:
            a, b = self._offset[id(p)]
            for fa, fb, s in self.shard_overlap(a, b):
                out[s:s + fb - fa].copy_(values[id(p)].reshape(-1)[fa - a:fb - a])
        return out

    def take_fp32_shard(self) -> torch.Tensor:
        """The owned elements in fp32 as they were before the cast to param_dtype (once: the optimizer
        adopts it as its master weights), or an fp32 copy of the owned parameters."""
        out, self._fp32_shard = self._fp32_shard, None
        return out if out is not None else self.owned_params_fp32()

    def owned_params_fp32(self) -> torch.Tensor:
        """The owned elements of param_data, in fp32, in shard coordinates."""
        out = torch.empty(self.shard_numel, dtype=torch.float32, device=self.device)
        for cls in self.classes:
            for a, b, s in self.update_pieces(cls):
                out[s:s + b - a].copy_(self.param_data[a:b])
        return out

    def bytes_per_param(self) -> dict[str, float]:
        """Bytes of these buffers per model parameter (padding included), for the memory table."""
        n_model = sum(p.numel() for p in self.params)
        return {"param": self.numel * self.param_dtype.itemsize / n_model,
                "grad": self.numel * self.grad_dtype.itemsize / n_model}

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

