"""TrainStep over the ParamAndGradBuffer + FlatAdamW: learning, grad-accumulation equivalence, loss
mask, fp16 overflow skip, bf16 parameters with fp32 masters (resume, fp32 accumulation), the
compiled update against its plain twin, optimizer groups."""
import copy

import pytest
import torch

from hpcmeg.model.config import GPTConfig
from hpcmeg.fused.model import build_gpt
from hpcmeg.train.loss_scale import DynamicLossScaler
from hpcmeg.train.optim import AdamWConfig, build_optimizer, param_groups
from hpcmeg.train.step import TrainStep


def tiny_model(fused=False, seed=0):
    torch.manual_seed(seed)
    return build_gpt(GPTConfig(2, 64, 4, 256, 32, 128, hidden_dropout=0.0, attention_dropout=0.0, fused=fused))


def batch(n=4, s=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 128, (n, s + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def grads_of(buf, model) -> dict[str, torch.Tensor]:
    return {n: buf.grad_data[slice(*buf.locate(p))].view(p.shape).clone() for n, p in model.named_parameters()}


def test_param_groups_no_decay_for_biases_and_norms():
    m = tiny_model()
    decay, no_decay = param_groups(m, 0.1)
    names = {id(p): n for n, p in m.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(names[id(p)].endswith("bias") or "layernorm" in names[id(p)] for p in no_decay["params"])
    assert {names[id(p)] for p in decay["params"]} >= {"embedding.word_embeddings.weight",
                                                      "encoder.layers.1.mlp.dense_4h_to_h.weight"}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(m.parameters()))
    _, opt = build_optimizer(m, AdamWConfig(1e-3))
    assert opt.name == "hpcmeg.FlatAdamW(plain)"
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


@pytest.mark.parametrize("precision,fused", [("fp32", False), ("bf16", True)])
def test_loss_decreases(precision, fused):
    m = tiny_model(fused)
    buf, opt = build_optimizer(m, AdamWConfig(3e-3, weight_decay=0.0))
    step = TrainStep(m, buf, opt, precision, grad_clip=1.0, device="cpu")
    x, y = batch()
    losses = [step.run([(x, y)]).loss for _ in range(15)]
    assert losses[-1] < losses[0] - 1.0, losses


def test_grad_accumulation_equals_one_big_batch():
    x, y = batch(4)
    results, grads = [], []
    for split in (1, 2):
        m = tiny_model()
        buf, opt = build_optimizer(m, AdamWConfig(0.0))  # lr 0: the reduced gradients stay in the buffer to compare
        step = TrainStep(m, buf, opt, "fp32", grad_clip=0.0, device="cpu")
        mbs = [(x[i:i + 4 // split], y[i:i + 4 // split]) for i in range(0, 4, 4 // split)]
        results.append(step.run(mbs))
        grads.append(grads_of(buf, m))
    assert abs(results[0].loss - results[1].loss) < 1e-6
    assert abs(results[0].grad_norm - results[1].grad_norm) < 1e-5 and results[0].grad_norm > 0
    for k in grads[0]:  # two micro batches summed against one batch: reordered sums (tests/TOLERANCES.md, case 2)
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-5, atol=1e-7, msg=k)


def test_loss_mask_excludes_tokens():
    m = tiny_model()
    x, y = batch(2)
    mask = torch.ones(2, 32); mask[:, 16:] = 0
    buf, opt = build_optimizer(m, AdamWConfig(0.0))
    step = TrainStep(m, buf, opt, "fp32", grad_clip=0.0, device="cpu")
    got = step.run([(x, y, mask)]).loss
    with torch.no_grad():
        want = m(x, y)[:, :16].mean().item()
    assert abs(got - want) < 1e-5


def test_fp16_overflow_skips_step_and_lowers_scale():
    m = tiny_model()
    buf, opt = build_optimizer(m, AdamWConfig(1e-3))
    scaler = DynamicLossScaler(initial_scale=2.0 ** 10, hysteresis=1, growth_interval=2)
    step = TrainStep(m, buf, opt, "fp16", grad_clip=1.0, loss_scaler=scaler, device="cpu")
    x, y = batch()
    before = copy.deepcopy(m.state_dict())
    w = m.encoder.layers[0].mlp.dense_h_to_4h.weight
    hook = w.register_hook(lambda g: g * float("inf"))  # injected overflow in one gradient
    r = step.run([(x, y)])
    assert r.skipped and r.loss_scale == 2.0 ** 10 and scaler.scale == 2.0 ** 9
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k  # nothing moved
    assert all(p.grad is None for p in m.parameters())
    assert opt.step_count == 0 and not opt.exp_avg.any()  # Adam moments never saw the bad step
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


# ---- bf16 parameters + fp32 master weights -------------------------------------------------

def _bf16_setup(seed=0, lr=3e-3, grad_dtype=None):
    m = tiny_model(fused=True, seed=seed)
    buf, opt = build_optimizer(m, AdamWConfig(lr, weight_decay=0.1), param_dtype=torch.bfloat16, grad_dtype=grad_dtype)
    return m, buf, opt


def test_bf16_params_clip_and_trainstep_learns():
    m, buf, opt = _bf16_setup()
    step = TrainStep(m, buf, opt, "bf16", grad_clip=1.0, device="cpu")
    assert step.autocast_dtype is None  # bf16 parameters: no autocast
    x, y = batch()
    first = step.run([(x, y)])
    for _ in range(15):
        last = step.run([(x, y)])
    assert last.loss < first.loss - 0.5 and first.grad_norm > 0
    # clip: the reported norm is the fp32 norm of the gradients, the update uses min(1, 1/norm)
    buf.grad_data.fill_(1.0)  # (padding included: the norm runs over the whole flat buffer)
    n = buf.numel
    norm = opt.clip_grad_norm_(1.0)
    assert abs(float(norm) - n ** 0.5) < 1e-3 * n ** 0.5
    assert abs(float(opt._coef) - 1.0 / n ** 0.5) < 1e-6


def test_bf16_resume_is_exact():
    """Save model + optimizer state after 2 steps, continue 2 more; a fresh run loading the state
    (model first, then optimizer, as the trainer does) ends bit-identical."""
    x, y = batch(seed=5)
    m, buf, opt = _bf16_setup(seed=1)
    step = TrainStep(m, buf, opt, "bf16", grad_clip=1.0, device="cpu")
    for _ in range(2):
        step.run([(x, y)])
    msd = {k: v.clone() for k, v in m.state_dict().items()}
    osd = copy.deepcopy(opt.state_dict())
    assert set(osd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert all(v.dtype == torch.bfloat16 for v in msd.values())
    losses = [step.run([(x, y)]).loss for _ in range(2)]

    m2, buf2, opt2 = _bf16_setup(seed=9)  # different init: everything must come from the state
    m2.load_state_dict(msd)
    opt2.load_state_dict(osd)
    step2 = TrainStep(m2, buf2, opt2, "bf16", grad_clip=1.0, device="cpu")
    losses2 = [step2.run([(x, y)]).loss for _ in range(2)]
    assert losses == losses2
    for a, b in zip(m.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    # weights-only start (no optimizer state): the masters follow the loaded model
    m3, buf3, opt3 = _bf16_setup(seed=9)
    m3.load_state_dict(msd)
    opt3.masters_from_params()
    assert torch.equal(opt3.master.to(torch.bfloat16), buf3.param_data)


def test_master_update_compiled_matches_plain():
    """The compiled fused update (what CUDA runs) agrees with the plain twin (here on CPU)."""
    from hpcmeg.train.adamw_update import adamw_master_update_, compiled_update
    g = torch.Generator().manual_seed(0)
    n = 4099
    ins = [torch.randn(n, generator=g) for _ in range(3)]
    ins[2] = ins[2].abs()
    g16 = torch.randn(n, generator=g).to(torch.bfloat16)
    hp = torch.tensor([1e-3, 0.9, 0.95, 1e-8, 0.1, 1 - 0.9 ** 3, 0.7, (1 - 0.95 ** 3) ** 0.5])
    a = [ins[0].to(torch.bfloat16)] + [t.clone() for t in ins]
    b = [t.clone() for t in a]
    adamw_master_update_(a[0], a[1], g16, a[2], a[3], hp)
    compiled_update()(b[0], b[1], g16, b[2], b[3], hp)
    # the same operations; Inductor's C++ kernel takes the IEEE square root, the twin torch's (MKL's,
    # an ulp off for some inputs on some CPUs: tests/TOLERANCES.md): masters a few fp32 ulps apart at
    # most, under rtol 1e-5 (case 2) with room. The bf16 copies are not compared with each other: a
    # master one ulp apart can round to another bf16 number, on some CPUs and not others; each copy
    # must be its own master rounded to nearest
    for x, z in zip(a[1:], b[1:]):
        torch.testing.assert_close(x, z, rtol=1e-5, atol=1e-6)
    assert torch.equal(a[0], a[1].bfloat16()) and torch.equal(b[0], b[1].bfloat16())


def test_sum_of_squares_compiled_matches_plain_and_vector_norm():
    """The gradient norm's fp64 sum of squares: compiled (what CUDA runs, the cast fused into the
    reduction) == plain twin == torch.linalg.vector_norm(dtype=float64) squared, to fp64 rounding."""
    from hpcmeg.train.adamw_update import compiled_sum_of_squares, sum_of_squares_fp64
    g = torch.randn(100_003, generator=torch.Generator().manual_seed(1)) * 1e-3
    plain, comp = sum_of_squares_fp64(g), compiled_sum_of_squares()(g)
    ref = torch.linalg.vector_norm(g, dtype=torch.float64) ** 2
    assert plain.dtype == comp.dtype == torch.float64
    assert abs(float(plain - ref)) <= 1e-13 * float(ref) and abs(float(comp - ref)) <= 1e-13 * float(ref)
    assert abs(float(sum_of_squares_fp64(g * 2)) - 4 * float(ref)) <= 4e-13 * float(ref)


def test_bf16_micro_batches_accumulate_in_fp32():
    """16 micro batches of bf16 gradients sum in the buffer's fp32 main grads (exact for these bf16
    values), where a bf16 running sum rounds at every add. The loss sum(p * g) makes p.grad == g."""
    g = torch.Generator().manual_seed(0)
    m, buf, opt = _bf16_setup(seed=4, grad_dtype=torch.float32)
    params = list(m.parameters())
    parts = [[torch.randn(p.shape, generator=g).to(torch.bfloat16) for p in params] for _ in range(16)]
    exact = {id(p): sum(mb[j].double() for mb in parts) for j, p in enumerate(params)}
    running = [torch.zeros_like(p) for p in params]  # a bf16 accumulation, for contrast
    buf.start_step(16)
    for mb in parts:
        sum((p * gp).sum() for p, gp in zip(params, mb)).backward()
        for r, gp in zip(running, mb):
            r += gp
        assert all(p.grad is None for p in params)
    buf.finish_grads()
    got = torch.cat([buf.grad_data[slice(*buf.locate(p))].double() for p in params])
    want = torch.cat([exact[id(p)].reshape(-1) for p in params])
    err32 = ((got - want).norm() / want.norm()).item()
    err16 = ((torch.cat([r.reshape(-1) for r in running]).double() - want).norm() / want.norm()).item()
    assert err32 < 1e-6 and err16 > 1e-4, (err32, err16)
