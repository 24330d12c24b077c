"""GPT model configuration: the one dataclass the model is built from, plus vocabulary padding.

Owns: `GPTConfig` (architecture hyper-parameters, dropout, init, and the fused path's few choices:
the attention backend, the LM-head loss, the GELU layers recomputed; the activation recompute that
hpcmeg/parallel/recompute.py applies); the vocabulary padding rule is
hpcmeg.megatron.layout.pad_vocab_size, the choice lists are the recipe schema's. No torch import: the
launcher can read this file on a host without a GPU build of torch.

Names follow Megatron-LM's flags (`--num-layers`, `--hidden-size`, `--ffn-hidden-size`,
`--max-position-embeddings`, `--init-method-std`, ...) so a recipe maps onto them 1:1.
"""
from __future__ import annotations

from dataclasses import dataclass

from hpcmeg.recipe_choices import CHOICES

ATTENTION_BACKENDS = CHOICES[("model", "attention_backend")]
CE_IMPLS = CHOICES[("model", "cross_entropy")]
RECOMPUTE_GRANULARITIES = CHOICES[("model", "recompute_granularity")]
RECOMPUTE_METHODS = CHOICES[("model", "recompute_method")]


@dataclass
class GPTConfig:
    """GPT-2 architecture (learned positions, pre-LayerNorm, tanh-GELU, tied embeddings)."""

    num_layers: int
    """Number of transformer layers (Megatron `--num-layers`; GPT-2 124M: 12)."""
    hidden_size: int
    """Model width h (`--hidden-size`; 124M: 768). Must be divisible by num_attention_heads."""
    num_attention_heads: int
    """Attention heads (`--num-attention-heads`; 124M: 12). Head dim = hidden_size / heads."""
    ffn_hidden_size: int
    """MLP inner width (`--ffn-hidden-size`; GPT-2 uses 4 * hidden_size)."""
    max_position_embeddings: int
    """Rows of the learned position table = longest sequence the model accepts (GPT-2: 1024)."""
    padded_vocab_size: int
    """Rows of the word-embedding / tied output matrix, already padded (hpcmeg.megatron.layout.pad_vocab_size)."""
    vocab_size: int | None = None
    """The true vocabulary size (rows past it are padding), when known: the initialisation draws real
    and padding rows separately so real rows do not depend on the padding (hpcmeg/model/init.py)."""
    hidden_dropout: float = 0.1
    """Dropout on the embedding output and on each residual branch before the add (Megatron default)."""
    attention_dropout: float = 0.1
    """Dropout on the attention probabilities."""
    layernorm_epsilon: float = 1e-5
    """LayerNorm epsilon (`--layernorm-epsilon`)."""
    init_method_std: float = 0.02
    """Std of the normal init of all weights; output projections use std / sqrt(2 * num_layers)."""
    fused: bool = False
    """Use the fast paths of hpcmeg/fused/ops.py (SDPA/flash attention, fusion-friendly ops,
    cross-entropy without full fp32 logits). False: the plain twins of hpcmeg/model/ops.py."""
    attention_backend: str = "auto"
    """Fused path only. 'auto': the flash-attn package if importable, else SDPA with priority
    cuDNN > flash > mem-efficient > math (the trainer turns a recipe's 'auto' into 'triton' on a
    Hopper GPU, compute capability 9.x, with bf16/fp16 training: hpcmeg/train/build.attention_backend_for).
    'triton': hpcmeg/kernels/attention.py (q/k/v read in the QKV GEMM's layout, dropout
    inside, the QKV bias gradient from its own row sums; where the shape is not supported, 'auto');
    or force one of cudnn|flash|flash_attn|efficient|math. Why 'triton' first on Hopper: forward +
    backward per layer at p = 0.1 on an H100, 0.395 ms against cuDNN's 0.451 (124M), 0.512 vs 0.585
    (355M) (bench/results/attention_probe_h100_s15.json), +1.2 % tokens/s in the 124M user path
    (bench/results/user_path_h100_s16.md); it keeps 1 bit per attention probability for the
    backward (19 MB per layer at 124M, micro batch 12). Other GPUs were never timed: SDPA there."""
    fp32_residual_connection: bool = False
    """Megatron's --fp32-residual-connection. False: under autocast the residual stream is kept in
    the autocast dtype (as in Megatron, where bf16 params make it bf16), halving its memory traffic;
    True: the residual stream stays in the params' dtype (fp32 under autocast)."""
    fused_ce: str = "grad_in_forward"
    """Fused path only: the LM head's loss (hpcmeg/fused/linear_ce.py). 'grad_in_forward': the
    forward's kernel (hpcmeg/kernels/cross_entropy.py) turns the bf16 logits into their gradient softmax -
    onehot in place, and the backward folds the per-token scale into the LM-head GEMMs: no fp32
    [tokens, vocab] tensor, no backward pass over the logits. 'backward_in_forward' (a memory
    trade-off): 'grad_in_forward' with the LM head's backward GEMMs run in the forward, chunk by
    chunk, on the loss weights TrainStep passes, so no [tokens, vocab] tensor is kept between forward
    and backward (same FLOPs; ~103 MB less per sequence of 1024 at GPT-2's vocabulary)."""

    recompute_gelu_layers: int = 0
    """Fused path only. The first this many layers of each pipeline stage keep their MLP's
    pre-activation but not its GELU output, which the backward recomputes with the same kernel
    (hpcmeg/fused/ops.py's _MLPRecomputeGelu): 2 x ffn
    bytes per token less per layer (124M at micro batch 16: 100 MB a layer) for one GELU pass per
    layer in the backward. For a micro batch that would not fit otherwise. 0: none."""
    recompute_granularity: str | None = None
    """Activation recompute (Megatron's --recompute-granularity), applied from outside by
    hpcmeg/parallel/recompute.py: None, 'full' (whole layers, per recompute_method and
    recompute_num_layers) or 'selective' (every layer's attention core)."""
    recompute_method: str | None = None
    """'full' only: 'uniform' (each stage's layers in groups of recompute_num_layers, one checkpoint
    a group) or 'block' (the first recompute_num_layers layers of each stage, one checkpoint each)."""
    recompute_num_layers: int | None = None
    """'full' only: the group size (uniform) or the number of layers (block) per pipeline stage."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                     "max_position_embeddings", "padded_vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)} must be >= 1")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"GPTConfig.hidden_size={self.hidden_size} is not divisible by "
                             f"num_attention_heads={self.num_attention_heads}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)} must be in [0, 1)")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"GPTConfig.attention_backend={self.attention_backend!r}: "
                             f"use one of {ATTENTION_BACKENDS}")
        if not 0 <= self.recompute_gelu_layers <= self.num_layers:
            raise ValueError(f"GPTConfig.recompute_gelu_layers={self.recompute_gelu_layers} must be in "
                             f"[0, num_layers={self.num_layers}]")
        if self.recompute_granularity not in (None, *RECOMPUTE_GRANULARITIES):
            raise ValueError(f"GPTConfig.recompute_granularity={self.recompute_granularity!r}: use None or one "
                             f"of {RECOMPUTE_GRANULARITIES}")
        if self.recompute_method not in (None, *RECOMPUTE_METHODS):
            raise ValueError(f"GPTConfig.recompute_method={self.recompute_method!r}: use None or one of "
                             f"{RECOMPUTE_METHODS}")
        if self.fused_ce not in CE_IMPLS:
            raise ValueError(f"GPTConfig.fused_ce={self.fused_ce!r}: use one of {CE_IMPLS}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads
