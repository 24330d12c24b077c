"""GPT-2 written for one device, with Megatron-LM legacy parameter names and layouts.

Contract:
  GPT(cfg).forward(tokens [b, s] int64, labels [b, s] int64 | None = None, position_ids=None)
    labels None -> logits [b, s, padded_vocab_size] (autocast dtype or fp32)
    labels given -> per-token cross-entropy float32 [b, s] (the caller masks and averages)
  Architecture: learned absolute positions, pre-LayerNorm, tanh-GELU MLP, output layer tied to
  embedding.word_embeddings.weight, dropout on embeddings / residual branches / attention probs.
  A pipeline chunk is the same class with parts left out (Megatron's pre/post process): GPT(cfg,
  layers=range(a, b), pre_process=False, post_process=True) holds global layers a..b-1 as local
  layers 0..b-a-1, takes `hidden_states` [b, s, h] instead of tokens, and (last stage without the
  embedding) its own copy of the tied output weight as word_embeddings_for_head.weight.
  state_dict keys are exactly Megatron's legacy flat keys (docs/megatron-interop.md section 6.3):
    embedding.word_embeddings.weight [V_pad, h], embedding.position_embeddings.weight [max_pos, h],
    encoder.layers.{i}.{input_layernorm, self_attention.query_key_value, self_attention.dense,
    post_attention_layernorm, mlp.dense_h_to_4h, mlp.dense_4h_to_h}.{weight, bias},
    encoder.final_layernorm.{weight, bias}; no buffers of its own (the trainer may attach a
    non-persistent `main_grad_sink` to each nn.Linear and to the word embedding, sinkable_weights():
    gradient-accumulation fusion, wgrad.attach_sinks).
  query_key_value rows are in checkpoint_version-2 order: for each head, its q rows, k rows,
  v rows ([heads, 3, head_dim] flattened), so the output is viewed as [.., heads, 3*head_dim].
  Under autocast the residual stream is in the autocast dtype unless cfg.fp32_residual_connection.
  Init: Megatron's rules (hpcmeg/model/init.py), each parameter from a generator keyed by
  (init_seed, its global name), so every layout starts from slices of the same values;
  init_seed None draws one from torch's global RNG (deterministic under torch.manual_seed).
Parallelism is applied from outside (hpcmeg/parallel); this file knows nothing of ranks. Its seams
for that: attention heads follow from the QKV weight's rows (a TP shard holds whole heads), the
attention core is the `attend` method, and the output layer is the `head` module.
"""
from __future__ import annotations

import concurrent.futures

import torch
import torch.nn as nn

from hpcmeg.model import fused as fused_ops
from hpcmeg.model import ops as plain_ops
from hpcmeg.model import wgrad
from hpcmeg.model.config import GPTConfig
from hpcmeg.model.init import init_value


# how many parameters GPT.reset_parameters draws at once, on as many threads: the extra host memory
# per rank is at most this many full parameter tensors
INIT_THREADS = 4


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.padded_vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.p = cfg.hidden_dropout
        self.ops = fused_ops if cfg.fused else plain_ops

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        we = self.word_embeddings  # nn.Embedding, or tensor parallelism's vocabulary-parallel one
        sink = wgrad.layer_sink(we)
        x = (wgrad.embedding(tokens, we.weight, sink) if sink else we(tokens)) + self.position_embeddings(position_ids)
        return self.ops.dropout(x, self.p, self.training)


class SelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.query_key_value = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.head_dim = cfg.head_dim
        self.p = cfg.attention_dropout
        self.fused, self.backend = cfg.fused, cfg.attention_backend

    def attend(self, qkv: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The attention core: qkv [b, s, heads, 3 * head_dim] (per head its q, k, v rows, Megatron
        v2 layout) -> [b, s, heads, head_dim] (its dropout is the only RNG use). bias: the QKV bias
        when qkv holds it detached (fused Triton attention returns its gradient; fused.causal_attention_qkv)."""
        if self.fused:
            return fused_ops.causal_attention_qkv(qkv, self.p, self.training, self.backend, bias)
        q, k, v = qkv.split(self.head_dim, dim=-1)
        return plain_ops.causal_attention(q, k, v, self.p, self.training)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [b, s, h] -> (dense output without its bias [b, s, h_out], dense bias [h_out])."""
        b, s, _ = x.shape
        # heads from the weight's rows: a tensor-parallel shard holds whole heads
        qkv_lin = self.query_key_value
        # Triton attention sums the QKV bias gradient inside its backward kernels: the GEMM adds the
        # bias detached, so the linear's backward does not re-read dqkv for it
        split = self.fused and self.backend == "triton" and torch.is_grad_enabled() and qkv_lin.bias is not None
        qkv = wgrad.linear(x, qkv_lin.weight, qkv_lin.bias.detach() if split else qkv_lin.bias,
                           wgrad.layer_sink(qkv_lin))
        # per-head [q, k, v] rows
        ctx = self.attend(qkv.view(b, s, -1, 3 * self.head_dim), qkv_lin.bias if split else None)
        # bias returned separately so it fuses into the bias-dropout-add that follows
        out = wgrad.linear(ctx.reshape(b, s, -1), self.dense.weight, None, wgrad.layer_sink(self.dense))
        return out, self.dense.bias


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, recompute_gelu: bool = False):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size)
        self.dense_4h_to_h = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size)
        self.ops = fused_ops if cfg.fused else plain_ops
        # (the plain twin saves what autograd saves)
        self.gelu_kw = {"recompute_gelu": True} if cfg.fused and recompute_gelu else {}

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [b, s, h] -> (the output without its bias [b, s, h], the output bias [h])."""
        fc1, fc2 = self.dense_h_to_4h, self.dense_4h_to_h
        sinks = (wgrad.layer_sink(fc1), wgrad.layer_sink(fc2))  # only a fused model gets sinks: fused.mlp takes them
        kw = {"sink1": sinks[0], "sink2": sinks[1]} if any(sinks) else {}
        return self.ops.mlp(x, fc1.weight, fc1.bias, fc2.weight, **kw, **self.gelu_kw), fc2.bias


class TransformerLayer(nn.Module):
    def __init__(self, cfg: GPTConfig, recompute_gelu: bool = False):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.self_attention = SelfAttention(cfg)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.mlp = MLP(cfg, recompute_gelu)
        self.p, self.eps = cfg.hidden_dropout, cfg.layernorm_epsilon
        self.ops = fused_ops if cfg.fused else plain_ops

    def forward(self, x: torch.Tensor, h: torch.Tensor | None = None,
                next_norm: tuple[torch.Tensor, torch.Tensor] | None = None, stream_used: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [b, s, hidden]: the residual stream -> (the stream after this layer, next_norm's
        LayerNorm of it or None). h: input_layernorm(x) when the layer before computed it (fused
        with its closing bias-dropout-add), else None (computed here). next_norm: (weight, bias) of
        the LayerNorm that follows (the next layer's input_layernorm or the final one): the closing
        bias-dropout-add and that LayerNorm are one op, as the attention branch's and
        post_attention_layernorm always were, so the fused path's backward of the MLP branch end is
        the one LayerNorm pass of hpcmeg/kernels/layernorm.py too (mask, residual gradient and bias gradient
        included) instead of separate dropout-backward and bias-sum kernels. stream_used False: the
        caller uses the returned stream only through next_norm (the last layer before the final
        LayerNorm), so it needs no gradient of its own."""
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        if h is None:
            h = self.ops.layer_norm(x, ln1.weight, ln1.bias, self.eps)
        attn, attn_bias = self.self_attention(h)
        x, h = self.ops.bias_dropout_add_layer_norm(attn, attn_bias, x, self.p, self.training,
                                                    ln2.weight, ln2.bias, self.eps)
        out, out_bias = self.mlp(h)
        if next_norm is None:
            return self.ops.bias_dropout_add(out, out_bias, x, self.p, self.training), None
        return self.ops.bias_dropout_add_layer_norm(out, out_bias, x, self.p, self.training, *next_norm, self.eps,
                                                    out_grad=stream_used)


class Encoder(nn.Module):
    def __init__(self, cfg: GPTConfig, n_layers: int, final_layernorm: bool = True):
        super().__init__()
        # the first cfg.recompute_gelu_layers of this stage recompute their GELU output in the backward
        self.layers = nn.ModuleList(TransformerLayer(cfg, i < cfg.recompute_gelu_layers) for i in range(n_layers))
        self.final_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon) if final_layernorm else None
        self.ops = fused_ops if cfg.fused else plain_ops
        self.eps = cfg.layernorm_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # each layer ends with the LayerNorm that follows it (the next layer's input one, or the
        # final one), so it hands on both the residual stream x and that LayerNorm's output h
        h = None
        for i, layer in enumerate(self.layers):
            last = i + 1 == len(self.layers)
            nxt = self.final_layernorm if last else self.layers[i + 1].input_layernorm
            x, h = layer(x, h, None if nxt is None else (nxt.weight, nxt.bias), stream_used=not last)
        ln = self.final_layernorm
        if ln is None:
            return x
        return h if h is not None else self.ops.layer_norm(x, ln.weight, ln.bias, self.eps)


