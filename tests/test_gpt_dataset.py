"""GPT dataset indices: parity with Megatron-LM's own GPTDataset/BlendedDataset (golden arrays made by
running Megatron on datasets this test rebuilds), split rounding, epochs, the vectorized sample index
against its loop twin, and the .npy cache (built once by one of several processes, atomic writes)."""

import json
import multiprocessing as mp
import os
import sys

import numpy as np
import pytest

from hpcmeg import fsutil
from hpcmeg.data import index_cache
from hpcmeg.data.blended import (blending_indices, blending_indices_loop, build_train_valid_test_datasets,
                                 exhaustive_blending_indices, parse_blend, prepare_cache, size_per_dataset)
from hpcmeg.data.gpt_dataset import (GPTDatasetConfig, build_document_index, build_gpt_datasets, build_gpt_indices,
                                     build_sample_index, build_sample_index_loop, num_epochs_for,
                                     num_samples_per_split, separate_final_epoch, split_ranges)
from hpcmeg.data.indexed import IndexedDatasetBuilder

GOLD = os.path.join(os.path.dirname(__file__), "data", "megatron_golden")
sys.path.insert(0, GOLD)
from make_dataset import make_dataset  # noqa: E402

CASES = json.load(open(os.path.join(GOLD, "cases.json")))


@pytest.fixture(scope="module")
def golden_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("golden")
    return {w: make_dataset(str(d / w), w) for w in "AB"}


def _config(case, cache_dir):
    return GPTDatasetConfig(seq_length=case["seq_length"], seed=case["seed"], split=case["split"],
                            cache_dir=str(cache_dir), add_extra_token=case.get("add_extra_token", True),
                            drop_last_partial_validation=case.get("drop_last_partial_validation", True))


@pytest.mark.parametrize("name", sorted(CASES))
def test_megatron_parity(name, golden_data, tmp_path):
    case = CASES[name]
    gold = np.load(os.path.join(GOLD, name + ".npz"))
    blend = [golden_data.get(t, t) for t in case["data_path"]]
    datasets = build_train_valid_test_datasets(_config(case, tmp_path), blend, case["num_samples"])
    checked = 0
    for split, ds in zip(("train", "valid", "test"), datasets):
        if ds is None:
            assert f"{split}_m0_document_index" not in gold
            continue
        members = getattr(ds, "datasets", [ds])
        if hasattr(ds, "dataset_index"):
            for key in ("dataset_index", "dataset_sample_index"):
                ref, got = gold[f"{split}_{key}"], np.asarray(getattr(ds, key))
                assert got.dtype == ref.dtype and np.array_equal(got, ref), (split, key)
        for k, m in enumerate(members):
            for key in ("document_index", "sample_index", "shuffle_index"):
                ref, got = gold[f"{split}_m{k}_{key}"], np.asarray(getattr(m, key))
                assert got.dtype == ref.dtype and np.array_equal(got, ref), (split, k, key)
                checked += 1
        # the items themselves (tokens read through hpcmeg's reader) equal Megatron's __getitem__
        for prefix, obj in [(f"{split}_", ds)] + [(f"{split}_m{k}_", m) for k, m in enumerate(members)]:
            if prefix + "item_ids" not in gold:
                continue
            for row, i in enumerate(gold[prefix + "item_ids"]):
                item = obj[int(i)]
                for key in ("tokens", "labels", "loss_mask"):
                    assert np.array_equal(item[key], gold[prefix + "item_" + key][row]), (prefix, i, key)
    assert checked >= 6


def test_golden_cases_cover_both_final_epoch_rules(golden_data):
    """The committed cases really exercise separate and non-separate final epochs (guards the goldens)."""
    from hpcmeg.data.indexed import IndexedDataset

    sizes = IndexedDataset(golden_data["A"]).sequence_lengths
    beg, end = split_ranges("949,50,1", len(sizes))[0]
    T = int(sizes[beg:end].sum())
    flags = []
    for name in ("single_separate_final_epoch", "single_no_separate"):
        n = CASES[name]["num_samples"][0]
        e = num_epochs_for(T, n, 64)
        assert e == 3
        flags.append(separate_final_epoch(T, n, e, 64)[0])
    assert flags == [True, False]


