"""GPU side of the tensor/sequence-parallel building blocks (tests/test_tp_comm.py and
tests/test_vocab_parallel.py are the gloo/CPU side). One GPU, so no TP2; what one GPU can check:

1. the functional-collective ops hpcmeg/parallel/comm.py calls exist on this torch (2.11 on the
   H200) and run on NCCL: every autograd Function applied to a world-1 NCCL group (real NCCL
   collectives of one rank), eager and under torch.compile(fullgraph=True, Inductor);
2. the vocabulary-parallel CE's CUDA path: the Triton lse kernel on each simulated vocabulary
   shard (labels masked to the owning shard), combined as vocab_ce.py does, vs F.cross_entropy in
   fp32 over the full padded vocabulary (bf16 logits, GPT-2 124M shapes), loss and gradient;
3. its memory: peak bytes of forward + backward on a shard against the fp32 logits it must
   never build; and its time vs the plain twin's F.cross_entropy on the same shard;
4. the price of a literal dim-1 sequence split of [b, s, h] (the chunk+cat copy after each
   all-gather / before each reduce-scatter that comm.py's token-shard layout avoids).
Writes <out>/tp_blocks_gpu.json and prints it.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hpcmeg.parallel import comm, vocab_ce  # noqa: E402


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def check_functions(res):
    """Each Function with size 1 on a real NCCL group: identity semantics, eager and compiled."""
    name = dist.group.WORLD.group_name

    def chain(x):
        y = x
        for kind in comm._PAIRS:
            y = comm._Comm.apply(y, kind, 1, 0, name).sin()
        return y * 2

    x = torch.randn(4, 8, 16, device="cuda")
    outs = []
    for fn in (chain, torch.compile(chain, fullgraph=True)):
        xl = x.clone().requires_grad_()
        y = fn(xl)
        y.square().sum().backward()
        outs.append((y.detach(), xl.grad))
    ref_x = x.clone().requires_grad_()
    ref = ref_x
    for _ in comm._PAIRS:
        ref = ref.sin()
    ref = ref * 2
    ref.square().sum().backward()
    res["functions_nccl_world1"] = {
        "eager_vs_math": max(float((outs[0][0] - ref.detach()).abs().max()),
                             float((outs[0][1] - ref_x.grad).abs().max())),
        "compiled_vs_eager": max(float((outs[1][0] - outs[0][0]).abs().max()),
                                 float((outs[1][1] - outs[0][1]).abs().max()))}


def check_vocab_ce(res):
    """Shards of a [N, 50304] bf16 logits matrix through the kernel, combined, vs full fp32 CE."""
    torch.manual_seed(0)
    n, v = 12 * 1024, 50304
    logits = (torch.randn(n, v, device="cuda") * 4).to(torch.bfloat16)
    labels = torch.randint(0, 50257, (n,), device="cuda")
    off = 0
    for tp in (2, 4, 8):  # every shard's first and last row as labels
        vl = v // tp
        labels[off:off + 2 * tp] = torch.tensor([x for r in range(tp) for x in (r * vl, (r + 1) * vl - 1)],
                                                device="cuda")
        off += 2 * tp
    ref_l = logits.float().requires_grad_()
    ref = F.cross_entropy(ref_l, labels, reduction="none")
    g = torch.rand(n, device="cuda")
    (ref * g).sum().backward()
    out = {}
    for tp in (2, 4, 8):
        vl = v // tp
        stats = [vocab_ce._local_stats(logits[:, r * vl:(r + 1) * vl].contiguous(), labels, r * vl, True)
                 for r in range(tp)]
        lse = torch.logsumexp(torch.stack([s[0] for s in stats]), 0)
        loss = lse - torch.stack([s[1] for s in stats]).sum(0)
        grads = [vocab_ce._compiled_grad()(logits[:, r * vl:(r + 1) * vl].contiguous(), lse, s[2], s[3], g)
                 for r, s in enumerate(stats)]
        gfull = torch.cat(grads, 1).float()
        want = ref_l.grad.to(torch.bfloat16).float()  # the fp32 grad rounded to the logits' dtype
        out[f"tp{tp}"] = {"loss_max_abs_err": float((loss - ref.detach()).abs().max()),
                          "grad_rel_err_vs_bf16_rounded_fp32": float((gfull - want).norm() / want.norm()),
                          "grad_max_ulp_flips": int(((gfull - want).abs() > 0).sum())}
    res["vocab_ce_shards_vs_fp32"] = out


def memory_and_time(res):
    """A TP2 shard at 124M, micro batch 12: fast path (world-1 NCCL Function) vs the plain twin."""
    n, vl = 12 * 1024, 50304 // 2
    logits = (torch.randn(n, vl, device="cuda") * 4).to(torch.bfloat16)
    labels = torch.randint(0, vl, (n,), device="cuda")
    name = dist.group.WORLD.group_name

    def fast():
        x = logits.detach().requires_grad_()
        vocab_ce._VocabParallelCE.apply(x, labels, 1, 0, name, True).sum().backward()

    def plain():
        x = logits.detach().requires_grad_()
        F.cross_entropy(x.float(), labels, reduction="none").sum().backward()

    out = {"logits_bf16_MB": logits.numel() * 2 / 1e6, "fp32_logits_MB": logits.numel() * 4 / 1e6}
    for tag, fn in (("fast", fast), ("plain", plain)):
        fn()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        out[f"{tag}_peak_extra_MB"] = (torch.cuda.max_memory_allocated() - base) / 1e6
        out[f"{tag}_fwd_bwd_ms"] = timed(fn)
    res["vocab_ce_tp2_shard_124M"] = out


def layout_copy(res):
    """The chunk+cat a literal dim-1 split needs, per collective, bf16, at TP2."""
    out = {}
    for tag, (b, s, h) in {"124M": (12, 1024, 768), "1.3B": (12, 1024, 2048)}.items():
        gathered = torch.randn(2 * b, s // 2, h, device="cuda", dtype=torch.bfloat16)  # rank-major all-gather buffer
        ms = timed(lambda: torch.cat(gathered.chunk(2, 0), dim=1), reps=50)
        mb = gathered.numel() * 2 / 1e6
        # NVLink at TP2: each rank receives half the tensor; ~370 GB/s achieved per direction (assumed)
        out[tag] = {"tensor_MB": mb, "copy_ms": ms, "allgather_ms_estimate": mb / 2 / 370e3 * 1e3}
    res["dim1_layout_copy"] = out


def main() -> None:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
           "ops": {op: hasattr(torch.ops._c10d_functional, op)
                   for op in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "wait_tensor")},
           "funcol_public_names": {n: hasattr(fc, n) for n in ("all_gather_tensor", "all_gather_single",
                                                                 "reduce_scatter_tensor", "reduce_scatter_single")}}
    for step in (check_functions, check_vocab_ce, memory_and_time, layout_copy):
        try:
            step(res)
        except Exception as e:  # noqa: BLE001 - report every step
            res[step.__name__] = f"FAILED {type(e).__name__}: {e}"
    dist.destroy_process_group()
    with open(os.path.join(out_dir, "tp_blocks_gpu.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
