"""hpcmeg import-hf: a Hugging Face GPT-2 dir -> Megatron-layout `release` checkpoint (any TP/PP) that
the trainer's loader reads and hpcmeg's GPT computes identically; HF -> hpcmeg -> HF gives identical
weights, config and tokenizer; unsupported models are refused with a message naming the file."""
from __future__ import annotations

import json
import os

import pytest
import torch

from hpcmeg.cli import main as hpcmeg_main
from hpcmeg.convert.hf_tokenizer import TokenizerSource, write_tokenizer_files
from hpcmeg.convert.merge import load_full_checkpoint
from hpcmeg.model.config import GPTConfig
from hpcmeg.fused.model import build_gpt
from hpcmeg.checkpoint.store import load_checkpoint
from hpcmeg.megatron.names import read_tracker
from helpers import VOCAB, real_tokens, rel_err

LAYERS, H, HEADS, POS = 4, 48, 4, 64


def make_hf_dir(path: str, seed: int = 0, activation: str = "gelu_new", bin_only: bool = False) -> dict:
    """A random GPT2LMHeadModel saved the way transformers saves it, with GPT-2 tokenizer files."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=POS, n_embd=H, n_layer=LAYERS, n_head=HEADS,
                     activation_function=activation, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    m = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # non-trivial LayerNorms and biases
        for n, p in m.named_parameters():
            if n.endswith("bias") or ".ln_" in n:
                p.add_(0.2 * torch.randn_like(p))
    m.save_pretrained(path)
    if bin_only:
        sd = {k: v for k, v in m.state_dict().items() if k != "lm_head.weight"}
        os.remove(os.path.join(path, "model.safetensors"))
        torch.save(sd, os.path.join(path, "pytorch_model.bin"))
    write_tokenizer_files(path, TokenizerSource(), model_max_length=POS)
    return {"model": m, "config": cfg}


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("imp")
    d = str(root / "hf")
    return {"root": root, "dir": d, **make_hf_dir(d)}


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_hf_to_hpcmeg_to_hf_identical(hf, tp, pp):
    from safetensors.torch import load_file

    ck = str(hf["root"] / f"ck{tp}{pp}")
    assert hpcmeg_main(["import-hf", hf["dir"], ck, "--tp", str(tp), "--pp", str(pp)]) == 0
    assert read_tracker(ck) == "release"
    assert os.path.isdir(os.path.join(ck, "release", "mp_rank_00" if pp == 1 else "mp_rank_01_001"))
    for p in range(pp):
        for t in range(tp):
            it, st = load_checkpoint(ck, tp_rank=t, pp_rank=p, tp_size=tp, pp_size=pp)  # the trainer's loader
            assert it == 0 and "optimizer" not in st
            a = st["args"]
            assert a.padded_vocab_size == {1: 50304, 2: 50432}[tp]  # multiple of 128 x tp
            assert a.orig_vocab_size == VOCAB and a.tensor_model_parallel_size == tp
            rec = st["hpcmeg"]["recipe"]
            assert rec["model"]["hidden_size"] == H and rec["parallel"] == {"tensor": tp, "pipeline": pp}
            assert os.path.isfile(rec["data"]["vocab_file"]) and rec["data"]["vocab_file"].startswith(ck)
    back = str(hf["root"] / f"back{tp}{pp}")
    assert hpcmeg_main(["convert", ck, back]) == 0
    a, b = load_file(os.path.join(hf["dir"], "model.safetensors")), load_file(os.path.join(back, "model.safetensors"))
    a.pop("lm_head.weight", None)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ca, cb = (json.load(open(os.path.join(d, "config.json"))) for d in (hf["dir"], back))
    for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "activation_function",
              "layer_norm_epsilon", "bos_token_id", "eos_token_id", "tie_word_embeddings"):
        assert ca.get(k) == cb.get(k), k
    for f in ("vocab.json", "merges.txt"):
        assert open(os.path.join(hf["dir"], f), "rb").read() == open(os.path.join(back, f), "rb").read()


def test_imported_model_computes_like_hf(hf):
    """The release checkpoint loads strictly into hpcmeg's GPT (what fine-tuning starts from) and
    gives HF's logits on real tokens."""
    ck = str(hf["root"] / "ck_logits")
    assert hpcmeg_main(["import-hf", hf["dir"], ck, "--tp", "2", "--pp", "1"]) == 0
    full = load_full_checkpoint(ck)
    m = full.recipe["model"]
    cfg = GPTConfig(num_layers=m["num_layers"], hidden_size=m["hidden_size"],
                    num_attention_heads=m["num_attention_heads"], ffn_hidden_size=m["ffn_hidden_size"],
                    max_position_embeddings=m["max_position_embeddings"], padded_vocab_size=full.args.padded_vocab_size,
                    hidden_dropout=m["hidden_dropout"], attention_dropout=m["attention_dropout"],
                    layernorm_epsilon=m["layernorm_epsilon"])
    model = build_gpt(cfg).eval()
    model.load_state_dict(full.full, strict=True)
    tokens = real_tokens(2, 40)
    with torch.no_grad():
        ours = model(tokens)[..., :VOCAB]
        ref = hf["model"](tokens).logits
    assert rel_err(ours, ref) < 1e-5


def test_pytorch_bin_only_dir(tmp_path):
    d = str(tmp_path / "hfbin")
    src = make_hf_dir(d, seed=1, bin_only=True)
    ck = str(tmp_path / "ck")
    assert hpcmeg_main(["import-hf", d, ck]) == 0
    full = load_full_checkpoint(ck).full
    assert torch.equal(full["embedding.word_embeddings.weight"][:VOCAB], src["model"].transformer.wte.weight)
    assert not full["embedding.word_embeddings.weight"][VOCAB:].any()  # zero padding rows


def test_unsupported_models_are_refused(tmp_path, capsys):
    d = str(tmp_path / "erf")
    make_hf_dir(d, activation="gelu")
    ck = tmp_path / "ck"
    assert hpcmeg_main(["import-hf", d, str(ck)]) == 1
    err = capsys.readouterr().err
    assert os.path.join(d, "config.json") in err and "activation_function 'gelu'" in err
    assert not ck.exists()
    assert hpcmeg_main(["import-hf", str(tmp_path / "nowhere"), str(ck)]) == 1
    assert "config.json" in capsys.readouterr().err
    # a damaged weights file is named
    good = str(tmp_path / "good")
    make_hf_dir(good)
    st = os.path.join(good, "model.safetensors")
    with open(st, "r+b") as f:
        f.truncate(os.path.getsize(st) // 2)
    assert hpcmeg_main(["import-hf", good, str(ck)]) == 1
    assert st in capsys.readouterr().err
    assert not ck.exists() and not [e for e in os.listdir(tmp_path) if ".tmp-" in e]


def test_hpcmeg_train_fine_tunes_from_import_then_converts(hf, tmp_path):
    """The acceptance path: import-hf -> `hpcmeg train` with checkpoint.load (weights only, iteration 0)
    -> a few steps on real text tokenized with the imported tokenizer -> `hpcmeg convert` of the
    fine-tuned checkpoint loads in transformers with the same sizes."""
    import yaml

    from preloaded import run_cli

    ck = str(tmp_path / "imported")
    assert hpcmeg_main(["import-hf", hf["dir"], ck]) == 0
    text = open(json.__file__, encoding="utf-8").read()
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": text[i:i + 2000]}) + "\n" for i in range(0, len(text), 2000)))
    prefix = str(tmp_path / "docs")
    tok = os.path.join(ck, "tokenizer")
    assert hpcmeg_main(["preprocess", "--input", str(jsonl), "--output-prefix", prefix, "--vocab-file",
                        os.path.join(tok, "vocab.json"), "--merge-file", os.path.join(tok, "merges.txt"),
                        "--append-eod", "--workers", "1", "--quiet"]) == 0
    recipe = {
        "run": {"name": "ft", "output_root": str(tmp_path / "runs")},
        "data": {"data_path": [prefix + "_text_document"], "vocab_file": os.path.join(tok, "vocab.json"),
                 "merge_file": os.path.join(tok, "merges.txt"), "seq_length": 32, "num_workers": 0, "split": "90,10,0"},
        "model": {"num_layers": LAYERS, "hidden_size": H, "num_attention_heads": HEADS, "max_position_embeddings": POS,
                  "hidden_dropout": 0.0, "attention_dropout": 0.0},
        "train": {"micro_batch_size": 2, "global_batch_size": 2, "train_iters": 3, "lr": 1e-4, "lr_decay_style": "constant",
                  "precision": "fp32", "eval_interval": 0, "log_interval": 1, "compile": "off", "device": "cpu"},
        "checkpoint": {"save_interval": 3, "load": ck},
        "cluster": {"profile": "local", "gpus_per_node": 0, "cpu_tasks_per_node": 1},
    }
    path = tmp_path / "ft.yaml"
    path.write_text(yaml.safe_dump(recipe))
    # a process of its own, forked with torch already imported (tests/preloaded.py)
    r = run_cli(["train", str(path)], dict(os.environ), timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert f"weights from {ck}" in r.stdout + r.stderr
    run_ck = str(tmp_path / "runs" / "ft" / "checkpoints")
    assert read_tracker(run_ck) == 3
    out = str(tmp_path / "hf_ft")
    assert hpcmeg_main(["convert", run_ck, out]) == 0
    from transformers import GPT2LMHeadModel

    m = GPT2LMHeadModel.from_pretrained(out)
    assert m.config.vocab_size == VOCAB and m.config.n_embd == H
    # fine-tuning moved the weights away from the imported ones
    assert not torch.equal(m.transformer.h[0].attn.c_attn.weight, hf["model"].transformer.h[0].attn.c_attn.weight)
