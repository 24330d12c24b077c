"""What `hpcmeg import-hf` checks before it writes anything: config.json on its own, then every weight
against it. A checkpoint that passes is one hpcmeg's GPT loads strictly and computes like transformers.

Contract
  HFModelError(lines)                     a ConvertError carrying one line per independent problem
  check_hf_config(cfg, path) -> [line]    config.json alone: model_type gpt2, a tanh-GELU activation,
                                          the options hpcmeg's GPT implements, positive integer sizes
                                          (n_inner null or positive), n_head dividing n_embd,
                                          layer_norm_epsilon and initializer_range finite and > 0,
                                          resid_pdrop / embd_pdrop / attn_pdrop numbers in [0, 1),
                                          embd_pdrop equal to resid_pdrop (one hidden dropout)
  check_hf_weights(cfg, sd, where) -> [line]
                                          the weights against a config that passed check_hf_config:
                                          n_layer = the number of transformer.h.N blocks (more or fewer
                                          is refused: fewer would silently drop layers), every tensor's
                                          shape from n_embd / n_positions / vocab_size / n_inner, no
                                          tensor missing, none unexpected (the old attention-mask
                                          buffers h.N.attn.bias / masked_bias excepted), floating dtypes,
                                          lm_head.weight (if stored) equal to wte (tied embeddings)
Every line names config.json's key and the tensor (name, expected and found shape). A config key that
many tensors disagree with (a wrong n_embd) gives one line: its first tensor and how many more; with
n_inner null the MLP width counts as n_embd's.
"""
from __future__ import annotations

import math
import re
from typing import Any

import torch

from hpcmeg.convert.hf import _TANH_GELUS, ConvertError

# Options of GPT2Config that change what the model computes, with the value hpcmeg's GPT implements.
_FIXED_OPTIONS = (("scale_attn_by_inverse_layer_idx", False), ("add_cross_attention", False),
                  ("tie_word_embeddings", True), ("scale_attn_weights", True))
_REQUIRED_SIZES = ("n_layer", "n_head", "n_embd", "n_positions")
# GPT2Config's defaults for the float options that config.json may leave out.
_FLOAT_DEFAULTS = {"layer_norm_epsilon": 1e-5, "initializer_range": 0.02}
# The tensors each float option acts on, for the message.
_USED_BY = {"layer_norm_epsilon": "the LayerNorms transformer.h.*.ln_1 / ln_2 and transformer.ln_f",
            "initializer_range": "the initialization of new weights when fine-tuning",
            "resid_pdrop": "the outputs of transformer.h.*.attn.c_proj and mlp.c_proj",
            "embd_pdrop": "the sum of transformer.wte and transformer.wpe",
            "attn_pdrop": "the attention probabilities of transformer.h.*.attn"}
_DROPOUTS = ("resid_pdrop", "embd_pdrop", "attn_pdrop")
# Per-block causal-mask buffers that older transformers versions stored with the weights; not weights.
_MASK_BUFFER = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)$")
_BLOCK = re.compile(r"h\.(\d+)\.")


class HFModelError(ConvertError):
    """One or more problems with a Hugging Face model dir; `lines` has one self-contained line each."""

    def __init__(self, lines: list[str]):
        super().__init__(" | ".join(lines))
        self.lines = list(lines)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_hf_config(cfg: dict[str, Any], path: str) -> list[str]:
    """Problems of config.json (at `path`) that need no weights to see; [] if none."""
    if cfg.get("model_type") != "gpt2":
        return [f"{path}: model_type {cfg.get('model_type')!r}; only GPT-2 models (model_type gpt2) map onto "
                f"hpcmeg's Megatron GPT"]
    out = []
    act = cfg.get("activation_function", "gelu_new")
    if not isinstance(act, str) or act not in _TANH_GELUS:
        out.append(f"{path}: activation_function {act!r}; hpcmeg's GPT uses tanh-GELU ({', '.join(_TANH_GELUS)}), "
                   f"so this model would compute differently")
    for key, ok in _FIXED_OPTIONS:
        if cfg.get(key, ok) != ok:
            out.append(f"{path}: {key}={cfg[key]!r} is not supported (hpcmeg's GPT needs {key}={ok})")
    for key in _REQUIRED_SIZES:
        v = cfg.get(key)
        if not _is_int(v) or v < 1:
            what = "missing" if key not in cfg else f"{v!r} is not a positive integer"
            out.append(f"{path}: {key} {what}; a GPT-2 config gives n_layer, n_head, n_embd and n_positions as "
                       f"positive integers")
    for key, null_means in (("vocab_size", "the rows of transformer.wte.weight"), ("n_inner", "4 x n_embd")):
        v = cfg.get(key)
        if v is not None and (not _is_int(v) or v < 1):
            out.append(f"{path}: {key}={v!r} is not a positive integer; give one, or null for {null_means}")
    h, heads = cfg.get("n_embd"), cfg.get("n_head")
    if _is_int(h) and _is_int(heads) and h >= 1 and heads >= 1 and h % heads:
        out.append(f"{path}: n_head={heads} does not divide n_embd={h}: transformer.h.*.attn.c_attn.weight "
                   f"[{h}, {3 * h}] cannot be split into {heads} heads; fix n_head or n_embd")
    for key, default in _FLOAT_DEFAULTS.items():
        v = cfg.get(key, default)
        if not _is_number(v) or v <= 0:
            out.append(f"{path}: {key}={v!r} must be a finite number > 0 (GPT-2 uses {default}); it sets "
                       f"{_USED_BY[key]}")
    for key in _DROPOUTS:
        v = cfg.get(key, 0.1)
        if not _is_number(v) or not 0 <= v < 1:
            out.append(f"{path}: {key}={v!r} must be a dropout probability in [0, 1) (GPT-2 uses 0.1); it drops "
                       f"{_USED_BY[key]}")
    # Megatron's GPT has one hidden_dropout for the embeddings' sum and the blocks' outputs.
    emb, resid = cfg.get("embd_pdrop", 0.1), cfg.get("resid_pdrop", 0.1)
    if all(_is_number(v) and 0 <= v < 1 for v in (emb, resid)) and emb != resid:
        out.append(f"{path}: embd_pdrop={emb!r} differs from resid_pdrop={resid!r}; hpcmeg's GPT applies one hidden "
                   f"dropout to {_USED_BY['embd_pdrop']} and to {_USED_BY['resid_pdrop']}: set both to one value")
    return out


