"""hpcmeg reshard: Megatron's TP/PP rules on real checkpoints. Round trips 1 -> 2x2 -> 1 and
1 -> 4x1 -> 2x2 -> 1 are bit-identical; shard shapes/contents follow §5.1/§5.3 (QKV rows = whole
head groups, dense/4h_to_h by columns, replicated LNs and row-parallel biases, vocab rows split,
stage-local layers, tied head on the last stage); shards load through the trainer's verified loader;
a TP-sharded forward computed from the shards (emulated all-reduce) equals the full model's."""
from __future__ import annotations

import os

import pytest
import torch

from hpcmeg.cli import main as hpcmeg_main
from hpcmeg.convert.merge import load_full_checkpoint
from hpcmeg.model import ops
from hpcmeg.checkpoint.store import load_checkpoint
from hpcmeg.megatron.layout import from_megatron_model
from hpcmeg.megatron.names import read_tracker
from helpers import FFN, HEADS, LAYERS, VOCAB, H, make_run, real_tokens, rel_err

WE = "embedding.word_embeddings.weight"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    ckpt = str(root / "ckpt")
    model = make_run(ckpt, iterations=(10,))
    ck22 = str(root / "ck22")
    assert hpcmeg_main(["reshard", ckpt, ck22, "--tp", "2", "--pp", "2"]) == 0
    return {"root": root, "ckpt": ckpt, "ck22": ck22, "model": model}


def shard(ckpt: str, t: int, p: int, tp: int, pp: int) -> dict:
    got = load_checkpoint(ckpt, tp_rank=t, pp_rank=p, tp_size=tp, pp_size=pp)  # manifest + crc verified
    assert got is not None
    return got[1]


def assert_same_model(a: str, b: str) -> None:
    fa, fb = load_full_checkpoint(a), load_full_checkpoint(b)
    assert fa.full.keys() == fb.full.keys()
    for k in fa.full:
        assert torch.equal(fa.full[k], fb.full[k]), k
    assert (fa.args.padded_vocab_size, fa.args.tensor_model_parallel_size, fa.args.pipeline_model_parallel_size) == \
        (fb.args.padded_vocab_size, fb.args.tensor_model_parallel_size, fb.args.pipeline_model_parallel_size)
    assert fa.base["iteration"] == fb.base["iteration"] == 10
    assert fa.args.consumed_train_samples == fb.args.consumed_train_samples


def test_round_trip_1_2x2_1_identical(run):
    back = str(run["root"] / "back11")
    assert hpcmeg_main(["reshard", run["ck22"], back, "--tp", "1", "--pp", "1"]) == 0
    assert_same_model(run["ckpt"], back)
    assert read_tracker(back) == 10
    # and the weights are exactly the model's, padding rows included
    full = load_full_checkpoint(back).full
    sd = run["model"].state_dict()
    assert all(torch.equal(full[k], sd[k]) for k in sd)


def test_round_trip_via_4x1_and_2x2(run):
    a, b, c = (str(run["root"] / n) for n in ("ck41", "ck41_22", "ck41_22_11"))
    assert hpcmeg_main(["reshard", run["ckpt"], a, "--tp", "4", "--pp", "1"]) == 0
    assert load_full_checkpoint(a).args.padded_vocab_size == 50688  # multiple of 128 x 4
    assert hpcmeg_main(["reshard", a, b, "--tp", "2", "--pp", "2"]) == 0
    assert hpcmeg_main(["reshard", b, c, "--tp", "1", "--pp", "1"]) == 0
    assert_same_model(run["ckpt"], c)


