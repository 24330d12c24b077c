"""Memory per GPU with the distributed optimizer, DP 1-64, from bytes measured on one GPU.

For each size the model's ParamAndGradBuffer + FlatAdamW are built the way a data-parallel rank
builds them (bf16 parameters, fp32 main gradients since DP > 1 sums them, masters and Adam moments
for this rank's shard only), for dp = 1, 2, ..., 64 as dp rank 0: the shard sizes come from the
real bucket layout (padding included), so bytes/param are measured, not assumed. Then a few
training steps at dp = 1 (same dtypes) give the peak memory; the rest of the peak (activations,
logits, workspace) does not depend on dp, so peak(dp) = peak(1) - state(1) + state(dp). Megatron's
formula for the same thing: (6 + 12/dp) bytes/param (bf16 param 2 + fp32 grad 4 + fp32 master,
exp_avg, exp_avg_sq 12, sharded).

Usage: python bench/memory_zero.py [--sizes 124M,355M,1.3B] [--mb 12,12,8] [--out bench/results]
Writes <out>/memory_zero_<tag>.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hpcmeg.megatron.layout import pad_vocab_size
from hpcmeg.model.config import GPTConfig  # noqa: E402
from hpcmeg.fused.model import build_gpt  # noqa: E402
from hpcmeg.model.gpt import GPT  # noqa: E402
from hpcmeg.megatron.parallel_dims import ParallelDims  # noqa: E402
from hpcmeg.parallel.context import ParallelContext  # noqa: E402
from hpcmeg.train.optim import AdamWConfig, build_optimizer  # noqa: E402
from hpcmeg.train.step import TrainStep  # noqa: E402

SIZES = {"124M": (12, 768, 12), "355M": (24, 1024, 16), "1.3B": (24, 2048, 16)}
DPS = (1, 2, 4, 8, 16, 32, 64)
SEQ, VOCAB = 1024, 50257


def model_for(size: str) -> GPT:
    L, D, H = SIZES[size]
    torch.manual_seed(0)
    cfg = GPTConfig(L, D, H, 4 * D, SEQ, pad_vocab_size(VOCAB), hidden_dropout=0.0, attention_dropout=0.0,
                    fused=True)
    with torch.device("cuda"):  # init on the GPU: seconds for 1.3B, where the CPU takes ~10 s per build
        return build_gpt(cfg)


def dp_rank0_layout(dp: int) -> ParallelContext:
    """Data-parallel rank 0 of `dp` ranks with the distributed optimizer (dp > 1), for the memory its
    buffer and state take: no process group, as building them communicates nothing."""
    return ParallelContext(world_size=dp, rank=0, local_rank=0, tp_size=1, pp_size=1, dp_size=dp, tp_rank=0,
                           dp_rank=0, pp_rank=0, device=torch.device("cuda"),
                           dims=ParallelDims(dp, distributed_optimizer=dp > 1))


def state_bytes(buf, opt) -> int:
    return sum(t.numel() * t.element_size() for t in (buf.param_data, buf.grad_data, opt.master, opt.exp_avg,
                                                      opt.exp_avg_sq))


def measure(size: str, mb: int, steps: int = 6) -> dict:
    n = None
    per_dp = {}
    for dp in DPS:
        model = model_for(size)
        n = model.num_params()
        buf, opt = build_optimizer(model, AdamWConfig(3e-4), dp_rank0_layout(dp), param_dtype=torch.bfloat16,
                                   grad_dtype=torch.float32)
        per_dp[dp] = state_bytes(buf, opt)
        buf.remove_hooks()
        del model, buf, opt
        torch.cuda.empty_cache()
    # the peak of real steps at dp 1 (fp32 main grads, as at any dp > 1)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = model_for(size)
    buf, opt = build_optimizer(model, AdamWConfig(3e-4), param_dtype=torch.bfloat16, grad_dtype=torch.float32)
    allocated_state = torch.cuda.memory_allocated() - base
    step = TrainStep(model, buf, opt, "bf16", grad_clip=1.0, compile=True, device="cuda",
                     compile_options={"triton.cudagraphs": True})
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randint(0, VOCAB, (mb, SEQ + 1), device="cuda", generator=gen)
    for _ in range(steps):
        res = step.run([(x[:, :-1].contiguous(), x[:, 1:].contiguous())])
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    rows = []
    for dp in DPS:
        ours = per_dp[dp] / n
        rows.append(dict(dp=dp, bytes_per_param=round(ours, 3), megatron_bytes_per_param=round(6 + 12 / dp, 3),
                         state_GB=round(per_dp[dp] / 1e9, 2), megatron_state_GB=round((6 + 12 / dp) * n / 1e9, 2),
                         peak_GB=round((peak - per_dp[1] + per_dp[dp]) / 1e9, 2)))
    del model, buf, opt, step
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    return dict(size=size, n_params=n, micro_batch=mb, measured_state_GB_dp1=round(allocated_state / 1e9, 2),
                computed_state_GB_dp1=round(per_dp[1] / 1e9, 2), peak_GB_dp1=round(peak / 1e9, 2),
                activations_GB=round((peak - per_dp[1]) / 1e9, 2), loss=round(res.loss, 3), rows=rows)


def table(r: dict) -> str:
    lines = [f"### {r['size']} ({r['n_params'] / 1e6:.0f} M params, micro batch {r['micro_batch']}): peak at dp 1 "
             f"{r['peak_GB_dp1']} GB, of which state {r['computed_state_GB_dp1']} GB (allocator says "
             f"{r['measured_state_GB_dp1']}), the rest {r['activations_GB']} GB\n",
             "| dp | bytes/param hpcmeg | Megatron 6 + 12/dp | state GB | Megatron state GB | peak GB per GPU |",
             "|---|---|---|---|---|---|"]
    for x in r["rows"]:
        lines.append(f"| {x['dp']} | {x['bytes_per_param']} | {x['megatron_bytes_per_param']} | {x['state_GB']} | "
                     f"{x['megatron_state_GB']} | {x['peak_GB']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="124M,355M,1.3B")
    ap.add_argument("--mb", default="12,12,8")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "bench", "results")))
    ap.add_argument("--tag", default="h200")
    a = ap.parse_args()
    env = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d %H:%M:%S"))
    results = [measure(s, int(mb)) for s, mb in zip(a.sizes.split(","), a.mb.split(","))]
    md = "\n\n".join([f"# Distributed optimizer memory, DP 1-64 (computed from one GPU)\n\n{json.dumps(env)}\n"]
                     + [table(r) for r in results])
    print(md, flush=True)
    os.makedirs(a.out, exist_ok=True)
    for ext, text in (("json", json.dumps(dict(env=env, results=results), indent=1)), ("md", md)):
        with open(os.path.join(a.out, f"memory_zero_{a.tag}.{ext}"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
