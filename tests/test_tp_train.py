"""Tensor parallelism through `hpcmeg train` (torchrun, gloo, CPU, fp32) and the checkpoint tools.

One process (TP1, accumulation 2) is the reference for TP2, TP2 + sequence parallelism and
TP2 x DP2 with the distributed optimizer (4 processes): the same losses and gradient norms (rtol
1e-5: partial dot products summed in another order) and the same merged weights within Adam's
round-off bound (tests/test_tp_model.py explains it). The padded vocabulary must be the same model
in every layout: make_vocab_size_divisible_by 256 at TP1 and 128 at TP2 both pad GPT-2's 50257 to
50432. Then, on the TP2 checkpoints: resume is bit-exact (dropout on, so the TP RNG stream saved per
shard matters), `hpcmeg convert` gives a Hugging Face model whose logits equal the distributed
forward, `hpcmeg reshard --tp 1` gives what transformers' own Megatron converter reads the same way,
and the resharded TP1 checkpoint continues the TP2 loss curve.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from helpers import (assert_curves_close, assert_weights_close, curve, hf_logits, real_tokens, rel_err,
                     run_transformers_converter, stdlib_dataset, train_cli as train)
from hpcmeg.checkpoint.store import load_checkpoint
from hpcmeg.cli import main as hpcmeg_main
from hpcmeg.convert.merge import load_full_checkpoint

pytestmark = pytest.mark.dist

TP1 = ["model.make_vocab_size_divisible_by=256"]
TP2 = ["parallel.tensor=2", "model.make_vocab_size_divisible_by=128"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    prefix = stdlib_dataset(out / "data")
    return {"out": out, "prefix": prefix,
            "tp1": train(1, out, prefix, "tp1", TP1),
            "tp2": train(2, out, prefix, "tp2", TP2)}


def test_tp2_sp_and_tp2xdp2_equal_one_process(runs):
    ref, m1 = curve(runs["tp1"])
    got, m2 = curve(runs["tp2"])
    assert m2["start"][0]["tensor_parallel_size"] == 2 and m2["start"][0]["grad_accum_steps"] == 2
    assert_curves_close(got, ref)
    sp = train(2, runs["out"], runs["prefix"], "tp2sp", TP2 + ["parallel.sequence_parallel=true"])
    assert_curves_close(curve(sp)[0], ref)
    dp = train(4, runs["out"], runs["prefix"], "tp2dp2", TP2 + ["parallel.distributed_optimizer=true"])
    c, m = curve(dp)
    assert (m["start"][0]["data_parallel_size"], m["start"][0]["grad_accum_steps"]) == (2, 1)
    assert_curves_close(c, ref)
    full1 = load_full_checkpoint(os.path.join(runs["tp1"], "checkpoints")).full
    for rd in (runs["tp2"], sp, dp):
        ck = load_full_checkpoint(os.path.join(rd, "checkpoints"))
        assert ck.tp == 2
        assert_weights_close(ck.full, full1)


def test_tp2_resume_is_bit_exact(runs):
    drop = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"]
    straight = train(2, runs["out"], runs["prefix"], "drop_straight", TP2 + drop)
    resumed = train(2, runs["out"], runs["prefix"], "drop_resumed", TP2 + drop, sigterm_after_first_log=True)
    a, ma = curve(straight)
    b, mb = curve(resumed)
    assert mb["start"][-1]["start"].startswith("resumed")
    assert a == b and [x["val_loss"] for x in ma["eval"]] == [x["val_loss"] for x in mb["eval"]]
    for tp_rank in (0, 1):
        (_, sa), (_, sb) = (load_checkpoint(os.path.join(rd, "checkpoints"), tp_rank=tp_rank, pp_rank=0,
                                            tp_size=2, pp_size=1) for rd in (straight, resumed))
        enc_a, enc_b = sa["model"]["language_model"]["encoder"], sb["model"]["language_model"]["encoder"]
        assert all(torch.equal(enc_a[k], enc_b[k]) for k in enc_a)
        assert torch.equal(sa["rng_state"][0]["rng_tracker_states"]["model-parallel-rng"],
                           sb["rng_state"][0]["rng_tracker_states"]["model-parallel-rng"])
    # the two TP ranks' streams differ (dropout on their own heads differs), the default streams agree
    (_, s0), (_, s1) = (load_checkpoint(os.path.join(straight, "checkpoints"), tp_rank=r, pp_rank=0, tp_size=2,
                                        pp_size=1) for r in (0, 1))
    assert not torch.equal(s0["rng_state"][0]["rng_tracker_states"]["model-parallel-rng"],
                           s1["rng_state"][0]["rng_tracker_states"]["model-parallel-rng"])
    assert torch.equal(s0["rng_state"][0]["torch_rng_state"], s1["rng_state"][0]["torch_rng_state"])


def _distributed_logits(rank, world, ckpt_dir, tokens):
    """The TP2 model's forward (no labels: the vocabulary gathered) from its own shard files."""
    from hpcmeg.megatron.layout import HEAD_KEY, from_megatron_model
    from hpcmeg.model.config import GPTConfig
    from hpcmeg.fused.model import build_gpt
    from hpcmeg.parallel.context import context_for
    from hpcmeg.megatron.parallel_dims import ParallelDims
    from hpcmeg.parallel.tensor import parallelize_tensor

    ctx = context_for(ParallelDims(world, tp=world), rank, rank, "cpu")
    _, st = load_checkpoint(ckpt_dir, tp_rank=rank, pp_rank=0, tp_size=world, pp_size=1)
    a = st["args"]
    cfg = GPTConfig(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
                    ffn_hidden_size=a.ffn_hidden_size, max_position_embeddings=a.max_position_embeddings,
                    padded_vocab_size=a.padded_vocab_size, hidden_dropout=0.0, attention_dropout=0.0)
    m = build_gpt(cfg, init_seed=0)
    parallelize_tensor(m, ctx)
    flat = from_megatron_model(st["model"])
    flat.pop(HEAD_KEY, None)
    m.load_state_dict(flat)
    with torch.no_grad():
        return m.eval()(tokens).float()


