"""fused_ce 'backward_in_forward' (hpcmeg/fused/linear_ce.py): the LM head's backward GEMMs run in
the forward, chunk by chunk, on the loss weights TrainStep passes. Checked against 'grad_in_forward'
(same gradients), for what it keeps between forward and backward (no [tokens, vocab] tensor), for
its promise check (a different upstream gradient is an error), and end to end through TrainStep
with the main-grad sinks, a loss mask, eager and compiled.
Tolerances: tests/TOLERANCES.md's cases, named at each comparison."""

import pytest
import torch

from hpcmeg.fused.linear_ce import linear_cross_entropy
from hpcmeg.train.optim import AdamWConfig, build_optimizer
from hpcmeg.train.step import TrainStep
from test_wgrad import fused_gpt, micro_batches


def _inputs(n=40, h=16, v=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, n // 2, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.3
    labels = torch.randint(0, v, (2, n // 2), generator=g)
    w = torch.full((2, n // 2), 0.01)
    w[0, :3] = 0.0  # masked tokens
    return hidden, weight, labels, w


def _grads(impl, hidden, weight, labels, w, **kw):
    x, wt = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss = linear_cross_entropy(x, wt, labels, impl=impl, **kw)
    (loss * w).sum().backward()
    return loss.detach(), x.grad, wt.grad


@pytest.mark.parametrize("chunk", [7, 16, 4096])  # uneven chunks, several, one
def test_matches_grad_in_forward(chunk):
    hidden, weight, labels, w = _inputs()
    ref = _grads("grad_in_forward", hidden, weight, labels, w)
    out = _grads("backward_in_forward", hidden, weight, labels, w, loss_weights=w, chunk_tokens=chunk)
    # the same CE, its backward GEMMs in chunks of tokens: d weight sums the chunks' products in another
    # grouping (case 2 over n <= 40 tokens: a few u, hence rtol 1e-6; atol 1e-7 for gradient entries
    # ~1e-3 that cancel), the loss and d hidden the same arithmetic
    for a, b, name in zip(out, ref, ("loss", "d hidden", "d weight")):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
    # without the weights, or without grad, it is grad_in_forward (case 1 under case 5's default tolerance)
    torch.testing.assert_close(_grads("backward_in_forward", hidden, weight, labels, w)[2], ref[2])
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(hidden, weight, labels, impl="backward_in_forward",
                                                        loss_weights=w), ref[0])


def test_keeps_no_vocabulary_sized_tensor_and_checks_its_promise():
    hidden, weight, labels, w = _inputs(n=200)  # tokens >> hidden size, as in a model
    n, v = labels.numel(), weight.shape[0]

    def saved_numels(impl, **kw):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            linear_cross_entropy(hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True), labels,
                                 impl=impl, **kw)
        return sizes

    assert n * v in saved_numels("grad_in_forward")  # G = softmax - onehot, [tokens, vocab]
    kept = saved_numels("backward_in_forward", loss_weights=w, chunk_tokens=8)
    assert kept and max(kept) < n * v and sum(kept) < n * v / 2, kept  # d hidden, the weights, d weight
    x = hidden.clone().requires_grad_(True)
    loss = linear_cross_entropy(x, weight, labels, impl="backward_in_forward", loss_weights=w)
    with pytest.raises(RuntimeError, match="differs from the loss_weights"):
        (loss * (2 * w)).sum().backward()


def _train(ce: str, compile: bool = False, masked: bool = True, steps: int = 2):
    m = fused_gpt(ce=ce)
    buf, opt = build_optimizer(m, AdamWConfig(1e-2), bucket_numel=3000, wgrad_fusion=True)
    ts = TrainStep(m, buf, opt, "fp32", grad_clip=1.0, device="cpu", compile=compile)
    assert ts.pass_loss_weights == (ce == "backward_in_forward")
    hist = []
    for step in range(steps):
        mbs = micro_batches(3, seed=step)
        if masked:  # a loss mask on every micro batch: the weights are factor x mask
            mbs = [(x, y, (torch.arange(y.numel()).view(y.shape) % 5 != 0).float()) for x, y in mbs]
        hist.append(ts.run(mbs).loss)
    sunk = sum(len(bk.params) for bk in buf.buckets if bk.sunk)
    return hist, {k: v.clone() for k, v in m.state_dict().items()}, sunk


@pytest.mark.parametrize("masked", [True, False])
def test_train_step_matches_grad_in_forward(masked):
    """Through TrainStep: the weights it passes are exactly the gradient it backpropagates (else the
    promise check raises), and the tied word embedding stays sunk (the output layer's d W goes into
    its main grad during the forward)."""
    h_ref, w_ref, s_ref = _train("grad_in_forward", masked=masked)
    h, w, s = _train("backward_in_forward", masked=masked)
    assert s == s_ref == 4 * 2 + 1
    assert h == pytest.approx(h_ref, rel=1e-6)  # the losses: the same forward arithmetic, a few u at most
    for k in w_ref:  # the weights after Adam steps (lr 1e-3) from case-2 gradients: Adam's g / sqrt(v)
        # lifts a ~0 gradient's round-off to up to ~1e-3 of a step, ~1e-6 absolute: atol 2e-6
        torch.testing.assert_close(w[k], w_ref[k], rtol=1e-5, atol=2e-6, msg=k)


def test_compiled_train_step_matches_compiled_grad_in_forward():
    """Under torch.compile the chunk loop, the in-place CE op and the main-grad accumulation inside
    the forward of an autograd.Function trace, and the step equals the compiled default path's.
    (Against eager, both compiled paths differ alike where Adam turns round-off of ~0 gradients
    into updates of up to the learning rate.)"""
    h_c, w_c, _ = _train("backward_in_forward", compile=True, steps=1)
    h_g, w_g, _ = _train("grad_in_forward", compile=True, steps=1)
    assert h_c == pytest.approx(h_g, rel=1e-6)  # the same forward: a few u at most
    for k in w_g:  # one step, both compiled by Inductor into the same kernels but the LM head's: a few u
        torch.testing.assert_close(w_c[k], w_g[k], rtol=1e-6, atol=1e-7, msg=k)


def test_recipe_key_reaches_the_trainer(tmp_path_factory):
    """`model.cross_entropy: backward_in_forward` through the recipe and the trainer `hpcmeg train`
    builds (the fused model: CPU defaults to the plain one), on real data (GPT-2's vocabulary, two
    micro batches per step): its TrainStep passes the loss weights, and the logged losses are
    grad_in_forward's."""
    from hpcmeg.procenv import dist_env
    from hpcmeg.train.build import build_trainer
    from hpcmeg.train.metrics import read_metrics
    from helpers import run_dir, small_recipe, stdlib_dataset

    data = stdlib_dataset(tmp_path_factory.mktemp("data"))
    losses = {}
    for ce in ("grad_in_forward", "backward_in_forward"):
        r = small_recipe(tmp_path_factory.mktemp(ce), data, "model.fused=on", f"model.cross_entropy={ce}",
                         "train.train_iters=4",
                         "train.global_batch_size=4", "train.micro_batch_size=2", "train.log_interval=1",
                         "train.eval_interval=4", "train.eval_iters=1", "checkpoint.save_interval=0")
        trainer, ctx = build_trainer(r, dist_env(None))
        try:
            assert trainer.step.pass_loss_weights == (ce == "backward_in_forward")
            trainer.run()
            trainer.metrics.close()
        finally:
            ctx.destroy()
        losses[ce] = [e["loss"] for e in read_metrics(f"{run_dir(r)}/metrics.jsonl")["train"]]
    assert len(losses["grad_in_forward"]) == 4
    # four steps of training: the losses carry the weights' Adam-amplified case-2 differences (see
    # test_train_step_matches_grad_in_forward), ~1e-6 relative on losses ~5: rel 1e-5
    assert losses["backward_in_forward"] == pytest.approx(losses["grad_in_forward"], rel=1e-5)


@pytest.mark.parametrize("kw", [{"fused_ce": "backward_in_forward"}, {}, {"recompute_gelu_layers": 1}],
                         ids=["backward_in_forward", "shipped", "recompute_gelu"])
def test_the_compiled_sunk_model_makes_no_copy_of_the_main_grad_buffer(kw):
    """The sunk fused model with backward_in_forward under torch.compile (Inductor, on CPU): no
    temporary of the main-grad buffer's size. When d hidden was complete in the forward, nothing of
    the model's backward depended on the incoming gradient, AOTAutograd's partitioner moved all of
    it into the forward graph, and Inductor cloned the whole buffer there (0.5 GB at 124M), kept the
    clone until the backward and copied it back, per micro batch. The layers' weight
    gradients are in the generated code as the buffer's in-place accumulations (wgrad_accumulate_)."""
    from torch._inductor.utils import run_and_get_code

    from hpcmeg.model.config import GPTConfig
    from hpcmeg.fused.model import build_gpt
    from hpcmeg.train.optim import AdamWConfig, build_optimizer
    cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                    max_position_embeddings=64, padded_vocab_size=128, fused=True, **kw)
    m = build_gpt(cfg, init_seed=3)
    buf, _ = build_optimizer(m, AdamWConfig(1e-3), bucket_numel=5000, wgrad_fusion=True)
    tok = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    compiled = torch.compile(m)

    def step():
        loss = compiled(tok, tok, loss_weights=torch.full((2, 64), 1 / 128))
        (loss / 128).sum().backward()

    _, codes = run_and_get_code(step)
    code = "\n".join(codes)
    n = buf.grad_data.numel()
    assert f"(({n}, ), (1, ), torch.float32)" not in code  # no buffer-sized temporary
    assert code.count("wgrad_accumulate_.default(") >= 8  # 4 weight-gradient GEMMs a layer
    assert ("main_grad_add_.default(" in code) == (kw.get("fused_ce") == "backward_in_forward")
    assert buf.grad_data.abs().sum() > 0


def test_through_the_main_grad_sinks_as_grad_in_forward():
    """TrainStep with wgrad fusion: backward_in_forward's main grads (the tied weight's LM-head part
    summed over chunks in the forward, added in the backward) are grad_in_forward's."""
    from hpcmeg.model.config import GPTConfig
    from hpcmeg.fused.model import build_gpt
    from hpcmeg.train.optim import AdamWConfig, build_optimizer
    from hpcmeg.train.step import TrainStep
    tok = torch.randint(0, 128, (2, 65), generator=torch.Generator().manual_seed(0))
    mbs = [(tok[:, :-1].contiguous(), tok[:, 1:].contiguous())] * 2
    main = {}
    for impl in ("grad_in_forward", "backward_in_forward"):
        cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                        max_position_embeddings=64, padded_vocab_size=128, fused=True, fused_ce=impl,
                        hidden_dropout=0.0, attention_dropout=0.0)
        m = build_gpt(cfg, init_seed=3)
        buf, opt = build_optimizer(m, AdamWConfig(1e-3), bucket_numel=5000, wgrad_fusion=True)
        TrainStep(m, buf, opt, "fp32", grad_clip=0.0, device="cpu").run(mbs)
        main[impl] = buf.grad_data.clone()
    # case 2 (the chunked d weight) through two layers; atol 1e-6 for main grads of a mean loss (~1e-3)
    torch.testing.assert_close(main["backward_in_forward"], main["grad_in_forward"], atol=1e-6, rtol=1e-5)
    assert main["grad_in_forward"].abs().sum() > 0
