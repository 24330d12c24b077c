"""GPT training samples from a Megatron indexed dataset: split, epochs, document/sample/shuffle index.

Owns Megatron's GPTDataset algorithm (mcore, docs/megatron-interop.md §3.1-3.3), reimplemented so
that the same `.bin/.idx`, split, seed, sequence length and sample count give the SAME samples as
Megatron, without its C++ helper: the sample index is a cumsum + searchsorted (no compile step in
a job). `build_sample_index_loop` is the plain one-sample-at-a-time twin; tests check they agree.

Contract
- `sizes`: int32[S] tokens per sequence (the .idx `sequence_lengths`); a split is a contiguous
  range of SEQUENCE ids (`split_ranges`).
- document_index: int32[E * len(docs)], sequence ids, epochs shuffled by RandomState(seed).
- sample_index: [N+1, 2] int32 (int64 if needed) of (position in document_index, token offset);
  sample j covers tokens [row j, row j+1) plus `add_extra_token` (1) more, so samples are L+1 long
  and overlap by one token (inputs = [:-1], labels = [1:]).
- shuffle_index: uint32[N] (int64 if N >= 2**32-1), a permutation of the samples.
- `GPTDataset[i]` -> {"tokens": int64[L], "labels": int64[L], "loss_mask": float32[L]} (numpy; the
  sampler's collate makes torch tensors). Padding (only a non-dropped last valid sample) has
  loss_mask 0 and token id 0.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from hpcmeg.data.index_cache import load_or_build

SPLIT_NAMES = ("train", "valid", "test")
INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")
ALGORITHM = "megatron-mcore-gptdataset-v1"  # bump when the index algorithm changes (rebuilds caches)
_CHUNK = 1 << 22  # samples per searchsorted slab (bounds temporary memory to ~100 MB)


# ---------------------------------------------------------------------------------------------
# split and requested sample counts
# ---------------------------------------------------------------------------------------------
def parse_split(split: str) -> List[float]:
    """"949,50,1" (any separators) -> normalized [0.949, 0.05, 0.001]; padded with zeros to 3."""
    values = [float(v) for v in re.findall(r"[.0-9]+", split)]
    if not values or len(values) > 3:
        raise ValueError(f"split {split!r}: give 1 to 3 non-negative numbers, e.g. '949,50,1'")
    values += [0.0] * (3 - len(values))
    total = np.sum(np.array(values, dtype=np.float64))
    if total <= 0:
        raise ValueError(f"split {split!r}: the parts sum to zero")
    return (np.array(values, dtype=np.float64) / total).tolist()


def split_matrix(weights: Sequence[float]) -> List[Optional[Tuple[float, float]]]:
    """Normalized split weights -> bookends [(0, a), (a, a+b), (a+b, a+b+c)]; empty splits -> None.

    Cumulative sums in Python float, left to right, as Megatron does (the bookends enter rounding).
    """
    ends = [0]
    for w in weights:
        ends.append(ends[-1] + w)
    return [(a, b) if b > a else None for a, b in zip(ends[:-1], ends[1:])]


def split_ranges(split: str, num_sequences: int) -> List[Optional[Tuple[int, int]]]:
    """Sequence-id range [beg, end) per split: round(bookend * N) (Python round, half to even)."""
    out = []
    for bookend in split_matrix(parse_split(split)):
        if bookend is None:
            out.append(None)
        else:
            out.append((int(round(bookend[0] * float(num_sequences))),
                        int(round(bookend[1] * float(num_sequences)))))
    return out


def num_samples_per_split(global_batch_size: int, eval_iters: int, eval_interval: int | None,
                          train_iters: int | None = None, train_samples: int | None = None
                          ) -> Tuple[int, int, int]:
    """Requested (train, valid, test) samples, as Megatron's training loop asks for them.

    train = train_samples or train_iters*gbs; valid = (train_iters//eval_interval + 1)*eval_iters*gbs;
    test = eval_iters*gbs. These counts are part of the cache key.
    """
    if train_samples is None:
        if train_iters is None:
            raise ValueError("give train_iters or train_samples")
        train_samples = train_iters * global_batch_size
    if train_iters is None:  # sample-based schedule: as many iterations as the samples make
        train_iters = train_samples // global_batch_size
    eval_points = train_iters // eval_interval + 1 if eval_interval else 1
    return train_samples, eval_points * eval_iters * global_batch_size, eval_iters * global_batch_size


# ---------------------------------------------------------------------------------------------
# index algorithms (pure numpy, deterministic)
# ---------------------------------------------------------------------------------------------
def num_epochs_for(tokens_per_epoch: int, num_samples: int | None, seq_length: int, add_extra_token: int = 1) -> int:
    """Smallest E >= 1 with E * tokens_per_epoch >= num_samples * seq_length + add_extra_token."""
    if num_samples is None:
        return 1
    if tokens_per_epoch <= 0:
        raise ValueError("the split holds no tokens; use a larger dataset or another --split")
    need = num_samples * seq_length + add_extra_token
    return max(1, -(-need // tokens_per_epoch))


def separate_final_epoch(tokens_per_epoch: int, num_samples: int, num_epochs: int, seq_length: int,
                         add_extra_token: int = 1) -> Tuple[bool, int]:
    """(separate?, samples before the final epoch). Separate when the last epoch is used < 80%."""
    if num_epochs == 1:
        return False, 0
    sans_final = ((num_epochs - 1) * tokens_per_epoch - add_extra_token) // seq_length
    from_final = num_samples - sans_final
    per_epoch = (tokens_per_epoch - add_extra_token) // seq_length
    assert 0 <= from_final <= per_epoch + 1, (from_final, per_epoch)
    return from_final < int(0.80 * per_epoch), sans_final


def build_document_index(docs: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final: bool) -> np.ndarray:
    """`docs` repeated per epoch and shuffled; with separate_final the last epoch is shuffled alone."""
    if not separate_final or num_epochs == 1:
        index = np.tile(np.asarray(docs), num_epochs).astype(np.int32)
        rng.shuffle(index)
        return index
    first = build_document_index(docs, num_epochs - 1, rng, False)
    last = build_document_index(docs, 1, rng, False)
    return np.concatenate((first, last))


def _num_samples_total(total_tokens: int, seq_length: int, drop_last: bool, add_extra_token: int) -> int:
    if drop_last:
        return (total_tokens - add_extra_token) // seq_length
    # Megatron's helper computes this in C++ single-precision float; keep that rounding exactly
    return int(math.ceil(np.float32(total_tokens - add_extra_token) / np.float32(seq_length)))


def _sample_index_dtype(sizes: np.ndarray, document_index: np.ndarray):
    big = max(document_index.shape[0], int(sizes.max()) if sizes.size else 0)
    return np.int32 if big <= np.iinfo(np.int32).max else np.int64


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int, num_epochs: int,
                       tokens_per_epoch: int, drop_last: bool = True, add_extra_token: int = 1) -> np.ndarray:
    """Vectorized sample index: row k (k >= 1) is where the global token position k*L falls.

    Why this equals the C++ loop: sample k ends (exclusive, with the extra token) at global position
    k*L + x; the loop walks to the first document-index position d whose cumulative end is >= that
    and records offset k*L - start(d). Zero-length sequences are skipped by the same rule. If the
    stream runs out (only the last, non-dropped sample) the row is (last, size(last) - x).
    """
    x = int(add_extra_token)
    n = _num_samples_total(num_epochs * tokens_per_epoch, seq_length, drop_last, x)
    dtype = _sample_index_dtype(sizes, document_index)
    ends = np.cumsum(sizes[document_index], dtype=np.int64)  # end of each position in the stream
    out = np.empty((n + 1, 2), dtype=dtype)
    out[0] = 0
    last = document_index.shape[0] - 1
    for lo in range(1, n + 1, _CHUNK):
        k = np.arange(lo, min(n + 1, lo + _CHUNK), dtype=np.int64)
        pos = k * seq_length
        d = np.searchsorted(ends, pos + x, side="left")
        over = d > last
        d = np.minimum(d, last)
        off = pos - (ends[d] - sizes[document_index[d]])
        if over.any():  # the final partial sample (drop_last=False) ran past the stream
            assert over.sum() == 1 and over[-1] and lo + len(k) - 1 == n
            off[over] = int(sizes[document_index[last]]) - x
        out[lo:lo + len(k), 0] = d
        out[lo:lo + len(k), 1] = off
    return out


def build_sample_index_loop(sizes, document_index, seq_length, num_epochs, tokens_per_epoch,
                            drop_last=True, add_extra_token=1) -> np.ndarray:
    """The plain twin of build_sample_index: one sample at a time, Megatron's helper logic (slow)."""
    x = int(add_extra_token)
    n = _num_samples_total(num_epochs * tokens_per_epoch, seq_length, drop_last, x)
    out = np.zeros((n + 1, 2), dtype=_sample_index_dtype(sizes, document_index))
    d, offset = 0, 0
    for row in range(1, n + 1):
        remaining = seq_length + x
        while remaining != 0:
            length = int(sizes[document_index[d]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - x
                remaining = 0
            elif d == len(document_index) - 1:
                assert row == n
                offset = int(sizes[document_index[d]]) - x
                break
            else:
                d, offset = d + 1, 0
        out[row] = (d, offset)
    return out


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """Shuffled arange(num_samples), then (if total_size > num_samples) shuffled arange(num_samples, total)."""
    dtype = np.int64 if total_size >= np.iinfo(np.uint32).max - 1 else np.uint32
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(sizes: np.ndarray, docs: np.ndarray, num_samples: int | None, seq_length: int, seed: int,
                      drop_last: bool = True, add_extra_token: int = 1) -> dict:
    """All three indices for one split of one dataset (Megatron GPTDataset, mcore, bit-exact)."""
    sizes = np.asarray(sizes)
    if sizes.dtype != np.int32:
        sizes = sizes.astype(np.int32)
    docs = np.asarray(docs, dtype=np.int32)
    x = int(add_extra_token)
    tokens_per_epoch = int(np.sum(sizes[docs], dtype=np.int64))
    epochs = num_epochs_for(tokens_per_epoch, num_samples, seq_length, x)
    separate, sans_final = (separate_final_epoch(tokens_per_epoch, num_samples, epochs, seq_length, x)
                            if num_samples is not None else (False, 0))
    rng = np.random.RandomState(seed)  # one stream: document shuffles first, then sample shuffles
    document_index = build_document_index(docs, epochs, rng, separate)
    sample_index = build_sample_index(sizes, document_index, seq_length, epochs, tokens_per_epoch, drop_last, x)
    n = sample_index.shape[0] - 1
    shuffle_index = build_shuffle_index(sans_final if separate else n, n, rng)
    return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}


# ---------------------------------------------------------------------------------------------
# the dataset
# ---------------------------------------------------------------------------------------------
@dataclass
class GPTDatasetConfig:
    seq_length: int  # L: tokens per training sample (inputs); L+1 tokens are read per sample
    seed: int  # numpy RandomState seed for the shuffles (Megatron --seed)
    split: str  # e.g. "949,50,1": train/valid/test shares of the SEQUENCES of each dataset
    cache_dir: Optional[str] = None  # None -> "<prefix>/cache/GPTDataset_indices" like Megatron
    add_extra_token: bool = True  # Megatron add_extra_token_to_sequence
    drop_last_partial_validation: bool = True  # Megatron drop_last_partial_validation_sequence
    mid_level_surplus: float = 0.005  # blending: extra samples built per member dataset
    eod_id: Optional[int] = None  # with eod_mask_loss: token whose label position gets loss 0
    eod_mask_loss: bool = False
    mmap: bool = True  # mmap the .bin (False: seek+read, for filesystems where mmap misbehaves)

    def __post_init__(self):
        if self.seq_length < 2:
            raise ValueError(f"seq_length={self.seq_length}: must be >= 2")
        parse_split(self.split)  # fail early on a bad split string
        if self.eod_mask_loss and self.eod_id is None:
            raise ValueError("eod_mask_loss=True needs eod_id")


class GPTDataset:
    """One split of one indexed dataset, as Megatron's GPTDataset; indices from the cache or built."""

    def __init__(self, indexed, dataset_path: str, split_name: str, docs: np.ndarray,
                 num_samples: int | None, config: GPTDatasetConfig):
        self.indexed, self.dataset_path, self.split_name = indexed, dataset_path, split_name
        self.num_samples, self.config = num_samples, config
        sizes = indexed.sequence_lengths
        if len(docs) == 0 or int(np.sum(sizes[docs], dtype=np.int64)) == 0:
            # Megatron loops forever here; say what to change instead
            raise ValueError(f"{dataset_path}: the {split_name} split of '{config.split}' gets no tokens "
                             f"({len(docs)} of {len(sizes)} sequences); give it a larger share or set it to 0")
        drop_last = config.drop_last_partial_validation if split_name == "valid" else True
        self.description = {
            "class": "GPTDataset", "algorithm": ALGORITHM, "dataset_path": os.path.abspath(dataset_path),
            "num_sequences": int(sizes.shape[0]), "num_tokens": int(np.sum(sizes, dtype=np.int64)),
            "num_samples": num_samples, "index_split": split_name, "split": config.split,
            "doc_range": [int(docs[0]), int(docs[-1]) + 1] if len(docs) else [0, 0],
            "random_seed": config.seed, "sequence_length": config.seq_length,
            "add_extra_token": bool(config.add_extra_token), "drop_last": drop_last,
        }
        cache_dir = config.cache_dir or os.path.join(dataset_path, "cache", "GPTDataset_indices")
        arrays = load_or_build(
            cache_dir, "GPTDataset", split_name, self.description,
            lambda: build_gpt_indices(np.asarray(sizes), docs, num_samples, config.seq_length, config.seed,
                                      drop_last, int(config.add_extra_token)),
            INDEX_NAMES)
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def tokens(self, i: int) -> np.ndarray:
        """The L+x raw tokens of sample i (int64), padded with -1 if the stream ran out."""
        x = int(self.config.add_extra_token)
        j = int(self.shuffle_index[i])
        d0, o0 = (int(v) for v in self.sample_index[j])
        d1, o1 = (int(v) for v in self.sample_index[j + 1])
        get, doc = self.indexed.get, self.document_index
        if d0 == d1:
            parts = [get(int(doc[d0]), offset=o0, length=o1 - o0 + x)]
        else:
            parts = [get(int(doc[d0]), offset=o0)]
            parts += [get(int(doc[d])) for d in range(d0 + 1, d1)]
            parts.append(get(int(doc[d1]), offset=0, length=o1 + x))
        out = np.full(self.config.seq_length + x, -1, dtype=np.int64)
        flat = np.concatenate(parts)
        out[:flat.size] = flat
        return out

    def __getitem__(self, i: int) -> dict:
        text = self.tokens(i)
        if self.config.add_extra_token:
            tokens, labels = text[:-1].copy(), text[1:].copy()
        else:
            tokens, labels = text, np.append(text[1:], -1)
        loss_mask = np.ones(tokens.shape[0], dtype=np.float32)
        if self.config.eod_mask_loss:
            loss_mask[tokens == self.config.eod_id] = 0.0  # Megatron masks where the INPUT is EOD
        loss_mask[labels < 0] = 0.0
        tokens[tokens < 0] = 0
        labels[labels < 0] = 0
        return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}


def build_gpt_datasets(prefix: str, config: GPTDatasetConfig, num_samples: Sequence[int | None],
                       indexed=None) -> List[Optional[GPTDataset]]:
    """[train, valid, test] GPTDatasets of one prefix (None where the split is empty and unused).

    A split that rounds to no sequences (or no tokens) is None when training cannot need it: always
    for test, and for valid when no validation samples are requested (0 or None). An empty train
    split, or an empty valid split with validation samples requested, is a one-line ValueError.
    """
    if indexed is None:
        from hpcmeg.data.indexed import IndexedDataset

        indexed = IndexedDataset(prefix, mmap=config.mmap)
    sizes = indexed.sequence_lengths
    out: List[Optional[GPTDataset]] = []
    for name, rng, n in zip(SPLIT_NAMES, split_ranges(config.split, len(sizes)), num_samples):
        if rng is None:  # a share of 0 in data.split: the user turned this split off
            out.append(None)
            continue
        docs = np.arange(rng[0], rng[1], dtype=np.int32)
        tokens = int(np.sum(sizes[docs], dtype=np.int64))
        if tokens > 0:
            out.append(GPTDataset(indexed, prefix, name, docs, n, config))
            continue
        if name == "test" or (name == "valid" and not n):  # rounded to empty, and never read
            out.append(None)
            continue
        need = f"{n} validation samples are requested" if name == "valid" else "training needs it"
        fix = ("use data.split=90,10,0 or more data" if name == "valid"
               else "give train a larger share of data.split or use more data")
        raise ValueError(f"{prefix}: the {name} split of data.split={config.split!r} gets {len(docs)} of "
                         f"{len(sizes)} sequences ({tokens} tokens) but {need}; {fix}")
    return out
