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