def _shape(s) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in s) + "]"


def expected_shapes(cfg: dict[str, Any], prefix: str) -> dict[str, tuple[tuple[int | None, str], ...]]:
    """Weight name -> its dims, each (size, config key it comes from); size None = not fixed by config."""
    h, pos, vocab = cfg["n_embd"], cfg["n_positions"], cfg.get("vocab_size")
    ffn = cfg.get("n_inner") or 4 * h
    H, F = (h, "n_embd"), (ffn, "n_inner")
    exp: dict[str, tuple[tuple[int | None, str], ...]] = {
        prefix + "wte.weight": ((vocab, "vocab_size"), H), prefix + "wpe.weight": ((pos, "n_positions"), H),
        prefix + "ln_f.weight": (H,), prefix + "ln_f.bias": (H,)}
    for i in range(cfg["n_layer"]):
        b = f"{prefix}h.{i}."
        # HF's Conv1D stores [in, out]: c_attn [h, 3h] (q, k, v), c_fc [h, ffn], c_proj [ffn, h].
        exp.update({b + "ln_1.weight": (H,), b + "ln_1.bias": (H,), b + "ln_2.weight": (H,), b + "ln_2.bias": (H,),
                    b + "attn.c_attn.weight": (H, (3 * h, "n_embd")), b + "attn.c_attn.bias": ((3 * h, "n_embd"),),
                    b + "attn.c_proj.weight": (H, H), b + "attn.c_proj.bias": (H,),
                    b + "mlp.c_fc.weight": (H, F), b + "mlp.c_fc.bias": (F,),
                    b + "mlp.c_proj.weight": (F, H), b + "mlp.c_proj.bias": (H,)})
    return exp


def _key_value(cfg: dict[str, Any], key: str) -> str:
    if key == "n_inner" and cfg.get("n_inner") is None:
        return f"n_inner=None (4 x n_embd = {4 * cfg['n_embd']})"
    return f"{key}={cfg.get(key)}"


def _blame(dims: tuple[tuple[int | None, str], ...], found: torch.Size) -> list[str]:
    """The config keys a tensor's shape disagrees with ([] if it agrees); a rank mismatch blames the
    first dim's key."""
    if len(dims) != len(found):
        return [dims[0][1]]
    return list(dict.fromkeys(k for (size, k), f in zip(dims, found) if size is not None and size != f))


def check_hf_weights(cfg: dict[str, Any], sd: dict[str, torch.Tensor], where: str) -> list[str]:
    """Problems of the weights `sd` (read from `where`) against a config that check_hf_config passed."""
    prefix = "transformer." if any(k.startswith("transformer.") for k in sd) else ""
    exp = expected_shapes(cfg, prefix)
    blocks = sorted({int(m.group(1)) for k in sd if k.startswith(prefix) and (m := _BLOCK.match(k[len(prefix):]))})
    have = blocks[-1] + 1 if blocks else 0
    groups: dict[str, list[str]] = {}  # config key or kind -> lines; one line each in the end
    for group, line in (_layer_count(cfg, prefix, have, where) + _expected_tensors(cfg, sd, exp, prefix, have, where)
                        + _other_tensors(cfg, sd, exp, prefix, where)):
        groups.setdefault(group, []).append(line)
    if cfg.get("n_inner") is None and "n_embd" in groups and "n_inner" in groups:
        groups["n_embd"] += groups.pop("n_inner")  # the MLP width is 4 x n_embd: one wrong key, one line
    return [lines[0] + (f" (and {len(lines) - 1} more tensors)" if len(lines) > 1 else "")
            for lines in groups.values()]


