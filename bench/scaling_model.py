"""Predicted step time of each parallel layout on one 8-GPU node and on 2-4 nodes, on paper.

What it predicts, per layout and model: step time = per-rank compute (+ the pipeline bubble) + the
communication the layout leaves exposed, from the bytes each layout moves (docs/parallelism.md's
table) over stated link bandwidths. The multi-GPU run checks these numbers; this file is the model
they are checked against, and docs/parallelism.md's "A scaling model" section prints its table.

Inputs and their sources (each a flag):
  * per-rank compute: one GPU's measured tokens/s on the user path (--tokens-per-s, default the
    H100 rows of bench/results/user_path_h100_accept_*.md; 2.7B at 1.3B's MFU), split over the
    tensor-parallel ranks without loss (an assumption until the one-GPU layout harness,
    bench/layouts_gpu.py, measures each layout's per-rank compute: pass its numbers with
    --compute-json);
  * NVLink inside a node: H100 SXM's NVLink 4 is 900 GB/s per GPU, 450 GB/s each way (NVIDIA's
    H100 datasheet); a ring collective's bus bandwidth is taken as 80 % of one direction: 360 GB/s;
  * between nodes: a DGX H100-style node has one 400 Gb/s NDR InfiniBand port per GPU (50 GB/s);
    taken as 80 % of it: 40 GB/s per GPU, which bounds any collective whose ring leaves the node;
  * overlap: the data-parallel reduction runs behind the backward (hpcmeg/parallel/overlap.py:
    buckets start as their layers' backward ends), the backward taken as 2/3 of the compute; the
    tied embedding's bucket starts after it (its last gradient is the backward's last op).
    Tensor-parallel all-reduces are on the critical path; pipeline sends are counted exposed.
Batch: the recipe's global batch per 8-GPU node (weak scaling: 2 nodes train twice the batch).
Bytes (per rank, per step): DP ring all-reduce 2(n-1)/n x 4 bytes x (N / (tp x pp)) (fp32 main
grads); with the distributed optimizer (n-1)/n x 6 bytes x the same (fp32 reduce-scatter + bf16
all-gather); TP 4 all-reduces of b x s x h bf16 per layer and micro batch, ring 2(t-1)/t; PP one
b x s x h bf16 activation and its gradient per micro batch.

    python bench/scaling_model.py [--nodes 1,2,4] [--sizes 124M,1.3B,2.7B] [--compute-json FILE]
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

SEQ = 1024
VOCAB = 50304
PEAK_H100 = 790e12  # bf16 dense matmul FLOP/s measured on the lent H100 (784-792 in the user-path rows)
NVLINK_BUS_GBPS = 360.0
IB_BUS_GBPS = 40.0
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Size:
    layers: int
    hidden: int
    global_batch: int
    micro_batch: int
    tokens_per_s: float  # one GPU, the user path

    @property
    def params(self) -> int:
        L, d = self.layers, self.hidden
        return VOCAB * d + SEQ * d + L * (12 * d * d + 13 * d) + 2 * d

    @property
    def flops_per_token(self) -> float:
        return 6 * self.params + 12 * self.layers * self.hidden * SEQ


def _mfu_tokens(layers: int, hidden: int, mfu: float) -> float:
    s = Size(layers, hidden, 1, 1, 0.0)
    return mfu * PEAK_H100 / s.flops_per_token


SIZES = {
    # bench/results/user_path_h100_accept_{124M,1.3B}.md; 2.7B (32 x 2560) at 1.3B's 68.7 % MFU
    "124M": Size(12, 768, 192, 12, 495_867.0),
    "1.3B": Size(24, 2048, 64, 8, 64_069.0),
    "2.7B": Size(32, 2560, 64, 4, _mfu_tokens(32, 2560, 0.687)),
}
LAYOUTS = {"DP": (1, 1), "TP2 x DP": (2, 1), "PP2 x DP": (1, 2), "TP2 x PP2 x DP": (2, 2)}


def predict(size: Size, gpus: int, tp: int, pp: int, distributed_optimizer: bool = False,
            compute_s: float | None = None) -> dict:
    """One row: the step's parts in seconds. compute_s: a measured per-rank compute time for this
    layout (forward + backward + optimizer of one step), else one GPU's scaled down."""
    dp = gpus // (tp * pp)
    nodes = -(-gpus // GPUS_PER_NODE)
    global_batch = size.global_batch * nodes  # weak scaling: each node adds the recipe's batch
    per_rank = global_batch // dp  # sequences per data-parallel rank and step
    micro = min(size.micro_batch, per_rank)
    m = per_rank // micro  # micro batches per step
    if compute_s is None:
        compute_s = per_rank * SEQ / size.tokens_per_s / (tp * pp)
    bubble_s = compute_s * (pp - 1) / m if pp > 1 else 0.0  # 1F1B: (p - 1) of m + p - 1 slots idle
    dp_bw = (NVLINK_BUS_GBPS if nodes == 1 else IB_BUS_GBPS) * 1e9
    shard = size.params / (tp * pp)
    dp_bytes = 0.0 if dp == 1 else ((dp - 1) / dp * 6 * shard if distributed_optimizer
                                    else 2 * (dp - 1) / dp * 4 * shard)
    dp_s = dp_bytes / dp_bw
    tail_s = dp_s * (VOCAB * size.hidden / (tp * pp)) / shard  # the embedding's bucket, after the backward
    dp_exposed = max(0.0, dp_s - tail_s - 2 / 3 * compute_s) + tail_s
    act = micro * SEQ * size.hidden * 2  # one [b, s, h] bf16 activation
    tp_bytes = 0.0 if tp == 1 else 4 * (size.layers / pp) * m * 2 * (tp - 1) / tp * act
    tp_s = tp_bytes / (NVLINK_BUS_GBPS * 1e9)  # TP stays inside a node
    pp_s = 0.0 if pp == 1 else 2 * m * act / ((NVLINK_BUS_GBPS if nodes == 1 else IB_BUS_GBPS) * 1e9)
    step = compute_s + bubble_s + dp_exposed + tp_s + pp_s
    return {"gpus": gpus, "tp": tp, "pp": pp, "dp": dp, "micro": micro, "accum": m,
            "compute_s": compute_s, "bubble_s": bubble_s, "dp_bytes": dp_bytes, "dp_s": dp_s,
            "dp_exposed_s": dp_exposed, "tp_s": tp_s, "pp_s": pp_s, "step_s": step,
            "tokens_per_s_per_gpu": global_batch * SEQ / step / gpus,
            "efficiency": global_batch * SEQ / step / gpus / size.tokens_per_s}


def table(sizes: list[str], nodes: list[int], compute: dict | None = None) -> str:
    lines = ["| model | GPUs | layout | micro x accum | compute ms | bubble ms | DP reduction ms (exposed) | "
             "TP ms | step ms | tokens/s per GPU | vs one GPU |", "|" + "---|" * 11]
    for name in sizes:
        size = SIZES[name]
        for n in nodes:
            gpus = n * GPUS_PER_NODE
            for label, (tp, pp) in LAYOUTS.items():
                key = f"{name} {gpus} tp{tp} pp{pp}"
                r = predict(size, gpus, tp, pp, compute_s=(compute or {}).get(key))
                lines.append(
                    f"| {name} | {gpus} | {label}{r['dp']} | {r['micro']} x {r['accum']} | "
                    f"{1e3 * r['compute_s']:.1f} | {1e3 * r['bubble_s']:.1f} | {1e3 * r['dp_s']:.1f} "
                    f"({1e3 * r['dp_exposed_s']:.1f}) | {1e3 * r['tp_s']:.1f} | {1e3 * r['step_s']:.1f} | "
                    f"{r['tokens_per_s_per_gpu']:,.0f} | {r['efficiency']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="124M,1.3B,2.7B")
    ap.add_argument("--nodes", default="1,2,4")
    ap.add_argument("--compute-json", default=None,
                    help='measured per-rank compute seconds, {"1.3B 8 tp2 pp1": 0.41, ...}')
    a = ap.parse_args()
    compute = json.load(open(a.compute_json)) if a.compute_json else None
    print(table(a.sizes.split(","), [int(n) for n in a.nodes.split(",")], compute))


if __name__ == "__main__":
    main()
