"""Activation recompute applied from outside to a GPT or every chunk of a pipeline StageModel: Megatron's
`--recompute-granularity full|selective`, `--recompute-method uniform|block`, `--recompute-num-layers`.

Contract
- `apply_recompute(model, granularity, method=None, num_layers=None, rng=None) -> int`: in place, after
  tensor parallelism (its hooks and its TP-stream fork are then recomputed with the rest); returns the
  number of checkpointed regions per micro batch. Each chunk (pipeline stage, or virtual stage) counts
  its own layers, as Megatron's num_layers_per_pipeline_rank:
  * 'full' + 'uniform': the chunk's layers in consecutive groups of num_layers (which must divide the
    chunk's layer count), each group one checkpoint: only its input is kept, the group's forward runs
    again in the backward;
  * 'full' + 'block': the chunk's first num_layers layers, each its own checkpoint; the rest as they are;
  * 'selective': every layer's attention core (`self_attention.attend`: QK^T, softmax, dropout, @V)
    keeps only its input qkv; the core runs again in the backward;
  * None: nothing changes.
  Settings Megatron refuses (hpcmeg/recipe_checks.recompute_problem) raise ValueError.
How: a checkpointed layer's class is swapped for a subclass (made once per apply call, shared by the
layers, so a per-layer compile sees one class) whose `__call__` runs the module's normal call, hooks
included, under torch.utils.checkpoint (non-reentrant); the parameters, state_dict keys and
`type(layer).forward` stay as they are. A uniform group of more than one layer needs one checkpoint
around several layer calls, so the encoder's class is swapped for a subclass whose forward runs the
groups through the encoder's run_layers and finish (the plain and the fused encoder each pass their own
values between layers). 'selective' replaces `attend` on the instance by a checkpointed call of
whatever `attend` was there (TP's forked one, or the class's).
RNG: the recompute draws the same dropout masks as the forward. torch's default stream (CPU and the
inputs' CUDA devices) is put back by checkpoint's preserve_rng_state; the TP stream (`rng`, a
hpcmeg/parallel/random.RNGStreams, None at TP 1) is recorded when the forward enters a region and set
for that region's recompute, then put back to where the backward had it, as Megatron's
CheckpointFunction does for its RNG tracker. Early stopping of the recompute is off: the region always
runs to its end, so TP's enter/leave hooks and collectives run in full, alike on every rank.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, noop_context_fn, set_checkpoint_early_stop

from hpcmeg.parallel.overlap import transformer_layers
from hpcmeg.recipe_checks import recompute_problem
from hpcmeg.recipe_choices import CHOICES

GRANULARITIES = CHOICES[("model", "recompute_granularity")]
METHODS = CHOICES[("model", "recompute_method")]


def _tp_stream_contexts(rng):
    """checkpoint's context_fn: (around the forward, around the recompute) for the TP stream."""
    at_forward = {}

    @contextlib.contextmanager
    def forward():
        at_forward.update(rng.state_dict())  # clones
        yield

    @contextlib.contextmanager
    def recompute():
        now = rng.state_dict()
        rng.load_state_dict(at_forward)
        try:
            yield
        finally:
            rng.load_state_dict(now)

    return forward(), recompute()


def _checkpointed(fn, rng, *args, **kwargs):
    """fn(*args, **kwargs), keeping only its inputs for the backward, which runs it again."""
    context_fn = functools.partial(_tp_stream_contexts, rng) if rng is not None else noop_context_fn
    with set_checkpoint_early_stop(False):
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, context_fn=context_fn,
                          **kwargs)


def _recomputed_layer_class(base: type, rng) -> type:
    call = base.__call__

    def __call__(self, *args, **kwargs):
        return _checkpointed(functools.partial(call, self), rng, *args, **kwargs)

    return type(f"Recomputed{base.__name__}", (base,), {"__call__": __call__})


def _grouped_encoder_class(base: type, group: int, rng) -> type:
    """type(encoder) whose forward checkpoints the layers `group` at a time."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = None  # what a layer hands the next besides x (Encoder.run_layers)
        for start in range(0, len(self.layers), group):
            x, h = _checkpointed(self.run_layers, rng, x, h, start, start + group)
        return self.finish(x, h)

    return type(f"Grouped{base.__name__}", (base,), {"forward": forward})


def apply_recompute(model: nn.Module, granularity: str | None, method: str | None = None,
                    num_layers: int | None = None, rng=None) -> int:
    if granularity is None and method is None and num_layers is None:
        return 0
    chunks = list(model.chunks) if hasattr(model, "chunks") else [model]
    if granularity not in (None, *GRANULARITIES) or method not in (None, *METHODS):
        raise ValueError(f"apply_recompute: granularity {granularity!r} / method {method!r}: use None or one of "
                         f"{GRANULARITIES} / {METHODS}")
    for chunk in chunks:
        problem = recompute_problem(granularity, method, num_layers, len(chunk.encoder.layers))
        if problem:
            raise ValueError(f"apply_recompute: {problem[0]}: {problem[1]}")
    if granularity == "selective":
        layers = transformer_layers(model)
        for layer in layers:
            attn = layer.self_attention
            attn.attend = functools.partial(_checkpointed, attn.attend, rng)  # TP's forked one, or the bound method
        return len(layers)
    classes: dict[type, type] = {}  # one subclass per base class, shared by the layers
    regions = 0
    for chunk in chunks:
        encoder, layers = chunk.encoder, chunk.encoder.layers
        if method == "uniform" and num_layers > 1:
            base = type(encoder)
            if base not in classes:
                classes[base] = _grouped_encoder_class(base, num_layers, rng)
            encoder.__class__ = classes[base]
            regions += len(layers) // num_layers
            continue
        chosen = layers if method == "uniform" else layers[:num_layers]
        for layer in chosen:
            base = type(layer)
            if base not in classes:
                classes[base] = _recomputed_layer_class(base, rng)
            layer.__class__ = classes[base]
        regions += len(chosen)
    return regions


def describe_recompute(granularity: str | None, method: str | None, num_layers: int | None) -> str:
    """The start line's phrase for these settings."""
    if granularity is None:
        return "no activation recompute"
    if granularity == "selective":
        return "selective recompute (attention core)"
    if method == "uniform":
        return f"full recompute, uniform groups of {num_layers} layer(s)"
    return f"full recompute, block: the first {num_layers} layer(s) of each stage"
