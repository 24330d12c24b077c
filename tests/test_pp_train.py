"""Pipeline parallelism through `hpcmeg train` (torchrun, gloo, CPU, fp32) and the checkpoint tools.

One process (4 layers, accumulation 4) is the reference for PP2 (1F1B), PP2 x V2 (interleaved) and
TP2 x PP2 (4 processes): the same losses and gradient norms (rtol 1e-5) and merged weights within
Adam's round-off bound (tests/test_tp_model.py). The checkpoints are Megatron's: mp_rank_TT_PPP,
stage-local layers, word_embeddings_for_head on the last stage, model0/model1 with V2. Resume at
TP2 x PP2 is bit-exact (dropout on: the per-stage default stream and the TP stream are saved per
shard); its checkpoint reshards to TP1 x PP1 and converts to a Hugging Face model whose logits equal
the distributed forward of the TP2 x PP2 shards.
"""
from __future__ import annotations

import os

import pytest
import torch

from helpers import (assert_curves_close, assert_weights_close, curve, hf_logits, real_tokens, rel_err,
                     train_cli as train)
from hpcmeg.checkpoint.store import load_checkpoint
from hpcmeg.cli import main as hpcmeg_main
from hpcmeg.convert.merge import load_full_checkpoint

pytestmark = pytest.mark.dist

