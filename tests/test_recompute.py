"""Activation recompute (hpcmeg/parallel/recompute.py; model.recompute_granularity / _method / _num_layers):
recomputing changes when activations are computed, never what they are.

- One process, fp32, eager, dropout 0.1, plain and fused models: every setting gives the loss and every
  gradient of no recompute bit for bit, leaves torch's RNG where no recompute leaves it, keeps fewer
  tensors for the backward, and really runs the recomputed parts twice (counted calls). Compiled (the
  whole model, or layer by layer), the gradient is the derivative of the forward's own masks.
- Through the train job's builders (rank_model, rank_step: TP hooks, the TP RNG stream, the pipeline
  schedule) on gloo, dropout 0.1: TP2, TP2 + sequence parallelism and PP2 train a step with each
  setting exactly as without recompute (losses, gradient norms, weights after a step: ==); the TP stream is drawn
  again for the recompute, so a mask drawn otherwise would show at once. At dropout 0 TP2 + SP with
  recompute equals one process within test_tp_model.py's tolerances.
- The product path: `hpcmeg train` with recompute equals the run without, an interrupted and resumed
  run equals the straight one (==), the start line names it and the checkpoint's Megatron args hold it.
- Settings Megatron refuses: one recipe line naming the key and the fix.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from helpers import random_batches, run_dir, small_recipe, stdlib_dataset
from hpcmeg.fused.model import build_gpt
from hpcmeg.megatron.parallel_dims import ParallelDims
from hpcmeg.model.config import GPTConfig
from hpcmeg.parallel.context import context_for
from hpcmeg.parallel.recompute import apply_recompute
from hpcmeg.train.optim import AdamWConfig
from hpcmeg.train.rank_model import rank_model, rank_optimizer, rank_step

SEQ, MB, LAYERS = 32, 2, 4
CFG = GPTConfig(num_layers=LAYERS, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                max_position_embeddings=SEQ, padded_vocab_size=512, vocab_size=500, hidden_dropout=0.1,
                attention_dropout=0.1)
# every kind of region: a group of layers, one layer, the attention core (4 layers, or the 2 of a PP2 stage)
SETTINGS = [("full", "uniform", 2), ("full", "block", 1), ("selective", None, None)]
ONE_PROCESS = SETTINGS + [("full", "uniform", 1), ("full", "uniform", 4), ("full", "block", 3)]


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """One thread, as each gloo rank runs: on the 2 shared cores torch's two threads made a step of
    this tiny model ~20x slower, and the train job's data workers see OMP_NUM_THREADS=1."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _with(cfg: GPTConfig, setting) -> GPTConfig:
    g, m, n = setting or (None, None, None)
    return dataclasses.replace(cfg, recompute_granularity=g, recompute_method=m, recompute_num_layers=n)


# ------------------------------------------------------------------------------------ one process

def _counted(model):
    """Count the calls of each layer's MLP (runs in a full recompute) and attention core (selective)."""
    calls = {"mlp": 0, "attend": 0}
    for layer in model.encoder.layers:
        layer.mlp.register_forward_hook(lambda *a: calls.__setitem__("mlp", calls["mlp"] + 1))
        attend = layer.self_attention.attend

        def counting(*args, attend=attend, **kwargs):
            calls["attend"] += 1
            return attend(*args, **kwargs)
        layer.self_attention.attend = counting  # an instance attribute, as TP's fork: recompute wraps it
    return calls