class LMHead(nn.Module):
    """The output layer: logits, or the per-token loss, of the final hidden state against the (tied)
    output weight it is given. No parameters of its own (the weight is the word embedding's, or the
    last pipeline stage's copy); tensor parallelism swaps in a vocabulary-parallel one."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fused, self.impl = cfg.fused, cfg.fused_ce

    def forward(self, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor | None, sink=None,
                loss_weights: torch.Tensor | None = None) -> torch.Tensor:
        """sink: the weight's main-grad sink when it is a sunk weight (GPT.sinkable_weights).
        loss_weights [b, s]: d total / d loss per token, which the caller will backpropagate (used by
        fused_ce 'backward_in_forward' only; fused_ce.linear_cross_entropy)."""
        if labels is None:
            return wgrad.linear(h, weight, None, sink)
        if self.fused:
            return fused_ops.linear_cross_entropy(h, weight, labels, impl=self.impl, sink=sink,
                                                  loss_weights=loss_weights)
        return plain_ops.linear_cross_entropy(h, weight, labels)


class HeadWeight(nn.Module):
    """The last pipeline stage's copy of the tied output matrix (Megatron's word_embeddings_for_head)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.padded_vocab_size, cfg.hidden_size))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, *, layers: range | None = None, pre_process: bool = True,
                 post_process: bool = True, init_seed: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.layer_range = range(cfg.num_layers) if layers is None else layers
        # the modules are built on the meta device, then given storage and reset_parameters' values:
        # built for real, nn.Linear and nn.Embedding would first draw their own default init on the
        # CPU, only to be overwritten (half of a 1.3B model's 19.5 s construction on a 2-core machine)
        device = torch.empty(0).device  # the caller's default device: meta under torch.device("meta")
        with torch.device("meta"):
            self.embedding = Embedding(cfg) if pre_process else None
            self.encoder = Encoder(cfg, len(self.layer_range), final_layernorm=post_process)
            self.head = LMHead(cfg) if post_process else None
            self.word_embeddings_for_head = HeadWeight(cfg) if post_process and not pre_process else None
        if init_seed is None:  # one draw from the global RNG keeps GPT(cfg) deterministic under manual_seed
            init_seed = int(torch.randint(0, 2 ** 62, (1,), device="cpu").item())
        self.init_seed = init_seed
        if device.type != "meta":
            self.to_empty(device=device)
            self.reset_parameters()

    def global_name(self, name: str) -> str:
        """A local parameter name -> its name in the whole model (pipeline chunks number layers from 0)."""
        if name.startswith("encoder.layers.") and self.layer_range.start:
            i, rest = name[len("encoder.layers."):].split(".", 1)
            return f"encoder.layers.{int(i) + self.layer_range.start}.{rest}"
        return name

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Megatron's init rules, each parameter from its own (seed, global name) generator. The
        draws run on up to INIT_THREADS threads (torch's CPU fills release the GIL, and each
        parameter's generator is its own, so the values do not depend on the order): on a 2-core
        machine a 1.3B model's 8.2 s became 4.9 s on 2 threads (memory already touched; 11.4 s
        serially on fresh pages). At most INIT_THREADS full tensors are in flight, which bounds
        the extra host memory per rank."""
        def fill(item):
            name, p = item
            with torch.no_grad():  # grad mode is per thread: the decorator does not reach the pool's
                p.copy_(init_value(self.global_name(name), p.shape, self.cfg, self.init_seed))

        items = list(self.named_parameters())
        workers = max(1, min(INIT_THREADS, torch.get_num_threads(), len(items)))
        if workers == 1:
            for item in items:
                fill(item)
            return
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            list(pool.map(fill, items))  # list(): re-raise the first failure here

    def output_weight(self) -> torch.Tensor:
        if self.embedding is not None:
            return self.embedding.word_embeddings.weight  # tied
        return self.word_embeddings_for_head.weight

    def num_params(self, exclude_position_embeddings: bool = False) -> int:
        """Parameter count, the tied embedding/output matrix counted once."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_position_embeddings and self.embedding is not None:
            n -= self.embedding.position_embeddings.weight.numel()
        return n

    def forward(self, tokens: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, hidden_states: torch.Tensor | None = None,
                loss_weights: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [b, s] (first chunk) or hidden_states [b, s, h] (later pipeline chunks) -> logits
        [b, s, V] (labels None), per-token loss fp32 [b, s] (labels given), or the hidden state
        [b, s, h] (a chunk without the output layer). loss_weights [b, s]: d total / d loss that the
        caller will backpropagate, for a head that uses it (LMHead with fused_ce
        'backward_in_forward'); other heads ignore it, which is always correct."""
        x = self.embed(tokens, position_ids) if self.embedding is not None else hidden_states
        h = self.encoder(x)
        if self.head is None:
            return h
        sink = wgrad.layer_sink(self.embedding.word_embeddings) if self.embedding is not None else None
        extra = {"loss_weights": loss_weights} if loss_weights is not None and type(self.head) is LMHead else {}
        if sink:  # the tied weight is sunk: its output-layer gradient goes to the same main grad
            return self.head(h, self.output_weight(), labels, sink=sink, **extra)
        return self.head(h, self.output_weight(), labels, **extra)

    def sinkable_weights(self) -> list[torch.Tensor]:
        """The weights whose every use can add its gradient straight into a main-grad sink
        (wgrad.py; build_optimizer sinks them with gradient-accumulation fusion): every nn.Linear's,
        and the word embedding when the embedding is a plain nn.Embedding and its tied output layer
        here is an LMHead (every fused loss takes a sink). Fused models only."""
        if not self.cfg.fused:
            return []
        out = [m.weight for m in self.modules() if isinstance(m, nn.Linear)]
        if (self.embedding is not None and type(self.embedding.word_embeddings) is nn.Embedding
                and type(self.head) is LMHead):
            out.append(self.embedding.word_embeddings.weight)
        return out

    def embed(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [b, s] -> the residual stream entering layer 0, [b, s, h] (first chunk only)."""
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
        return x
