"""hpcmeg/train/triton_adamw.py (train.optimizer_kernel 'triton'): the AdamW update kernel against its
plain twin (optim.adamw_master_update_) in Triton's CPU interpreter, on its own and inside FlatAdamW
over a model's buffers for one step; the kernel compiled for sm90 (vector loads, IEEE division,
no contracted multiply-adds); how the update kernel is chosen, and the recipe key.

What can be compared to the bit, and what cannot (the same on every x86-64 CPU):
- exp_avg and exp_avg_sq: multiplies and adds only, IEEE-rounded one by one in the twin (ATen's
  binary kernels, any ISA) and in the interpreter (numpy): equal to the bit. (Divisions too: torch
  divides by the 0-d hp entries IEEE-rounded on the CPU, not as a multiply by the reciprocal.)
- The master weights: the kernel divides and takes the square root IEEE-rounded (div_rn, sqrt_rn;
  numpy's in the interpreter), so its masters equal, to the bit, the twin's expressions evaluated with
  every operation IEEE-rounded (`ieee_master` below; what the twin gives on the GPU). The CPU twin's
  `v.sqrt()` is not always IEEE-rounded: torch sends fp32 sqrt to MKL's vector math library (VML,
  high-accuracy mode), whose code path MKL picks by CPU at run time, whatever ATEN_CPU_CAPABILITY
  says. Measured with torch.rand roots: on an AMD EPYC (AVX2) 20 % of them are one ulp off the
  nearest float, on an Intel Xeon's AVX-512 path 0.6 %, on the same Xeon with
  MKL_ENABLE_INSTRUCTIONS=AVX2 none; never more than one ulp (a faithful root: one of the two floats
  around the exact one). A tolerance tuned on one CPU fails on another (1.05-1.55 "ulps at scale" on
  the EPYC), so the test derives the twin's masters' range instead: every operation after the root
  (/ bc2_sqrt > 0, + eps, numerator / that, master' - that) is monotone in it and IEEE rounding is
  monotone, so the twin's master lies between ieee_master with the root one ulp down and one ulp up.
- The bf16 parameter copy: the twin rounds the master to nearest even; Triton 3.6's interpreter
  converts fp32 to bf16 by truncation (the GPU's cvt.rn rounds to nearest even), so the kernel's copy
  is its own master rounded either way, nothing else.
The GPU comparison (to the bit, both on CUDA) is bench/gpu_agreement.py --parts adamw.
"""

import re

import pytest
import torch

from hpcmeg.train import optim
from hpcmeg.train import triton_adamw as ta
from helpers import run_in_triton_interpreter