def _one_process(fused: bool, setting):
    model = build_gpt(dataclasses.replace(CFG, fused=fused), init_seed=3)
    calls = _counted(model)
    if setting:
        apply_recompute(model, *setting)
    (x, y), = random_batches(1, MB, SEQ, 500)
    torch.manual_seed(7)
    saved = []  # what the backward keeps outside the checkpointed regions (checkpoint's own hooks are innermost)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        loss = model(x, y).mean()
    forward_calls = dict(calls)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, sum(saved), forward_calls, dict(calls), torch.rand(4)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_each_setting_equals_no_recompute_bit_for_bit(fused):
    loss, grads, saved, _, _, rng_after = _one_process(fused, None)
    kept = {}
    for setting in ONE_PROCESS:
        rloss, rgrads, rsaved, fwd, total, rrng = _one_process(fused, setting)
        kept[setting] = rsaved
        assert torch.equal(rloss, loss), setting
        for n, g in grads.items():
            assert torch.equal(rgrads[n], g), (setting, n)
        assert torch.equal(rrng, rng_after), setting  # the default stream ends where it would
        assert rsaved < saved, setting
        assert fwd == {"mlp": LAYERS, "attend": LAYERS}
        g, method, k = setting
        recomputed_layers = 0 if g == "selective" else LAYERS if method == "uniform" else k
        assert total == {"mlp": LAYERS + recomputed_layers,
                         "attend": LAYERS + (LAYERS if g == "selective" else recomputed_layers)}, setting
    assert grads["encoder.layers.0.self_attention.query_key_value.weight"].abs().sum() > 0
    # the more a setting recomputes, the less the backward keeps
    assert saved > kept[("full", "block", 1)] > kept[("full", "block", 3)] > kept[("full", "uniform", 1)] \
        > kept[("full", "uniform", 2)] > kept[("full", "uniform", 4)]


@pytest.mark.parametrize("compiled,setting", [("whole", ("full", "uniform", 2)), ("layers", ("selective", None, None))],
                         ids=["whole_model_full", "per_layer_selective"])
def test_compiled_recompute_differentiates_the_forwards_masks(compiled, setting):
    """Under torch.compile (the whole model, as one GPU process runs; or layer by layer, as DP > 1
    does: hpcmeg/parallel/overlap.py) the compiled graphs draw other masks than eager, so compare the
    gradient with the forward itself: its directional derivative against central differences of the
    loss, every forward from the same seed (dropout 0.3, steps of 1e-4 per element). Measured: within
    0.2 %; a recompute that drew its own masks (preserve_rng_state off) was 10 % and 80 % off."""
    from hpcmeg.parallel.overlap import compile_layers

    model = build_gpt(dataclasses.replace(CFG, num_layers=2, fused=True, hidden_dropout=0.3, attention_dropout=0.3),
                      init_seed=3)
    apply_recompute(model, *setting)
    run = torch.compile(model) if compiled == "whole" else model
    if compiled == "layers":
        compile_layers(model)
    (x, y), = random_batches(1, MB, SEQ, 500)

    def loss():
        torch.manual_seed(5)
        return run(x, y).mean()

    loss().backward()
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(0)
    direction = [torch.randn(p.shape, generator=gen) * 0.01 for p in params]
    analytic = sum((p.grad * d).sum() for p, d in zip(params, direction)).item()
    with torch.no_grad():
        for p, d in zip(params, direction):
            p.add_(d, alpha=0.01)
    up = loss().item()
    with torch.no_grad():
        for p, d in zip(params, direction):
            p.sub_(d, alpha=0.02)
    down = loss().item()
    assert analytic == pytest.approx((up - down) / 0.02, rel=1e-2)


# ------------------------------------------------------------------------------------ process cases