def test_megatron_shard_layout(run):
    sd = run["model"].state_dict()
    tp, pp, per = 2, 2, LAYERS // 2
    hd, np_ = H // HEADS, HEADS // 2
    stages = {(t, p): shard(run["ck22"], t, p, tp, pp) for t in range(tp) for p in range(pp)}
    for (t, p), st in stages.items():
        a = st["args"]
        assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size) == (2, 2)
        assert a.padded_vocab_size == 50432 and a.orig_vocab_size == VOCAB  # multiple of 128 x 2
        assert st["hpcmeg"]["recipe"]["parallel"] == {"tensor": 2, "pipeline": 2}
        lm = st["model"]["language_model"]
        flat = from_megatron_model(st["model"])
        layer_ids = {int(k.split(".")[2]) for k in flat if k.startswith("encoder.layers.")}
        assert layer_ids == set(range(per))  # stage-local numbering
        assert ("embedding" in lm) == (p == 0)
        assert ("final_layernorm.weight" in lm["encoder"]) == (p == pp - 1)
        assert ("word_embeddings_for_head" in st["model"]) == (p == pp - 1)
        for i in range(per):
            g, loc = f"encoder.layers.{p * per + i}.", f"encoder.layers.{i}."
            qkv = sd[g + "self_attention.query_key_value.weight"].view(HEADS, 3 * hd, H)
            assert torch.equal(flat[loc + "self_attention.query_key_value.weight"],
                               qkv[t * np_:(t + 1) * np_].reshape(-1, H))  # whole heads, [q,k,v] each
            assert torch.equal(flat[loc + "self_attention.query_key_value.bias"],
                               sd[g + "self_attention.query_key_value.bias"].view(HEADS, -1)[t * np_:(t + 1) * np_].reshape(-1))
            assert torch.equal(flat[loc + "self_attention.dense.weight"],
                               sd[g + "self_attention.dense.weight"][:, t * H // 2:(t + 1) * H // 2])
            assert torch.equal(flat[loc + "mlp.dense_h_to_4h.weight"], sd[g + "mlp.dense_h_to_4h.weight"][t * FFN // 2:(t + 1) * FFN // 2])
            assert torch.equal(flat[loc + "mlp.dense_h_to_4h.bias"], sd[g + "mlp.dense_h_to_4h.bias"][t * FFN // 2:(t + 1) * FFN // 2])
            assert torch.equal(flat[loc + "mlp.dense_4h_to_h.weight"], sd[g + "mlp.dense_4h_to_h.weight"][:, t * FFN // 2:(t + 1) * FFN // 2])
            for rep in ("self_attention.dense.bias", "mlp.dense_4h_to_h.bias", "input_layernorm.weight",
                        "input_layernorm.bias", "post_attention_layernorm.weight", "post_attention_layernorm.bias"):
                assert torch.equal(flat[loc + rep], sd[g + rep]), rep
    # vocabulary rows split over TP; the head copy on the last stage is the same slice
    emb = torch.cat([stages[(t, 0)]["model"]["language_model"]["embedding"]["word_embeddings"]["weight"] for t in range(tp)])
    head = torch.cat([stages[(t, 1)]["model"]["word_embeddings_for_head"]["weight"] for t in range(tp)])
    assert emb.shape == (50432, H) and torch.equal(emb, head)
    assert torch.equal(emb[:50304], sd[WE]) and not emb[50304:].any()


def test_tp_sharded_forward_matches_full_model(run):
    """Compute the model from the TP=2 shards the way Megatron's TP layers do (local heads and MLP
    slice per rank, partial outputs summed = the all-reduce, bias once, vocab-parallel logits
    concatenated) and compare with the unsharded forward."""
    ck = str(run["root"] / "ck21")
    assert hpcmeg_main(["reshard", run["ckpt"], ck, "--tp", "2", "--pp", "1"]) == 0
    shards = [from_megatron_model(shard(ck, t, 0, 2, 1)["model"]) for t in range(2)]
    tokens = real_tokens(2, 32)
    s0 = shards[0]
    eps, hd = 1e-5, H // HEADS
    pos = torch.arange(tokens.shape[1])
    # vocab-parallel embedding: each rank looks up its rows, zeros elsewhere, then all-reduce
    x = 0
    for r, s in enumerate(shards):
        w = s[WE]
        lo = r * w.shape[0]
        local = tokens - lo
        mask = (local < 0) | (local >= w.shape[0])
        e = w[local.clamp(0, w.shape[0] - 1)]
        x = x + e.masked_fill(mask.unsqueeze(-1), 0.0)
    x = x + s0["embedding.position_embeddings.weight"][pos]
    for i in range(LAYERS):
        p = f"encoder.layers.{i}."
        ln = torch.nn.functional.layer_norm(x, (H,), s0[p + "input_layernorm.weight"], s0[p + "input_layernorm.bias"], eps)
        attn = 0
        for s in shards:
            qkv = torch.nn.functional.linear(ln, s[p + "self_attention.query_key_value.weight"],
                                             s[p + "self_attention.query_key_value.bias"])
            b_, n_ = qkv.shape[:2]
            q, k, v = qkv.view(b_, n_, -1, 3 * hd).split(hd, dim=-1)
            ctx = ops.causal_attention(q, k, v, 0.0, False).reshape(b_, n_, -1)
            attn = attn + torch.nn.functional.linear(ctx, s[p + "self_attention.dense.weight"])
        x = x + attn + s0[p + "self_attention.dense.bias"]
        ln = torch.nn.functional.layer_norm(x, (H,), s0[p + "post_attention_layernorm.weight"],
                                            s0[p + "post_attention_layernorm.bias"], eps)
        mlp = 0
        for s in shards:
            hmid = ops.bias_gelu(torch.nn.functional.linear(ln, s[p + "mlp.dense_h_to_4h.weight"]), s[p + "mlp.dense_h_to_4h.bias"])
            mlp = mlp + torch.nn.functional.linear(hmid, s[p + "mlp.dense_4h_to_h.weight"])
        x = x + mlp + s0[p + "mlp.dense_4h_to_h.bias"]
    x = torch.nn.functional.layer_norm(x, (H,), s0["encoder.final_layernorm.weight"], s0["encoder.final_layernorm.bias"], eps)
    logits = torch.cat([torch.nn.functional.linear(x, s[WE]) for s in shards], dim=-1)[..., :VOCAB]
    with torch.no_grad():
        ref = run["model"](tokens)[..., :VOCAB]
    assert rel_err(logits, ref) < 1e-5


def test_bad_layouts_are_refused(run, tmp_path, capsys):
    out = tmp_path / "x"
    assert hpcmeg_main(["reshard", run["ckpt"], str(out), "--tp", "3", "--pp", "1"]) == 1
    assert "num_attention_heads=4 is not divisible by --tp 3" in capsys.readouterr().err
    assert hpcmeg_main(["reshard", run["ckpt"], str(out), "--tp", "1", "--pp", "3"]) == 1
    assert "num_layers=4 is not divisible by --pp 3" in capsys.readouterr().err
    assert not out.exists()
    # an existing checkpoint dir is never overwritten
    assert hpcmeg_main(["reshard", run["ckpt"], run["ck22"], "--tp", "1", "--pp", "1"]) == 1
    assert "exists and is not empty" in capsys.readouterr().err
    assert os.path.isdir(os.path.join(run["ck22"], "iter_0000010", "mp_rank_01_001"))


def test_trainer_optimizer_state_resharded_resume_is_exact(tmp_path):
    """AdamW state saved the trainer's way survives 1 -> 2x2 -> 1 bit for bit, its 2x2 shards hold
    the right slices, and one more step from the round-tripped state equals one more step from the
    original."""
    from hpcmeg.checkpoint.safe import capture_rng_state
    from hpcmeg.checkpoint.store import save_checkpoint
    from hpcmeg.megatron.args import make_checkpoint_dict, make_megatron_args
    from hpcmeg.megatron.layout import to_megatron_model
    from hpcmeg.train.optim import param_groups
    from helpers import POS, tiny_model

    def step(model, opt, tokens):
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    tokens = real_tokens(1, 17)
    m = tiny_model(3)
    opt = torch.optim.AdamW(param_groups(m, 0.1), lr=1e-3)
    step(m, opt, tokens)
    args = make_megatron_args(padded_vocab_size=m.cfg.padded_vocab_size, orig_vocab_size=VOCAB, hidden_size=H,
                              num_layers=LAYERS, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                              max_position_embeddings=POS)
    sched = {"max_lr": 1e-3, "lr_warmup_steps": 0, "num_steps": 16, "lr_decay_style": "constant", "lr_decay_steps": 16,
             "min_lr": 0.0, "start_wd": 0.1, "end_wd": 0.1, "wd_incr_style": "constant", "wd_incr_steps": 16}
    ck = make_checkpoint_dict(args=args, iteration=2, model=to_megatron_model(m.state_dict(), True, 1),
                              optimizer={"optimizer": opt.state_dict(), "grad_scaler": None}, opt_param_scheduler=sched,
                              rng_state=[capture_rng_state()], recipe=None)
    src, mid, back = (str(tmp_path / n) for n in ("src", "mid", "back"))
    save_checkpoint(src, 2, ck, tp_rank=0, pp_rank=0, tp_size=1, pp_size=1, is_shard_writer=True,
                    barrier=lambda: None, is_global_rank0=True)
    assert hpcmeg_main(["reshard", src, mid, "--tp", "2", "--pp", "2"]) == 0
    assert hpcmeg_main(["reshard", mid, back, "--tp", "1", "--pp", "1"]) == 0

    # the 2x2 shard (tp 1, pp 1) holds tp-rank 1's rows of layer 2's QKV moments as its layer 0
    st = shard(mid, 1, 1, 2, 2)
    inner = st["optimizer"]["optimizer"]
    qkv = dict(m.named_parameters())["encoder.layers.2.self_attention.query_key_value.weight"]
    qkv_idx = [i for i, p in enumerate(param_groups(m, 0.1)[0]["params"]) if p is qkv][0]
    full_m1 = opt.state_dict()["state"][qkv_idx]["exp_avg"]
    flat = from_megatron_model(st["model"])
    assert len(inner["param_groups"][0]["params"]) == sum(1 for v in flat.values() if v.ndim >= 2)
    got = [s["exp_avg"] for s in inner["state"].values() if s["exp_avg"].shape == (3 * H // 2, H)]
    assert sum(torch.equal(g, full_m1[3 * H // 2:]) for g in got) == 1
    assert st["rng_state"] is not None and st["opt_param_scheduler"] == sched and st["iteration"] == 2

    # round trip: identical optimizer state, and the resumed step is identical
    b = shard(back, 0, 0, 1, 1)
    o1, o2 = opt.state_dict(), b["optimizer"]["optimizer"]
    assert o1["param_groups"] == o2["param_groups"] and o1["state"].keys() == o2["state"].keys()
    for i in o1["state"]:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(torch.as_tensor(o1["state"][i][k]), torch.as_tensor(o2["state"][i][k])), (i, k)
    m2 = tiny_model(99)
    m2.load_state_dict(from_megatron_model(b["model"]))
    opt2 = torch.optim.AdamW(param_groups(m2, 0.1), lr=1e-3)
    opt2.load_state_dict(o2)
    step(m, opt, tokens)
    step(m2, opt2, tokens)
    for (n, p1), (_, p2) in zip(m.named_parameters(), m2.named_parameters()):
        assert torch.equal(p1, p2), n


def test_virtual_pipeline_checkpoint_round_trips_through_reshard_and_convert(run, tmp_path):
    """--pp 2 --vpp 2: each shard holds model0 and model1 (Megatron's interleaved checkpoint), chunk v of
    pipeline rank p = layers of virtual stage v*pp + p numbered from 0, the head copy in the last
    shard's last chunk; it converts to the same model and reshards back to the same weights."""
    v2 = str(tmp_path / "v2")
    assert hpcmeg_main(["reshard", run["ckpt"], v2, "--tp", "2", "--pp", "2", "--vpp", "2"]) == 0
    per = LAYERS // 4
    sd = run["model"].state_dict()
    for p in range(2):
        st = shard(v2, 0, p, 2, 2)
        assert "model" not in st and set(k for k in st if k.startswith("model")) == {"model0", "model1"}
        assert st["args"].virtual_pipeline_model_parallel_size == 2
        for v in range(2):
            enc = st[f"model{v}"]["language_model"]["encoder"]
            layers = sorted({int(k.split(".")[1]) for k in enc if k.startswith("layers.")})
            assert layers == list(range(per))  # chunk-local numbering
            g = (v * 2 + p) * per  # the chunk's first global layer
            want = sd[f"encoder.layers.{g}.mlp.dense_4h_to_h.weight"][:, :FFN // 2]
            assert torch.equal(enc["layers.0.mlp.dense_4h_to_h.weight"], want)
            assert ("embedding" in st[f"model{v}"]["language_model"]) == (p == 0 and v == 0)
            assert ("word_embeddings_for_head" in st[f"model{v}"]) == (p == 1 and v == 1)
            assert ("final_layernorm.weight" in enc) == (p == 1 and v == 1)
    full = load_full_checkpoint(v2)
    assert full.vpp == 2 and (full.tp, full.pp) == (2, 2)
    hf = str(tmp_path / "hf")
    assert hpcmeg_main(["convert", v2, hf]) == 0
    tokens = real_tokens()
    with torch.no_grad():
        ref = run["model"](tokens)[..., :VOCAB]
    from helpers import hf_logits

    assert rel_err(hf_logits(hf, tokens), ref) < 1e-5
    back = str(tmp_path / "back")
    assert hpcmeg_main(["reshard", v2, back, "--tp", "1", "--pp", "1"]) == 0
    assert_same_model(run["ckpt"], back)