_KERNEL_CHECK = r"""
import numpy as np
import torch
from hpcmeg.train.optim import adamw_master_update_
from hpcmeg.train.triton_adamw import Launch, adamw_update_

def ieee_master(master, m, v, hp, root):  # the twin's master update, its operations in its order, with square root `root`
    lr, b1, b2, eps, wd, bc1, coef, bc2_sqrt = hp
    return master * (1 - lr * wd) - (lr / bc1) * m / (root / bc2_sqrt + eps)

def bf16_either_way(w, p):  # p is w's bf16 copy rounded to nearest even or truncated (the interpreter's)
    trunc = (w.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)  # exact: 8 mantissa bits left
    return bool(((p == w.to(torch.bfloat16)) | (p == trunc)).all())

g = torch.Generator().manual_seed(0)
n_checks = n_root_off = 0
for n, launch in ((5000, Launch(block=1024, warps=4)), (4096, Launch()), (77, Launch(block=128, warps=1))):
    for gdt in (torch.float32, torch.bfloat16):
        for pdt in (torch.bfloat16, torch.float32):
            master = torch.randn(n, generator=g)
            m = torch.randn(n, generator=g) * 1e-2
            v = torch.rand(n, generator=g) * 1e-4
            grad = (torch.randn(n, generator=g) * 1e-2).to(gdt)
            for hp in (torch.tensor([1e-3, 0.9, 0.95, 1e-8, 0.1, 1 - 0.9 ** 3, 0.7, (1 - 0.95 ** 3) ** 0.5]),
                       torch.tensor([3e-4, 0.8, 0.999, 1e-6, 0.0, 1 - 0.8, 1.0, (1 - 0.999) ** 0.5])):
                a = [master.to(pdt, copy=True), master.clone(), m.clone(), v.clone()]  # the twin's
                b = [t.clone() for t in a]  # the kernel's
                adamw_master_update_(a[0], a[1], grad, a[2], a[3], hp)
                adamw_update_(b[0], b[1], grad, b[2], b[3], hp, launch)
                assert torch.equal(a[2], b[2]) and torch.equal(a[3], b[3]), ("moments", n, gdt, pdt)
                root = torch.from_numpy(np.sqrt(a[3].numpy()))  # IEEE-rounded: the x86 sqrt instruction
                assert torch.equal(b[1], ieee_master(master, a[2], a[3], hp, root)), ("kernel master", n, gdt, pdt)
                cpu_root = a[3].sqrt()  # what the twin used
                down = torch.nextafter(root, torch.zeros(()))
                up = torch.nextafter(root, torch.full((), float("inf")))
                assert bool(((cpu_root == root) | (cpu_root == down) | (cpu_root == up)).all()), "torch's fp32 sqrt off by more than one ulp"
                n_root_off += int((cpu_root != root).sum())
                lo, hi = ieee_master(master, a[2], a[3], hp, down), ieee_master(master, a[2], a[3], hp, up)
                assert bool(((a[1] >= torch.minimum(lo, hi)) & (a[1] <= torch.maximum(lo, hi))).all()), ("twin master", n, gdt, pdt)
                assert torch.equal(a[0], a[1].to(pdt)), ("twin copy", n, gdt, pdt)
                if pdt == torch.bfloat16:
                    assert bf16_either_way(b[1], b[0]), ("kernel copy", n, gdt, pdt)
                else:
                    assert torch.equal(b[0], b[1]), ("kernel copy", n, gdt, pdt)
                assert not torch.equal(a[1], master)  # the update moved the weights
                n_checks += 1
assert n_checks == 24
print(f"roots off by one ulp on this CPU: {n_root_off}")
print("ok")
"""


def test_kernel_matches_twin_in_interpreter():
    """Ragged and whole blocks, fp32 and bf16 gradients and parameters, with and without decay and
    clipping: exp_avg / exp_avg_sq bit for bit; the kernel's masters the twin's expressions IEEE-rounded
    bit for bit, the twin's masters within the range its faithful square root allows (the header)."""
    run_in_triton_interpreter(_KERNEL_CHECK)


_OPTIMIZER_CHECK = r"""
import torch
from hpcmeg.model.config import GPTConfig
from hpcmeg.model.gpt import GPT
from hpcmeg.train.optim import build_optimizer
from hpcmeg.train.step import TrainStep

def run(kernel):
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=96,
                    max_position_embeddings=32, padded_vocab_size=128, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPT(cfg, init_seed=3)
    buf, opt = build_optimizer(model, 1e-2, weight_decay=0.1, compiled=False, update_kernel=kernel)
    ts = TrainStep(model, buf, opt, "fp32", grad_clip=0.05, device="cpu")
    g = torch.Generator().manual_seed(1)
    for _ in range(1):
        x = torch.randint(0, 128, (4, 32), generator=g)
        for grp in opt.param_groups:
            grp["lr"] = 1e-2
        ts.run([(x[:2], x[:2].roll(-1, 1)), (x[2:], x[2:].roll(-1, 1))])
    return opt

# one step (two micro batches, clipped): the same gradients in, so the moments to the bit. The masters
# differ only through the CPU twin's square root (the header): with u = 2**-24 (fp32's unit roundoff),
# the step q = (lr / bc1) * m / (sqrt(v) / bc2_sqrt + eps) has relative error <= 6u (first order) in
# the kernel (six IEEE-rounded operations; the one addition adds two positives, no cancellation) and
# <= 7u in the twin (its root may be off by an ulp, <= 2u), so |q_twin - q_kernel| <= 13u |q|;
# master' = master * (1 - lr * wd) is the same bits in both, and master' - q rounds once in each
# (<= u |new master| each). On the first step from zero moments m / bc1 = g and sqrt(v) / bc2_sqrt =
# |g| (the clip coefficient scales both) up to a relative ~20u from rounding and the fp32 betas
# (0.9, 0.95), and eps only shrinks q, so |q| <= lr (1 + 20u): together
# |twin - kernel| <= 2u max|new master| + 13u lr (1 + 20u) < eps max|new master| + 7 eps lr, eps = 2u.
# (Measured: at most 0.46 of that on an AMD EPYC, 0.35 on an Intel Xeon: a LayerNorm weight ~1 one
# ulp apart.)
# (Later steps would compare chaos: an ulp in a weight moves the attention key biases' gradients,
# zero in exact arithmetic, and Adam scales that noise into lr-sized steps.)
po, to = run("plain"), run("triton")
assert to.name == "hpcmeg.FlatAdamW(triton)" and po.name == "hpcmeg.FlatAdamW(plain)", (to.name, po.name)
assert torch.equal(po.exp_avg, to.exp_avg) and torch.equal(po.exp_avg_sq, to.exp_avg_sq)
eps32 = torch.finfo(torch.float32).eps
bound = eps32 * torch.maximum(po.master.abs(), to.master.abs()) + 7 * eps32 * 1e-2
assert bool(((po.master - to.master).abs() <= bound).all()), float(((po.master - to.master).abs() / bound).max())
assert float(po.exp_avg.abs().sum()) > 0
print("ok")
"""


