"""A data plan -> train/validation datasets and this rank's batches (uses hpcmeg/data, owns none of it).

Contract
- Every function here takes a DataPlan (hpcmeg.recipe_plan.data_plan, derived once per start from
  the recipe: the blend of (weight, prefix) pairs, split, sequence length, seed, index cache
  directory, the sample counts and the vocabulary); nothing here reads the recipe.
  `plan.samples` = (train, valid, test) keys the index cache: `hpcmeg prepare-cache` and training
  both take it from data_plan, so a prepared cache is always a hit (data_plan says why validation
  always uses the same first eval_iters global batches).
- `build_datasets(plan, barrier, is_rank0)`: global rank 0 (is_rank0) builds missing index files
  first; after barrier() the other ranks load them (the file lock in index_cache covers other jobs
  sharing a cache).
- `TrainBatches`: an iterator of steps; each step is a list of `grad_accum_steps` micro batches
  (tokens int64 [mbs, L], labels int64 [mbs, L]) already on the device. The order is Megatron's
  pretraining sampler from `consumed_samples` (resume is arithmetic: same consumed -> same
  batches). The next step's host->device copy is issued (non_blocking, from pinned memory on
  CUDA) right after the current step is handed out, so it overlaps the step's GPU work.
  DataLoader workers get a private seeded generator: the global torch RNG (dropout) is never
  touched by data loading, which keeps interrupted-and-resumed runs bit-identical.
- `eval_batches(...)`: the fixed evaluation set of this rank: eval_iters steps of micro batches
  (tokens, labels, loss_mask), built once and kept in (pinned) host memory.
- `vocab_checked(plan, ds)`: the dataset with every sample's token ids checked against the
  vocabulary on the host (TokenIdError naming model.vocab_size / the tokenizer and the data).
"""
from __future__ import annotations

from typing import Iterator

import torch

from hpcmeg.data.gpt_dataset import GPTDatasetConfig
from hpcmeg.data.sampler import PretrainingSampler, collate
from hpcmeg.recipe_plan import DataPlan


def dataset_config(plan: DataPlan) -> GPTDatasetConfig:
    return GPTDatasetConfig(seq_length=plan.seq_length, seed=plan.seed, split=plan.split, cache_dir=plan.cache_dir)


def blend_arg(plan: DataPlan) -> list[str]:
    """Megatron --data-path form for hpcmeg.data.blended: [prefix] or [w1, p1, w2, p2, ...]."""
    if len(plan.blend) == 1:
        return [plan.blend[0][1]]
    return [x for w, p in plan.blend for x in (repr(float(w)), p)]


def check_inputs_exist(plan: DataPlan) -> None:
    from hpcmeg.data.indexed import dataset_exists

    missing = [p for _, p in plan.blend if not dataset_exists(p)]
    if missing:
        where = "data.data_path" if plan.from_data_path else "the preprocess stage output"
        raise FileNotFoundError(f"no tokenized dataset at {missing[0]}.bin/.idx ({where}); run "
                                f"`hpcmeg submit RECIPE --stages preprocess` (or `hpcmeg preprocess`) first")


def build_datasets(plan: DataPlan, barrier=lambda: None, is_rank0: bool = True) -> list:
    """[train, valid, test] datasets; rank 0 builds the index cache, the others wait then load."""
    from hpcmeg.data.blended import build_train_valid_test_datasets

    check_inputs_exist(plan)
    cfg, blend = dataset_config(plan), blend_arg(plan)
    out = None
    if is_rank0:
        out = build_train_valid_test_datasets(cfg, blend, plan.samples)
    barrier()
    if out is None:
        out = build_train_valid_test_datasets(cfg, blend, plan.samples)
    return out


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor.to(device, non_blocking=True) if device.type == "cuda" else tensor


