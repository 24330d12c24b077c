"""GPT-2 written for one device, with Megatron-LM legacy parameter names and layouts.

Contract:
  GPT(cfg).forward(tokens [b, s] int64, labels [b, s] int64 | None = None, position_ids=None)
    labels None -> logits [b, s, padded_vocab_size] (autocast dtype or fp32)
    labels given -> per-token cross-entropy float32 [b, s] (the caller masks and averages)
  Architecture: learned absolute positions, pre-LayerNorm, tanh-GELU MLP, output layer tied to
  embedding.word_embeddings.weight, dropout on embeddings / residual branches / attention probs.
  state_dict keys are exactly Megatron's legacy flat keys (docs/megatron-interop.md section 6.3):
    embedding.word_embeddings.weight [V_pad, h], embedding.position_embeddings.weight [max_pos, h],
    encoder.layers.{i}.{input_layernorm, self_attention.query_key_value, self_attention.dense,
    post_attention_layernorm, mlp.dense_h_to_4h, mlp.dense_4h_to_h}.{weight, bias},
    encoder.final_layernorm.{weight, bias}; no buffers.
  query_key_value rows are in checkpoint_version-2 order: for each head, its q rows, k rows,
  v rows ([heads, 3, head_dim] flattened), so the output is viewed as [.., heads, 3*head_dim].
  Under autocast the residual stream is in the autocast dtype unless cfg.fp32_residual_connection.
  Init: N(0, std) weights, std/sqrt(2*num_layers) for the two output projections, zero biases,
  LayerNorm ones/zeros; deterministic under torch.manual_seed.
Parallelism is applied from outside (hpcmeg/parallel); this file knows nothing of ranks.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpcmeg.model import fused as fused_ops
from hpcmeg.model import ops as plain_ops
from hpcmeg.model.config import GPTConfig


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.padded_vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.p = cfg.hidden_dropout

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(tokens) + self.position_embeddings(position_ids)
        return F.dropout(x, p=self.p, training=self.training)


class SelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.query_key_value = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.p = cfg.attention_dropout
        self.fused, self.backend = cfg.fused, cfg.attention_backend

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [b, s, h] -> (dense output without its bias [b, s, h], dense bias [h])."""
        b, s, _ = x.shape
        qkv = self.query_key_value(x).view(b, s, self.heads, 3 * self.head_dim)
        q, k, v = qkv.split(self.head_dim, dim=-1)  # per-head [q, k, v] rows (Megatron v2 layout)
        if self.fused:
            ctx = fused_ops.causal_attention(q, k, v, self.p, self.training, self.backend)
        else:
            ctx = plain_ops.causal_attention(q, k, v, self.p, self.training)
        # bias returned separately so it fuses into the bias-dropout-add that follows
        return F.linear(ctx.reshape(b, s, -1), self.dense.weight), self.dense.bias


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size)
        self.dense_4h_to_h = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size)
        self.ops = fused_ops if cfg.fused else plain_ops

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.ops.linear_bias_gelu(x, self.dense_h_to_4h.weight, self.dense_h_to_4h.bias)
        return F.linear(h, self.dense_4h_to_h.weight), self.dense_4h_to_h.bias


class TransformerLayer(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.self_attention = SelfAttention(cfg)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.mlp = MLP(cfg)
        self.p, self.eps = cfg.hidden_dropout, cfg.layernorm_epsilon
        self.ops = fused_ops if cfg.fused else plain_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ln1, ln2w = self.input_layernorm, self.post_attention_layernorm
        attn, attn_bias = self.self_attention(self.ops.layer_norm(x, ln1.weight, ln1.bias, self.eps))
        x, h = self.ops.bias_dropout_add_layer_norm(attn, attn_bias, x, self.p, self.training,
                                                    ln2w.weight, ln2w.bias, self.eps)
        out, out_bias = self.mlp(h)
        return self.ops.bias_dropout_add(out, out_bias, x, self.p, self.training)


class Encoder(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_layers))
        self.final_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.ops = fused_ops if cfg.fused else plain_ops
        self.eps = cfg.layernorm_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        ln = self.final_layernorm
        return self.ops.layer_norm(x, ln.weight, ln.bias, self.eps)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embedding = Embedding(cfg)
        self.encoder = Encoder(cfg)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Megatron init, in named_parameters order so it is deterministic under a seed."""
        std = self.cfg.init_method_std
        out_std = std / math.sqrt(2.0 * self.cfg.num_layers)
        for name, p in self.named_parameters():
            if "layernorm" in name:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.zero_()
            elif name.endswith(("self_attention.dense.weight", "mlp.dense_4h_to_h.weight")):
                p.normal_(0.0, out_std)
            else:
                p.normal_(0.0, std)

    def num_params(self, exclude_position_embeddings: bool = False) -> int:
        """Parameter count, the tied embedding/output matrix counted once."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_position_embeddings:
            n -= self.embedding.position_embeddings.weight.numel()
        return n

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        s = tokens.shape[1]
        if s > self.cfg.max_position_embeddings:
            raise ValueError(f"GPT.forward: sequence length {s} > max_position_embeddings="
                             f"{self.cfg.max_position_embeddings}; shorten the sequence or raise the config")
        if position_ids is None:
            position_ids = torch.arange(s, device=tokens.device).unsqueeze(0)
        x = self.embedding(tokens, position_ids)
        dev = tokens.device.type
        if not self.cfg.fp32_residual_connection and torch.is_autocast_enabled(dev):
            x = x.to(torch.get_autocast_dtype(dev))  # bf16 residual stream (Megatron's default)
        h = self.encoder(x)
        w = self.embedding.word_embeddings.weight  # tied output layer
        if labels is None:
            return F.linear(h, w)
        if self.cfg.fused:
            return fused_ops.linear_cross_entropy(h, w, labels, impl=self.cfg.fused_ce)
        return plain_ops.linear_cross_entropy(h, w, labels)
