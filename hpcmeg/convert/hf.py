"""Megatron-layout checkpoint (any TP x PP) -> Hugging Face GPT-2 model directory, offline.

Contract
  convert_checkpoint(ckpt_dir, out_dir, iteration=None, dtype="fp32", pytorch_bin=False,
                     tokenizer_dir=None) -> out_dir
    writes   config.json             GPT2LMHeadModel; vocab_size = the TRUE vocabulary (padding rows cut),
                                     activation gelu_new (hpcmeg/Megatron use tanh-GELU), n_positions,
                                     n_embd, n_layer, n_head, n_inner, epsilon, dropouts, bos/eos = the
                                     tokenizer's <|endoftext|> (or eos) id, tied embeddings
             model.safetensors       transformer.* weights in `dtype` (lm_head is tied: not stored)
             pytorch_model.bin       the same dict, only with pytorch_bin=True
             generation_config.json  bos/eos/pad ids
             tokenizer files         the run's own (hf_tokenizer.write_tokenizer_files)
             hpcmeg_source.json      provenance: checkpoint dir, iteration, layout (marks the dir as ours)
    Everything is written into a staging dir that is renamed to out_dir at the end; on any error
    out_dir is untouched. A missing or corrupt shard raises CheckpointReadError naming the file.
  convert_all(ckpt_dir, out_dir, ...) -> [dirs]: every committed iteration into out_dir/iter_XXXXXXX.
  megatron_to_hf_state / hf_to_megatron_state: the weight mapping, both directions (import_hf uses it).
  cli_convert(args) -> exit code (the `hpcmeg convert` entry point).

Mapping (interop doc §6.4): HF's Conv1D stores [in, out], i.e. the transpose of torch Linear; Megatron's
query_key_value rows are per head [q, k, v] while HF c_attn wants all q, then all k, then all v.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any

import torch

from hpcmeg.convert.hf_tokenizer import TokenizerError, TokenizerSource, source_from_dir, write_tokenizer_files
from hpcmeg.convert.merge import (CheckpointReadError, OutputDirError, atomic_output_dir, check_output_dir,
                                  load_full_checkpoint, readable_iterations)
from hpcmeg.megatron.layout import WORD_EMB
from hpcmeg.errors import one_line
from hpcmeg.fsutil import atomic_path
from hpcmeg.megatron.names import iter_dirname

DTYPES = {"fp32": (torch.float32, "float32"), "bf16": (torch.bfloat16, "bfloat16"), "fp16": (torch.float16, "float16")}
SOURCE_FILE = "hpcmeg_source.json"
_TANH_GELUS = ("gelu_new", "gelu_fast", "gelu_pytorch_tanh")


class ConvertError(ValueError):
    """Bad input for a conversion; the message names the file/key and the fix."""


# ---------------------------------------------------------------------------------- weight mapping

def _qkv_to_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[heads*3*hd, ...] per-head q,k,v rows -> [3*heads*hd, ...] (all q, all k, all v)."""
    rest = t.shape[1:]
    return t.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(-1, *rest)


def _qkv_from_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    rest = t.shape[1:]
    return t.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(-1, *rest)


