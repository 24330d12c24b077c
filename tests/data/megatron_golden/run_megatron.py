"""Scratch only (never committed to hpcmeg): run Megatron-LM's own GPTDataset/BlendedDataset builder on
hpcmeg-made datasets and save the index arrays + a few items as golden .npz files."""
import json, os, sys, tempfile, shutil
import numpy as np
GOLD = sys.argv[1]          # tests/data/megatron_golden in the hpcmeg checkout
sys.path.insert(0, GOLD)
from make_dataset import make_dataset   # builds with hpcmeg's IndexedDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

class Tok:  # minimal tokenizer object: Megatron only needs these attributes for GPT indices/items
    unique_identifiers = {"class": "GoldenTokenizer"}
    vocab_size = 70000
    eod = 50256

work = tempfile.mkdtemp()
paths = {w: make_dataset(os.path.join(work, w), w) for w in "AB"}
cases = json.load(open(os.path.join(GOLD, "cases.json")))
for name, c in cases.items():
    blend = [paths.get(t, t) for t in c["data_path"]]
    if len(blend) % 2 == 0:
        bl = (blend[1::2], [float(w) for w in blend[0::2]])
    else:
        bl = (blend, None)
    cfg = GPTDatasetConfig(random_seed=c["seed"], sequence_length=c["seq_length"], blend=bl, split=c["split"],
                           path_to_cache=os.path.join(work, "cache_" + name), tokenizer=Tok(),
                           reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                           create_attention_mask=False,
                           drop_last_partial_validation_sequence=c.get("drop_last_partial_validation", True),
                           add_extra_token_to_sequence=c.get("add_extra_token", True))
    dss = BlendedMegatronDatasetBuilder(GPTDataset, c["num_samples"], lambda: True, cfg).build()
    out = {}
    def items(prefix, ds):
        n = len(ds)
        idx = list(range(min(6, n)))
        if isinstance(ds, GPTDataset):
            last = int(np.nonzero(np.asarray(ds.shuffle_index) == n - 1)[0][0])
            idx.append(last)
        got = [ds[i] for i in idx]
        out[prefix + "item_ids"] = np.array(idx, dtype=np.int64)
        for key in ("tokens", "labels", "loss_mask"):
            out[prefix + "item_" + key] = np.stack([g[key].numpy() for g in got])
        if isinstance(ds, BlendedDataset):
            out[prefix + "item_dataset_id"] = np.array([int(g["dataset_id"]) for g in got])
    for split, ds in zip(("train", "valid", "test"), dss):
        if ds is None:
            continue
        if isinstance(ds, BlendedDataset):
            out[f"{split}_dataset_index"] = np.asarray(ds.dataset_index)
            out[f"{split}_dataset_sample_index"] = np.asarray(ds.dataset_sample_index)
            members = ds.datasets
            items(f"{split}_", ds)
        else:
            members = [ds]
        for k, m in enumerate(members):
            p = f"{split}_m{k}_"
            out[p + "document_index"] = np.asarray(m.document_index)
            out[p + "sample_index"] = np.asarray(m.sample_index)
            out[p + "shuffle_index"] = np.asarray(m.shuffle_index)
            out[p + "num_samples"] = np.array(-1 if m.num_samples is None else m.num_samples)
            items(p, m)
    np.savez_compressed(os.path.join(GOLD, name + ".npz"), **out)
    print(name, {k: (v.shape, str(v.dtype)) for k, v in out.items() if k.endswith("_index")})
shutil.rmtree(work)
