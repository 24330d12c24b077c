"""Training FLOPs per token, MFU, and a measured bf16 matmul peak.

Convention (the same as ../shared/bench/anchors_gpt2.py, so ratios are apples to apples):
  flops_per_token = 6 * N + 12 * L * d * T
    N: all parameters, the tied embedding/output matrix counted once (it is one LM-head matmul);
    12*L*d*T: attention scores and weighted sum, forward + backward, causal half NOT discounted.
  MFU = tokens/s * flops_per_token / peak, peak measured in the same process by
  `measure_bf16_peak` (an 8192^3 bf16 matmul; ~790 TFLOP/s on an H200 vs 989 on the datasheet).
"""
from __future__ import annotations

import torch


def flops_per_token(n_params: int, num_layers: int, hidden_size: int, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token: 6N + 12*L*d*T."""
    return 6 * n_params + 12 * num_layers * hidden_size * seq_len


def mfu(tokens_per_s: float, flops_per_tok: float, peak_flops: float) -> float:
    """Model FLOPs utilisation in [0, 1]: achieved FLOP/s over the peak FLOP/s."""
    return tokens_per_s * flops_per_tok / peak_flops


def measure_bf16_peak(device: str | torch.device = "cuda", n: int = 8192, iters: int = 20) -> float:
    """Measured dense bf16 matmul rate in FLOP/s (random data: zeros run faster and lie)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"measure_bf16_peak: needs a CUDA device, got {dev}; pass the peak explicitly")
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(dev)
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    torch.cuda.synchronize(dev)
    return 2 * n ** 3 * iters / (start.elapsed_time(end) / 1e3)