def _layer_count(cfg: dict[str, Any], prefix: str, have: int, where: str) -> list[tuple[str, str]]:
    """(group, line) when the weights hold more or fewer blocks (``have``) than config.json's n_layer."""
    n_layer = cfg["n_layer"]
    span = f"{prefix}h.0 .. {prefix}h.{have - 1}" if have else "none"

    def blocks_from(first: int, last: int) -> str:
        return f"block {first}" if first == last else f"blocks {first} .. {last}"

    if have > n_layer:
        return [("n_layer", f"{where}: config.json n_layer={n_layer} but the weights hold {have} blocks ({span}): "
                            f"{prefix}h.{n_layer}.ln_1.weight and the rest of {blocks_from(n_layer, have - 1)} would "
                            f"be dropped; set n_layer to {have}")]
    if have < n_layer:
        return [("n_layer", f"{where}: config.json n_layer={n_layer} but the weights hold only {have} blocks ({span}): "
                            f"{prefix}h.{have}.ln_1.weight and the rest of {blocks_from(have, n_layer - 1)} are "
                            f"missing; " + (f"set n_layer to {have}" if have else "give a GPT-2's block weights"))]
    return []


def _expected_tensors(cfg: dict[str, Any], sd: dict[str, torch.Tensor], exp: dict, prefix: str, have: int,
                      where: str) -> list[tuple[str, str]]:
    """(group, line) for every tensor config.json implies that is missing (outside a missing block),
    has another shape (grouped by the config key it disagrees with) or is not floating point."""
    out = []
    for name, dims in exp.items():
        if name not in sd:
            block = _BLOCK.match(name[len(prefix):])
            if block and int(block.group(1)) >= have:
                continue  # a missing block: the n_layer line says it
            out.append(("missing", f"{where}: {name} missing (expected {_shape(s for s, _ in dims)} for config.json "
                                   f"{_key_value(cfg, dims[0][1])}, n_layer={cfg['n_layer']}); give the complete "
                                   f"weights"))
            continue
        tensor = sd[name]
        keys = _blame(dims, tensor.shape)
        for key in keys:
            want = _shape(s for s, _ in dims)
            out.append((key, f"{where}: config.json {_key_value(cfg, key)} disagrees with {name}: expected shape "
                             f"{want}, found {_shape(tensor.shape)}; fix {key} in config.json or give the matching "
                             f"weights"))
        if not keys and not tensor.dtype.is_floating_point:
            dkey = "dtype" if "dtype" in cfg else "torch_dtype"
            out.append(("dtype", f"{where}: {name} has dtype {tensor.dtype} (config.json {dkey}={cfg.get(dkey)}); "
                                 f"GPT-2 weights are floating point"))
    return out


def _other_tensors(cfg: dict[str, Any], sd: dict[str, torch.Tensor], exp: dict, prefix: str,
                   where: str) -> list[tuple[str, str]]:
    """(group, line) for every stored tensor config.json does not imply: an lm_head that is not wte's
    tie, or an unexpected weight (old mask buffers and the blocks past n_layer excepted)."""
    n_layer = cfg["n_layer"]
    out = []
    for name in sorted(sd):
        if name in exp:
            continue
        rest = name[len(prefix):] if name.startswith(prefix) else None
        if rest is not None and _MASK_BUFFER.match(rest):
            continue
        if rest is not None and (block := _BLOCK.match(rest)) and int(block.group(1)) >= n_layer:
            continue  # an extra block: the n_layer line says it
        if name == "lm_head.weight":
            wte = sd.get(prefix + "wte.weight")
            lm = sd[name]
            if wte is None or (lm.shape == wte.shape and torch.equal(lm, wte)):
                continue
            diff = (f"shapes {_shape(lm.shape)} vs {_shape(wte.shape)}" if lm.shape != wte.shape else
                    f"largest difference {(lm.float() - wte.float()).abs().max().item():.3g}")
            out.append(("tie", f"{where}: config.json tie_word_embeddings=True but lm_head.weight differs from "
                               f"{prefix}wte.weight ({diff}); hpcmeg's GPT ties them, so this output layer would be "
                               f"lost"))
            continue
        arch = cfg.get("architectures")
        out.append(("unexpected", f"{where}: unexpected weight {name} {_shape(sd[name].shape)} (config.json "
                                  f"architectures={arch}; a GPT2LMHeadModel with n_layer={n_layer} has no such "
                                  f"tensor); give a GPT2LMHeadModel's weights"))
    return out
