"""hpcmeg import-hf refuses a Hugging Face GPT-2 dir whose config.json disagrees with itself or with its
weights: a real tiny GPT2LMHeadModel saved by transformers, damaged one way per case (config.json
and/or model.safetensors), run through the real CLI. Each case: exit 1, one line naming config.json's
key and the tensor (with expected and found shapes where it is a shape), no traceback, nothing written."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from cli_helpers import hpcmeg
from hpcmeg.cli import main as hpcmeg_main
from hpcmeg.convert.merge import load_full_checkpoint

# 50257 rows: GPT-2's vocabulary, so the dir needs no tokenizer files (import-hf uses the embedded one).
VOCAB, H, LAYERS, HEADS, POS = 50257, 16, 2, 2, 32
CFG_NAME, ST_NAME = "config.json", "model.safetensors"


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    d = str(tmp_path_factory.mktemp("hfgood") / "gpt2")
    GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=POS, n_embd=H, n_layer=LAYERS,
                               n_head=HEADS)).save_pretrained(d)
    return d


def _edit(d: str, config: dict | None = None, weights=None, raw_config: str | None = None) -> None:
    """Change config.json keys (raw_config: replace the text) and/or the weights (weights(sd) edits in place)."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(d, CFG_NAME)
    if config:
        cfg = json.load(open(path))
        cfg.update(config)
        with open(path, "w") as f:
            json.dump(cfg, f)  # float('nan') is written as NaN, which json.load reads back
    if raw_config is not None:
        with open(path, "w") as f:
            f.write(raw_config)
    if weights:
        st = os.path.join(d, ST_NAME)
        sd = load_file(st)
        weights(sd)
        save_file({k: v.contiguous() for k, v in sd.items()}, st, metadata={"format": "pt"})


def _set(name: str, make):
    def f(sd):
        sd[name] = make(sd)
    return f


def _drop(name: str):
    return lambda sd: sd.pop(name)


def _narrow_mlp(sd):  # block 1's MLP 60 wide where the config (n_inner null) says 4 x 16 = 64
    b = "transformer.h.1.mlp."
    sd[b + "c_fc.weight"], sd[b + "c_fc.bias"] = sd[b + "c_fc.weight"][:, :60], sd[b + "c_fc.bias"][:60]
    sd[b + "c_proj.weight"] = sd[b + "c_proj.weight"][:60]


# id -> (config changes, weight edit, substrings the one stderr line must contain)
CASES = {
    "n_layer_fewer_than_blocks": ({"n_layer": 1}, None,
                                  ["config.json n_layer=1", "hold 2 blocks", "transformer.h.1.ln_1.weight",
                                   "dropped", "set n_layer to 2"]),
    "n_layer_more_than_blocks": ({"n_layer": 3}, None,
                                 ["config.json n_layer=3", "only 2 blocks", "transformer.h.2.ln_1.weight", "missing",
                                  "set n_layer to 2"]),
    "n_inner_vs_c_fc": ({"n_inner": 48}, None,
                        ["config.json n_inner=48", "transformer.h.0.mlp.c_fc.weight", "expected shape [16, 48], "
                         "found [16, 64]", "more tensors"]),
    "n_positions_vs_wpe": ({"n_positions": 16}, None,
                           ["config.json n_positions=16", "transformer.wpe.weight",
                            "expected shape [16, 16], found [32, 16]"]),
    "n_embd_vs_all": ({"n_embd": 32}, None,
                      ["config.json n_embd=32", "transformer.wte.weight", "expected shape [50257, 32], found "
                       "[50257, 16]", "more tensors"]),
    "vocab_size_vs_wte": ({"vocab_size": 50000}, None,
                          ["config.json vocab_size=50000", "transformer.wte.weight",
                           "expected shape [50000, 16], found [50257, 16]"]),
    "n_head_not_dividing": ({"n_head": 3}, None, ["n_head=3 does not divide n_embd=16", "attn.c_attn.weight"]),
    "epsilon_string": ({"layer_norm_epsilon": "1e-5"}, None, ["layer_norm_epsilon='1e-5'", "finite number > 0",
                                                                       "transformer.ln_f"]),
    "epsilon_zero": ({"layer_norm_epsilon": 0}, None, ["layer_norm_epsilon=0 ", "finite number > 0"]),
    "epsilon_nan": ({"layer_norm_epsilon": float("nan")}, None, ["layer_norm_epsilon=nan", "finite number > 0"]),
    "resid_pdrop_1.5": ({"resid_pdrop": 1.5}, None, ["resid_pdrop=1.5", "[0, 1)", "mlp.c_proj"]),
    "embd_pdrop_negative": ({"embd_pdrop": -0.1}, None, ["embd_pdrop=-0.1", "[0, 1)"]),
    "embd_pdrop_differs": ({"embd_pdrop": 0.0}, None, ["embd_pdrop=0.0 differs from resid_pdrop=0.1",
                                                        "transformer.wte", "set both to one value"]),
    "attn_pdrop_string": ({"attn_pdrop": "0.1"}, None, ["attn_pdrop='0.1'", "[0, 1)"]),
    "initializer_range_negative": ({"initializer_range": -0.02}, None, ["initializer_range=-0.02", "> 0"]),
    "n_inner_not_integer": ({"n_inner": 64.5}, None, ["n_inner=64.5", "positive integer"]),
    "mlp_weight_narrower": (None, _narrow_mlp,
                            ["config.json n_inner=None (4 x n_embd = 64)", "transformer.h.1.mlp.c_fc.weight",
                             "expected shape [16, 64], found [16, 60]", "(and 2 more tensors)"]),
    "wpe_wider": (None, _set("transformer.wpe.weight", lambda sd: torch.randn(POS, 20)),
                  ["config.json n_embd=16", "transformer.wpe.weight", "expected shape [32, 16], found [32, 20]"]),
    "tensor_missing": (None, _drop("transformer.h.0.ln_2.bias"),
                       ["transformer.h.0.ln_2.bias missing", "expected [16]", "config.json n_embd=16"]),
    "tensor_unexpected": (None, _set("score.weight", lambda sd: torch.randn(2, H)),
                          ["unexpected weight score.weight [2, 16]", "GPT2LMHeadModel"]),
    "lm_head_untied": (None, _set("lm_head.weight", lambda sd: sd["transformer.wte.weight"] + 1),
                       ["config.json tie_word_embeddings=True", "lm_head.weight differs from transformer.wte.weight",
                        "largest difference 1"]),
    "dtype_integer": (None, _set("transformer.ln_f.weight", lambda sd: torch.ones(H, dtype=torch.int64)),
                      ["transformer.ln_f.weight has dtype torch.int64", "config.json dtype=float32",
                       "floating point"]),
}


