"""The fused model as the trainer runs it (main-grad sinks on every weight, wgrad.py) traces into
torch.compile without a graph break, for each choice of the fused path. A graph break splits the
step into several compiled graphs and CUDA graphs with eager Python between them (an
autograd.Function that gets the one main-grad buffer twice is one: Dynamo does not trace it, and a
sunk weight then gets a .grad). Dynamo decides breaks before any backend, so the test compiles with
backend 'eager'."""
from __future__ import annotations

import pytest
import torch

from hpcmeg.model.config import GPTConfig
from hpcmeg.fused.model import build_gpt
from hpcmeg.train.optim import AdamWConfig, build_optimizer


@pytest.mark.parametrize("kw", [{}, {"attention_backend": "triton"}, {"recompute_gelu_layers": 1},
                                {"fused_ce": "backward_in_forward"}, {"hidden_dropout": 0.1}],
                         ids=["shipped", "triton_attention", "recompute_gelu", "backward_in_forward", "dropout"])
def test_the_sunk_fused_model_has_no_graph_break(kw):
    from torch._dynamo.utils import counters
    cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                    max_position_embeddings=64, padded_vocab_size=128, fused=True, **kw)
    m = build_gpt(cfg, init_seed=3)
    buf, _ = build_optimizer(m, AdamWConfig(1e-3), bucket_numel=5000, wgrad_fusion=True)
    assert buf.is_sunk(m.encoder.layers[0].mlp.dense_h_to_4h.weight)
    tok = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    counters.clear()
    loss = torch.compile(m, backend="eager")(tok, tok, loss_weights=torch.full((2, 64), 1 / 128))
    (loss / 128).sum().backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert buf.grad_data.abs().sum() > 0
