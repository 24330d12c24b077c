"""build_optimizer's parameter roles (the buffer classes, their extra reductions and what the norm
counts, in one process; the parallel layouts themselves: test_tp_model.py, test_pp_model.py), and
FlatAdamW's two updates: torch.compile'd (what CUDA runs) against the plain twin inside the
optimizer over a model's buffers, and the fall-back to the plain update when the compiler fails for
real. (The update function on its own against its twin, and the gradient norm's sum of squares:
test_step.py.)"""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from hpcmeg.model.config import GPTConfig
from hpcmeg.fused.model import build_gpt
from hpcmeg.train.optim import AdamWConfig, BufferClass, Role, build_optimizer, param_roles

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# one clipped step of two micro batches over a tiny GPT's buffers (two parameter groups, so the
# compiled update runs at two lengths), compiled or plain; run here and in a fresh process
_ONE_STEP = r"""
import torch
from hpcmeg.model.config import GPTConfig
from hpcmeg.fused.model import build_gpt
from hpcmeg.train.optim import AdamWConfig, build_optimizer
from hpcmeg.train.step import TrainStep

def one_step(compiled):
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=96,
                    max_position_embeddings=32, padded_vocab_size=128, hidden_dropout=0.0, attention_dropout=0.0)
    model = build_gpt(cfg, init_seed=3)
    buf, opt = build_optimizer(model, AdamWConfig(1e-2, weight_decay=0.1), compiled=compiled)
    step = TrainStep(model, buf, opt, "fp32", grad_clip=0.05, device="cpu")
    start = opt.master.clone()
    x = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    norm = step.run([(x[:2], x[:2].roll(-1, 1)), (x[2:], x[2:].roll(-1, 1))]).grad_norm
    assert not torch.equal(opt.master, start)  # the step moved the weights
    return opt, norm
"""


def test_param_roles_the_more_specific_wins():
    roles = param_roles(tied=[1], partial=[2, 3], replicated=[1, 2, 3, 4])
    assert roles == {1: Role.TIED, 2: Role.PARTIAL, 3: Role.PARTIAL, 4: Role.REPLICATED}
    assert param_roles() == {}


def test_roles_make_buffer_classes_in_role_order_with_their_reductions():
    """A role's parameters get a class of their own in each group where it has members (in Role's
    order, a PLAIN class always); partial and tied classes get an extra reduction; one process (tp
    rank 0, the first stage) counts every class in the norm."""
    model = build_gpt(GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                          max_position_embeddings=16, padded_vocab_size=64), init_seed=0)
    wte, wpe = model.embedding.word_embeddings.weight, model.embedding.position_embeddings.weight
    ln = model.encoder.layers[0].input_layernorm
    roles = param_roles(tied=[id(wte)], partial=[id(ln.weight)], replicated=[id(ln.weight), id(ln.bias), id(wpe)])
    buf, opt = build_optimizer(model, AdamWConfig(1e-3), roles=roles)
    decay, no_decay = (lambda role: BufferClass("decay", role)), (lambda role: BufferClass("no_decay", role))
    assert buf.classes == [decay(Role.TIED), decay(Role.PLAIN), decay(Role.REPLICATED), no_decay(Role.PLAIN),
                           no_decay(Role.REPLICATED), no_decay(Role.PARTIAL)]
    assert [g["classes"] for g in opt.param_groups] == [buf.classes[:3], buf.classes[3:]]
    assert [bk.params for bk in buf.buckets if bk.cls == decay(Role.TIED)] == [[wte]]
    assert [bk.params for bk in buf.buckets if bk.cls == no_decay(Role.PARTIAL)] == [[ln.weight]]
    assert buf.extra_reductions == ((decay(Role.TIED), None), (no_decay(Role.PARTIAL), None))
    assert opt.norm_skip == frozenset() and opt.norm_groups == ()
    # no roles: one PLAIN class per group
    buf, _ = build_optimizer(build_gpt(model.cfg, init_seed=0), AdamWConfig(1e-3))
    assert buf.classes == [decay(Role.PLAIN), no_decay(Role.PLAIN)]


def test_compiled_update_in_the_optimizer_follows_the_plain_one():
    """The same gradients in, so the same clip coefficient and the same step up to the compiled
    update's other square root (IEEE-rounded against MKL's: tests/TOLERANCES.md case 2)."""
    import torch._inductor.config

    scope: dict = {}
    exec(_ONE_STEP, scope)
    with torch._inductor.config.patch(compile_threads=1):  # no compile-worker pool on 2 shared cores
        (plain, plain_norm), (comp, comp_norm) = scope["one_step"](False), scope["one_step"](True)
    assert (plain.name, comp.name) == ("hpcmeg.FlatAdamW(plain)", "hpcmeg.FlatAdamW(compiled)")
    assert comp_norm == plain_norm  # the fp64 sum of squares, rounded to fp32 once
    for a, b in ((plain.master, comp.master), (plain.exp_avg, comp.exp_avg), (plain.exp_avg_sq, comp.exp_avg_sq)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert torch.equal(comp.buffer.param_data, comp.master)  # fp32 parameters: the masters themselves


def test_a_compiler_failure_falls_back_to_the_plain_update(tmp_path):
    """Inductor's C++ compiler replaced by one that always fails (a fresh process and kernel cache,
    so nothing is compiled already): the step still runs, says so once per compiled function, and
    gives the plain optimizer's weights bit for bit."""
    script = _ONE_STEP + r"""
plain, plain_norm = one_step(False)
comp, comp_norm = one_step(True)
assert comp.name == "hpcmeg.FlatAdamW(plain)", comp.name
assert comp_norm == plain_norm
assert torch.equal(comp.master, plain.master) and torch.equal(comp.exp_avg_sq, plain.exp_avg_sq)
print("ok")
"""
    env = {**os.environ, "CXX": "/bin/false", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "TORCHINDUCTOR_COMPILE_THREADS": "1", "PYTHONPATH": ROOT}  # no compile-worker pool on 2 shared cores
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.count("FlatAdamW: the compiled update failed") == 1, r.stdout[-2000:]
    assert r.stdout.count("FlatAdamW: compiled sum of squares failed") == 1, r.stdout[-2000:]