def megatron_to_hf_state(full: dict[str, torch.Tensor], num_layers: int, num_attention_heads: int,
                         vocab_size: int) -> dict[str, torch.Tensor]:
    """Full hpcmeg/Megatron flat dict -> GPT2LMHeadModel state dict (tied lm_head omitted, vocab cut)."""
    sd = {"transformer.wte.weight": full[WORD_EMB][:vocab_size],
          "transformer.wpe.weight": full["embedding.position_embeddings.weight"],
          "transformer.ln_f.weight": full["encoder.final_layernorm.weight"],
          "transformer.ln_f.bias": full["encoder.final_layernorm.bias"]}
    for i in range(num_layers):
        m, h = f"encoder.layers.{i}.", f"transformer.h.{i}."
        sd[h + "ln_1.weight"] = full[m + "input_layernorm.weight"]
        sd[h + "ln_1.bias"] = full[m + "input_layernorm.bias"]
        sd[h + "attn.c_attn.weight"] = _qkv_to_hf(full[m + "self_attention.query_key_value.weight"], num_attention_heads).t()
        sd[h + "attn.c_attn.bias"] = _qkv_to_hf(full[m + "self_attention.query_key_value.bias"], num_attention_heads)
        sd[h + "attn.c_proj.weight"] = full[m + "self_attention.dense.weight"].t()
        sd[h + "attn.c_proj.bias"] = full[m + "self_attention.dense.bias"]
        sd[h + "ln_2.weight"] = full[m + "post_attention_layernorm.weight"]
        sd[h + "ln_2.bias"] = full[m + "post_attention_layernorm.bias"]
        sd[h + "mlp.c_fc.weight"] = full[m + "mlp.dense_h_to_4h.weight"].t()
        sd[h + "mlp.c_fc.bias"] = full[m + "mlp.dense_h_to_4h.bias"]
        sd[h + "mlp.c_proj.weight"] = full[m + "mlp.dense_4h_to_h.weight"].t()
        sd[h + "mlp.c_proj.bias"] = full[m + "mlp.dense_4h_to_h.bias"]
    return {k: v.contiguous() for k, v in sd.items()}


def hf_to_megatron_state(sd: dict[str, torch.Tensor], num_layers: int, num_attention_heads: int,
                         where: str = "HF state dict") -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel (or GPT2Model, no 'transformer.' prefix) state dict -> full flat dict, unpadded."""
    p = "transformer." if "transformer.wte.weight" in sd else ""

    def get(k: str) -> torch.Tensor:
        try:
            return sd[p + k]
        except KeyError:
            raise ConvertError(f"{where}: missing weight {p + k!r} (not a GPT-2 checkpoint with {num_layers} layers?)") from None

    full = {WORD_EMB: get("wte.weight"), "embedding.position_embeddings.weight": get("wpe.weight")}
    for i in range(num_layers):
        m, h = f"encoder.layers.{i}.", f"h.{i}."
        full[m + "input_layernorm.weight"] = get(h + "ln_1.weight")
        full[m + "input_layernorm.bias"] = get(h + "ln_1.bias")
        full[m + "self_attention.query_key_value.weight"] = _qkv_from_hf(get(h + "attn.c_attn.weight").t(), num_attention_heads)
        full[m + "self_attention.query_key_value.bias"] = _qkv_from_hf(get(h + "attn.c_attn.bias"), num_attention_heads)
        full[m + "self_attention.dense.weight"] = get(h + "attn.c_proj.weight").t()
        full[m + "self_attention.dense.bias"] = get(h + "attn.c_proj.bias")
        full[m + "post_attention_layernorm.weight"] = get(h + "ln_2.weight")
        full[m + "post_attention_layernorm.bias"] = get(h + "ln_2.bias")
        full[m + "mlp.dense_h_to_4h.weight"] = get(h + "mlp.c_fc.weight").t()
        full[m + "mlp.dense_h_to_4h.bias"] = get(h + "mlp.c_fc.bias")
        full[m + "mlp.dense_4h_to_h.weight"] = get(h + "mlp.c_proj.weight").t()
        full[m + "mlp.dense_4h_to_h.bias"] = get(h + "mlp.c_proj.bias")
    full["encoder.final_layernorm.weight"] = get("ln_f.weight")
    full["encoder.final_layernorm.bias"] = get("ln_f.bias")
    return {k: v.contiguous() for k, v in full.items()}


# ------------------------------------------------------------------------------------- config

def _arg(args: argparse.Namespace, recipe_model: dict, name: str, default: Any = None) -> Any:
    v = getattr(args, name, None)
    if v is None:
        v = recipe_model.get(name)
    return default if v is None else v


def hf_config_dict(args: argparse.Namespace, recipe_model: dict, vocab_size: int, bos_id: int, eos_id: int,
                   dtype_name: str) -> dict[str, Any]:
    """config.json for GPT2LMHeadModel from the checkpoint's args (recipe model section as fallback)."""
    from transformers import GPT2Config

    cfg = GPT2Config(
        vocab_size=vocab_size, n_positions=args.max_position_embeddings, n_embd=args.hidden_size,
        n_layer=args.num_layers, n_head=args.num_attention_heads,
        n_inner=_arg(args, recipe_model, "ffn_hidden_size", 4 * args.hidden_size),
        activation_function="gelu_new",  # tanh-approximated GELU, as hpcmeg and Megatron's fused bias-GeLU
        resid_pdrop=_arg(args, recipe_model, "hidden_dropout", 0.1),
        embd_pdrop=_arg(args, recipe_model, "hidden_dropout", 0.1),
        attn_pdrop=_arg(args, recipe_model, "attention_dropout", 0.1),
        layer_norm_epsilon=_arg(args, recipe_model, "layernorm_epsilon", 1e-5),
        initializer_range=_arg(args, recipe_model, "init_method_std", 0.02),
        bos_token_id=bos_id, eos_token_id=eos_id, tie_word_embeddings=True, scale_attn_weights=True,
        architectures=["GPT2LMHeadModel"],
    )
    d = cfg.to_dict()
    d["dtype" if "dtype" in d else "torch_dtype"] = dtype_name  # transformers 5 / 4 spelling
    return d


