"""Weighted blending of several GPT datasets, and the top-level train/valid/test builder.

Owns Megatron's BlendedDataset and BlendedMegatronDatasetBuilder semantics (mcore HEAD,
docs/megatron-interop.md §3.5):
- `--data-path` forms: one prefix; "w1 p1 w2 p2 ..." (weights normalized in float64); or several
  prefixes without weights (weights = member dataset lengths, size capped at their sum).
- Each member is split by `config.split` on its own and asked for ceil(ceil(size*w)*(1+surplus))
  samples (surplus 0.005); the blend has sum_d ceil(size*w) samples.
- Blend order: for i in 0..size-1 pick d* = argmax_d (w_d * max(i,1) - count_d), first max wins;
  dataset_index[i] = d* (int16), dataset_sample_index[i] = count_d* (int64). No randomness.

`blending_indices` is a tight pure-Python loop (K multiply-subtracts per sample, ~1 us/sample on
the dev box); with numba importable the same loop is jit-compiled (optional, never required).
The arrays are cached like the GPT indices (`index_cache.load_or_build`).
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


def _blend_loop(weights: List[float], size: int, dataset_index, dataset_sample_index) -> None:
    counts = [0] * len(weights)
    ks = range(1, len(weights))
    w0 = weights[0]
    for i in range(size):
        s = float(i) if i > 1 else 1.0
        best, err_max = 0, w0 * s - counts[0]
        for d in ks:
            err = weights[d] * s - counts[d]
            if err > err_max:
                best, err_max = d, err
        dataset_index[i] = best
        dataset_sample_index[i] = counts[best]
        counts[best] += 1


def _blend_numba():
    try:
        import numba  # optional accelerator, only if already installed
    except ImportError:
        return None

    @numba.njit(cache=False)
    def loop(weights, size, dataset_index, dataset_sample_index):  # pragma: no cover - optional
        counts = np.zeros(weights.shape[0], dtype=np.int64)
        for i in range(size):
            s = max(float(i), 1.0)
            best, err_max = 0, weights[0] * s - counts[0]
            for d in range(1, weights.shape[0]):
                err = weights[d] * s - counts[d]
                if err > err_max:
                    best, err_max = d, err
            dataset_index[i] = best
            dataset_sample_index[i] = counts[best]
            counts[best] += 1
    return loop


def blending_indices(weights: Sequence[float], size: int, use_numba: bool = True) -> Tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16[size], dataset_sample_index int64[size]) for normalized `weights`."""
    if len(weights) >= 32767:
        raise ValueError("at most 32766 datasets can be blended (int16 dataset index)")
    fast = _blend_numba() if use_numba else None
    if fast is not None:
        di, dsi = np.zeros(size, np.int16), np.zeros(size, np.int64)
        fast(np.asarray(weights, np.float64), size, di, dsi)
        return di, dsi
    # Python lists are faster to index than numpy arrays in a scalar loop; convert once at the end
    di, dsi = [0] * size, [0] * size
    _blend_loop([float(w) for w in weights], size, di, dsi)
    return np.array(di, dtype=np.int16), np.array(dsi, dtype=np.int64)


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
        if split_members[0] is None:
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
