"""hpcmeg's GPU kernels, one file per op, each with its plain PyTorch twin and a torch custom op
(hpcmeg::...) that runs the kernel on CUDA and the twin elsewhere: attention.py (causal flash
attention with dropout; its Triton kernels in attention_kernels.py), layernorm.py (the LayerNorm
backward with the residual, dropout and bias gradients), gelu.py (the MLP's tanh-GELU forward and
backward), dropout.py (Philox keep-masks), cross_entropy.py (the LM head's loss). Each file's launch
configuration is its `Launch`. hpcmeg/fused/ops.py is what the fused model (hpcmeg/fused/model.py) calls."""
