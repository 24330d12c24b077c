"""The `args` namespace, `opt_param_scheduler` and top-level dict of a Megatron legacy checkpoint
(megatron-interop.md sections 6.2, 6.4, 6.5): pure and torch-free.

Everything saved must unpickle with torch.load(weights_only=True) plus argparse.Namespace
allow-listed, so `args` holds plain Python values only (make_megatron_args checks it).
"""
from __future__ import annotations

import argparse
from typing import Any

from hpcmeg.megatron.names import CHECKPOINT_VERSION

# What Megatron's check_checkpoint_args and transformers' converters read (§6.2, §6.4, §6.5), with the
# defaults of hpcmeg's GPT-2 architecture: learned positions, LayerNorm, tanh-GELU, biases, tied head.
_ARGS_DEFAULTS: dict[str, Any] = dict(
    orig_vocab_size=None, kv_channels=None, ffn_hidden_size=None, seq_length=None,
    tokenizer_type="GPT2BPETokenizer", tokenizer_name_or_path=None, vocab_file=None, merge_file=None,
    tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=1, world_size=1,
    virtual_pipeline_model_parallel_size=None, sequence_parallel=False, use_distributed_optimizer=False,
    bias_gelu_fusion=True, openai_gelu=False, make_vocab_size_divisible_by=128,
    position_embedding_type="learned_absolute", add_position_embedding=True, normalization="LayerNorm",
    layernorm_epsilon=1e-5, apply_residual_connection_post_layernorm=False,
    untie_embeddings_and_output_weights=False, add_bias_linear=True, swiglu=False,
    group_query_attention=False, num_query_groups=None, attention_dropout=0.1, hidden_dropout=0.1,
    consumed_train_samples=0, consumed_valid_samples=0, iteration=0, micro_batch_size=None,
    global_batch_size=None, fp16=False, bf16=False, seed=1234, ckpt_format="torch",
    recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
)
_ARGS_REQUIRED = ("padded_vocab_size", "hidden_size", "num_layers", "num_attention_heads", "max_position_embeddings")
_PLAIN = (type(None), bool, int, float, str)


def make_megatron_args(**fields: Any) -> argparse.Namespace:
    """Build the plain argparse.Namespace stored as checkpoint['args'].

    Required: padded_vocab_size, hidden_size, num_layers, num_attention_heads, max_position_embeddings.
    Derived when not given: ffn_hidden_size = 4h, kv_channels = h/heads, seq_length = max positions,
    orig_vocab_size = padded_vocab_size. Extra fields pass through. Values must be plain Python
    (None/bool/int/float/str and lists/tuples/dicts of those) so weights_only loading never needs hpcmeg."""
    missing = [k for k in _ARGS_REQUIRED if fields.get(k) is None]
    if missing:
        raise ValueError(f"make_megatron_args: missing required field(s) {missing}")
    a = {**_ARGS_DEFAULTS, **fields}
    h = a["hidden_size"]
    if a["ffn_hidden_size"] is None:
        a["ffn_hidden_size"] = 4 * h
    if a["kv_channels"] is None:
        a["kv_channels"] = h // a["num_attention_heads"]
    if a["seq_length"] is None:
        a["seq_length"] = a["max_position_embeddings"]
    if a["orig_vocab_size"] is None:
        a["orig_vocab_size"] = a["padded_vocab_size"]
    for k, v in a.items():
        _check_plain(v, f"args.{k}")
    return argparse.Namespace(**a)


def _check_plain(v: Any, where: str) -> None:
    if isinstance(v, _PLAIN):
        return
    if isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            _check_plain(x, f"{where}[{i}]")
        return
    if isinstance(v, dict):
        for k, x in v.items():
            _check_plain(k, f"{where} key")
            _check_plain(x, f"{where}[{k!r}]")
        return
    raise TypeError(f"{where} is a {type(v).__name__}; checkpoint args must be plain Python values "
                    f"so they unpickle with weights_only=True")


_SCHED_KEYS = ("max_lr", "lr_warmup_steps", "num_steps", "lr_decay_style", "lr_decay_steps", "min_lr",
               "start_wd", "end_wd", "wd_incr_style", "wd_incr_steps")


def make_scheduler_state(**fields: Any) -> dict[str, Any]:
    """Megatron's opt_param_scheduler dict (§6.2/§7.2). All step counts are in *samples*."""
    missing = [k for k in _SCHED_KEYS if k not in fields]
    unknown = [k for k in fields if k not in _SCHED_KEYS]
    if missing or unknown:
        raise ValueError(f"opt_param_scheduler: missing {missing}, unknown {unknown}")
    return {k: fields[k] for k in _SCHED_KEYS}


def make_checkpoint_dict(*, args: argparse.Namespace, iteration: int, model: dict[str, Any] | list[dict[str, Any]],
                         optimizer: dict[str, Any] | None, opt_param_scheduler: dict[str, Any] | None,
                         rng_state: list[dict[str, Any]] | None, recipe: dict[str, Any] | None = None,
                         data_state: Any = None, extra: Any = None) -> dict[str, Any]:
    """The dict saved as model_optim_rng.pt; `model` is the nested dict from to_megatron_model, or a
    list of them, one per virtual-pipeline chunk: saved as Megatron does, "model0" .. "model{V-1}"
    (a list of one is "model")."""
    models = model if isinstance(model, list) else [model]
    if not models or any("language_model" not in m for m in models):
        raise ValueError("model must be the nested Megatron dict (use to_megatron_model on the flat state dict)")
    ckpt: dict[str, Any] = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": int(iteration)}
    if len(models) == 1:
        ckpt["model"] = models[0]
    else:
        ckpt.update({f"model{v}": m for v, m in enumerate(models)})
    if optimizer is not None:
        ckpt["optimizer"] = optimizer
    if opt_param_scheduler is not None:
        ckpt["opt_param_scheduler"] = opt_param_scheduler
    if rng_state is not None:
        ckpt["rng_state"] = rng_state
    ckpt["hpcmeg"] = {"recipe": recipe, "data_state": data_state, "extra": extra}
    return ckpt


def checkpoint_models(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The nested model dicts of a loaded shard: [state["model"]], or the virtual-pipeline chunks
    [state["model0"], state["model1"], ...] in chunk order."""
    if "model" in state:
        return [state["model"]]
    chunks = sorted((int(k[len("model"):]), v) for k, v in state.items() if k.startswith("model") and k[5:].isdigit())
    if not chunks or [i for i, _ in chunks] != list(range(len(chunks))):
        raise KeyError("the checkpoint has no 'model' entry (nor 'model0', 'model1', ... of a virtual pipeline)")
    return [v for _, v in chunks]
