"""Resumable pretraining sampler: order, DP slicing, exact resume from a consumed-samples count,
collation to torch tensors and the DataLoader wrapper over a real GPTDataset."""

import os
import sys

import numpy as np
import pytest
import torch

from hpcmeg.data.gpt_dataset import GPTDatasetConfig, build_gpt_datasets
from hpcmeg.data.sampler import PretrainingSampler, collate, global_batch_indices

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data", "megatron_golden"))
from make_dataset import make_dataset  # noqa: E402


def _all_ranks(total, consumed, mbs, dp, drop_last=True):
    return [list(PretrainingSampler(total, consumed, mbs, r, dp, drop_last)) for r in range(dp)]


def test_single_rank_order_and_length():
    s = PretrainingSampler(10, 0, 3, 0, 1)
    assert list(s) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]] and len(s) == 3
    s = PretrainingSampler(10, 0, 3, 0, 1, drop_last=False)
    assert list(s)[-1] == [9] and len(s) == 4


def test_dp2_slices_each_global_group():
    r0, r1 = _all_ranks(20, 0, 2, 2)
    assert r0[:2] == [[0, 1], [4, 5]] and r1[:2] == [[2, 3], [6, 7]]
    # every group of mbs*dp consecutive indices is split between ranks with no overlap
    for a, b in zip(r0, r1):
        assert sorted(a + b) == list(range(a[0], a[0] + 4))
    assert len(r0) == len(r1) == 5


@pytest.mark.parametrize("dp,mbs,gbs", [(1, 4, 8), (2, 2, 8), (4, 1, 8), (2, 3, 12)])
def test_resume_gives_exact_tail(dp, mbs, gbs):
    total = 96
    full = _all_ranks(total, 0, mbs, dp)
    for iters_done in (1, 3, 7):
        consumed = iters_done * gbs
        resumed = _all_ranks(total, consumed, mbs, dp)
        micro_per_iter = gbs // (mbs * dp)  # gradient-accumulation steps
        for r in range(dp):
            assert resumed[r] == full[r][iters_done * micro_per_iter:]
        # and the next global batch (all ranks, all micro steps) is the next gbs indices
        first = sorted(i for r in range(dp) for mb in resumed[r][:micro_per_iter] for i in mb)
        assert first == global_batch_indices(consumed, gbs)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="consumed_samples"):
        PretrainingSampler(10, 10, 2, 0, 1)
    with pytest.raises(ValueError, match="data_parallel_rank"):
        PretrainingSampler(10, 0, 2, 2, 2)


def test_collate_and_dataloader_over_real_dataset(tmp_path):
    prefix = make_dataset(str(tmp_path / "A"), "A")
    cfg = GPTDatasetConfig(seq_length=32, seed=1234, split="98,2,0", cache_dir=str(tmp_path / "cache"))
    train = build_gpt_datasets(prefix, cfg, [64, 8, None])[0]
    batch = collate([train[0], train[1]])
    assert batch["tokens"].dtype == torch.int64 and batch["tokens"].shape == (2, 32)
    assert batch["labels"].dtype == torch.int64 and batch["loss_mask"].dtype == torch.float32
    assert torch.equal(batch["tokens"][0, 1:], batch["labels"][0, :-1])  # labels are inputs shifted by one
    # rank 1 of dp=2, resumed after 16 samples, through the trainer's loader: micro batches are exactly
    # the expected dataset items
    from hpcmeg.train.data import TrainBatches

    got = list(TrainBatches(train, 16, 4, 1, 1, 2, torch.device("cpu")))
    assert len(got) == (len(train) - 16) // 8
    for k, ((tokens, _),) in enumerate(got[:3]):
        start = 16 + k * 8 + 4
        want = np.stack([train[i]["tokens"] for i in range(start, start + 4)])
        assert np.array_equal(tokens.numpy(), want)