# ---------------------------------------------------------------------------------- tokenizer

def tokenizer_source(args: argparse.Namespace, recipe: dict | None, tokenizer_dir: str | None) -> TokenizerSource:
    """--tokenizer-dir, else the checkpoint's recipe data section, else Megatron's args."""
    if tokenizer_dir:
        return source_from_dir(tokenizer_dir)
    data = (recipe or {}).get("data")
    if data:
        return TokenizerSource(data.get("tokenizer_type") or "GPT2BPETokenizer", data.get("vocab_file"),
                               data.get("merge_file"), data.get("tokenizer_model"))
    ttype = getattr(args, "tokenizer_type", "GPT2BPETokenizer")
    if ttype in ("HuggingFaceTokenizer", "PretrainedFromHF"):
        return TokenizerSource("HuggingFaceTokenizer", tokenizer_model=getattr(args, "tokenizer_model", None)
                               or getattr(args, "tokenizer_name_or_path", None))
    return TokenizerSource(ttype, getattr(args, "vocab_file", None), getattr(args, "merge_file", None))


def _true_vocab_size(ck, tok_vocab: int, source: TokenizerSource) -> int:
    args, padded = ck.args, ck.full[WORD_EMB].shape[0]
    if tok_vocab > padded:
        raise ConvertError(f"tokenizer ({source.describe()}) has {tok_vocab} tokens but {ck.iter_dir} has only "
                           f"{padded} embedding rows: wrong tokenizer; pass --tokenizer-dir")
    orig = getattr(args, "orig_vocab_size", None)
    if orig is not None and orig != getattr(args, "padded_vocab_size", None) and orig != tok_vocab:
        raise ConvertError(f"tokenizer ({source.describe()}) has {tok_vocab} tokens but {ck.iter_dir} was trained "
                           f"with orig_vocab_size={orig}: wrong tokenizer; pass --tokenizer-dir")
    return tok_vocab


# --------------------------------------------------------------------------------- conversion