def _run(d: str, out_root, capsys=None) -> tuple[int, list[str], str]:
    """`hpcmeg import-hf d <out_root>/ck`: as a process, or (capsys given) through the same entry
    point in this process, which spares the ~5 s of importing torch and transformers per case; an
    exception escaping main() fails the test as a traceback would."""
    ck = os.path.join(str(out_root), "ck")
    if capsys is None:
        r = hpcmeg("import-hf", d, ck, check=False)
        rc, out, err = r.returncode, r.stdout, r.stderr
    else:
        rc = hpcmeg_main(["import-hf", d, ck])
        out, err = capsys.readouterr()
    assert not os.path.exists(ck), "a refused import wrote its output dir"
    assert not [e for e in os.listdir(str(out_root)) if ".tmp-" in e], "a staging dir was left behind"
    assert "Traceback" not in err + out, err[-3000:]
    return rc, [ln for ln in err.splitlines() if ln.strip()], out


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_disagreement_refused_in_one_line(good_dir, tmp_path, capsys, case):
    config, weights, expect = CASES[case]
    d = str(tmp_path / "hf")
    shutil.copytree(good_dir, d)
    _edit(d, config, weights)
    out = tmp_path / "out"
    out.mkdir()
    rc, lines, _ = _run(d, out, capsys)
    assert rc == 1 and len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("hpcmeg import-hf: ") and d in line, line
    for s in expect:
        assert s in line, f"{s!r} not in: {line}"


def test_independent_problems_one_line_each(good_dir, tmp_path):
    """Two keys wrong at once: both reported, each on its own line naming its key and tensor."""
    d = str(tmp_path / "hf")
    shutil.copytree(good_dir, d)
    _edit(d, {"n_positions": 16, "n_inner": 48}, _drop("transformer.ln_f.bias"))
    out = tmp_path / "out"
    out.mkdir()
    rc, lines, _ = _run(d, out)
    assert rc == 1 and len(lines) == 3, lines
    for want in (("n_positions=16", "transformer.wpe.weight"), ("n_inner=48", "transformer.h.0.mlp.c_fc.weight"),
                 ("transformer.ln_f.bias missing", "n_embd=16")):
        assert sum(all(w in ln for w in want) for ln in lines) == 1, (want, lines)


def test_stored_tied_head_and_mask_buffers_accepted(good_dir, tmp_path):
    """What older transformers versions stored next to the weights (lm_head.weight equal to wte, the
    per-block causal-mask buffers) is accepted and not imported."""
    d = str(tmp_path / "hf")
    shutil.copytree(good_dir, d)

    def old_style(sd):
        sd["lm_head.weight"] = sd["transformer.wte.weight"].clone()
        for i in range(LAYERS):
            sd[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, POS, POS, dtype=torch.bool))
            sd[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)

    _edit(d, None, old_style)
    ck = str(tmp_path / "ck")
    r = hpcmeg("import-hf", d, ck)
    assert "wrote" in r.stdout
    full = load_full_checkpoint(ck).full
    from safetensors.torch import load_file

    src = load_file(os.path.join(d, ST_NAME))
    assert torch.equal(full["embedding.word_embeddings.weight"][:VOCAB], src["transformer.wte.weight"])
    assert not [k for k in full if "masked_bias" in k or k.endswith("attn.bias")]
