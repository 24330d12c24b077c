"""GPT model: Megatron legacy names/shapes, per-head QKV row order, init, tying, determinism."""
import math

import pytest
import torch
import torch.nn.functional as F

from hpcmeg.megatron.layout import pad_vocab_size
from hpcmeg.model.config import GPTConfig
from hpcmeg.fused.model import build_gpt


def tiny(**kw):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                max_position_embeddings=32, padded_vocab_size=128)
    base.update(kw)
    return GPTConfig(**base)


def test_pad_vocab_size():
    assert pad_vocab_size(50257) == 50304
    assert pad_vocab_size(50257, tp=2) == 50432
    assert pad_vocab_size(128) == 128
    with pytest.raises(ValueError):
        pad_vocab_size(0)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="not divisible"):
        tiny(hidden_size=66)
    with pytest.raises(ValueError, match="attention_backend"):
        tiny(attention_backend="xformers")


def test_state_dict_keys_and_shapes_are_megatron_legacy():
    cfg = tiny()
    sd = build_gpt(cfg).state_dict()
    h, f = 64, 256
    want = {"embedding.word_embeddings.weight": (128, h), "embedding.position_embeddings.weight": (32, h),
            "encoder.final_layernorm.weight": (h,), "encoder.final_layernorm.bias": (h,)}
    for i in range(2):
        p = f"encoder.layers.{i}."
        want.update({p + "input_layernorm.weight": (h,), p + "input_layernorm.bias": (h,),
                     p + "self_attention.query_key_value.weight": (3 * h, h),
                     p + "self_attention.query_key_value.bias": (3 * h,),
                     p + "self_attention.dense.weight": (h, h), p + "self_attention.dense.bias": (h,),
                     p + "post_attention_layernorm.weight": (h,), p + "post_attention_layernorm.bias": (h,),
                     p + "mlp.dense_h_to_4h.weight": (f, h), p + "mlp.dense_h_to_4h.bias": (f,),
                     p + "mlp.dense_4h_to_h.weight": (h, f), p + "mlp.dense_4h_to_h.bias": (h,)})
    assert {k: tuple(v.shape) for k, v in sd.items()} == want
    assert list(build_gpt(cfg).buffers()) == []


def test_gpt2_124m_parameter_count():
    with torch.device("meta"):
        m = build_gpt(GPTConfig(12, 768, 12, 3072, 1024, pad_vocab_size(50257)))
    # V*h + P*h + L*(12h^2 + 13h) + 2h, tied output matrix counted once
    assert m.num_params() == 50304 * 768 + 1024 * 768 + 12 * (12 * 768 ** 2 + 13 * 768) + 2 * 768 == 124_475_904


@pytest.mark.parametrize("fused", [False, True])
def test_qkv_rows_are_per_head_q_k_v(fused):
    """Hand-check: head h's q rows are [h*3*hd, h*3*hd+hd), then its k rows, then its v rows."""
    cfg = tiny(num_layers=1, hidden_dropout=0.0, attention_dropout=0.0, fused=fused)
    torch.manual_seed(0)
    attn = build_gpt(cfg).encoder.layers[0].self_attention.eval()
    with torch.no_grad():
        attn.query_key_value.bias.normal_()
    x = torch.randn(2, 9, 64)
    W, B = attn.query_key_value.weight, attn.query_key_value.bias
    hd, heads = 16, 4
    outs = []
    for h in range(heads):
        r = h * 3 * hd
        q, k, v = (x @ W[r + j * hd: r + (j + 1) * hd].T + B[r + j * hd: r + (j + 1) * hd] for j in range(3))
        s = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        s = s.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(s.softmax(-1) @ v)
    want = torch.cat(outs, -1) @ attn.dense.weight.T
    got, bias = attn(x)
    # the written-out attention against the module's fused QKV GEMM and SDPA (tests/TOLERANCES.md, case 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert bias is attn.dense.bias


def test_init_is_megatron_and_deterministic():
    cfg = tiny(num_layers=4, hidden_size=256, ffn_hidden_size=1024, padded_vocab_size=512)
    torch.manual_seed(1); a = build_gpt(cfg)
    torch.manual_seed(1); b = build_gpt(cfg)
    for (n, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), n
    sd = a.state_dict()
    assert abs(sd["encoder.layers.0.mlp.dense_h_to_4h.weight"].std().item() - 0.02) < 1e-3
    out_std = 0.02 / math.sqrt(2 * 4)
    assert abs(sd["encoder.layers.3.mlp.dense_4h_to_h.weight"].std().item() - out_std) < 5e-4
    assert abs(sd["encoder.layers.1.self_attention.dense.weight"].std().item() - out_std) < 5e-4
    assert abs(sd["embedding.word_embeddings.weight"].std().item() - 0.02) < 1e-3
    assert torch.all(sd["encoder.layers.2.self_attention.query_key_value.bias"] == 0)
    assert torch.all(sd["encoder.final_layernorm.weight"] == 1)
    assert torch.all(sd["encoder.layers.0.post_attention_layernorm.bias"] == 0)


@pytest.mark.parametrize("fused", [False, True])
def test_forward_shapes_tying_and_loss(fused):
    cfg = tiny(fused=fused)
    torch.manual_seed(0); m = build_gpt(cfg).eval()
    x = torch.randint(0, 100, (3, 20)); y = torch.randint(0, 128, (3, 20))
    logits = m(x)
    assert logits.shape == (3, 20, 128)
    loss = m(x, y)
    assert loss.dtype == torch.float32 and loss.shape == (3, 20)
    ref = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(3, 20)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)  # another CE implementation: case 2 (tests/TOLERANCES.md)
    # tied output layer: the logits are hidden @ word_embeddings^T, so a change of one
    # embedding row of a token absent from x moves that logit column only
    with torch.no_grad():
        m.embedding.word_embeddings.weight[117] += torch.randn(64)  # not a constant: LN output sums to 0
    changed = (m(x) - logits).abs().amax(dim=(0, 1)) > 1e-4
    assert changed[117] and changed.sum() == 1
    # near-uniform start: loss ~ ln(V)
    assert abs(loss.mean().item() - math.log(128)) < 0.3


def test_position_ids_and_too_long_input():
    m = build_gpt(tiny(hidden_dropout=0.0, attention_dropout=0.0)).eval()
    x = torch.randint(0, 128, (1, 8))
    torch.testing.assert_close(m(x, position_ids=torch.arange(8)[None]), m(x))  # the same positions: case 1
    assert not torch.allclose(m(x, position_ids=torch.arange(8, 16)[None]), m(x))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        m(torch.zeros(1, 33, dtype=torch.long))


@pytest.mark.parametrize("fp32_res", [False, True])
def test_residual_stream_dtype_under_autocast(fp32_res):
    """Megatron semantics: bf16 residual stream under bf16 autocast unless fp32_residual_connection."""
    m = build_gpt(tiny(fused=True, fp32_residual_connection=fp32_res))
    seen = []
    m.encoder.layers[1].register_forward_hook(lambda mod, inp, out: seen.append((inp[0].dtype, out[0].dtype)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = m(torch.randint(0, 128, (2, 8)), torch.randint(0, 128, (2, 8)))
    want = torch.float32 if fp32_res else torch.bfloat16
    assert seen == [(want, want)] and loss.dtype == torch.float32


def test_init_on_threads_is_the_serial_init(monkeypatch):
    """GPT.reset_parameters draws the parameters on several threads: every value is init_value's
    for its (seed, name), the parameters stay leaves that require grad, and one thread gives the
    same model."""
    import concurrent.futures

    import hpcmeg.model.gpt as gpt_module
    from hpcmeg.model.init import init_value
    pools = []

    class Pool(concurrent.futures.ThreadPoolExecutor):
        def __init__(self, workers):
            pools.append(workers)
            super().__init__(workers)

    monkeypatch.setattr(gpt_module.concurrent.futures, "ThreadPoolExecutor", Pool)
    monkeypatch.setattr(gpt_module.torch, "get_num_threads", lambda: 8)  # a CI machine may give 1
    cfg = tiny(num_layers=4, vocab_size=100)
    threaded = build_gpt(cfg, init_seed=7)
    assert pools == [gpt_module.INIT_THREADS] and gpt_module.INIT_THREADS > 1
    for name, p in threaded.named_parameters():
        assert p.requires_grad and p.grad_fn is None, name
        assert torch.equal(p, init_value(name, p.shape, cfg, 7)), name
    monkeypatch.setattr(gpt_module, "INIT_THREADS", 1)
    serial = build_gpt(cfg, init_seed=7).state_dict()
    for name, t in threaded.state_dict().items():
        assert torch.equal(t, serial[name]), name


def test_init_is_the_same_whatever_the_layout():
    """Each parameter comes from its own (seed, global name) generator: a pipeline chunk holds exactly
    its layers of the whole model, real vocabulary rows ignore the padding, the head copy of a last
    stage starts equal to the embedding."""
    cfg = tiny(num_layers=4, vocab_size=100)
    full = build_gpt(cfg, init_seed=7).state_dict()
    assert torch.equal(build_gpt(cfg, init_seed=7).state_dict()["encoder.layers.3.mlp.dense_4h_to_h.weight"],
                       full["encoder.layers.3.mlp.dense_4h_to_h.weight"])
    assert not torch.equal(build_gpt(cfg, init_seed=8).state_dict()["encoder.layers.3.mlp.dense_4h_to_h.weight"],
                           full["encoder.layers.3.mlp.dense_4h_to_h.weight"])
    last = build_gpt(cfg, layers=range(2, 4), pre_process=False, init_seed=7)
    sd = last.state_dict()
    assert "embedding.word_embeddings.weight" not in sd and "encoder.final_layernorm.weight" in sd
    for k in ("self_attention.query_key_value.weight", "mlp.dense_h_to_4h.weight"):
        assert torch.equal(sd[f"encoder.layers.0.{k}"], full[f"encoder.layers.2.{k}"])
        assert torch.equal(sd[f"encoder.layers.1.{k}"], full[f"encoder.layers.3.{k}"])
    assert torch.equal(sd["word_embeddings_for_head.weight"], full["embedding.word_embeddings.weight"])
    first = build_gpt(cfg, layers=range(0, 2), post_process=False, init_seed=7).state_dict()
    assert "encoder.final_layernorm.weight" not in first and "word_embeddings_for_head.weight" not in first
    wider = build_gpt(tiny(num_layers=4, vocab_size=100, padded_vocab_size=256), init_seed=7).state_dict()
    assert torch.equal(wider["embedding.word_embeddings.weight"][:100], full["embedding.word_embeddings.weight"][:100])
    # a chunk is single-device code too: hidden states in, hidden states out (no output layer)
    mid = build_gpt(cfg, layers=range(1, 3), pre_process=False, post_process=False, init_seed=7)
    x = torch.randn(2, 5, 64)
    assert mid(hidden_states=x).shape == (2, 5, 64)
