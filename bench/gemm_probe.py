"""The weight-gradient GEMMs on the GPU: the one the model runs (hpcmeg/model/wgrad.py's
wgrad_accumulate_: torch.addmm into the fp32 main grad, bf16 operands, beta 1) against each
algorithm cuBLASLt's heuristic offers for the same problem, every one checked against it first.

Why: the 124M user path's profile (bench/results/profile_h200_s12_124M_gbs192.md) spends 8.5 ms per
step (1.8 %) in cuBLASLt's split-K reduce kernels after these GEMMs. Their outputs are a few dozen
192 x 192 tiles (QKV 2304 x 768: 48; the attention's dense 768 x 768: 16) over K = 12,288 tokens,
so the heuristic cuts K to fill 132 SMs and sums the pieces in a second kernel. If another
algorithm of the heuristic's list (another split, a stream-K one) is faster, the model can ask for
it by a rule on that list (the list is deterministic for a problem, so the choice and the
numerics are too, which bit-exact resume needs; timing inside the run would not be).
Time: triton.testing.do_bench_cudagraph (median of CUDA-graph replays; beta 1 keeps adding into
the same fp32 output, which stays finite).
Usage: python bench/gemm_probe.py [--sizes 124M,355M,1.3B] [--n 16] [--out DIR] [--tag TAG]
Writes <out>/gemm_probe[_<tag>].json after each size: per problem torch's ms, then each
algorithm's ms, its configuration (id, tile, split-K, reduction scheme; waves and workspace from
the heuristic) and its largest difference from torch's result relative to the largest value; per
rule (hpcmeg/model/cublaslt_wgrad.py) a layer's four GEMMs and the LM head's with the algorithms
it picks; and <out>/wgrad_best_<size>.txt: the rule >= 2 % faster than torch on a layer's GEMMs
(with 1 / layers of the LM head's), else 'torch', for $HPCMEG_WGRAD_ALGO in the user path.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hpcmeg.model import cublaslt, cublaslt_wgrad  # noqa: E402

V = 50304
# hidden size, tokens per micro batch (the user path's micro batch x 1024)
SIZES = {"124M": (768, 12 * 1024), "355M": (1024, 12 * 1024), "1.3B": (2048, 8 * 1024)}


def problems(size: str) -> list[tuple[str, int, int, int]]:
    """(name, out, in, tokens) of each weight gradient main[out, in] += dy[T, out]^T x[T, in]; every
    layer runs each once per micro batch (the LM head once per model)."""
    d, t = SIZES[size]
    return [("qkv", 3 * d, d, t), ("dense", d, d, t), ("fc1", 4 * d, d, t), ("fc2", d, 4 * d, t),
            ("lm_head", V, d, t)]


Problem = cublaslt_wgrad.WgradGemm  # the model's own descriptors (tests/test_cublaslt.py checks them)


def rules_of(rows: list[dict]) -> list[str]:
    """The rules worth timing for these problems: each rank of the lists, each split-K and each
    reduction scheme seen."""
    seen = {f"rank={e['rank']}" for r in rows for e in r["algos"]}
    for kind in ("splitk", "reduction"):
        seen |= {f"{kind}={e[kind]}" for r in rows for e in r["algos"] if isinstance(e.get(kind), int)}
    return sorted(seen, key=lambda s: (s.split("=")[0], int(s.split("=")[1])))


def rule_totals(rows: list[dict]) -> dict:
    """Per rule: the ms of one micro batch's weight-gradient GEMMs of one layer (qkv, dense, fc1, fc2)
    with the algorithm the rule picks in each list (torch's where the pick failed or disagreed), and
    torch's; the LM head's apart (once per model, not per layer)."""
    out = {}
    for rule in ["torch"] + rules_of(rows):
        layer = head = 0.0
        for r in rows:
            ms = r["torch_ms"]
            if rule != "torch":
                i = cublaslt_wgrad.pick(r["algos"], cublaslt_wgrad.parse_rule(rule))
                e = r["algos"][i] if i is not None else {}
                ms = e["ms"] if "ms" in e and e["rel_diff"] < 1e-3 else ms
            if r["gemm"] == "lm_head":
                head += ms
            else:
                layer += ms
        out[rule] = dict(layer_ms=round(layer, 4), lm_head_ms=round(head, 4))
    return out


def torch_wgrad(main: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> None:
    torch.ops.hpcmeg.wgrad_accumulate_(main.view(-1), dy, x, 0)  # the model's op, as the model calls it


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="124M,355M,1.3B")
    ap.add_argument("--n", type=int, default=16, help="algorithms asked of the heuristic per problem")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    from triton.testing import do_bench_cudagraph

    from hpcmeg.model import wgrad  # noqa: F401  (registers hpcmeg::wgrad_accumulate_)
    lt = cublaslt.lt()
    if lt is None:
        raise SystemExit("gemm_probe: no usable libcublasLt in this process")
    dev = torch.device("cuda", torch.cuda.current_device())
    handle = lt.handle(dev.index)
    path = os.path.join(a.out, f"gemm_probe{'_' + a.tag if a.tag else ''}.json")
    report = dict(env=dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(dev)), rows=[])
    g = torch.Generator(device="cuda").manual_seed(0)
    for size in a.sizes.split(","):
        for name, out_f, in_f, t in problems(size):
            dy = torch.randn(t, out_f, device=dev, generator=g).bfloat16()
            x = torch.randn(t, in_f, device=dev, generator=g).bfloat16()
            ref = torch.zeros(out_f, in_f, device=dev)
            torch_wgrad(ref, dy, x)
            scale = ref.abs().max().item()
            m = torch.zeros_like(ref)
            row = dict(size=size, gemm=name, out=out_f, inp=in_f, tokens=t,
                       torch_ms=round(do_bench_cudagraph(lambda: torch_wgrad(m, dy, x), rep=100), 4), algos=[])
            p = Problem(lt, dy, x, m)
            try:
                for i, r in enumerate(p.algorithms(handle, a.n)):
                    e = dict(rank=i, waves=round(r.waves_count, 3), workspace=r.workspace_size,
                             **cublaslt_wgrad.algo_config(lt, r))
                    try:
                        ws = torch.empty(max(r.workspace_size, 1), dtype=torch.uint8, device=dev)
                        m.zero_()
                        p.run(handle, r, ws)
                        e["rel_diff"] = float(((m - ref).abs().max() / scale).item())
                        e["ms"] = round(do_bench_cudagraph(lambda: p.run(handle, r, ws), rep=100), 4)
                    except Exception as ex:  # an algorithm that fails: keep the others
                        e["error"] = f"{type(ex).__name__}: {str(ex)[:160]}"
                    row["algos"].append(e)
            finally:
                p.close()
            ok = [e for e in row["algos"] if "ms" in e and e["rel_diff"] < 1e-3]
            if ok:
                best = min(ok, key=lambda e: e["ms"])
                row["best"] = dict(rank=best["rank"], ms=best["ms"], x_torch=round(row["torch_ms"] / best["ms"], 3))
            print(json.dumps({k: v for k, v in row.items() if k != "algos"}), flush=True)
            report["rows"].append(row)
        rows = [r for r in report["rows"] if r["size"] == size]
        totals = rule_totals(rows)
        report.setdefault("rules", {})[size] = totals
        # the rule for the user path ($HPCMEG_WGRAD_ALGO): the fastest on a layer's four GEMMs plus
        # the LM head's share (1 / layers of it), if >= 2 % faster than torch's
        layers = {"124M": 12, "355M": 24, "1.3B": 24}[size]
        cost = {k: v["layer_ms"] + v["lm_head_ms"] / layers for k, v in totals.items()}
        best = min(cost, key=cost.get)
        pick = best if best != "torch" and cost[best] < 0.98 * cost["torch"] else "torch"
        print(json.dumps(dict(size=size, rules={k: round(v, 4) for k, v in cost.items()}, pick=pick)), flush=True)
        with open(os.path.join(a.out, f"wgrad_best_{size}.txt"), "w") as f:
            f.write(pick)
        with open(path + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
