"""Hugging Face GPT-2 directory -> Megatron-layout `release` checkpoint that `hpcmeg train` can fine-tune.

Contract
  import_hf(hf_dir, ckpt_dir, tp=1, pp=1, make_vocab_size_divisible_by=128) -> ckpt_dir
    reads    hf_dir/config.json (model_type gpt2, tanh-GELU activation, tied embeddings) and the weights
             (model.safetensors, sharded safetensors with an index, or pytorch_model.bin loaded with
             weights_only=True); nothing is downloaded.
    checks   config.json, then every weight against it (hf_import_checks), before anything is written:
             HFModelError lists every problem, one line each naming config.json's key and the tensor.
    writes   ckpt_dir/latest_checkpointed_iteration.txt = "release"
             ckpt_dir/release/mp_rank_TT[_PPP]/model_optim_rng.pt (+ hpcmeg manifest), each with
               args (plain argparse.Namespace: sizes, orig/padded vocab, tp/pp, tokenizer, dropouts),
               checkpoint_version 3.0, iteration 0, the model shard, no optimizer/scheduler/RNG, and
               "hpcmeg": {"recipe": {"model": ..., "data": tokenizer fields, "parallel": ...}} so that
               `hpcmeg convert` round-trips it and training can check its recipe against it;
             ckpt_dir/tokenizer/ the HF dir's tokenizer files (the recipe stub points at them).
    Vocabulary rows are padded with zeros to a multiple of make_vocab_size_divisible_by x tp
    (Megatron's rule); weights keep the HF file's dtype, so HF -> hpcmeg -> HF is bit-identical.
  cli_import_hf(args) -> exit code (`hpcmeg import-hf HF_DIR CKPT_DIR [--tp N --pp M]`); a refused model
    prints its problems one per line and exits 1, nothing written.
Fine-tuning: point the recipe's checkpoint.load at ckpt_dir; model sizes must match the recipe stub.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

import torch

from hpcmeg.convert.hf import ConvertError, hf_to_megatron_state
from hpcmeg.convert.hf_import_checks import HFModelError, check_hf_config, check_hf_weights
from hpcmeg.convert.hf_tokenizer import HF_TOKENIZER_FILES
from hpcmeg.convert.merge import OutputDirError, atomic_output_dir, check_output_dir, repad_vocab, split_full
from hpcmeg.megatron.layout import WORD_EMB, pad_vocab_size
from hpcmeg.errors import one_line
from hpcmeg.convert.reshard import write_checkpoint_layout
from hpcmeg.checkpoint.safe import safe_torch_load
from hpcmeg.megatron.args import make_checkpoint_dict, make_megatron_args
from hpcmeg.megatron.names import RELEASE_DIRNAME

TOKENIZER_SUBDIR = "tokenizer"


def read_hf_config(hf_dir: str) -> dict[str, Any]:
    """config.json as a dict, checked to be a GPT-2 that hpcmeg's model computes identically
    (hf_import_checks.check_hf_config; HFModelError lists every problem)."""
    path = os.path.join(hf_dir, "config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConvertError(f"{path}: cannot read the model config ({why}); give a Hugging Face GPT-2 model "
                           f"directory") from None
    if not isinstance(cfg, dict):
        raise ConvertError(f"{path}: a JSON {type(cfg).__name__}, not a model config; give a Hugging Face GPT-2 "
                           f"model directory")
    problems = check_hf_config(cfg, path)
    if problems:
        raise HFModelError(problems)
    return cfg


def read_hf_weights(hf_dir: str) -> dict[str, torch.Tensor]:
    """All weights of a HF model dir: safetensors (single or sharded) preferred, else pytorch_model.bin."""
    from safetensors.torch import load_file

    def shards(index: str) -> list[str]:
        path = os.path.join(hf_dir, index)
        try:
            with open(path) as f:
                return sorted(set(str(v) for v in json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConvertError(f"{path}: cannot read the shard index ({type(e).__name__}: {e}); it needs a "
                               f"weight_map of weight name -> file") from None

    if os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        files, loader = ["model.safetensors"], load_file
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors.index.json")):
        files, loader = shards("model.safetensors.index.json"), load_file
    elif os.path.isfile(os.path.join(hf_dir, "pytorch_model.bin")):
        files, loader = ["pytorch_model.bin"], safe_torch_load
    elif os.path.isfile(os.path.join(hf_dir, "pytorch_model.bin.index.json")):
        files, loader = shards("pytorch_model.bin.index.json"), safe_torch_load
    else:
        raise ConvertError(f"{hf_dir}: no model.safetensors or pytorch_model.bin (nor a sharded index)")
    sd: dict[str, torch.Tensor] = {}
    for name in files:
        path = os.path.join(hf_dir, name)
        try:
            sd.update(loader(path))
        except Exception as e:  # noqa: BLE001 - any read failure: name the file
            raise ConvertError(f"{path}: cannot read weights ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    return sd


def _tokenizer_fields(hf_dir: str, tok_dir: str, vocab_size: int) -> tuple[dict[str, Any], list[str]]:
    """Recipe data fields for the copied tokenizer (paths at its final place) and the files to copy."""
    files = [n for n in HF_TOKENIZER_FILES if os.path.isfile(os.path.join(hf_dir, n))]
    fields: dict[str, Any] = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": None, "merge_file": None,
                              "tokenizer_model": None}
    if {"vocab.json", "merges.txt"} <= set(files):
        with open(os.path.join(hf_dir, "vocab.json"), encoding="utf-8") as f:
            has_eod = "<|endoftext|>" in json.load(f)
        if has_eod:  # hpcmeg's own GPT-2 BPE path (preprocessing uses the same two files)
            fields.update(vocab_file=os.path.join(tok_dir, "vocab.json"), merge_file=os.path.join(tok_dir, "merges.txt"))
            return fields, files
    if "tokenizer.json" in files:
        fields.update(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tok_dir)
        return fields, files
    if vocab_size == 50257:  # no tokenizer shipped: the GPT-2 vocabulary embedded with hpcmeg
        return fields, []
    raise ConvertError(f"{hf_dir}: no tokenizer files (tokenizer.json or vocab.json + merges.txt) and the "
                       f"vocabulary ({vocab_size}) is not GPT-2's; add the tokenizer files to {hf_dir}")


def import_hf(hf_dir: str, ckpt_dir: str, tp: int = 1, pp: int = 1, make_vocab_size_divisible_by: int = 128) -> str:
    """See the file header."""
    if tp < 1 or pp < 1 or make_vocab_size_divisible_by < 1:
        raise ConvertError(f"--tp {tp} --pp {pp} --make-vocab-size-divisible-by {make_vocab_size_divisible_by}: "
                           f"each must be >= 1")
    check_output_dir(ckpt_dir)  # before reading the weights, not after
    cfg = read_hf_config(hf_dir)
    n_layer, n_head, h = cfg["n_layer"], cfg["n_head"], cfg["n_embd"]
    if n_head % tp or n_layer % pp:
        raise ConvertError(f"--tp {tp} --pp {pp}: need n_head={n_head} divisible by tp and n_layer={n_layer} by pp")
    sd = read_hf_weights(hf_dir)
    problems = check_hf_weights(cfg, sd, hf_dir)
    if problems:
        raise HFModelError(problems)
    full = hf_to_megatron_state(sd, n_layer, n_head, where=hf_dir)
    del sd
    vocab = full[WORD_EMB].shape[0]
    padded = pad_vocab_size(vocab, make_vocab_size_divisible_by, tp)
    full = repad_vocab(full, vocab, padded)
    ckpt_abs = os.path.abspath(ckpt_dir)
    tok_fields, tok_files = _tokenizer_fields(hf_dir, os.path.join(ckpt_abs, TOKENIZER_SUBDIR), vocab)
    ffn = cfg.get("n_inner") or 4 * h
    model = {"num_layers": n_layer, "hidden_size": h, "num_attention_heads": n_head, "ffn_hidden_size": ffn,
             "max_position_embeddings": cfg["n_positions"], "make_vocab_size_divisible_by": make_vocab_size_divisible_by,
             "vocab_size": vocab, "hidden_dropout": cfg.get("resid_pdrop", 0.1),
             "attention_dropout": cfg.get("attn_pdrop", 0.1), "init_method_std": cfg.get("initializer_range", 0.02),
             "layernorm_epsilon": cfg.get("layer_norm_epsilon", 1e-5)}
    recipe = {"model": model, "data": tok_fields, "parallel": {"tensor": tp, "pipeline": pp}}
    args = make_megatron_args(
        padded_vocab_size=padded, orig_vocab_size=vocab, hidden_size=h, num_layers=n_layer,
        num_attention_heads=n_head, ffn_hidden_size=ffn, max_position_embeddings=cfg["n_positions"],
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, world_size=tp * pp,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by, tokenizer_type=tok_fields["tokenizer_type"],
        vocab_file=tok_fields["vocab_file"], merge_file=tok_fields["merge_file"],
        tokenizer_model=tok_fields["tokenizer_model"], hidden_dropout=model["hidden_dropout"],
        attention_dropout=model["attention_dropout"], init_method_std=model["init_method_std"],
        layernorm_epsilon=model["layernorm_epsilon"], bias_gelu_fusion=True, finetune=True)
    extra = {"imported_from": os.path.abspath(hf_dir)}
    states = {key: make_checkpoint_dict(args=args, iteration=0, model=m, optimizer=None, opt_param_scheduler=None,
                                        rng_state=None, recipe=recipe, extra=extra)
              for key, m in split_full(full, tp, pp, n_layer, n_head).items()}
    with atomic_output_dir(ckpt_dir) as stage:
        write_checkpoint_layout(stage, RELEASE_DIRNAME, states, tp, pp)
        if tok_files:
            os.makedirs(os.path.join(stage, TOKENIZER_SUBDIR))
            for n in tok_files:
                shutil.copyfile(os.path.join(hf_dir, n), os.path.join(stage, TOKENIZER_SUBDIR, n))
    return ckpt_abs


def cli_import_hf(args) -> int:
    try:
        out = import_hf(args.hf_dir, args.ckpt_dir, args.tp, args.pp, args.make_vocab_size_divisible_by)
    except HFModelError as e:  # one line per independent problem, each naming the key and the tensor
        for line in e.lines:
            print(f"hpcmeg import-hf: {line}", file=sys.stderr)
        return 1
    except (ConvertError, OutputDirError, OSError) as e:
        print(f"hpcmeg import-hf: {one_line(e)}", file=sys.stderr)
        return 1
    print(f"hpcmeg import-hf: wrote {out} (release, tp={args.tp}, pp={args.pp}); fine-tune with "
          f"checkpoint.load: {out}")
    return 0