def _train_case(rank, world, tp, sp, pp, settings, dropout=True, steps=1):
    """`steps` AdamW steps (of 2 micro batches) of every setting (each from the same seeds); returns per setting the (loss, norm)
    history and this rank's weights."""
    dims = ParallelDims(world, tp=tp, pp=pp, sequence_parallel=sp)
    ctx = context_for(dims, rank, rank, "cpu")
    cfg = CFG if dropout else dataclasses.replace(CFG, hidden_dropout=0.0, attention_dropout=0.0)
    out = {}
    for setting in settings:
        torch.manual_seed(1234 + 100 * ctx.pp_rank)  # the train job's default stream (build.seed_everything)
        model, plan, rng = rank_model(_with(cfg, setting), dims, ctx, 3, "cpu")
        buf, opt = rank_optimizer(model, plan, ctx, AdamWConfig(1e-3), param_dtype=torch.float32,
                                  grad_dtype=torch.float32)
        step = rank_step(model, buf, opt, dims, ctx, micro_batch=MB, seq_length=SEQ, act_dtype=torch.float32,
                         precision="fp32", grad_clip=1.0, device="cpu")
        hist = []
        for x, y in random_batches(steps, 2 * MB, SEQ, 500):
            res = step.run([(x[i:i + MB], y[i:i + MB]) for i in range(0, 2 * MB, MB)])
            hist.append((res.loss, res.grad_norm))
        out[setting] = {"hist": hist, "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
                        "tp_stream": rng.state_dict() if rng is not None else None}
    return out


def _assert_same_as_without(out, settings):
    for r in out:
        ref = r[None]
        for s in settings:
            assert r[s]["hist"] == ref["hist"], s
            for n, w in ref["weights"].items():
                assert torch.equal(r[s]["weights"][n], w), (s, n)
            if ref["tp_stream"] is not None:  # the TP stream advanced by the forward's draws only
                assert all(torch.equal(r[s]["tp_stream"][k], v) for k, v in ref["tp_stream"].items()), s


@pytest.mark.dist
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
def test_tp2_with_dropout_equals_no_recompute(dist_pool, sp):
    out = dist_pool(2).run(_train_case, 2, sp, 1, [None, *SETTINGS])
    _assert_same_as_without(out, SETTINGS)
    assert out[0][None]["hist"][0][0] == out[1][None]["hist"][0][0]  # one loss for the TP group


@pytest.mark.dist
def test_pp2_with_dropout_equals_no_recompute(dist_pool):
    # each stage holds 2 layers: uniform 2 is one group per stage, block 1 its first layer
    out = dist_pool(2).run(_train_case, 1, False, 2, [None, *SETTINGS])
    _assert_same_as_without(out, SETTINGS)


@pytest.mark.dist
def test_tp2_sp_with_recompute_equals_one_process(dist_pool):
    """At dropout 0 (TP draws other masks than one process): the layout parity of test_tp_model.py,
    with its tolerances (partial sums in another order), holds with recompute on."""
    setting = ("full", "uniform", 2)
    (got, _), ref = dist_pool(2).run(_train_case, 2, True, 1, [setting], False), \
        _train_case(0, 1, 1, False, 1, [None], False)[None]
    assert [h[0] for h in got[setting]["hist"]] == pytest.approx([h[0] for h in ref["hist"]], rel=1e-6)
    assert [h[1] for h in got[setting]["hist"]] == pytest.approx([h[1] for h in ref["hist"]], rel=1e-5)


# ------------------------------------------------------------------------------------ refusals

def test_settings_megatron_refuses(tmp_path):
    from hpcmeg.recipe import RecipeError, load_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text("run: {name: t}\ndata: {inputs: [x.jsonl]}\nmodel: {num_layers: 12}\n"
                      "train: {train_iters: 10, micro_batch_size: 1, global_batch_size: 2}\n")
    full = ["model.recompute_granularity=full"]
    ok = load_recipe(recipe, full + ["model.recompute_method=uniform", "model.recompute_num_layers=4"]).model
    assert (ok.recompute_granularity, ok.recompute_method, ok.recompute_num_layers) == ("full", "uniform", 4)
    assert load_recipe(recipe, ["model.recompute_granularity=selective"]).model.recompute_method is None
    cases = [  # (overrides, the key blamed, what the line must say)
        (full, "model.recompute_method", "uniform or block"),
        (full + ["model.recompute_method=block"], "model.recompute_num_layers", "needs recompute_num_layers"),
        (["model.recompute_method=block"], "model.recompute_method", "recompute_granularity: full"),
        (["model.recompute_num_layers=2"], "model.recompute_num_layers", "recompute_granularity: full"),
        (["model.recompute_granularity=selective", "model.recompute_method=uniform"], "model.recompute_method",
         "leave it null"),
        (["model.recompute_granularity=partial"], "model.recompute_granularity", "full, selective"),
        (full + ["model.recompute_method=block", "model.recompute_num_layers=13"], "model.recompute_num_layers",
         "use at most 12"),
        (full + ["model.recompute_method=uniform", "model.recompute_num_layers=5"], "model.recompute_num_layers",
         "use one of [1, 2, 3, 4, 6, 12]"),
        # under PP 2 a stage holds 6 layers: Megatron counts recompute_num_layers per stage
        (full + ["model.recompute_method=uniform", "model.recompute_num_layers=12", "parallel.pipeline=2",
                 "cluster.cpu_tasks_per_node=2"], "model.recompute_num_layers", "use at most 6"),
    ]
    for sets, key, says in cases:
        with pytest.raises(RecipeError) as e:
            load_recipe(recipe, sets)
        (line,) = e.value.problems
        assert key in line and says in line, (sets, line)


