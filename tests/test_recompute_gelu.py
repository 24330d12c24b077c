"""model.recompute_gelu_layers (fused._MLPRecomputeGelu): layers that keep the MLP's pre-activation
but not its GELU output and recompute it in the backward. Against the layers that keep both: the
same loss and gradients (eager, compiled, and through TrainStep's main-grad sinks), exactly one
[tokens, ffn] tensor less saved per such layer, and the config's and the recipe's bounds.
Tolerances: tests/TOLERANCES.md's cases, named at each comparison."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from hpcmeg.model.config import GPTConfig
from hpcmeg.fused.model import build_gpt

TOKENS, FFN = 2 * 64, 256


def _cfg(**kw):
    return GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=FFN,
                     max_position_embeddings=64, padded_vocab_size=128, fused=True, hidden_dropout=0.0,
                     attention_dropout=0.0, **kw)


def _tok():
    return torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0))


def _run(cfg, compiled=False):
    m = build_gpt(cfg, init_seed=3)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        loss = (torch.compile(m) if compiled else m)(_tok(), _tok()).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}, sum(saved)


def test_same_gradients_one_tensor_less_saved_per_layer():
    loss, grads, saved = _run(_cfg())
    for k in (1, 2):
        rloss, rgrads, rsaved = _run(_cfg(recompute_gelu_layers=k))
        # the same forward (case 1, under case 5's default); the recomputing backward takes the GELU
        # derivative and fc2's weight gradient in its own ops (case 2; atol 1e-6 for ~1e-3 gradients)
        torch.testing.assert_close(rloss, loss)
        for n, want in grads.items():
            torch.testing.assert_close(rgrads[n], want, atol=1e-6, rtol=1e-5, msg=n)
        assert saved - rsaved == k * TOKENS * FFN  # the GELU output of each recomputing layer
    assert grads["encoder.layers.0.mlp.dense_4h_to_h.weight"].abs().sum() > 0  # fc2's grad needs g
    closs, cgrads, _ = _run(_cfg(recompute_gelu_layers=1), compiled=True)
    torch.testing.assert_close(closs, loss)  # compiled against eager: case 5 on the mean loss
    for n, want in grads.items():  # case 3
        torch.testing.assert_close(cgrads[n], want, atol=1e-5, rtol=1e-4, msg=n)


def test_the_compiled_graph_saves_no_gelu_output():
    """Under torch.compile (AOTAutograd's min-cut partition, the one Inductor uses) the forward hands
    the backward h alone in a recomputing layer: its GELU output is not among the forward graph's
    saved outputs (a backward that called hpcmeg::gelu_tanh again was merged with the forward's call
    by the joint graph's common-subexpression pass, and g was saved after all)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def saved_ffn_tensors(k):
        shapes = []

        def fw(gm, example_inputs):
            out = next(n for n in gm.graph.nodes if n.op == "output")
            shapes.extend(tuple(a.meta["val"].shape) for a in out.args[0]
                          if isinstance(getattr(a, "meta", {}).get("val"), torch.Tensor))
            return gm.forward

        backend = aot_autograd(fw_compiler=fw, bw_compiler=lambda gm, ex: gm.forward,
                               partition_fn=min_cut_rematerialization_partition)
        torch._dynamo.reset()
        m = build_gpt(_cfg(recompute_gelu_layers=k), init_seed=3)
        torch.compile(m, backend=backend)(_tok(), _tok()).mean().backward()
        # [tokens, ffn] or [b, s, ffn]: the GEMMs save 2-D views, the GELU function its 3-D input
        return sum(1 for sh in shapes if sh[-1] == FFN and torch.Size(sh).numel() == TOKENS * FFN)

    assert [saved_ffn_tensors(k) for k in (0, 1, 2)] == [4, 3, 2]  # h and g per layer, then h alone


def test_through_the_main_grad_sinks():
    """TrainStep with wgrad fusion: fc1's and fc2's weight gradients go into the buffer from the
    recomputing layer's backward as from the others'."""
    from hpcmeg.train.optim import AdamWConfig, build_optimizer
    from hpcmeg.train.step import TrainStep
    tok = _tok()
    mbs = [(tok[:, :-1].contiguous(), tok[:, 1:].contiguous())] * 2
    main = {}
    for k in (0, 2):
        m = build_gpt(_cfg(recompute_gelu_layers=k), init_seed=3)
        buf, opt = build_optimizer(m, AdamWConfig(1e-3), bucket_numel=5000, wgrad_fusion=True)
        assert buf.is_sunk(m.encoder.layers[0].mlp.dense_4h_to_h.weight)
        TrainStep(m, buf, opt, "fp32", grad_clip=0.0, device="cpu").run(mbs)
        main[k] = {n: buf.grad_data[slice(*buf.locate(p))].clone() for n, p in m.named_parameters()}
    for n, want in main[0].items():  # as the eager gradients above (case 2)
        torch.testing.assert_close(main[2][n], want, atol=1e-6, rtol=1e-5, msg=n)
    assert main[2]["encoder.layers.0.mlp.dense_h_to_4h.weight"].abs().sum() > 0


def test_the_recompute_op():
    from hpcmeg.kernels import gelu as triton_gelu
    h = torch.randn(6, 40)
    torch.library.opcheck(triton_gelu.gelu_tanh_recompute, (h,))
    assert torch.equal(torch.ops.hpcmeg.gelu_tanh_recompute(h), torch.ops.hpcmeg.gelu_tanh(h))


def test_the_start_line_names_it():
    from hpcmeg.train.build import kernels_of
    assert "recomputed" not in kernels_of(_cfg())
    assert kernels_of(_cfg(recompute_gelu_layers=2)).endswith(", GELU recomputed in 2 layer(s)")


def test_bounds(tmp_path):
    with pytest.raises(ValueError, match="recompute_gelu_layers"):
        dataclasses.replace(_cfg(), recompute_gelu_layers=3)
    with pytest.raises(ValueError, match="recompute_gelu_layers"):
        dataclasses.replace(_cfg(), recompute_gelu_layers=-1)
    from hpcmeg.recipe import RecipeError, load_recipe
    recipe = tmp_path / "r.yaml"
    recipe.write_text("run: {name: t}\ndata: {inputs: [x.jsonl]}\n"
                      "train: {train_iters: 10, micro_batch_size: 1, global_batch_size: 1}\n")
    assert load_recipe(recipe, ["model.num_layers=4", "model.recompute_gelu_layers=4"]).model.recompute_gelu_layers == 4
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe, ["model.num_layers=4", "model.recompute_gelu_layers=5"])
    (line,) = e.value.problems
    assert "model.recompute_gelu_layers" in line and "num_layers=4" in line