def test_split_rounding_bookends():
    # bookends (0, .949, .999, 1.0) rounded over the number of SEQUENCES, Python round (half to even)
    assert split_ranges("949,50,1", 1000) == [(0, 949), (949, 999), (999, 1000)]
    assert split_ranges("949,50,1", 240) == [(0, 228), (228, 240), (240, 240)]  # test rounds to empty
    assert split_ranges("98,2,0", 379)[2] is None
    assert split_ranges("1 1", 10) == [(0, 5), (5, 10), None]  # any separators, padded with zeros
    assert split_ranges("1,1,2", 2) == [(0, 0), (0, 1), (1, 2)]  # 0.5 rounds to even 0
    with pytest.raises(ValueError):
        split_ranges("0,0,0", 10)


def test_requested_sample_counts():
    # CodeParrot: 150k iters, gbs 192, eval every 200 for 10 iters
    assert num_samples_per_split(192, 10, 200, train_iters=150000) == (28_800_000, 751 * 10 * 192, 1920)
    assert num_samples_per_split(8, 2, 5, train_samples=100) == (100, (12 // 5 + 1) * 16, 16)


def test_epochs_and_separate_final_epoch_edges():
    assert num_epochs_for(1000, None, 10) == 1
    assert num_epochs_for(1000, 99, 10) == 1  # 99*10+1 = 991 tokens fit one epoch
    assert num_epochs_for(1000, 100, 10) == 2  # 1001 tokens: the extra token needs a second epoch
    assert num_epochs_for(1000, 100, 10, add_extra_token=0) == 1
    # per epoch (1000-1)//10 = 99 samples; E=2 -> 99 before the final epoch
    # int(0.8 * 99) = 79: a final epoch used for 79 samples stays mixed, 78 is shuffled alone
    assert separate_final_epoch(1000, 99 + 79, 2, 10) == (False, 99)
    assert separate_final_epoch(1000, 99 + 78, 2, 10) == (True, 99)
    assert separate_final_epoch(1000, 50, 1, 10) == (False, 0)
    with pytest.raises(ValueError):
        num_epochs_for(0, 5, 10)


def test_document_index_separate_epoch_is_shuffled_alone():
    docs = np.arange(10, 20, dtype=np.int32)
    idx = build_document_index(docs, 3, np.random.RandomState(1), True)
    assert idx.dtype == np.int32 and len(idx) == 30
    assert sorted(idx[20:].tolist()) == docs.tolist()  # final epoch = each doc exactly once
    assert sorted(idx[:20].tolist()) == sorted(docs.tolist() * 2)
    mixed = build_document_index(docs, 3, np.random.RandomState(1), False)
    assert sorted(mixed[20:].tolist()) != docs.tolist()  # without separation epochs mix


@pytest.mark.parametrize("seed", range(40))
def test_vectorized_sample_index_matches_loop(seed):
    rs = np.random.RandomState(seed)
    sizes = rs.randint(0 if seed % 4 == 0 else 1, rs.choice([3, 30, 300]), size=rs.randint(2, 80)).astype(np.int32)
    sizes[-1] = max(sizes[-1], 2)
    docs = np.arange(len(sizes), dtype=np.int32)
    L, x, e = int(rs.choice([2, 5, 16, 64])), int(rs.randint(0, 2)), int(rs.randint(1, 4))
    di = build_document_index(docs, e, np.random.RandomState(seed), False)
    T = int(sizes.sum())
    for drop in (True, False):
        a = build_sample_index(sizes, di, L, e, T, drop, x)
        b = build_sample_index_loop(sizes, di, L, e, T, drop, x)
        assert a.dtype == b.dtype == np.int32 and np.array_equal(a, b)


def test_samples_cover_the_token_stream_exactly(golden_data, tmp_path):
    """Unshuffled, consecutive samples tile the document stream with one token of overlap."""
    cfg = GPTDatasetConfig(seq_length=37, seed=3, split="1,0,0", cache_dir=str(tmp_path))
    ds = build_train_valid_test_datasets(cfg, [golden_data["A"]], [200, None, None])[0]
    stream = np.concatenate([ds.indexed.get(int(d)) for d in ds.document_index]).astype(np.int64)
    inv = np.argsort(ds.shuffle_index)
    for j in (0, 1, 57, len(ds) - 1):
        t = ds.tokens(int(inv[j]))
        assert np.array_equal(t, stream[j * 37: j * 37 + 38])


def test_blending_rule_and_sizes():
    for fn in (blending_indices, blending_indices_loop):
        di, dsi = fn([0.3, 0.7], 10)
        assert di.tolist() == [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]  # worked by hand: argmax of w*max(i,1) - count
        assert dsi.tolist() == [0, 0, 1, 2, 1, 3, 4, 2, 5, 6]
        di, _ = fn([0.5, 0.5], 4)
        assert di.tolist() == [0, 1, 0, 1]  # ties: the first dataset wins
    assert size_per_dataset([0.3, 0.7], 1000, 0.005) == [302, 704]
    assert parse_blend("0.3 a 0.7 b") == (["a", "b"], [0.3, 0.7])
    assert parse_blend(["a", "b"]) == (["a", "b"], None)
    di, dsi = exhaustive_blending_indices([2, 3])
    assert np.bincount(di).tolist() == [2, 3] and sorted(dsi[di == 1].tolist()) == [0, 1, 2]


def _build_in_process(args):
    cache_dir, sizes_path, log_path = args
    sizes = np.load(sizes_path)
    calls = []

    def build():
        calls.append(1)
        with open(log_path, "a") as f:
            f.write(f"{os.getpid()}\n")
        return build_gpt_indices(sizes, np.arange(len(sizes), dtype=np.int32), 5000, 128, 1234)

    desc = {"dataset": "concurrency-test", "n": 5000}
    arrays = index_cache.load_or_build(cache_dir, "GPTDataset", "train", desc, build,
                                       ("document_index", "sample_index", "shuffle_index"))
    return {k: np.asarray(v).tobytes() for k, v in arrays.items()}


def test_cache_built_once_by_concurrent_processes(tmp_path):
    sizes = np.random.RandomState(0).randint(1, 2000, size=20000).astype(np.int32)
    np.save(tmp_path / "sizes.npy", sizes)
    log = tmp_path / "builders.log"
    args = (str(tmp_path / "cache"), str(tmp_path / "sizes.npy"), str(log))
    with mp.get_context("spawn").Pool(3) as pool:
        results = pool.map(_build_in_process, [args] * 3)
    assert len(open(log).read().split()) == 1  # exactly one process built; the others waited and loaded
    assert results[0] == results[1] == results[2]
    files = sorted(os.listdir(tmp_path / "cache"))
    assert sum(f.endswith(".npy") for f in files) == 3 and sum(f.endswith("description.txt") for f in files) == 1
    # fsutil names a temporary ".<target>.tmp-<pid>-<random>"; its target exists once the build is done
    assert not [f for f in files if any(f.startswith(fsutil.temp_prefix(t)) for t in files)]
    # a second call is a pure cache hit: the build function must not run
    again = index_cache.load_or_build(args[0], "GPTDataset", "train", {"dataset": "concurrency-test", "n": 5000},
                                      lambda: pytest.fail("rebuilt on a cache hit"),
                                      ("document_index", "sample_index", "shuffle_index"))
    assert isinstance(again["sample_index"], np.memmap)


def test_atomic_write_leaves_old_file_on_failure(tmp_path):
    path = str(tmp_path / "x.npy")
    index_cache.atomic_save_npy(path, np.arange(5))

    bad = np.empty(3, dtype=object)  # np.save with allow_pickle=False refuses object arrays mid-write
    with pytest.raises(ValueError):
        index_cache.atomic_save_npy(path, bad)
    assert np.load(path).tolist() == [0, 1, 2, 3, 4]
    assert os.listdir(tmp_path) == ["x.npy"]  # no temporary left behind


def test_interrupted_build_is_not_a_cache_hit(tmp_path):
    """A builder that dies before the description is written leaves no usable (half) cache entry."""
    def build():
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        index_cache.load_or_build(str(tmp_path), "GPTDataset", "train", {"a": 1}, build, ("document_index",))
    out = index_cache.load_or_build(str(tmp_path), "GPTDataset", "train", {"a": 1},
                                    lambda: {"document_index": np.arange(3)}, ("document_index",))
    assert out["document_index"].tolist() == [0, 1, 2]


def test_prepare_cache_then_training_loads(golden_data, tmp_path):
    cfg = GPTDatasetConfig(seq_length=64, seed=1234, split="90,8,2", cache_dir=str(tmp_path / "c"))
    blend = ["0.5", golden_data["A"], "0.5", golden_data["B"]]
    prepare_cache(cfg, blend, (400, 40, 8))
    n_files = len(os.listdir(tmp_path / "c"))
    assert n_files >= 3 * 2 * 4 + 3 * 3  # member GPT indices + blend indices (+ lock files)
    ds = build_train_valid_test_datasets(cfg, blend, (400, 40, 8))
    assert isinstance(ds[0].dataset_index, np.memmap) and len(ds[0]) == 400
    assert len(os.listdir(tmp_path / "c")) == n_files


def _weight_cases():
    rs = np.random.RandomState(11)
    cases = [[1.0], [0.5, 0.5], [0.3, 0.7], [0.2, 0.3, 0.5], [1 / 3] * 3, [0.25] * 4, [0.123, 0.877],
             [1e-9, 1 - 1e-9], [1e-4, 0.3, 0.7 - 1e-4], [1e-12, 1e-12, 1.0], [3, 1, 1, 1, 1, 1, 1, 1]]
    cases += [rs.dirichlet([a] * k).tolist() for a, k in [(1, 2), (1, 3), (1, 3), (1, 4), (0.1, 3), (1, 6),
                                                          (0.2, 8), (1, 40)]]
    return [np.array(w, np.float64) / np.sum(np.array(w, np.float64)) for w in cases]  # normalized like the blend


@pytest.mark.parametrize("k", range(19))
def test_fast_blending_is_bit_identical_to_the_loop(k):
    """Speculated numpy blend == Megatron's one-step loop: equal/tiny/random weights, 1..40 datasets,
    sizes around the period start-up and long enough for several blocks, resyncs and tilings."""
    w = _weight_cases()[k].tolist()
    for size in (0, 1, 2, 3, 65, 1000, 60_000 if len(w) < 10 else 5000):
        ref, ref_s = blending_indices_loop(w, size)
        got, got_s = blending_indices(w, size)
        assert got.dtype == np.int16 and got_s.dtype == np.int64
        assert np.array_equal(got, ref) and np.array_equal(got_s, ref_s), (w, size)


def _tiny_dataset(path, n_docs):
    rs = np.random.RandomState(n_docs)
    builder = IndexedDatasetBuilder(str(path) + ".bin", np.uint16)
    for _ in range(n_docs):
        n = int(rs.randint(20, 80))
        builder.add_document(rs.randint(0, 50000, size=n), [n])
    builder.finalize(str(path) + ".idx")
    return str(path)


def test_split_rounding_to_empty_test_or_unused_valid_is_none(tmp_path):
    # 300 documents: "949,50,1" rounds the test split to (300, 300), which training never reads
    prefix = _tiny_dataset(tmp_path / "t300", 300)
    cfg = GPTDatasetConfig(seq_length=32, seed=1, split="949,50,1", cache_dir=str(tmp_path / "c"))
    train, valid, test = build_gpt_datasets(prefix, cfg, [200, 20, 8])
    assert len(train) >= 200 and len(valid) >= 20 and test is None
    # blends follow their members: no test split, no error
    ds = build_train_valid_test_datasets(cfg, ["0.4", prefix, "0.6", prefix], [200, 20, 8])
    assert len(ds[0]) == 200 and ds[2] is None
    # 40 documents: "99,1,0" rounds valid to (40, 40); fine while no validation samples are asked for
    small = _tiny_dataset(tmp_path / "t40", 40)
    cfg = GPTDatasetConfig(seq_length=32, seed=1, split="99,1,0", cache_dir=str(tmp_path / "c"))
    for n_valid in (0, None):
        train, valid, test = build_gpt_datasets(small, cfg, [50, n_valid, None])
        assert len(train) >= 50 and valid is None and test is None


def test_split_rounding_to_empty_when_needed_names_split_count_and_fix(tmp_path):
    small = _tiny_dataset(tmp_path / "t40", 40)
    cfg = GPTDatasetConfig(seq_length=32, seed=1, split="99,1,0", cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError) as e:
        build_gpt_datasets(small, cfg, [50, 16, None])
    msg = str(e.value)
    assert "\n" not in msg and "valid split" in msg and "0 of 40 sequences" in msg and "16 validation samples" in msg
    assert "data.split=90,10,0" in msg
    cfg = GPTDatasetConfig(seq_length=32, seed=1, split="1,99,0", cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match=r"the train split of data.split='1,99,0' gets 0 of 40 sequences"):
        build_gpt_datasets(small, cfg, [50, 0, None])
    with pytest.raises(ValueError, match="train split"):
        build_train_valid_test_datasets(cfg, ["0.5", small, "0.5", small], [50, 0, None])