def test_apply_recompute_refuses_what_the_recipe_refuses():
    model = build_gpt(CFG, init_seed=3)
    with pytest.raises(ValueError, match="model.recompute_num_layers: 3 does not divide the 4 layers"):
        apply_recompute(model, "full", "uniform", 3)
    with pytest.raises(ValueError, match="recompute_granularity"):
        dataclasses.replace(CFG, recompute_granularity="everything")
    assert apply_recompute(model, None) == 0 and type(model.encoder.layers[0]).__name__ == "TransformerLayer"


# ------------------------------------------------------------------------------------ the product path

@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return stdlib_dataset(tmp_path_factory.mktemp("data")), tmp_path_factory.mktemp("runs")


def test_train_resume_with_recompute_is_exact(data):
    from hpcmeg.checkpoint.store import load_checkpoint
    from hpcmeg.megatron.names import EXIT_OK, EXIT_REQUEUE
    from hpcmeg.train.entry import train
    from hpcmeg.train.metrics import read_metrics

    prefix, out = data
    keys = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1", "train.train_iters=6", "train.eval_interval=3"]
    full = ["model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=2"]
    runs = {}
    for name, sets in (("plain", keys), ("straight", keys + full)):
        r = small_recipe(out, prefix, *sets, name=name)
        assert train(r) == EXIT_OK
        runs[name] = run_dir(r)
    r = small_recipe(out, prefix, *keys, *full, "checkpoint.save_interval=2", name="resumed")
    assert train(r, exit_interval=3) == EXIT_REQUEUE
    assert train(r) == EXIT_OK
    runs["resumed"] = run_dir(r)
    m = {k: read_metrics(os.path.join(rd, "metrics.jsonl")) for k, rd in runs.items()}
    curve = {k: [(x["loss"], x["grad_norm"]) for x in v["train"]] + [x["val_loss"] for x in v["eval"]]
             for k, v in m.items()}
    assert len(curve["plain"]) == 8 and curve["straight"] == curve["plain"] and curve["resumed"] == curve["plain"]
    assert m["resumed"]["start"][-1]["start"].endswith("at iteration 3")
    assert m["straight"]["start"][0]["recompute"] == "full recompute, uniform groups of 2 layer(s)"
    assert m["plain"]["start"][0]["recompute"] == "no activation recompute"
    (_, a), (_, b) = (load_checkpoint(os.path.join(runs[k], "checkpoints"), tp_rank=0, pp_rank=0, tp_size=1,
                                      pp_size=1) for k in ("straight", "resumed"))
    enc_a, enc_b = a["model"]["language_model"]["encoder"], b["model"]["language_model"]["encoder"]
    assert all(torch.equal(enc_a[k], enc_b[k]) for k in enc_a)
    args = b["args"]
    assert (args.recompute_granularity, args.recompute_method, args.recompute_num_layers) == ("full", "uniform", 2)
