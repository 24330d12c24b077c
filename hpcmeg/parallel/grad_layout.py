"""Where every parameter and every bucket of a ParamAndGradBuffer (hpcmeg/parallel/grad_buffer.py)
sits in its flat buffers: pure arithmetic on parameter sizes, no storage, no collectives.

- Class by class; inside a class in REVERSE registration order (backward produces the last layers'
  gradients first, so buckets fill in order); every parameter starts at a multiple of ``align``
  elements; a class is cut into buckets of about ``bucket_numel`` elements (a parameter is never
  split; buckets never span classes, so no rank's slice ever mixes decay and no-decay parameters);
  every bucket is padded to a multiple of ``align * dp_size``, so each data-parallel rank's slice of
  each bucket has the same length. Padding stays zero in both buffers.
- A bucket never mixes sunk parameters (weights whose GEMMs write their own main grads,
  hpcmeg/fused/wgrad.py) with others.
- `main_grad_dtype(param_dtype, dp_size, grad_accum)`: the main grads' dtype rule.
- With sharding each rank owns one slice of every bucket; "shard coordinates" number the owned
  elements contiguously in bucket order (``Bucket.shard_start``, ``Layout.shard_numel``).
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch
import torch.nn as nn


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass
class Bucket:
    start: int
    end: int
    """[start, end) in the full buffers; (end - start) is a multiple of align * dp_size."""
    cls: Hashable
    """The key of the class it belongs to (the optimizer's decay / no-decay x parameter role)."""
    params: list
    shard_start: int
    """Where this rank's slice of the bucket starts in shard coordinates."""
    sunk: bool = False
    """Its parameters' main grads are written by their GEMMs (hpcmeg/fused/wgrad.py), not by hooks."""


@dataclass
class Layout:
    offset: dict[int, tuple[int, int]]
    """id(parameter) -> its [start, end) in the full buffers."""
    buckets: list[Bucket]
    """Every bucket, in buffer order (the order their reductions start in)."""
    class_buckets: dict[Hashable, list[Bucket]]
    class_range: dict[Hashable, tuple[int, int]]
    """A class's [start, end) in the full buffers (its buckets are contiguous)."""
    numel: int
    """Elements of each full buffer, padding included."""
    shard_numel: int
    """Elements this rank owns (all of them without sharding)."""


def plan_layout(classes: list[tuple[Hashable, list[nn.Parameter]]], *, sunk: frozenset, align: int,
                dp_size: int, sharded: bool, bucket_numel: int) -> Layout:
    """The layout of `classes` (ordered ``(key, [params])``); `sunk` holds ids of sunk parameters."""
    lay = Layout({}, [], {}, {}, 0, 0)
    slice_div = dp_size if sharded else 1

    def close(cls, params, start, end, shard_off):
        end = start + round_up(end - start, align * dp_size)
        lay.buckets.append(Bucket(start, end, cls, list(params), shard_off, id(params[0]) in sunk))
        return end, shard_off + (end - start) // slice_div

    off, shard_off = 0, 0
    for name, ps in classes:
        cls_start, first = off, len(lay.buckets)
        cur: list = []
        b_start = off
        for p in reversed(ps):
            start = round_up(off, align)
            sunk_changes = cur and (id(p) in sunk) != (id(cur[0]) in sunk)
            if cur and (sunk_changes or start + p.numel() - b_start > bucket_numel):
                off, shard_off = close(name, cur, b_start, off, shard_off)
                cur, b_start, start = [], off, off
            lay.offset[id(p)] = (start, start + p.numel())
            cur.append(p)
            off = start + p.numel()
        if cur:
            off, shard_off = close(name, cur, b_start, off, shard_off)
        lay.class_buckets[name] = lay.buckets[first:]
        lay.class_range[name] = (cls_start, off)
    lay.numel, lay.shard_numel = off, shard_off
    return lay


def bucket_gaps(bk: Bucket, offset: dict[int, tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, end) ranges of bucket `bk` (relative to its start) that hold no parameter."""
    spans = sorted(offset[id(p)] for p in bk.params)
    out, at = [], bk.start
    for a, e in spans + [(bk.end, bk.end)]:
        if a > at:
            out.append((at - bk.start, a - bk.start))
        at = max(at, e)
    return out


def sunk_ranges(buckets: list[Bucket]) -> list[list[int]]:
    """The main-grad ranges the model's GEMMs accumulate into (zeroed at each step's start), adjacent
    sunk buckets merged into one range."""
    out: list[list[int]] = []
    for bk in buckets:
        if bk.sunk:
            if out and out[-1][1] == bk.start:
                out[-1][1] = bk.end
            else:
                out.append([bk.start, bk.end])
    return out


def main_grad_dtype(param_dtype: torch.dtype, dp_size: int, grad_accum: int) -> torch.dtype:
    """fp32 whenever gradients are summed (over micro batches or over ranks), Megatron's bf16 rule;
    fp16 parameters always get fp32 gradients (loss scaling); the parameters' dtype only when there
    is nothing to sum (one micro batch, one rank): the gradient is then exactly what backward made,
    and keeping it in bf16 saves 2 bytes/param of traffic in the copy, the norm and the update."""
    if param_dtype == torch.float16 or dp_size > 1 or grad_accum > 1:
        return torch.float32
    return param_dtype
