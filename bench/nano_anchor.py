"""The nanoGPT-style anchor with nanoGPT's own knobs: dropout and gradient accumulation.

Owns the anchor of bench/user_path.py. bench/anchors_gpt2.py (a verbatim copy of the project's
baseline script) has no dropout and one micro batch per step; a user who picks nanoGPT instead of
hpcmeg trains with `dropout` and `gradient_accumulation_steps`, so the user-path comparison runs
this twin of its `Nano`, extended the way nanoGPT's model.py and train.py do it:
  * dropout after the embedding sum, on the attention probabilities (SDPA's dropout_p while
    training), after the attention projection and after the MLP's output projection;
  * the training loop of nanoGPT's train.py: `accum` micro batches, each loss / accum backward,
    clip 1.0, fused AdamW, zero_grad(set_to_none=True); the model compiled (torch.compile), bf16
    autocast over fp32 parameters; batches drawn like nanoGPT's get_batch: random windows of a
    uint16 token file (here the same .bin hpcmeg trains on), pinned and copied non-blocking.
At dropout 0 the model computes exactly anchors_gpt2.Nano's function (tests/test_bench_anchor.py
checks it on CPU with the same weights).

Vocabulary: 50304 (NANOGPT_VOCAB), nanoGPT's GPTConfig default when it trains GPT-2 from scratch
(50257 padded up to a multiple of 64 "for efficiency"); the token file's ids stay < 50257, the
extra rows of the tied embedding / LM head are padding that no label names. hpcmeg pads the same
way (Megatron's make-vocab-size-divisible-by), so both sides run the same LM-head shape.

Peak memory (PEAK_MEMORY; bench/user_path.py reports hpcmeg's rows by the same definition): the
CUDA caching allocator's max_memory_allocated, reset once the model and optimizer exist and before
the first step, read after the timed steps, so warm-up counts (compilation and CUDA-graph capture:
a CUDA-graphed step allocates its activations only while its graphs are recorded; replays bypass
the allocator, so a reset after warm-up would not see them), less what this process held before
the run (earlier rows of the same bench process); GB = 1e9 bytes.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


GPT2_VOCAB = 50257  # GPT-2's tokenizer: every token id is < 50257
NANOGPT_VOCAB = 50304  # nanoGPT's GPTConfig.vocab_size: GPT-2's 50257 padded to a multiple of 64
PEAK_MEMORY = ("peak allocated: max_memory_allocated from a reset before the first step (model and optimizer "
               "built) to the end of the timed steps, warm-up included, less memory held before the run; GB = 1e9 B")


def peak_mem_gb(peak_bytes: float, held_before_bytes: float = 0.0) -> float:
    """PEAK_MEMORY in GB from the allocator's peak and what the process held before the run (bytes)."""
    return round((peak_bytes - held_before_bytes) / 1e9, 2)


@dataclass(frozen=True)
class NanoConfig:
    n_layer: int = 12
    n_embd: int = 768
    n_head: int = 12
    vocab_size: int = NANOGPT_VOCAB
    block_size: int = 1024
    dropout: float = 0.0


class Block(nn.Module):
    def __init__(self, c: NanoConfig):
        super().__init__()
        self.c = c
        self.ln1, self.ln2 = nn.LayerNorm(c.n_embd), nn.LayerNorm(c.n_embd)
        self.qkv, self.proj = nn.Linear(c.n_embd, 3 * c.n_embd), nn.Linear(c.n_embd, c.n_embd)
        self.fc, self.out = nn.Linear(c.n_embd, 4 * c.n_embd), nn.Linear(4 * c.n_embd, c.n_embd)
        self.drop_attn, self.drop_mlp = nn.Dropout(c.dropout), nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, T, D]
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        q, k, v = (t.view(B, T, self.c.n_head, D // self.c.n_head).transpose(1, 2) for t in (q, k, v))
        p = self.c.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + self.drop_attn(self.proj(y.transpose(1, 2).reshape(B, T, D)))
        return x + self.drop_mlp(self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh")))


class Nano(nn.Module):
    def __init__(self, c: NanoConfig):
        super().__init__()
        self.c = c
        self.wte, self.wpe = nn.Embedding(c.vocab_size, c.n_embd), nn.Embedding(c.block_size, c.n_embd)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.lnf = nn.LayerNorm(c.n_embd)
        self.head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied, as GPT-2

    def forward(self, idx: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token CE; idx / labels [B, T] (labels already shifted)."""
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device)))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.lnf(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


class Batches:
    """nanoGPT's get_batch over a uint16 token file: random windows of block_size + 1 tokens."""

    def __init__(self, bin_path: str, batch: int, block: int, seed: int = 1, device: str = "cuda"):
        self.data = np.memmap(bin_path, dtype=np.uint16, mode="r")
        self.batch, self.block, self.device = batch, block, device
        self.rng = np.random.default_rng(seed)

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        ix = self.rng.integers(0, len(self.data) - self.block - 1, self.batch)
        w = np.stack([self.data[i:i + self.block + 1].astype(np.int64) for i in ix])  # [B, T+1]
        x, y = torch.from_numpy(w[:, :-1]), torch.from_numpy(w[:, 1:])
        if self.device == "cuda":
            return x.pin_memory().to("cuda", non_blocking=True), y.pin_memory().to("cuda", non_blocking=True)
        return x.to(self.device), y.to(self.device)


def run(c: NanoConfig, bin_path: str, micro: int, accum: int, steps: int, warmup: int = 3,
        compile: bool = True) -> dict:
    """Train `warmup + steps` optimizer steps of `accum` micro batches of `micro` sequences; returns
    tokens/s over the timed steps, the peak memory (PEAK_MEMORY, as user_path reports hpcmeg's rows)
    and the last loss."""
    torch.manual_seed(0)
    torch.cuda.synchronize()
    held_before = torch.cuda.memory_allocated()  # earlier rows of this process: not this run's memory
    m = Nano(c).cuda()
    n_params = sum(p.numel() for p in m.parameters())
    opt = torch.optim.AdamW(m.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    fwd = torch.compile(m) if compile else m
    get = Batches(bin_path, micro, c.block_size)
    torch.cuda.reset_peak_memory_stats()

    def step() -> torch.Tensor:  # nanoGPT train.py's inner loop
        x, y = get()
        for _ in range(accum):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = fwd(x, y) / accum
            x, y = get()  # prefetch the next micro batch while the GPU runs this one (as nanoGPT)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t_c = time.perf_counter()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t_c
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    toks = micro * accum * c.block_size / dt
    return dict(n_params=n_params, step_ms=round(dt * 1e3, 2), tokens_per_s=round(toks),
                peak_mem_GB=peak_mem_gb(torch.cuda.max_memory_allocated(), held_before),
                loss=round(loss.item() * accum, 3) if math.isfinite(loss.item()) else None,
                warmup_s=round(warm_s, 1))