LAYERS4 = ["model.num_layers=4", "train.global_batch_size=8", "train.micro_batch_size=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from helpers import stdlib_dataset

    out = tmp_path_factory.mktemp("pp")
    prefix = stdlib_dataset(out / "data")
    return {"out": out, "prefix": prefix,
            "pp1": train(1, out, prefix, "pp1", LAYERS4 + ["model.make_vocab_size_divisible_by=256"])}


def test_pp2_interleaved_and_tp2xpp2_equal_one_process(runs):
    ref, _ = curve(runs["pp1"])
    full1 = load_full_checkpoint(os.path.join(runs["pp1"], "checkpoints")).full
    layouts = {"pp2": (2, ["parallel.pipeline=2"]),
               "pp2v2": (2, ["parallel.pipeline=2", "parallel.virtual_pipeline=2"]),
               "tp2pp2": (4, ["parallel.pipeline=2", "parallel.tensor=2", "cluster.cpu_tasks_per_node=4"])}
    for name, (nproc, extra) in layouts.items():
        div = "128" if "parallel.tensor=2" in extra else "256"
        rd = train(nproc, runs["out"], runs["prefix"], name, LAYERS4 + extra + [f"model.make_vocab_size_divisible_by={div}"])
        c, m = curve(rd)
        assert m["start"][0]["pipeline_parallel_size"] == 2 and m["start"][0]["grad_accum_steps"] == 4
        assert_curves_close(c, ref)
        assert all(0 <= x["pipeline_bubble"] <= 1 and x["pipeline_bubble_ideal"] == pytest.approx(
            1 / (4 * (2 if "v2" in name else 1) + 1)) for x in m["train"])
        ck = load_full_checkpoint(os.path.join(rd, "checkpoints"))
        assert (ck.pp, ck.vpp) == (2, 2 if "v2" in name else 1)
        assert_weights_close(ck.full, full1)
        runs[name] = rd
    # Megatron's files: mp_rank_TT_PPP, stage-local layers, the head copy on the last stage
    it = os.path.join(runs["tp2pp2"], "checkpoints", "iter_0000008")
    assert sorted(d for d in os.listdir(it) if d.startswith("mp_rank")) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    _, last = load_checkpoint(os.path.join(runs["tp2pp2"], "checkpoints"), tp_rank=1, pp_rank=1, tp_size=2, pp_size=2)
    enc = last["model"]["language_model"]["encoder"]
    assert sorted({int(k.split(".")[1]) for k in enc if k.startswith("layers.")}) == [0, 1]
    assert "word_embeddings_for_head" in last["model"] and "embedding" not in last["model"]["language_model"]
    _, v2 = load_checkpoint(os.path.join(runs["pp2v2"], "checkpoints"), tp_rank=0, pp_rank=0, tp_size=1, pp_size=2)
    assert {"model0", "model1"} <= set(v2) and "model" not in v2


def _stage_logits(rank, world, ckpt_dir, tokens):
    """The TP2 x PP2 model's forward from its own shards: each stage runs its chunk, the activations go
    stage 0 -> stage 1 over the pipeline group, the vocabulary is gathered on the last stage."""
    import torch.distributed as dist

    from hpcmeg.megatron.args import checkpoint_models
    from hpcmeg.model.config import GPTConfig
    from hpcmeg.parallel.context import context_for
    from hpcmeg.megatron.parallel_dims import ParallelDims
    from hpcmeg.parallel.pipeline.stages import build_chunks, load_megatron_models, StageModel
    from hpcmeg.parallel.tensor import parallelize_tensor

    dims = ParallelDims(world, tp=2, pp=2)
    ctx = context_for(dims, rank, rank, "cpu")
    _, st = load_checkpoint(ckpt_dir, tp_rank=ctx.tp_rank, pp_rank=ctx.pp_rank, tp_size=2, pp_size=2)
    a = st["args"]
    cfg = GPTConfig(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
                    ffn_hidden_size=a.ffn_hidden_size, max_position_embeddings=a.max_position_embeddings,
                    padded_vocab_size=a.padded_vocab_size, hidden_dropout=0.0, attention_dropout=0.0)
    chunks = build_chunks(cfg, 2, 1, ctx.pp_rank, 0)
    for c in chunks:
        parallelize_tensor(c, ctx)
    stage = StageModel(chunks, ctx.pp_rank, 2).eval()
    load_megatron_models(stage, checkpoint_models(st))
    peer = dims.rank_of(ctx.tp_rank, ctx.dp_rank, 1 - ctx.pp_rank)
    with torch.no_grad():
        if ctx.pp_rank == 0:
            h = stage.stage_fn(0)(tokens)
            dist.send(h.contiguous(), peer)
            return None
        h = torch.empty(tokens.shape[0], tokens.shape[1], cfg.hidden_size)
        dist.recv(h, peer)
        h = stage.stage_fn(0)(h)
        return stage.chunks[-1].head(h, stage.chunks[-1].output_weight(), None).float()


def test_tp2xpp2_resume_reshard_and_convert(runs, dist_pool, tmp_path):
    drop = LAYERS4 + ["parallel.pipeline=2", "parallel.tensor=2", "model.make_vocab_size_divisible_by=128",
                      "cluster.cpu_tasks_per_node=4",
                      "model.hidden_dropout=0.1", "model.attention_dropout=0.1"]
    straight = train(4, runs["out"], runs["prefix"], "drop_straight", drop)
    resumed = train(4, runs["out"], runs["prefix"], "drop_resumed", drop, sigterm_after_first_log=True)
    (a, _), (b, mb) = curve(straight), curve(resumed)
    assert mb["start"][-1]["start"].startswith("resumed") and a == b
    fa = load_full_checkpoint(os.path.join(straight, "checkpoints")).full
    fb = load_full_checkpoint(os.path.join(resumed, "checkpoints")).full
    assert all(torch.equal(fa[k], fb[k]) for k in fa)
    # TP2 x PP2 -> TP1 x PP1 -> Hugging Face: the logits of the distributed forward
    ckpt = os.path.join(straight, "checkpoints")
    tokens = real_tokens(n=2, length=32)
    dist = dist_pool(4).run(_stage_logits, ckpt, tokens)
    last = [x for x in dist if x is not None]
    assert len(last) == 2 and torch.equal(last[0], last[1])
    one = str(tmp_path / "one")
    assert hpcmeg_main(["reshard", ckpt, one, "--tp", "1", "--pp", "1"]) == 0
    merged, resharded = load_full_checkpoint(ckpt).full, load_full_checkpoint(one).full
    for k, v in resharded.items():  # bitwise, but for the padding rows reshard re-pads for TP1
        assert torch.equal(v, merged[k][:v.shape[0]] if k == "embedding.word_embeddings.weight" else merged[k]), k
    hf = str(tmp_path / "hf")
    assert hpcmeg_main(["convert", one, hf]) == 0
    assert rel_err(hf_logits(hf, tokens), last[0][..., :50257]) < 1e-5


def test_pp2_under_bf16_autocast_follows_one_process(runs):
    """bf16 autocast with fp32 parameters (the CPU mixed-precision path): the residual stream, and so
    the activations sent between stages, are bf16. PP2 runs and follows PP1's curve; bf16 rounding of
    differently-ordered sums allows ~1e-2, not fp32's 1e-5."""
    bf16 = LAYERS4 + ["train.precision=bf16", "model.make_vocab_size_divisible_by=256", "train.train_iters=4",
                      "checkpoint.save_interval=0", "train.eval_interval=0"]
    ref, _ = curve(train(1, runs["out"], runs["prefix"], "bf16pp1", bf16))
    got, m = curve(train(2, runs["out"], runs["prefix"], "bf16pp2", bf16 + ["parallel.pipeline=2"]))
    assert m["start"][0]["pipeline_parallel_size"] == 2 and len(got) == len(ref) == 4
    assert [x[1] for x in got] == pytest.approx([x[1] for x in ref], rel=1e-2)
    assert all(torch.isfinite(torch.tensor(x[2])) for x in got)
