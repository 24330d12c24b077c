"""Weighted blending of several GPT datasets, and the top-level train/valid/test builder.

Owns Megatron's BlendedDataset and BlendedMegatronDatasetBuilder semantics (mcore HEAD,
docs/megatron-interop.md §3.5):
- `--data-path` forms: one prefix; "w1 p1 w2 p2 ..." (weights normalized in float64); or several
  prefixes without weights (weights = member dataset lengths, size capped at their sum).
- Each member is split by `config.split` on its own and asked for ceil(ceil(size*w)*(1+surplus))
  samples (surplus 0.005); the blend has sum_d ceil(size*w) samples.
- Blend order: for i in 0..size-1 pick d* = argmax_d (w_d * max(i,1) - count_d), first max wins;
  dataset_index[i] = d* (int16), dataset_sample_index[i] = count_d* (int64). No randomness.

`blending_indices` is numpy, no compile step, bit-identical to that loop: picks are proposed by
copying the sequence p steps back (it is nearly periodic) and every pick is re-checked in double
(`blend_speculative`), ~0.15 us/sample for 2-3 datasets; `blending_indices_loop` is the plain one-step twin
(~1.3 us/sample). The arrays are cached like the GPT indices (`index_cache.load_or_build`);
`prepare_cache` builds every index a training run will load, ahead of time.
"""

from __future__ import annotations

import math
import os
from typing import List, Optional, Sequence, Tuple

import numpy as np

from hpcmeg.data.gpt_dataset import SPLIT_NAMES, GPTDatasetConfig, build_gpt_datasets
from hpcmeg.data.index_cache import load_or_build

BLEND_NAMES = ("dataset_index", "dataset_sample_index")


def parse_blend(blend: Sequence[str] | str) -> Tuple[List[str], Optional[List[float]]]:
    """["0.3", "A", "0.7", "B"] -> (["A", "B"], [0.3, 0.7]); ["A", "B"] -> (["A", "B"], None)."""
    items = blend.split() if isinstance(blend, str) else [str(b) for b in blend]
    if not items:
        raise ValueError("empty data path: give a prefix or 'weight prefix weight prefix ...'")
    if len(items) % 2 == 0:
        try:
            weights = [float(w) for w in items[0::2]]
        except ValueError:
            weights = None
        if weights is not None:
            if any(w <= 0 for w in weights):
                raise ValueError(f"data path {items}: weights must be > 0")
            return [p.strip() for p in items[1::2]], weights
    return [p.strip() for p in items], None


def normalize(weights: Sequence[float]) -> List[float]:
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def size_per_dataset(weights: Sequence[float], size: int, surplus: float = 0.0) -> List[int]:
    """ceil(ceil(size * w) * (1 + surplus)) per dataset (surplus 0 gives the blend's own shares)."""
    return [int(math.ceil(math.ceil(size * w) * (1 + surplus))) for w in weights]


def _loop_steps(w: List[float], start: int, stop: int, counts: List[int], out) -> None:
    """Megatron's rule, one step at a time, for steps [start, stop); updates `counts` in place."""
    ks, w0 = range(1, len(w)), w[0]
    for i in range(start, stop):
        s = float(i) if i > 1 else 1.0
        best, err_max = 0, w0 * s - counts[0]
        for d in ks:
            err = w[d] * s - counts[d]
            if err > err_max:
                best, err_max = d, err
        out[i - start] = best
        counts[best] += 1


