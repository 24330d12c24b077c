"""hpcmeg convert: Megatron-layout checkpoints (TP1PP1, TP2, PP2, TP2xPP2 via reshard) -> Hugging Face
GPT-2 dirs whose logits equal hpcmeg's own forward; offline AutoModel/AutoTokenizer + generate;
agreement with transformers' own convert_megatron_gpt2_checkpoint.py; dtype/--pytorch-bin/--all;
corrupt or missing shards and unknown iterations fail with one message naming the file, OUT_DIR untouched.

Also the shared tiny-run helpers (`make_run`, `hf_logits`) that test_reshard.py / test_import_hf.py import.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import (FFN, HEADS, LAYERS, OFFLINE_ENV, POS, VOCAB, H, hf_logits, make_run, real_tokens,  # noqa: F401
                     rel_err, run_transformers_converter)
from hpcmeg.cli import main as hpcmeg_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("conv")
    ckpt = str(root / "ckpt")
    model = make_run(ckpt, iterations=(5, 10))
    return {"root": root, "ckpt": ckpt, "model": model}


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_logits_equal_hpcmeg_forward(run, tp, pp):
    src = run["ckpt"]
    if (tp, pp) != (1, 1):
        src = str(run["root"] / f"ckpt_tp{tp}pp{pp}")
        assert hpcmeg_main(["reshard", run["ckpt"], src, "--tp", str(tp), "--pp", str(pp)]) == 0
        shard_dirs = sorted(d for d in os.listdir(os.path.join(src, "iter_0000010")) if d.startswith("mp_rank"))
        assert len(shard_dirs) == tp * pp
    out = str(run["root"] / f"hf_tp{tp}pp{pp}")
    assert hpcmeg_main(["convert", src, out]) == 0
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["vocab_size"] == VOCAB  # the true vocabulary, not 50304 / 50432
    assert (cfg["activation_function"], cfg["n_positions"], cfg["n_embd"], cfg["n_layer"], cfg["n_head"],
            cfg["n_inner"]) == ("gelu_new", POS, H, LAYERS, HEADS, FFN)
    assert cfg["bos_token_id"] == cfg["eos_token_id"] == 50256
    assert json.load(open(os.path.join(out, "generation_config.json")))["eos_token_id"] == 50256
    tokens = real_tokens()
    with torch.no_grad():
        ref = run["model"](tokens)[..., :VOCAB]
    got = hf_logits(out, tokens)
    assert got.shape == ref.shape
    assert rel_err(got, ref) < 1e-5


def test_offline_automodel_autotokenizer_generate(run):
    out = str(run["root"] / "hf_auto")
    assert hpcmeg_main(["convert", run["ckpt"], out]) == 0
    for f in ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "model.safetensors", "config.json", "generation_config.json"):
        assert os.path.isfile(os.path.join(out, f)), f
    code = f"""
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained({out!r})
model = AutoModelForCausalLM.from_pretrained({out!r}).eval()
assert tok("Hello world").input_ids == [15496, 995], tok("Hello world").input_ids
assert tok.eos_token_id == 50256 and len(tok) == 50257
ids = tok("def main():", return_tensors="pt").input_ids
gen = model.generate(ids, max_new_tokens=12, do_sample=False)
assert gen.shape[1] > ids.shape[1]
text = tok.decode(gen[0], skip_special_tokens=True)
assert text.startswith("def main():") and len(text) > len("def main():"), text
print("GENERATED", repr(text))
"""
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, **OFFLINE_ENV}, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "GENERATED" in r.stdout


def test_dtype_and_pytorch_bin(run):
    from safetensors.torch import load_file

    out = str(run["root"] / "hf_bf16")
    assert hpcmeg_main(["convert", run["ckpt"], out, "--dtype", "bf16", "--pytorch-bin"]) == 0
    st = load_file(os.path.join(out, "model.safetensors"))
    binsd = torch.load(os.path.join(out, "pytorch_model.bin"), weights_only=True)
    assert set(st) == set(binsd) and all(v.dtype == torch.bfloat16 for v in st.values())
    assert all(torch.equal(st[k], binsd[k]) for k in st)
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    ref = run["model"].state_dict()["embedding.word_embeddings.weight"][:VOCAB].to(torch.bfloat16)
    assert torch.equal(st["transformer.wte.weight"], ref)


def test_all_iterations_and_reconvert(run, capsys):
    out = str(run["root"] / "hf_all")
    assert hpcmeg_main(["convert", run["ckpt"], out, "--all"]) == 0
    assert sorted(os.listdir(out)) == ["iter_0000005", "iter_0000010"]
    src = json.load(open(os.path.join(out, "iter_0000005", "hpcmeg_source.json")))
    assert src["iteration"] == 5 and src["tp"] == 1
    # a requeued array task converts again into the same dir: replaced, not refused
    assert hpcmeg_main(["convert", run["ckpt"], os.path.join(out, "iter_0000005"), "--iteration", "5"]) == 0
    # but a foreign non-empty dir is never overwritten
    foreign = run["root"] / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert hpcmeg_main(["convert", run["ckpt"], str(foreign)]) == 1
    assert "exists and is not empty" in capsys.readouterr().err
    assert os.listdir(foreign) == ["notes.txt"]


def test_missing_iteration_is_a_clear_error(run, capsys):
    out = run["root"] / "hf_missing"
    assert hpcmeg_main(["convert", run["ckpt"], str(out), "--iteration", "7"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "iter_0000007" in err and "iteration 7 does not exist" in err and "[5, 10]" in err
    assert not out.exists()
    empty = run["root"] / "no_ckpt_here"
    empty.mkdir()
    assert hpcmeg_main(["convert", str(empty), str(out)]) == 1
    assert "latest_checkpointed_iteration.txt" in capsys.readouterr().err


def _leftovers(parent) -> list[str]:
    return [e for e in os.listdir(parent) if ".tmp-" in e or ".old-" in e]


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "missing"])
def test_bad_shard_names_file_and_leaves_out_dir_alone(run, tmp_path, capsys, damage):
    ck = str(tmp_path / "ck22")
    assert hpcmeg_main(["reshard", run["ckpt"], ck, "--tp", "2", "--pp", "2"]) == 0
    capsys.readouterr()
    bad = os.path.join(ck, "iter_0000010", "mp_rank_01_001", "model_optim_rng.pt")
    if damage == "missing":
        os.remove(bad)
    else:
        size = os.path.getsize(bad)
        with open(bad, "r+b") as f:
            if damage == "truncate":
                f.truncate(size // 2)
            else:  # same size, flipped bytes in the middle: only the crc32 can tell
                f.seek(size // 2)
                chunk = f.read(64)
                f.seek(size // 2)
                f.write(bytes(b ^ 0xFF for b in chunk))
    out = tmp_path / "hf"
    assert hpcmeg_main(["convert", ck, str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert bad in err and len(err.splitlines()) == 1, err
    assert {"corrupt": "corrupt", "truncate": "truncated", "missing": "missing"}[damage] in err
    assert not out.exists() and _leftovers(tmp_path) == []
    # an earlier good conversion in OUT_DIR survives a failed re-conversion untouched
    good = tmp_path / "hf_good"
    assert hpcmeg_main(["convert", run["ckpt"], str(good)]) == 0
    before = {f: os.path.getmtime(good / f) for f in os.listdir(good)}
    assert hpcmeg_main(["convert", ck, str(good)]) == 1
    assert {f: os.path.getmtime(good / f) for f in os.listdir(good)} == before
    assert _leftovers(tmp_path) == []


def test_all_is_all_or_nothing(run, tmp_path, capsys):
    """--all with a damaged later iteration: the earlier one it converted goes again, so no partial
    OUT_DIR is left (and a parent it had to create goes too)."""
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(run["ckpt"], ck)
    bad = ck / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
    with open(bad, "r+b") as f:
        f.truncate(os.path.getsize(bad) // 2)
    out = tmp_path / "new" / "hf_all"
    assert hpcmeg_main(["convert", str(ck), str(out), "--all"]) == 1
    err = capsys.readouterr().err.strip()
    assert str(bad) in err and len(err.splitlines()) == 1, err
    assert sorted(os.listdir(tmp_path)) == ["ck"]


# ------------------------------------------------------------------- transformers' own converter

def test_transformers_converter_agrees(run, tmp_path):
    from safetensors.torch import load_file

    ours_dir = str(tmp_path / "ours")
    assert hpcmeg_main(["convert", run["ckpt"], ours_dir]) == 0
    ours = load_file(os.path.join(ours_dir, "model.safetensors"))
    theirs, their_cfg = run_transformers_converter(
        os.path.join(run["ckpt"], "iter_0000010", "mp_rank_00", "model_optim_rng.pt"), ours_dir, tmp_path)
    our_cfg = json.load(open(os.path.join(ours_dir, "config.json")))
    # the known leak we fix: their config keeps Megatron's padded vocabulary
    assert their_cfg["vocab_size"] == 50304 and our_cfg["vocab_size"] == VOCAB
    for k in ("n_positions", "n_embd", "n_layer", "n_head", "n_inner", "eos_token_id"):
        assert their_cfg[k] == our_cfg[k], k
    skipped = {k for k in theirs if k.endswith((".attn.bias", ".attn.masked_bias"))}
    assert len(skipped) == 2 * LAYERS
    assert set(theirs) - skipped == set(ours) | {"lm_head.weight"}
    for k, v in ours.items():
        t = theirs[k][:VOCAB] if k == "transformer.wte.weight" else theirs[k]
        assert torch.equal(t.to(v.dtype), v), k
    assert torch.equal(theirs["lm_head.weight"][:VOCAB], ours["transformer.wte.weight"])