def _is_our_output(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, SOURCE_FILE))


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def convert_checkpoint(ckpt_dir: str, out_dir: str, iteration: int | str | None = None, dtype: str = "fp32",
                       pytorch_bin: bool = False, tokenizer_dir: str | None = None) -> str:
    """Convert one iteration of a Megatron-layout checkpoint dir into a HF GPT-2 directory (see header)."""
    if dtype not in DTYPES:
        raise ConvertError(f"dtype {dtype!r}: use one of {sorted(DTYPES)}")
    torch_dtype, dtype_name = DTYPES[dtype]
    check_output_dir(out_dir, replaceable=_is_our_output)  # before minutes of loading, not after
    ck = load_full_checkpoint(ckpt_dir, iteration)
    args, recipe = ck.args, ck.recipe or {}
    source = tokenizer_source(args, recipe, tokenizer_dir)
    with atomic_output_dir(out_dir, replaceable=_is_our_output) as stage:
        tok = write_tokenizer_files(stage, source, model_max_length=args.max_position_embeddings)
        vocab = _true_vocab_size(ck, tok.vocab_size, source)
        sd = megatron_to_hf_state(ck.full, args.num_layers, args.num_attention_heads, vocab)
        sd = {k: v.to(torch_dtype).contiguous() for k, v in sd.items()}
        from safetensors.torch import save_file

        # through fsutil: safetensors creates its file 0o600; atomic_path gives the umask's mode
        with atomic_path(os.path.join(stage, "model.safetensors"), fsync=False) as tmp:
            save_file(sd, tmp, metadata={"format": "pt"})
        if pytorch_bin:
            torch.save(sd, os.path.join(stage, "pytorch_model.bin"))
        _write_json(os.path.join(stage, "config.json"),
                    hf_config_dict(args, recipe.get("model") or {}, vocab, tok.bos_token_id, tok.eos_token_id, dtype_name))
        _write_json(os.path.join(stage, "generation_config.json"),
                    {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                     "pad_token_id": tok.eos_token_id, "do_sample": False})
        _write_json(os.path.join(stage, SOURCE_FILE), {
            "checkpoint_dir": os.path.abspath(ckpt_dir), "iteration": ck.iteration, "tp": ck.tp, "pp": ck.pp,
            "padded_vocab_size": int(ck.full[WORD_EMB].shape[0]), "vocab_size": vocab, "dtype": dtype,
            "tokenizer": source.describe(),
            "consumed_train_samples": getattr(args, "consumed_train_samples", None)})
    return os.path.abspath(out_dir)


def convert_all(ckpt_dir: str, out_dir: str, **kw: Any) -> list[str]:
    """Every committed iteration (and release) into out_dir/<iter_XXXXXXX|release>."""
    its = readable_iterations(ckpt_dir)
    if not its:
        raise CheckpointReadError(f"{ckpt_dir}: no committed checkpoint to convert")
    out_dir = os.path.abspath(out_dir)
    check_output_dir(os.path.join(out_dir, iter_dirname(its[0])), replaceable=_is_our_output)
    made = []  # out_dir and the parents this call creates (deepest first): removed again on failure
    d = out_dir
    while not os.path.exists(d):
        made.append(d)
        d = os.path.dirname(d)
    done, new = [], []
    try:
        for it in its:
            sub = os.path.join(out_dir, iter_dirname(it))
            fresh = not os.path.exists(sub)
            done.append(convert_checkpoint(ckpt_dir, sub, iteration=it, **kw))
            if fresh:
                new.append(sub)
    except BaseException:
        # all or nothing: outputs this call created go again (replaced earlier ones were complete
        # conversions and have been swapped for complete new ones; they stay)
        for sub in new:
            shutil.rmtree(sub, ignore_errors=True)
        for d in made:
            try:
                os.rmdir(d)  # empty by now unless someone else writes there: then it stays
            except OSError:
                pass
        raise
    return done


def cli_convert(args: argparse.Namespace) -> int:
    """`hpcmeg convert CKPT_DIR OUT_DIR [--iteration N | --all] [--dtype] [--pytorch-bin] [--tokenizer-dir]`."""
    kw = dict(dtype=args.dtype, pytorch_bin=args.pytorch_bin, tokenizer_dir=args.tokenizer_dir)
    try:
        if getattr(args, "all", False):
            outs = convert_all(args.ckpt_dir, args.out_dir, **kw)
        else:
            it = args.iteration
            outs = [convert_checkpoint(args.ckpt_dir, args.out_dir, iteration=it, **kw)]
    except (CheckpointReadError, ConvertError, TokenizerError, OutputDirError, OSError) as e:
        print(f"hpcmeg convert: {one_line(e)}", file=sys.stderr)
        return 1
    for o in outs:
        print(f"hpcmeg convert: wrote {o}")
    return 0


__all__ = ["convert_checkpoint", "convert_all", "cli_convert", "megatron_to_hf_state", "hf_to_megatron_state",
           "hf_config_dict", "tokenizer_source", "ConvertError"]
