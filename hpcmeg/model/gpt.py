"""GPT-2 written for one device in plain PyTorch, with Megatron-LM legacy parameter names and layouts.

Contract:
  GPT(cfg).forward(tokens [b, s] int64, labels [b, s] int64 | None = None, position_ids=None)
    labels None -> logits [b, s, padded_vocab_size]
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
    encoder.final_layernorm.{weight, bias}; no buffers.
  query_key_value rows are in checkpoint_version-2 order: for each head, its q rows, k rows,
  v rows ([heads, 3, head_dim] flattened), so the output is viewed as [.., heads, 3*head_dim].
  Under autocast the residual stream is in the autocast dtype unless cfg.fp32_residual_connection.
  Init: Megatron's rules (hpcmeg/model/init.py), each parameter from a generator keyed by
  (init_seed, its global name), so every layout starts from slices of the same values;
  init_seed None draws one from torch's global RNG (deterministic under torch.manual_seed).
Everything else is applied from outside by replacing modules, so this one file serves CPU tests,
every parallel layout and the GPU: tensor parallelism (hpcmeg/parallel/tensor.py: shards, the
vocabulary-parallel embedding and head, hooks around the attention and MLP blocks, an RNG stream for
`attend`) and the fused path (hpcmeg/fused/model.py: the same modules with fast ops, main-grad sinks
and the LM-head loss variants, when cfg.fused). The seams they use: attention heads follow from the
QKV weight's rows (a TP shard holds whole heads), the attention core is the `attend` method, the
output layer is the parameter-free `head` module, and the two output projections return their bias
apart (Megatron's skip-bias-add: TP adds it after the reduction, the fused path inside its
bias-dropout-add).
"""
from __future__ import annotations

import concurrent.futures

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpcmeg.model import ops
from hpcmeg.model.config import GPTConfig
from hpcmeg.model.init import init_value

# how many parameters GPT.reset_parameters draws at once, on as many threads: the extra host memory
# per rank is at most this many full parameter tensors
INIT_THREADS = 4


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm's parameters, computed by ops.layer_norm (fp32 statistics, the input's dtype out):
    the same bits whatever the number of CPU threads, where torch's CPU kernel sums the weight and
    bias gradients per thread, so a one-process run and the ranks the parallel tests compare it
    with (one thread each) would differ in the last bits."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.padded_vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.word_embeddings(tokens) + self.position_embeddings(position_ids))


class SelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.query_key_value = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.head_dim = cfg.head_dim
        self.dropout_p = cfg.attention_dropout

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """The attention core: qkv [b, s, heads, 3 * head_dim] (per head its q, k, v rows) ->
        [b, s, heads, head_dim]. Its dropout is the layer's only RNG use inside the heads."""
        q, k, v = qkv.split(self.head_dim, dim=-1)
        return ops.causal_attention(q, k, v, self.dropout_p, self.training)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [b, s, h] -> (dense output without its bias [b, s, h], dense bias [h])."""
        b, s, _ = x.shape
        qkv = self.query_key_value(x).view(b, s, -1, 3 * self.head_dim)  # heads from the weight's rows
        ctx = self.attend(qkv).reshape(b, s, -1)
        return F.linear(ctx, self.dense.weight), self.dense.bias


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size)
        self.dense_4h_to_h = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [b, s, h] -> (the output without its bias [b, s, h], the output bias [h])."""
        g = F.gelu(self.dense_h_to_4h(x), approximate="tanh")  # GPT-2's gelu_new
        return F.linear(g, self.dense_4h_to_h.weight), self.dense_4h_to_h.bias


class TransformerLayer(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.input_layernorm = LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.self_attention = SelfAttention(cfg)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.mlp = MLP(cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, s, h]: the residual stream -> the stream after this layer. Each branch ends with
        residual + dropout(out + bias); the bias is cast to the branch's dtype so that under autocast
        the stream stays in the autocast dtype (the bias is an fp32 parameter)."""
        out, bias = self.self_attention(self.input_layernorm(x))
        x = x + self.dropout(out + bias.to(out.dtype))
        out, bias = self.mlp(self.post_attention_layernorm(x))
        return x + self.dropout(out + bias.to(out.dtype))


class Encoder(nn.Module):
    def __init__(self, cfg: GPTConfig, n_layers: int, final_layernorm: bool = True):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(n_layers))
        self.final_layernorm = LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon) if final_layernorm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x if self.final_layernorm is None else self.final_layernorm(x)

    # forward in pieces, for a caller that wraps a run of layers (full recompute's groups): h is what a
    # layer hands the next besides the stream x (None here; the fused encoder's next LayerNorm output)
    def run_layers(self, x: torch.Tensor, h, start: int, stop: int):
        for layer in self.layers[start:stop]:
            x = layer(x)
        return x, h

    def finish(self, x: torch.Tensor, h) -> torch.Tensor:
        return x if self.final_layernorm is None else self.final_layernorm(x)


class LMHead(nn.Module):
    """The output layer: logits, or the per-token loss, of the final hidden state against the (tied)
    output weight it is given. No parameters of its own (the weight is the word embedding's, or the
    last pipeline stage's copy), so a parallel or fused head replaces it freely."""

    def forward(self, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        if labels is None:
            return F.linear(h, weight)
        return ops.linear_cross_entropy(h, weight, labels)


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
        # built on the meta device, then given storage and reset_parameters' values: built for real,
        # nn.Linear and nn.Embedding would first draw their own default init, only to be overwritten
        device = torch.empty(0).device  # the caller's default device: meta under torch.device("meta")
        with torch.device("meta"):
            self.embedding = Embedding(cfg) if pre_process else None
            self.encoder = Encoder(cfg, len(self.layer_range), final_layernorm=post_process)
            self.head = LMHead() if post_process else None
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
        """Megatron's init rules, each parameter from its own (seed, global name) generator, drawn on
        up to INIT_THREADS threads (torch's CPU fills release the GIL, and each generator is its own,
        so the values do not depend on the order; a 1.3B model: 4.9 s on 2 threads against 8.2 s on
        one). At most INIT_THREADS full tensors are in flight, which bounds the extra host memory."""
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
                position_ids: torch.Tensor | None = None, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [b, s] (first chunk) or hidden_states [b, s, h] (later pipeline chunks) -> logits
        [b, s, V] (labels None), per-token loss fp32 [b, s] (labels given), or the hidden state
        [b, s, h] (a chunk without the output layer)."""
        x = self.embed(tokens, position_ids) if self.embedding is not None else hidden_states
        h = self.encoder(x)
        if self.head is None:
            return h
        return self.head(h, self.output_weight(), labels)

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