def test_tp2_checkpoint_converts_reshards_and_resumes_as_tp1(runs, dist_pool, tmp_path):
    ckpt = os.path.join(runs["tp2"], "checkpoints")
    tokens = real_tokens(n=2, length=32)
    dist = dist_pool(2).run(_distributed_logits, ckpt, tokens)
    assert torch.equal(dist[0], dist[1])
    vocab = 50257
    hf = str(tmp_path / "hf")
    assert hpcmeg_main(["convert", ckpt, hf]) == 0
    assert rel_err(hf_logits(hf, tokens), dist[0][..., :vocab]) < 1e-5
    # reshard to TP1, then transformers' own converter reads the same weights as our convert
    tp1 = str(tmp_path / "tp1")
    assert hpcmeg_main(["reshard", ckpt, tp1, "--tp", "1", "--pp", "1"]) == 0
    from safetensors.torch import load_file

    theirs, _ = run_transformers_converter(os.path.join(tp1, "iter_0000008", "mp_rank_00", "model_optim_rng.pt"),
                                           hf, tmp_path)
    ours = load_file(os.path.join(hf, "model.safetensors"))
    for k, v in ours.items():
        t = theirs[k][:vocab] if k == "transformer.wte.weight" else theirs[k]
        assert torch.equal(t.to(v.dtype), v), k
    # the TP2 run's iteration-4 checkpoint, resharded to TP1, continues its loss curve at TP1
    mid = tmp_path / "mid"
    shutil.copytree(os.path.join(ckpt, "iter_0000004"), mid / "src" / "iter_0000004")
    (mid / "src" / "latest_checkpointed_iteration.txt").write_text("4\n")
    assert hpcmeg_main(["reshard", str(mid / "src"), str(tmp_path / "cont" / "tp1r" / "checkpoints"),
                        "--tp", "1", "--pp", "1"]) == 0
    rd = train(1, tmp_path / "cont", runs["prefix"], "tp1r", [])  # 128 at TP1: what reshard padded to
    cont, m = curve(rd)
    assert m["start"][0]["start"].startswith("resumed") and [x[0] for x in cont] == [5, 6, 7, 8]
    tp2_tail = [x for x in curve(runs["tp2"])[0] if x[0] > 4]
    # padding rows 50304..50431 are gone at TP1 (they only ever took probability mass): close, not equal
    assert [x[1] for x in cont] == pytest.approx([x[1] for x in tp2_tail], rel=1e-3)
