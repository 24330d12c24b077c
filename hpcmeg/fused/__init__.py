"""The fast path of the GPT: hpcmeg/model/gpt.py's plain model with its modules swapped for fused
twins (model.py: build_gpt, fuse), the fused ops they call (ops.py), the LM head's loss
(linear_ce.py) and gradient-accumulation fusion (wgrad.py). Kernels live in hpcmeg/kernels/."""