class TrainBatches:
    """Steps of micro batches for one data-parallel rank, from `consumed_samples` on."""

    def __init__(self, dataset, consumed_samples: int, micro_batch_size: int, grad_accum_steps: int,
                 dp_rank: int, dp_size: int, device: torch.device, num_workers: int = 0, seed: int = 0):
        self.accum, self.device = grad_accum_steps, device
        sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
        self.loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=sampler, num_workers=num_workers, collate_fn=collate,
            pin_memory=device.type == "cuda", persistent_workers=num_workers > 0,
            prefetch_factor=max(2, grad_accum_steps) if num_workers > 0 else None,
            generator=torch.Generator().manual_seed(seed))
        self._it = iter(self.loader)
        self._next = self._fetch()

    def _fetch(self) -> list | None:
        step = []
        for _ in range(self.accum):
            try:
                mb = next(self._it)
            except StopIteration:
                return None
            step.append((_to_device(mb["tokens"], self.device), _to_device(mb["labels"], self.device)))
        return step

    def __iter__(self) -> Iterator[list]:
        return self

    def __next__(self) -> list:
        self.prefetch()
        cur, self._next = self._next, None
        if cur is None:
            raise StopIteration
        return cur

    def prefetch(self) -> None:
        """Issue the next step's loads and copies; call after launching the current step."""
        if self._next is None:
            self._next = self._fetch()


def eval_batches(dataset, eval_iters: int, micro_batch_size: int, grad_accum_steps: int, dp_rank: int,
                 dp_size: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """This rank's micro batches of the fixed evaluation set (eval_iters global batches)."""
    total = eval_iters * micro_batch_size * dp_size * grad_accum_steps
    if dataset is None or total == 0:
        return []
    if len(dataset) < total:
        raise ValueError(f"the validation split has {len(dataset)} samples but evaluation needs {total} "
                         f"(train.eval_iters x global batch); lower train.eval_iters or use more data")
    sampler = PretrainingSampler(total, 0, micro_batch_size, dp_rank, dp_size)
    out = []
    pin = device.type == "cuda"
    for idx in sampler:
        mb = collate([dataset[i] for i in idx])
        t = [mb["tokens"], mb["labels"], mb["loss_mask"]]
        out.append(tuple(x.pin_memory() if pin else x for x in t))
    return out


class TokenIdError(ValueError):
    """A token id in the data is not below the vocabulary size the model is built with."""


class _VocabChecked(torch.utils.data.Dataset):
    """A GPT dataset whose samples are refused when a token id is >= the vocabulary size.

    Without it such an id fails deep inside the embedding (a 45-line IndexError on CPU, a
    device-side assert that kills the process on CUDA). The check runs on the host-side numpy
    sample (L + L integer compares, microseconds) where it is read anyway, so it covers exactly
    the tokens the run consumes, costs no device sync, and needs no scan of the whole .bin."""

    def __init__(self, ds, vocab_size: int, fix: str):
        self.ds, self.vocab_size, self.fix = ds, vocab_size, fix

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, index: int) -> dict:
        item = self.ds[index]
        top = int(max(item["tokens"].max(initial=0), item["labels"].max(initial=0)))
        if top >= self.vocab_size:
            raise TokenIdError(f"the data holds token id {top} but the vocabulary has {self.vocab_size} tokens "
                               f"(ids 0..{self.vocab_size - 1}); {self.fix}")
        return item


def vocab_checked(plan: DataPlan, ds):
    """`ds` wrapped so that a token id >= the vocabulary size is one clear error (None stays None)."""
    if ds is None:
        return None
    data = ", ".join(p for _, p in plan.blend)
    if plan.vocab_set:
        fix = (f"model.vocab_size={plan.vocab_size} is too small for {data}: raise it, or set it to null to "
               f"read it from the tokenizer files")
    else:
        fix = (f"{data} was tokenized with a larger vocabulary than {plan.tokenizer}: point data.vocab_file / "
               f"data.tokenizer_model at the tokenizer that wrote it, or set model.vocab_size")
    return _VocabChecked(ds, plan.vocab_size, fix)
