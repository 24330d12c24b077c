"""Megatron's two RNG streams for tensor parallelism, explicit (no global tracker).

Why two: dropout on activations every TP rank holds whole (the embedding output, residual branches
without sequence parallelism) must draw the same mask on every rank of a TP group, so it uses the
default stream: torch's own generator, seeded alike on every rank. Dropout on what differs per
rank (attention probabilities of the rank's own heads; every dropout of a layer whose activations
are split along the sequence) must draw different masks, so it uses the TP stream, seeded
seed + 2718 + tp_rank (Megatron's model-parallel seed offset).

Contract
- `RNGStreams(seed, tp_rank, device)`: the TP stream's generator state (CPU and, on CUDA, the
  device's), made without disturbing the default stream.
- `with streams.fork():` runs the body on the TP stream: torch's generator state is swapped for the
  TP stream's and back (CPU and CUDA), the TP stream advancing by what the body drew. Under
  torch.compile this is a graph break where it is used (only for dropout > 0 at TP > 1).
- `state_dict()` / `load_state_dict()`: the TP stream as tensors, kept per shard in the checkpoint's
  rng_state["rng_tracker_states"] (Megatron's "model-parallel-rng" slot), so a resume is bit-exact
  per rank; the default stream is the checkpoint's ordinary torch/cuda rng state.
"""
from __future__ import annotations

import contextlib

import torch

TP_SEED_OFFSET = 2718
TRACKER_KEY = "model-parallel-rng"


class RNGStreams:
    def __init__(self, seed: int, tp_rank: int, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        cpu, cuda = torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if self.cuda else None
        torch.manual_seed(seed + TP_SEED_OFFSET + tp_rank)
        self._cpu = torch.get_rng_state()
        self._cuda = torch.cuda.get_rng_state(self.device) if self.cuda else None
        torch.set_rng_state(cpu)
        if self.cuda:
            torch.cuda.set_rng_state(cuda, self.device)

    @contextlib.contextmanager
    def fork(self):
        cpu = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state(self.device) if self.cuda else None
        torch.set_rng_state(self._cpu)
        if self.cuda:
            torch.cuda.set_rng_state(self._cuda, self.device)
        try:
            yield
        finally:
            self._cpu = torch.get_rng_state()
            torch.set_rng_state(cpu)
            if self.cuda:
                self._cuda = torch.cuda.get_rng_state(self.device)
                torch.cuda.set_rng_state(cuda, self.device)

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {TRACKER_KEY: self._cpu.clone()}
        if self._cuda is not None:
            out[TRACKER_KEY + "-cuda"] = self._cuda.clone()
        return out

    def load_state_dict(self, states: dict[str, torch.Tensor]) -> None:
        if TRACKER_KEY in states:
            self._cpu = states[TRACKER_KEY].clone()
        if self.cuda and TRACKER_KEY + "-cuda" in states:
            self._cuda = states[TRACKER_KEY + "-cuda"].clone()