def dataset_sample_index_of(dataset_index: np.ndarray, num_datasets: int) -> np.ndarray:
    """int64[size]: for each position, how many earlier positions hold the same dataset."""
    size = dataset_index.shape[0]
    out = np.empty(size, dtype=np.int64)
    if num_datasets <= 16:
        for d in range(num_datasets):
            where = np.flatnonzero(dataset_index == d)
            out[where] = np.arange(where.shape[0], dtype=np.int64)
        return out
    order = np.argsort(dataset_index, kind="stable")
    counts = np.bincount(dataset_index, minlength=num_datasets)
    out[order] = np.arange(size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return out


_BLOCK_CELLS = 1 << 18  # steps x datasets checked per numpy pass (temporaries stay in cache)
_WARM = 64  # steps 0 and 1 share s = 1, so the sequence is periodic only after a short start
_RESYNC = 64  # exact steps a repair may take before the proposal is abandoned for this block


def _copy_distances(w: np.ndarray, size: int) -> List[int]:
    """Increasing p with w_d * p close to an integer for every d: picks p steps apart mostly agree."""
    out: List[int] = []
    for pmax in (64, 1024, 1 << 14, 1 << 18, 1 << 20):
        pmax = min(pmax, size // 4, max(64, (1 << 22) // w.shape[0]))
        if pmax < 1:
            break
        f = np.arange(1, pmax + 1, dtype=np.float64)[:, None] * w[None, :]
        p = int(np.argmin(np.abs(f - np.rint(f)).max(axis=1))) + 1
        if not out or p > out[-1]:
            out.append(p)
    return out


def _check(P: np.ndarray, i: int, w: np.ndarray, counts: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Megatron's pick at steps i..i+n-1 given that steps before them picked P: (picks, counts before).

    Counts are exact integers in float64 (< 2**53); errors are w*s - count in double, two roundings,
    as Megatron computes them; ties keep the lower dataset (strict >, like its loop).
    """
    n = P.shape[0]
    s = np.arange(i, i + n, dtype=np.float64)
    best = np.empty(n, np.float64)
    pick = np.zeros(n, np.intp)
    before = np.empty((w.shape[0], n), np.float64)
    err = np.empty(n, np.float64)
    for d in range(w.shape[0]):
        mine = P == d
        np.cumsum(mine, dtype=np.float64, out=before[d])
        before[d] -= mine
        before[d] += counts[d]
        np.multiply(s, w[d], out=err)
        err -= before[d]
        if d == 0:
            best[:] = err
        else:
            better = err > best
            np.copyto(pick, d, where=better)
            np.maximum(best, err, out=best)
    return pick, before


def _repair(w: List[float], i: int, j: int, n: int, counts: List[int], P: List[int]) -> Tuple[List[int], int, bool]:
    """Exact steps from block position j until the counts agree with the proposal's again.

    Returns (picks for positions j..k-1, k, resynced). Once counts agree, the proposal's later picks
    were already checked against the right counts, so the block continues past k.
    """
    ks, w0 = range(1, len(w)), w[0]
    diff, nonzero, out, m = [0] * len(w), 0, [], j
    while m < n and m - j < _RESYNC:
        s = float(i + m)
        best, err_max = 0, w0 * s - counts[0]
        for d in ks:
            err = w[d] * s - counts[d]
            if err > err_max:
                best, err_max = d, err
        out.append(best)
        counts[best] += 1
        x = P[m - j]
        if best != x:
            old = diff[best]
            diff[best] = old + 1
            nonzero += (old == 0) - (old == -1)
            old = diff[x]
            diff[x] = old - 1
            nonzero += (old == 0) - (old == 1)
        m += 1
        if nonzero == 0:
            return out, m, True
    return out, m, False


def blend_speculative(weights: List[float], size: int) -> np.ndarray:
    """dataset_index (int16) by Megatron's rule, speculated in numpy blocks and checked exactly.

    Why it is exact: the pick sequence is nearly periodic with any p where w*p is near integers
    (the error vector w*i - count then nearly repeats), so the picks p steps back are proposed for a
    block; `_check` recomputes every pick of the block in double from the proposal's counts. Up to
    the first disagreement the proposal is Megatron's sequence; from there `_repair` runs the exact
    loop until the counts agree again (usually two swapped picks at a near-tie) and the block goes on.
    Blocks never copy from unverified picks, except whole-block tiling of a short p, which is turned
    off for that p once it needed a repair. With many datasets (no good p) it falls back to the loop.
    """
    K = len(weights)
    w = np.asarray(weights, np.float64)
    di = np.zeros(size, np.int16)
    if K == 1:
        return di
    ladder = _copy_distances(w, size)
    head = min(size, ladder[0] + _WARM) if ladder else size
    counts_list = [0] * K
    _loop_steps(weights, 0, head, counts_list, di)
    counts = np.array(counts_list, np.float64)
    block, tile_ok, i = max(256, _BLOCK_CELLS // K), {}, head
    while i < size:
        p = max(q for q in ladder if q + _WARM <= i)
        n = min(block if tile_ok.get(p, True) else p, size - i)
        later = [q + _WARM - i for q in ladder if q + _WARM > i]
        n = min(n, later[0]) if later else n
        P = np.resize(di[i - p:i], n).astype(np.intp)
        pick, before = _check(P, i, w, counts)
        bad = np.flatnonzero(pick != P)
        end, done, repairs, counts_end = n, 0, 0, None
        last = int(P[n - 1])
        for j in bad.tolist():
            if j < done:  # inside a repaired stretch
                continue
            repairs += 1
            got, done, synced = _repair(weights, i, j, n, before[:, j].astype(np.int64).tolist(),
                                        P[j:j + _RESYNC].tolist())
            P[j:done] = got
            if not synced:  # the proposal is off here: keep the exact prefix, propose anew from it
                end = done
                counts_end = before[:, j] + np.bincount(np.asarray(got, np.intp), minlength=K)
                break
        if repairs and n > p:
            tile_ok[p] = False
        di[i:i + end] = P[:end]
        counts = counts_end if counts_end is not None else before[:, n - 1] + (np.arange(K) == last)
        i += end
        if repairs > 0.05 * end and not later and n <= p:  # no good p: Megatron's loop is cheaper
            rest = [0] * (size - i)
            cl = counts.astype(np.int64).tolist()
            _loop_steps(weights, i, size, cl, rest)
            di[i:] = rest
            break
    return di


def blending_indices_loop(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """The plain twin of `blending_indices`: Megatron's loop, one sample at a time (~1.3 us/sample)."""
    if len(weights) >= 32767:
        raise ValueError("at most 32766 datasets can be blended (int16 dataset index)")
    # Python lists are faster to index than numpy arrays in a scalar loop; convert once at the end
    di, dsi, counts = [0] * size, [0] * size, [0] * len(weights)
    ks, w = range(1, len(weights)), [float(v) for v in weights]
    for i in range(size):
        s = float(i) if i > 1 else 1.0
        best, err_max = 0, w[0] * s - counts[0]
        for d in ks:
            err = w[d] * s - counts[d]
            if err > err_max:
                best, err_max = d, err
        di[i], dsi[i] = best, counts[best]
        counts[best] += 1
    return np.array(di, dtype=np.int16), np.array(dsi, dtype=np.int64)


def blending_indices(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16[size], dataset_sample_index int64[size]) for normalized `weights`.

    Bit-identical to Megatron's loop (see `blend_speculative`); `blending_indices_loop` is the twin.
    """
    if len(weights) >= 32767:
        raise ValueError("at most 32766 datasets can be blended (int16 dataset index)")
    di = blend_speculative([float(v) for v in weights], size)
    return di, dataset_sample_index_of(di, len(weights))


def exhaustive_blending_indices(sizes: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """Take exactly sizes[d] samples from each dataset, interleaved by the same max-error rule."""
    total = int(sum(sizes))
    weights = [s / float(total) for s in sizes]
    counts, unspent = [0] * len(sizes), [d for d in range(len(sizes)) if sizes[d] > 0]
    di, dsi = np.zeros(total, np.int16), np.zeros(total, np.int64)
    for i in range(total):
        s = max(float(i), 1.0)
        best = max(unspent, key=lambda d: (weights[d] * s - counts[d], -d))
        di[i], dsi[i] = best, counts[best]
        counts[best] += 1
        if counts[best] == sizes[best]:
            unspent.remove(best)
    return di, dsi


class BlendedDataset:
    """Samples drawn from member datasets by the blend index; item = member item + dataset_id."""

    def __init__(self, datasets: list, weights: Sequence[float] | Sequence[int], size: Optional[int],
                 config: GPTDatasetConfig, cache_dir: Optional[str] = None):
        self.datasets, self.size, self.config = datasets, size, config
        self.split_name = datasets[0].split_name
        self.weights = normalize(weights) if size is not None else [int(w) for w in weights]
        self.description = {
            "class": "BlendedDataset", "datasets": [d.description for d in datasets],
            "split": self.split_name, "weights": self.weights, "size": size,
        }

        def build():
            if size is not None:
                di, dsi = blending_indices(self.weights, size)
            else:
                di, dsi = exhaustive_blending_indices(self.weights)
            counts = np.bincount(di, minlength=len(datasets))
            for d, (need, ds) in enumerate(zip(counts, datasets)):
                if need > len(ds):
                    raise ValueError(
                        f"{self.split_name} blend asks {need} samples of {ds.dataset_path} which has only "
                        f"{len(ds)}; raise mid_level_surplus (now {config.mid_level_surplus}), e.g. ten-fold")
            return {"dataset_index": di, "dataset_sample_index": dsi}

        if cache_dir is None:
            cache_dir = config.cache_dir or os.path.join(os.path.dirname(os.path.abspath(datasets[0].dataset_path)),
                                                         "cache", "BlendedDataset_indices")
        arrays = load_or_build(cache_dir, "BlendedDataset", self.split_name, self.description, build, BLEND_NAMES)
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]

    def __len__(self) -> int:
        return self.dataset_index.shape[0]

    def __getitem__(self, i: int) -> dict:
        d = int(self.dataset_index[i])
        item = self.datasets[d][int(self.dataset_sample_index[i])]
        item["dataset_id"] = d
        return item


def build_train_valid_test_datasets(config: GPTDatasetConfig, blend: Sequence[str] | str,
                                    num_samples: Sequence[Optional[int]]) -> list:
    """[train, valid, test] datasets for a `--data-path` blend (GPTDataset, BlendedDataset or None)."""
    prefixes, weights = parse_blend(blend)
    if len(prefixes) == 1 and weights is None:
        return build_gpt_datasets(prefixes[0], config, num_samples)
    if weights is not None:
        weights = normalize(weights)
        target = [[size_per_dataset([w], n)[0] if n is not None else None for n in num_samples] for w in weights]
        buffer = [[size_per_dataset([w], n, config.mid_level_surplus)[0] if n is not None else None
                   for n in num_samples] for w in weights]
    else:
        target = buffer = [[None] * 3 for _ in prefixes]
    members = [build_gpt_datasets(p, config, buffer[k]) for k, p in enumerate(prefixes)]
    out = []
    for i in range(len(SPLIT_NAMES)):
        split_members = [m[i] for m in members]
        if any(m is None for m in split_members):  # off, or empty and unused, in some member
            out.append(None)
            continue
        if weights is not None:
            if num_samples[i] is None:
                raise ValueError("blend weights need a requested sample count for every built split")
            out.append(BlendedDataset(split_members, weights, sum(t[i] for t in target), config))
        else:
            lengths = [len(m) for m in split_members]
            size = None if num_samples[i] is None else min(num_samples[i], sum(lengths))
            out.append(BlendedDataset(split_members, lengths, size, config))
    return out


def prepare_cache(config, blend, num_samples: Sequence[int | None]) -> list:
    """Build (or find) every index file that training with these arguments will load (the
    `hpcmeg prepare-cache` command: a login node, not rank 0 of a 1000-GPU job, should pay for it).

    config: `hpcmeg.data.gpt_dataset.GPTDatasetConfig` (cache_dir on the parallel filesystem);
    blend: a list of prefixes, or Megatron's `--data-path` form ["0.3", "A", "0.7", "B"];
    num_samples: requested (train, valid, test) samples, e.g. from `gpt_dataset.num_samples_per_split`.
    Returns the built datasets (train, valid, test; None for an empty split), whose indices are now cached.
    """
    return build_train_valid_test_datasets(config, blend, num_samples)
