"""Reshard on a GPU run's checkpoint: bf16 parameters beside fp32 masters, kept bit for bit.

A real `hpcmeg train` on one CUDA device (bf16 parameters, the default; dropout 0.1; 8 iterations,
saved at 4 and 8), then `hpcmeg reshard` of iteration 4: identity (TP1 -> TP1) and a round trip
TP1 -> TP2 -> TP1. Checked against the source shard: the fp32 masters (fp32_from_fp16_params) and
Adam's moments bit for bit (and that the masters hold bits the bf16 parameters do not, so the check
could fail), the parameters, the RNG state of the identity copy. Then training resumes from the
identity copy to iteration 8 and its losses are compared with the uninterrupted run's.

    python bench/reshard_bf16_gpu.py --data PREFIX --vocab VOCAB_JSON --merges MERGES_TXT --out DIR

Writes DIR/reshard_bf16_gpu.json; exit 0 when every bit-for-bit check holds.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from hpcmeg.checkpoint.store import load_checkpoint  # noqa: E402
from hpcmeg.train.metrics import read_metrics  # noqa: E402

SETS = ["data.split=949,50,0", "data.seq_length=64", "model.num_layers=2", "model.hidden_size=64",
        "model.num_attention_heads=2", "model.max_position_embeddings=64", "train.micro_batch_size=4",
        "train.global_batch_size=8", "train.train_iters=8", "train.lr_warmup_iters=2", "train.log_interval=1",
        "train.eval_interval=0", "checkpoint.save_interval=4", "model.hidden_dropout=0.1",
        "model.attention_dropout=0.1", "cluster.cpu_tasks_per_node=1", "cluster.gpus_per_node=1"]


def hpcmeg(*args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "hpcmeg.cli", *args], cwd=REPO, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=REPO))
    print(r.stdout[-3000:], r.stderr[-3000:], flush=True)
    if r.returncode != 0:
        raise SystemExit(f"hpcmeg {args[0]} exited {r.returncode}")


def train(out: str, name: str, extra: list[str]) -> str:
    sets = [f"run.output_root={out}", f"run.name={name}", *SETS, *extra]
    hpcmeg("train", "recipes/codeparrot_tiny.yaml", *[x for s in sets for x in ("--set", s)])
    return os.path.join(out, name)


def losses(run: str) -> dict[int, float]:
    return {r["iteration"]: r["loss"] for r in read_metrics(os.path.join(run, "metrics.jsonl"))["train"]}


def shard(ckpt_dir: str, iteration: int = 4) -> dict:
    return load_checkpoint(ckpt_dir, tp_rank=0, pp_rank=0, tp_size=1, pp_size=1, iteration=iteration)[1]


def tensors(d, prefix=""):
    if isinstance(d, torch.Tensor):
        yield prefix, d
    elif isinstance(d, dict):
        for k, v in d.items():
            yield from tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(d, (list, tuple)):
        for i, v in enumerate(d):
            yield from tensors(v, f"{prefix}.{i}")


def differing(a, b) -> list[str]:
    ta, tb = dict(tensors(a)), dict(tensors(b))
    bad = sorted(set(ta) ^ set(tb))
    for k in sorted(set(ta) & set(tb)):
        x, y = ta[k], tb[k]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            bad.append(k)
    return bad


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--vocab", required=True)
    ap.add_argument("--merges", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if not torch.cuda.is_available() and not os.environ.get("RESHARD_GPU_DRY"):
        raise SystemExit("needs a CUDA device")
    data = [f"data.data_path=[{a.data}]", f"data.vocab_file={a.vocab}", f"data.merge_file={a.merges}"]
    if torch.cuda.is_available():  # the tiny recipe trains in fp32 (made for CPU ranks)
        data.append("train.precision=bf16")
    res: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__}
    src = train(a.out, "src", data)
    ck = os.path.join(src, "checkpoints")
    s = shard(ck)
    model = dict(tensors(s["model"]))
    res["param_dtypes"] = sorted({str(t.dtype) for t in model.values()})
    masters = s["optimizer"]["optimizer"]["fp32_from_fp16_params"] if "optimizer" in s["optimizer"] else \
        s["optimizer"]["fp32_from_fp16_params"]
    flat = [t for _, t in tensors(masters)]
    res["master_dtypes"] = sorted({str(t.dtype) for t in flat})
    # masters carrying bits that bf16 drops: a reshard that rebuilt them from the parameters would lose them
    res["masters_with_sub_bf16_bits"] = sum(int((t != t.to(torch.bfloat16).float()).sum()) for t in flat)
    ident, tp2, back = (os.path.join(a.out, n) for n in ("ident", "tp2", "back"))
    hpcmeg("reshard", ck, ident, "--tp", "1", "--pp", "1", "--iteration", "4")
    hpcmeg("reshard", ck, tp2, "--tp", "2", "--pp", "1", "--iteration", "4")
    hpcmeg("reshard", tp2, back, "--tp", "1", "--pp", "1", "--iteration", "4")
    si, sb = shard(ident), shard(back)
    res["identity_differs"] = differing({k: v for k, v in s.items() if k != "hpcmeg"},
                                        {k: v for k, v in si.items() if k != "hpcmeg"})
    res["round_trip_optimizer_differs"] = differing(s["optimizer"], sb["optimizer"])
    res["round_trip_model_differs"] = differing(s["model"], sb["model"])
    resumed = train(a.out, "resumed", data + [f"checkpoint.dir={ident}"])
    ls, lr = losses(src), losses(resumed)
    res["losses_src"] = {k: ls[k] for k in sorted(ls)}
    res["losses_resumed"] = {k: lr[k] for k in sorted(lr)}
    res["resumed_equal"] = all(lr.get(i) == ls.get(i) for i in range(5, 9))
    ok = (res["master_dtypes"] == ["torch.float32"] and res["masters_with_sub_bf16_bits"] > 0
          and (res["param_dtypes"] == ["torch.bfloat16"] or not torch.cuda.is_available())
          and not res["identity_differs"] and not res["round_trip_optimizer_differs"])
    res["ok"] = ok
    with open(os.path.join(a.out, "reshard_bf16_gpu.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
