"""GPT model configuration: the one dataclass the model is built from, plus vocabulary padding.

Owns: `GPTConfig` (architecture hyper-parameters, dropout, init, and which op implementation
to use); the vocabulary padding rule is hpcmeg.megatron.layout.pad_vocab_size. No torch import: the recipe layer and the launcher can read
this file on a host without a GPU build of torch.

Names follow Megatron-LM's flags (`--num-layers`, `--hidden-size`, `--ffn-hidden-size`,
`--max-position-embeddings`, `--init-method-std`, ...) so a recipe maps onto them 1:1.
"""
from __future__ import annotations

from dataclasses import dataclass

ATTENTION_BACKENDS = ("auto", "triton", "cudnn", "flash", "flash_attn", "efficient", "math")
CE_IMPLS = ("fused", "fused_inductor", "grad_in_forward", "compiled", "chunked", "backward_in_forward")
DROPOUT_IMPLS = ("triton", "triton_bits", "native")
KERNEL_IMPLS = ("triton", "triton_forward", "inductor")  # layernorm_impl
GELU_IMPLS = ("triton", "inductor", "cublaslt", "cublaslt_dgelu")


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
    """Use the fast paths of hpcmeg/model/fused.py (SDPA/flash attention, fusion-friendly ops,
    cross-entropy without full fp32 logits). False: the plain twins of hpcmeg/model/ops.py."""
    attention_backend: str = "auto"
    """Fused path only. 'auto': the flash-attn package if importable, else SDPA with priority
    cuDNN > flash > mem-efficient > math (the trainer turns a recipe's 'auto' into 'triton' on a
    Hopper GPU, compute capability 9.x, with bf16/fp16 training: hpcmeg/train/build.attention_backend_for).
    'triton': hpcmeg/model/triton_attention.py (q/k/v read in the QKV GEMM's layout, dropout
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
    """Fused path only. 'grad_in_forward': the forward kernel (hpcmeg/model/triton_ce.py) turns the
    bf16 logits into their gradient softmax - onehot in place, and the backward folds the per-token
    scale into the LM-head GEMMs: no backward pass over [tokens, vocab] (LM head + loss fwd+bwd 4.76
    vs 4.91 ms at 124M, bench/results/gpu_agreement_h200_s7_ce.json; +0.6 % tokens/s end to end,
    bench/results/user_path_s9b_124M_kernels.md). 'fused': bf16 logits, one fp32 logsumexp pass forward (the
    Triton kernel on CUDA; 'fused_inductor': Inductor's two-pass lowering instead) and one
    softmax-minus-onehot pass backward (hpcmeg/model/fused.py); 'compiled': the same loss under
    plain autograd (its gather backward builds a dense fp32 [tokens, vocab] tensor); 'chunked':
    token chunks, logits recomputed in backward (least memory); 'backward_in_forward':
    'grad_in_forward' with the LM head's backward GEMMs run in the forward, chunk by chunk, on the
    loss weights TrainStep passes (no [tokens, vocab] tensor kept between forward and backward; same
    FLOPs). On an H100 it is about 1 % slower than 'grad_in_forward' at 124M (micro 16) and makes
    355M's micro 16 fit within nanoGPT's memory, the fastest 355M row (bench/results/
    user_path_h100_s18.md, user_path_h100_s19.md)."""

    dropout_impl: str = "triton_bits"
    """Fused path on CUDA only. 'triton': the keep-mask from hpcmeg/model/triton_dropout.py (one
    Philox call per 8 elements, 16-bit thresholds: p in steps of 2**-16; a bool mask that Inductor
    reads in its fused bias-dropout-add+LN kernel. A Triton bias-dropout-add+LN kernel that draws the
    mask itself measured slower at 124M's shape on the H200, 1.60 vs 1.44 ms fwd+bwd,
    bench/results/user_path_h200_s12.md; layernorm_impl 'triton_forward' runs one, aimed at hidden
    sizes above 1024); 'triton_bits' (the default): 'triton' with the residual
    branches' masks (the ones the bias-dropout-add + LayerNorm saves for its backward) packed eight
    to a byte (triton_dropout.dropout_keep_bits): the same bits, 1.75 B less saved per hidden
    element per layer (0.26 GB at 124M, micro batch 16, where the peak fell 9.54 -> 9.20 GB), and
    +0.6 % tokens/s there on an H100 (bench/results/user_path_h100_s16.md); 'native': torch's dropout (under torch.compile Inductor
    draws one Philox call per element inside that kernel: 61 us vs 18 us without dropout at 124M
    on the H200). All draw from torch's generator (reproducible, resumable); 'native''s masks
    differ. CPU always uses 'native'."""

    layernorm_impl: str = "triton"
    """Fused path only. 'triton': every LayerNorm's backward (with the residual-gradient add, the
    dropout mask and the bias gradient of the bias-dropout-add before it) is one pass of
    hpcmeg/model/triton_layernorm.py; 'inductor': autograd's formula, compiled by Inductor (a fused
    kernel, then column reductions that re-read its inputs). The forward is Inductor's with both.
    'triton_forward' (opt-in, untimed on a GPU): 'triton' with each bias-dropout-add + LayerNorm
    forward as one Triton row pass too (hpcmeg/model/triton_bda_layernorm.py), where Inductor's
    fused kernel re-reads each row above hidden 1024 (92 us per [8192, 2048] call on the H100, 3.7 %
    of the 1.3B step: bench/results/profile_h100_s19_1.3B_gbs64.md)."""
    gelu_impl: str = "cublaslt_dgelu"
    """Fused path only. 'cublaslt_dgelu' (the default): no GELU pass in either
    direction, as Transformer Engine does it: fc1's GEMM applies the GELU in its cuBLASLt epilogue
    (GELU_AUX_BIAS), fc2's input-gradient GEMM applies gelu' in its DGELU epilogue, and fc1's
    weight-gradient GEMM sums fc1's bias gradient (BGRADB). On an H100 (bench/results/
    user_path_h100_s19.md): +0.4 % tokens/s at 124M micro 16, +0.5 % at 355M, +1.2 % at 1.3B
    against 'cublaslt'; loss parity with HF kept (largest gap 0.019 over 400 steps). 'cublaslt':
    the forward epilogue only, the backward 'triton''s (cuBLASLt's combined DGELU_BGRAD epilogue
    measured 2.1x slower than the GEMM + Triton pass). Where no libcublasLt
    is loaded or its heuristic offers no algorithm for the shape, either takes the 'triton' path
    with a warning (hpcmeg/model/cublaslt.py). 'triton': the MLP's GELU forward and backward (with
    its bias gradient) are hpcmeg/model/triton_gelu.py's kernels (exp2-based tanh; one pass each);
    'inductor': F.gelu."""

    recompute_gelu_layers: int = 0
    """Fused path only. The first this many layers of each pipeline stage keep their MLP's
    pre-activation but not its GELU output, which the backward recomputes with the same kernel
    (fused._MLPRecomputeGelu; the Triton GELU in those layers, not cuBLASLt's epilogue): 2 x ffn
    bytes per token less per layer (124M at micro batch 16: 100 MB a layer) for one GELU pass per
    layer in the backward. For a micro batch that would not fit otherwise. 0: none."""

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
        if self.dropout_impl not in DROPOUT_IMPLS:
            raise ValueError(f"GPTConfig.dropout_impl={self.dropout_impl!r}: use one of {DROPOUT_IMPLS}")
        if self.layernorm_impl not in KERNEL_IMPLS:
            raise ValueError(f"GPTConfig.layernorm_impl={self.layernorm_impl!r}: use one of {KERNEL_IMPLS}")
        if self.gelu_impl not in GELU_IMPLS:
            raise ValueError(f"GPTConfig.gelu_impl={self.gelu_impl!r}: use one of {GELU_IMPLS}")
        if not 0 <= self.recompute_gelu_layers <= self.num_layers:
            raise ValueError(f"GPTConfig.recompute_gelu_layers={self.recompute_gelu_layers} must be in "
                             f"[0, num_layers={self.num_layers}]")
        if self.fused_ce not in CE_IMPLS:
            raise ValueError(f"GPTConfig.fused_ce={self.fused_ce!r}: use one of {CE_IMPLS}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads
