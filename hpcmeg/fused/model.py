"""The fused path: a plain GPT (hpcmeg/model/gpt.py) turned, module by module, into the fast one.

Contract:
  build_gpt(cfg, **GPT kwargs) -> GPT: the plain model, fused in place when cfg.fused. Every caller
    that builds a model for training or measuring builds it here.
  fuse(model) -> model: swaps each module of a GPT (or a pipeline chunk of one) for its fused twin
    below, in place. The twins subclass the plain modules and only replace `forward` (and the
    attention's `attend`), so the parameters, state_dict keys, hooks and attributes another wrapper
    put on a module stay as they are (FSDP2's fully_shard swaps module classes the same way). Call
    it before tensor parallelism wraps `forward`/`attend` of the layers, as hpcmeg/train/rank_model.py
    and hpcmeg/parallel/pipeline/stages.py do.
What the twins add, each from hpcmeg/fused/ops.py (kernels: hpcmeg/kernels/):
  * every linear layer and the word embedding through hpcmeg/fused/wgrad.py: with a main-grad sink
    attached from outside (gradient-accumulation fusion: build_optimizer's wgrad_fusion), the
    weight-gradient GEMM accumulates into the fp32 main grad itself;
  * attention: cfg.attention_backend (the Triton kernels, or an SDPA backend); with the Triton
    kernels the QKV bias is added detached and its gradient comes from the attention backward's
    own row sums, so the QKV linear's backward does not re-read dqkv;
  * MLP: the GELU kernels, the bias in the GEMM; the first cfg.recompute_gelu_layers layers of the
    chunk recompute their GELU output in the backward (a memory trade-off);
  * each residual branch ends with one bias-dropout-add + LayerNorm op: the attention branch with the
    layer's post-attention LayerNorm, the MLP branch with the LayerNorm that follows it (the next
    layer's input LayerNorm, or the final one), so the encoder hands each layer the stream and its
    normalised copy, and the only stand-alone LayerNorm is layer 0's;
  * the LM head: the loss of cfg.fused_ce (hpcmeg/fused/linear_ce.py), never fp32 logits for the
    whole batch; FusedGPT.forward takes the per-token loss weights that 'backward_in_forward' needs.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from hpcmeg.fused import ops as fused_ops
from hpcmeg.fused import wgrad
from hpcmeg.model import gpt
from hpcmeg.model.config import GPTConfig


class FusedEmbedding(gpt.Embedding):
    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        we = self.word_embeddings  # nn.Embedding, or tensor parallelism's vocabulary-parallel one
        sink = wgrad.layer_sink(we)
        x = (wgrad.embedding(tokens, we.weight, sink) if sink else we(tokens)) + self.position_embeddings(position_ids)
        return fused_ops.dropout(x, self.dropout.p, self.training)


class FusedSelfAttention(gpt.SelfAttention):
    backend: str = "auto"  # cfg.attention_backend, set by fuse()

    def attend(self, qkv: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """As the plain attend; bias: the QKV bias when qkv holds it detached (the Triton attention
        returns its gradient: fused_ops.causal_attention_qkv)."""
        return fused_ops.causal_attention_qkv(qkv, self.dropout_p, self.training, self.backend, bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        qkv_lin = self.query_key_value
        split = self.backend == "triton" and torch.is_grad_enabled() and qkv_lin.bias is not None
        qkv = wgrad.linear(x, qkv_lin.weight, qkv_lin.bias.detach() if split else qkv_lin.bias,
                           wgrad.layer_sink(qkv_lin))
        ctx = self.attend(qkv.view(b, s, -1, 3 * self.head_dim), qkv_lin.bias if split else None)
        out = wgrad.linear(ctx.reshape(b, s, -1), self.dense.weight, None, wgrad.layer_sink(self.dense))
        return out, self.dense.bias


class FusedMLP(gpt.MLP):
    recompute_gelu: bool = False  # set by fuse()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fc1, fc2 = self.dense_h_to_4h, self.dense_4h_to_h
        sinks = (wgrad.layer_sink(fc1), wgrad.layer_sink(fc2))
        kw = {"sink1": sinks[0], "sink2": sinks[1]} if any(sinks) else {}
        if self.recompute_gelu:
            kw["recompute_gelu"] = True
        return fused_ops.mlp(x, fc1.weight, fc1.bias, fc2.weight, **kw), fc2.bias


class FusedTransformerLayer(gpt.TransformerLayer):
    def forward(self, x: torch.Tensor, h: torch.Tensor | None = None,
                next_norm: nn.LayerNorm | None = None, stream_used: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [b, s, hidden]: the residual stream -> (the stream after this layer, next_norm of it or
        None). h: input_layernorm(x) when the layer before computed it, else None (computed here).
        next_norm: the LayerNorm that follows this layer (fused into the MLP branch's end).
        stream_used False: the caller uses the returned stream only through next_norm (the last
        layer before the final LayerNorm), so it needs no gradient of its own."""
        ln1, ln2, p = self.input_layernorm, self.post_attention_layernorm, self.dropout.p
        if h is None:
            h = fused_ops.layer_norm(x, ln1.weight, ln1.bias, ln1.eps)
        attn, attn_bias = self.self_attention(h)
        x, h = fused_ops.bias_dropout_add_layer_norm(attn, attn_bias, x, p, self.training,
                                                     ln2.weight, ln2.bias, ln2.eps)
        out, out_bias = self.mlp(h)
        if next_norm is None:
            return fused_ops.bias_dropout_add(out, out_bias, x, p, self.training), None
        return fused_ops.bias_dropout_add_layer_norm(out, out_bias, x, p, self.training, next_norm.weight,
                                                     next_norm.bias, next_norm.eps, out_grad=stream_used)


class FusedEncoder(gpt.Encoder):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(*self.run_layers(x, None, 0, len(self.layers)))

    def run_layers(self, x: torch.Tensor, h, start: int, stop: int):
        # each layer ends with the LayerNorm that follows it, so it hands on both the residual
        # stream x and that LayerNorm's output h (the final LayerNorm's after the last layer)
        n = len(self.layers)
        for i in range(start, stop):
            last = i + 1 == n
            x, h = self.layers[i](x, h, self.final_layernorm if last else self.layers[i + 1].input_layernorm,
                                  stream_used=not last)
        return x, h

    def finish(self, x: torch.Tensor, h) -> torch.Tensor:
        ln = self.final_layernorm
        if ln is None:
            return x
        return h if h is not None else fused_ops.layer_norm(x, ln.weight, ln.bias, ln.eps)  # no layers


class FusedLMHead(gpt.LMHead):
    impl: str = "grad_in_forward"  # cfg.fused_ce, set by fuse()

    def forward(self, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor | None, sink=None,
                loss_weights: torch.Tensor | None = None) -> torch.Tensor:
        """sink: the tied weight's main-grad sink (FusedGPT.sinkable_weights). loss_weights [b, s]:
        d total / d loss per token, which the caller will backpropagate ('backward_in_forward')."""
        if labels is None:
            return wgrad.linear(h, weight, None, sink)
        return fused_ops.linear_cross_entropy(h, weight, labels, impl=self.impl, sink=sink,
                                              loss_weights=loss_weights)


class FusedGPT(gpt.GPT):
    def forward(self, tokens: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, hidden_states: torch.Tensor | None = None,
                loss_weights: torch.Tensor | None = None) -> torch.Tensor:
        """GPT.forward; loss_weights [b, s]: d total / d loss that the caller will backpropagate, for
        a FusedLMHead with fused_ce 'backward_in_forward'; other heads ignore it, which is always
        correct. A sunk tied weight takes its output-layer gradient into the same main grad."""
        x = self.embed(tokens, position_ids) if self.embedding is not None else hidden_states
        h = self.encoder(x)
        if self.head is None:
            return h
        kw = {}
        if type(self.head) is FusedLMHead:
            if loss_weights is not None:
                kw["loss_weights"] = loss_weights
            sink = wgrad.layer_sink(self.embedding.word_embeddings) if self.embedding is not None else None
            if sink:
                kw["sink"] = sink
        return self.head(h, self.output_weight(), labels, **kw)

    def sinkable_weights(self) -> list[torch.Tensor]:
        """The weights whose every use can add its gradient straight into a main-grad sink: every
        nn.Linear's, and the word embedding when it is a plain nn.Embedding and its tied output
        layer here is a FusedLMHead (every fused loss takes a sink)."""
        out = [m.weight for m in self.modules() if isinstance(m, nn.Linear)]
        if (self.embedding is not None and type(self.embedding.word_embeddings) is nn.Embedding
                and type(self.head) is FusedLMHead):
            out.append(self.embedding.word_embeddings.weight)
        return out


_TWINS = {gpt.Embedding: FusedEmbedding, gpt.SelfAttention: FusedSelfAttention, gpt.MLP: FusedMLP,
          gpt.TransformerLayer: FusedTransformerLayer, gpt.Encoder: FusedEncoder,
          gpt.LMHead: FusedLMHead, gpt.GPT: FusedGPT}


def fuse(model: gpt.GPT) -> gpt.GPT:
    """The GPT (or pipeline chunk) `model`, its modules swapped for their fused twins in place."""
    cfg = model.cfg
    for module in model.modules():
        twin = _TWINS.get(type(module))
        if twin is not None:
            module.__class__ = twin
    for i, layer in enumerate(model.encoder.layers):
        layer.self_attention.backend = cfg.attention_backend
        # the first cfg.recompute_gelu_layers layers of this chunk
        layer.mlp.recompute_gelu = i < cfg.recompute_gelu_layers
    if type(model.head) is FusedLMHead:
        model.head.impl = cfg.fused_ce
    return model


def build_gpt(cfg: GPTConfig, **kwargs) -> gpt.GPT:
    """GPT(cfg, **kwargs), fused when cfg.fused."""
    model = gpt.GPT(cfg, **kwargs)
    return fuse(model) if cfg.fused else model
