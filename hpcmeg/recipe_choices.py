"""The recipe's fixed vocabularies: every choice key's allowed values (``CHOICES``) and the keys a
recipe may no longer hold (``RETIRED``), each written once.

Bottom layer: imports nothing from hpcmeg, so the schema (recipe_schema), the YAML reader
(recipe_yaml), the checks (recipe_checks) and the model's config (model/config.py) all read the same
tuples.
"""

from __future__ import annotations

# Keys a recipe may no longer hold, and what to do instead (the loader names them with this line
# rather than as unknown keys).
RETIRED = {
    "model.dropout_impl": "the fused path has one dropout (a Triton keep-mask on CUDA); model.fused: off "
                          "gives torch's",
    "model.layernorm_impl": "the fused path has one LayerNorm (its backward one Triton pass); model.fused: off "
                            "gives the plain one",
    "model.gelu_impl": "the fused path has one GELU (Triton kernels); model.fused: off gives the plain one",
    "train.optimizer_kernel": "AdamW's update runs compiled by Inductor on CUDA, plain elsewhere",
    "train.grad_accumulation": "gradients enter the fp32 main grads a bucket at a time",
    "train.gradient_accumulation_fusion": "a fused model on CUDA with bf16/fp16 parameters always accumulates "
                                          "weight gradients in its GEMMs; model.fused: off does not",
}

# Every choice key's allowed values, written once: the loader checks them, GPTConfig imports its own.
CHOICES = {
    ("data", "tokenizer_type"): ("GPT2BPETokenizer", "HuggingFaceTokenizer"),
    ("model", "fused"): ("auto", "on", "off"),
    ("model", "attention_backend"): ("auto", "triton", "cudnn", "flash", "flash_attn", "efficient", "math"),
    ("model", "cross_entropy"): ("grad_in_forward", "backward_in_forward"),
    # null (the default) is also allowed for these two: no recompute
    ("model", "recompute_granularity"): ("full", "selective"),
    ("model", "recompute_method"): ("uniform", "block"),
    ("train", "lr_decay_style"): ("cosine", "linear", "constant"),
    ("train", "precision"): ("bf16", "fp16", "fp32"),
    ("train", "compile"): ("auto", "on", "off"),
    ("train", "device"): ("auto", "cuda", "cpu"),
    ("cluster", "executor"): ("slurm", "local"),
    ("container", "runtime"): ("apptainer", "pyxis", "none"),
    ("convert", "format"): ("hf",),
    ("convert", "dtype"): ("fp32", "bf16", "fp16"),
}
