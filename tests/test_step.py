"""TrainStep: learning, grad-accumulation equivalence, loss mask, fp16 overflow skip, optimizer groups."""
import copy

import pytest
import torch

from hpcmeg.model.config import GPTConfig
from hpcmeg.model.gpt import GPT
from hpcmeg.train.optim import DynamicLossScaler, build_optimizer, param_groups
from hpcmeg.train.step import TrainStep


def tiny_model(fused=False, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(2, 64, 4, 256, 32, 128, hidden_dropout=0.0, attention_dropout=0.0, fused=fused))


def batch(n=4, s=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 128, (n, s + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def test_param_groups_no_decay_for_biases_and_norms():
    m = tiny_model()
    decay, no_decay = param_groups(m, 0.1)
    names = {id(p): n for n, p in m.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(names[id(p)].endswith("bias") or "layernorm" in names[id(p)] for p in no_decay["params"])
    assert {names[id(p)] for p in decay["params"]} >= {"embedding.word_embeddings.weight",
                                                      "encoder.layers.1.mlp.dense_4h_to_h.weight"}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(m.parameters()))
    opt, impl = build_optimizer(m, 1e-3)
    assert impl == "torch.AdamW(foreach)" and isinstance(opt, torch.optim.AdamW)


@pytest.mark.parametrize("precision,fused", [("fp32", False), ("bf16", True)])
def test_loss_decreases(precision, fused):
    m = tiny_model(fused)
    opt, _ = build_optimizer(m, 3e-3, weight_decay=0.0)
    step = TrainStep(m, opt, precision, grad_clip=1.0, device="cpu")
    x, y = batch()
    losses = [step.run([(x, y)]).loss for _ in range(15)]
    assert losses[-1] < losses[0] - 1.0, losses


def test_grad_accumulation_equals_one_big_batch():
    x, y = batch(4)
    results, params = [], []
    for split in (1, 2):
        m = tiny_model()
        opt = torch.optim.SGD(m.parameters(), lr=1.0)  # param change == gradient (Adam would hide scale bugs)
        before = copy.deepcopy(m.state_dict())
        step = TrainStep(m, opt, "fp32", grad_clip=0.0, device="cpu")
        mbs = [(x[i:i + 4 // split], y[i:i + 4 // split]) for i in range(0, 4, 4 // split)]
        results.append(step.run(mbs))
        params.append({k: before[k] - v for k, v in m.state_dict().items()})
    assert abs(results[0].loss - results[1].loss) < 1e-6
    assert abs(results[0].grad_norm - results[1].grad_norm) < 1e-5 and results[0].grad_norm > 0
    for k in params[0]:
        torch.testing.assert_close(params[1][k], params[0][k], rtol=1e-5, atol=1e-7, msg=k)


def test_loss_mask_excludes_tokens():
    m = tiny_model()
    x, y = batch(2)
    mask = torch.ones(2, 32); mask[:, 16:] = 0
    step = TrainStep(m, torch.optim.SGD(m.parameters(), lr=0.0), "fp32", grad_clip=0.0, device="cpu")
    got = step.run([(x, y, mask)]).loss
    with torch.no_grad():
        want = m(x, y)[:, :16].mean().item()
    assert abs(got - want) < 1e-5


def test_fp16_overflow_skips_step_and_lowers_scale():
    m = tiny_model()
    opt, _ = build_optimizer(m, 1e-3)
    scaler = DynamicLossScaler(initial_scale=2.0 ** 10, hysteresis=1, growth_interval=2)
    step = TrainStep(m, opt, "fp16", grad_clip=1.0, loss_scaler=scaler, device="cpu")
    x, y = batch()
    before = copy.deepcopy(m.state_dict())
    w = m.encoder.layers[0].mlp.dense_h_to_4h.weight
    hook = w.register_hook(lambda g: g * float("inf"))  # injected overflow in one gradient
    r = step.run([(x, y)])
    assert r.skipped and r.loss_scale == 2.0 ** 10 and scaler.scale == 2.0 ** 9
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k  # nothing moved
    assert all(p.grad is None for p in m.parameters())
    assert not opt.state  # Adam moments never saw the bad step
    hook.remove()
    r1, r2 = step.run([(x, y)]), step.run([(x, y)])
    assert not r1.skipped and r1.loss_scale == 2.0 ** 9 and r1.grad_norm > 0
    assert not torch.equal(w, before["encoder.layers.0.mlp.dense_h_to_4h.weight"])
    assert scaler.scale == 2.0 ** 10  # grew back after growth_interval=2 clean steps
    assert r2.loss < r.loss


def test_loss_scaler_hysteresis_and_floor():
    s = DynamicLossScaler(initial_scale=8.0, hysteresis=2, min_scale=2.0, growth_interval=100)
    s.update(True)
    assert s.scale == 8.0  # first overflow tolerated (Megatron hysteresis)
    s.update(True); assert s.scale == 4.0
    s.update(True); s.update(True); assert s.scale == 2.0  # floor
    state = s.state_dict(); t = DynamicLossScaler(); t.load_state_dict(state)
    assert t.scale == 2.0


# ---- bf16 params + fp32 master weights (MasterWeightAdamW) ----------------------------------

def _master_setup(seed=0, lr=3e-3):
    m = tiny_model(fused=True, seed=seed)
    opt, impl = build_optimizer(m, lr, weight_decay=0.1, master_weights=True)
    return m, opt, impl


def test_master_update_matches_torch_adamw():
    """The fused update (plain twin) equals torch AdamW on the fp32 masters for the same grads."""
    from hpcmeg.train.optim import MasterWeightAdamW
    ref = tiny_model(seed=3)
    m = tiny_model(seed=3)
    opt_ref, _ = build_optimizer(ref, 1e-2, weight_decay=0.1)
    opt, impl = build_optimizer(m, 1e-2, weight_decay=0.1, master_weights=True)
    assert isinstance(opt, MasterWeightAdamW) and impl.endswith("(plain)")
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        for lr in (1e-2 * (step + 1),):
            for group in opt_ref.param_groups + opt.param_groups:
                group["lr"] = lr
        for pr, pm in zip(ref.parameters(), m.parameters()):
            gb = torch.randn(pr.shape, generator=g).to(torch.bfloat16)  # bf16-representable grads
            pr.grad, pm.grad = gb.float(), gb.clone()
        opt_ref.step()
        opt.step()
        opt.zero_grad()
    masters = [p for grp in opt.param_groups for p in grp["params"]]
    refs = [p for grp in opt_ref.param_groups for p in grp["params"]]
    for a, b in zip(masters, refs):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
    for pm, mst in zip(opt._model_params, masters):  # the model holds the bf16 rounding of the master
        assert torch.equal(pm.detach(), mst.to(torch.bfloat16))
    # the checkpoint layout is torch AdamW's: a plain AdamW over fp32 params loads it
    sd = opt.state_dict()
    fresh = tiny_model(seed=3)
    plain, _ = build_optimizer(fresh, 1e-2, weight_decay=0.1)
    plain.load_state_dict({k: v for k, v in sd.items() if k != "fp32_from_fp16_params"})
    for i, st in opt_ref.state_dict()["state"].items():
        torch.testing.assert_close(plain.state_dict()["state"][i]["exp_avg_sq"], st["exp_avg_sq"], rtol=1e-5, atol=1e-9)


def test_master_weights_clip_and_trainstep_learns():
    m, opt, _ = _master_setup()
    step = TrainStep(m, opt, "bf16", grad_clip=1.0, device="cpu")
    assert step.bf16_params
    x, y = batch()
    first = step.run([(x, y)])
    for _ in range(15):
        last = step.run([(x, y)])
    assert last.loss < first.loss - 0.5 and first.grad_norm > 0
    # clip: the reported norm is the fp32 norm of the bf16 grads, and the update uses min(1, 1/norm)
    for p in m.parameters():
        p.grad = torch.full_like(p, 1.0)
    n = sum(p.numel() for p in m.parameters())
    norm = opt.clip_grad_norm_(1.0)
    assert abs(float(norm) - n ** 0.5) < 1e-3 * n ** 0.5
    assert abs(float(opt._coef) - 1.0 / n ** 0.5) < 1e-6


def test_master_weights_resume_is_exact():
    """Save model + optimizer state after 2 steps, continue 2 more; a fresh run loading the state
    (model first, then optimizer, as the trainer does) ends bit-identical."""
    x, y = batch(seed=5)
    m, opt, _ = _master_setup(seed=1)
    step = TrainStep(m, opt, "bf16", grad_clip=1.0, device="cpu")
    for _ in range(2):
        step.run([(x, y)])
    msd = {k: v.clone() for k, v in m.state_dict().items()}
    osd = copy.deepcopy(opt.state_dict())
    assert set(osd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert all(v.dtype == torch.bfloat16 for v in msd.values())
    losses = [step.run([(x, y)]).loss for _ in range(2)]

    m2, opt2, _ = _master_setup(seed=9)  # different init: everything must come from the state
    m2.load_state_dict(msd)
    opt2.load_state_dict(osd)
    step2 = TrainStep(m2, opt2, "bf16", grad_clip=1.0, device="cpu")
    losses2 = [step2.run([(x, y)]).loss for _ in range(2)]
    assert losses == losses2
    for a, b in zip(m.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    # weights-only start (no optimizer state): masters follow the loaded model
    m3, opt3, _ = _master_setup(seed=9)
    m3.load_state_dict(msd)
    assert all(torch.equal(a.to(torch.bfloat16), b) for a, b in
               zip((p for g in opt3.param_groups for p in g["params"]), opt3._model_params))


def test_master_update_compiled_matches_plain():
    """The compiled fused update (what CUDA runs) agrees with the plain twin (here on CPU)."""
    from hpcmeg.train.optim import _compiled_update, adamw_master_update_
    g = torch.Generator().manual_seed(0)
    n = 4099
    ins = [torch.randn(n, generator=g) for _ in range(3)]
    ins[2] = ins[2].abs()
    g16 = torch.randn(n, generator=g).to(torch.bfloat16)
    hp = torch.tensor([1e-3, 0.9, 0.95, 1e-8, 0.1, 1 - 0.9 ** 3, 0.7, (1 - 0.95 ** 3) ** 0.5])
    a = [ins[0].to(torch.bfloat16)] + [t.clone() for t in ins]
    b = [t.clone() for t in a]
    adamw_master_update_(a[0], a[1], g16, a[2], a[3], hp)
    _compiled_update()(b[0], b[1], g16, b[2], b[3], hp)
    for x, z in zip(a, b):
        torch.testing.assert_close(x, z, rtol=1e-5, atol=1e-6)


def test_master_weights_accumulate_micro_batches_in_fp32():
    """16 micro batches of bf16 grads: accumulate_grads_() sums them in fp32 (exact for these bf16
    values), where autograd's running sum in the bf16 p.grad rounds at every add; TrainStep takes
    the fp32 path by itself whenever a step has more than one micro batch."""
    g = torch.Generator().manual_seed(0)
    m, opt, _ = _master_setup(seed=4)
    params = opt._model_params
    parts = [[torch.randn(p.shape, generator=g).to(torch.bfloat16) for p in params] for _ in range(16)]
    exact = torch.cat([sum(mb[j].double() for mb in parts).reshape(-1) for j in range(len(params))])
    running = [torch.zeros_like(p) for p in params]  # what p.grad holds after 16 bf16 accumulations
    for i, mb in enumerate(parts):
        for p, gp, r in zip(params, mb, running):
            p.grad = gp.clone()
            r += gp
        if i < 15:
            opt.accumulate_grads_()
            assert all(p.grad is None for p in params)
    opt.clip_grad_norm_(None)
    assert opt._g.dtype == torch.float32
    err32 = ((opt._g.double() - exact).norm() / exact.norm()).item()
    err16 = ((torch.cat([r.reshape(-1) for r in running]).double() - exact).norm() / exact.norm()).item()
    assert err32 < 1e-6 and err16 > 1e-4, (err32, err16)
    opt.step()
    assert opt._n_acc == 0 and opt._g is opt._g16  # the next step starts from the bf16 path again

    m, opt, _ = _master_setup(seed=4)
    step = TrainStep(m, opt, "bf16", grad_clip=1.0, device="cpu")
    calls = []
    orig = opt.accumulate_grads_
    opt.accumulate_grads_ = lambda: (calls.append(1), orig())[1]
    res = step.run([batch(n=2, seed=10 + i) for i in range(4)])
    assert len(calls) == 3 and opt._n_acc == 0 and res.grad_norm > 0