def test_flat_adamw_with_triton_kernel_follows_plain():
    """FlatAdamW over a GPT's buffers (two parameter groups, clipping on, two micro batches): a step
    with the Triton update and with the plain one give the same moments and (within the artifacts) masters."""
    run_in_triton_interpreter(_OPTIMIZER_CHECK)


def test_compiles_for_hopper_with_vector_loads_and_ieee_division():
    from helpers import compile_for_hopper
    types = dict(P16="*bf16", MASTER="*fp32", GRAD="*fp32", M="*fp32", V="*fp32", HP="*fp32", n="i64")
    ptx = compile_for_hopper(ta._adamw_kernel, types, dict(BLOCK=ta.DEFAULT_LAUNCH.block),
                             num_warps=ta.DEFAULT_LAUNCH.warps, aligned_ints=("n",), enable_fp_fusion=False).asm["ptx"]
    loads = re.findall(r"ld\.global\.[\w.:]+", ptx)
    # 16 elements per thread: four 16-byte vectors for each of grad, exp_avg, exp_avg_sq, master
    assert sum(1 for x in loads if x.endswith("v4.b32")) == 16, loads
    assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx
    assert "sqrt.rn.f32" in ptx and "fma." not in ptx


def test_update_kernel_choice():
    dev_cpu = torch.zeros(4)
    assert optim.update_kernel_for("auto", False, dev_cpu) == "plain"
    assert optim.update_kernel_for("auto", True, dev_cpu) == "compiled"
    assert optim.update_kernel_for("plain", True, dev_cpu) == "plain"
    with pytest.raises(ValueError, match="not one of auto, compiled, triton, plain"):
        optim.update_kernel_for("fused", False, dev_cpu)
    if not ta.available(dev_cpu):  # outside the interpreter a CPU optimizer cannot run the kernel
        with pytest.raises(ValueError, match="train.optimizer_kernel=triton needs Triton"):
            optim.update_kernel_for("triton", False, dev_cpu)


def test_recipe_key(tmp_path):
    from hpcmeg.recipe_yaml import RecipeError
    from hpcmeg.recipe import load_recipe
    p = tmp_path / "r.yaml"
    p.write_text("run: {name: t}\ndata: {inputs: [x.jsonl]}\ntrain: {train_iters: 10, micro_batch_size: 1, global_batch_size: 1}\n")
    assert load_recipe(p).train.optimizer_kernel == "auto"
    assert load_recipe(p, ["train.optimizer_kernel=triton"]).train.optimizer_kernel == "triton"
    with pytest.raises(RecipeError, match="train.optimizer_kernel"):
        load_recipe(p, ["train.optimizer_kernel=apex"])
