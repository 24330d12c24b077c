"""Is fusing the weight-gradient accumulation into the GEMM worth it here?

Megatron's gradient_accumulation_fusion writes each weight gradient straight into the fp32 main grad
(cuBLAS with beta=1, C fp32, A/B bf16) instead of a bf16 gradient then a separate read-convert-add
pass. torch has the same GEMM as `torch.addmm(main, dy_t, x, out_dtype=torch.float32, out=main)`
(CUDA only). This times, per weight shape of a layer (124M / 355M / 1.3B widths, 12288 or 8192 tokens):
  * split: wgrad = dy_t @ x in bf16, then main += wgrad.float() (what an unfused accumulation does);
  * fused: the fp32-accumulating addmm into main;
and checks they agree (fp32 tolerance). Usage: python bench/dev/wgrad_probe.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os

import torch


def shapes(d: int, tokens: int) -> dict[str, tuple[int, int, int]]:
    """name -> (out features, in features, tokens): the four weights of one transformer layer."""
    return {"qkv": (3 * d, d, tokens), "proj": (d, d, tokens), "fc": (4 * d, d, tokens), "fc2": (d, 4 * d, tokens)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    from triton.testing import do_bench
    report = {}
    for tag, d, tokens in (("124M", 768, 12288), ("355M", 1024, 12288), ("1.3B", 2048, 8192)):
        rows = {}
        for name, (o, i, t) in shapes(d, tokens).items():
            g = torch.Generator(device="cuda").manual_seed(0)
            dy = torch.randn(t, o, device="cuda", dtype=torch.bfloat16, generator=g)  # [tokens, out]
            x = torch.randn(t, i, device="cuda", dtype=torch.bfloat16, generator=g)  # [tokens, in]
            main_s = torch.zeros(o, i, device="cuda")
            main_f = torch.zeros(o, i, device="cuda")

            def split():
                main_s.add_(dy.t() @ x)  # bf16 GEMM output, then a read-convert-add pass

            def fused():
                torch.addmm(main_f, dy.t(), x, out_dtype=torch.float32, out=main_f)
            split()
            fused()
            err = (main_s - main_f).abs().max().item() / main_f.abs().max().item()
            rows[name] = dict(split_us=round(1e3 * do_bench(split, warmup=10, rep=50), 1),
                              fused_us=round(1e3 * do_bench(fused, warmup=10, rep=50), 1),
                              rel_max_diff_first_call=round(err, 5))
            print(tag, name, rows[name], flush=True)
        report[tag] = rows
    with open(os.path.join(a.out, "wgrad_probe.json"), "w") as fh:
        json.dump(dict(env=dict(torch=torch.__version__, gpu=torch.cuda.get_device_name()), shapes=report), fh, indent=1)


if __name__ == "__main__":
    main()
