"""Helpers shared by the test modules (tests import this module, never each other).

- Training: TINY_RECIPE (the tiny recipe's path), SMALL (overrides that shrink it for a CPU test),
  stdlib_dataset (real Python stdlib sources tokenized with the GPT-2 BPE into .bin/.idx),
  small_recipe, run_dir, free_port, torchrun_cmd, Ranks / run_ranks (N local ranks started directly).
- `hpcmeg train` on N local ranks: TRAIN_BASE (8 iterations of the shrunk tiny recipe, checkpoints
  at 4 and 8), train_cli (one run, optionally stopped by SIGTERM and resumed), curve,
  assert_curves_close, assert_weights_close (Adam's round-off bound across layouts).
- Conversion: real_tokens (ids of real text), hf_logits (a converted directory's logits), rel_err,
  OFFLINE_ENV, converter_script / offline_hub_with_gpt2_tokenizer (transformers' own Megatron GPT-2
  converter, run offline).
- Conversion models: VOCAB, LAYERS, H, HEADS, FFN, POS, tiny_model (a GPT with randomised
  LayerNorms and biases), make_run (TP1 PP1 checkpoints of it, as the trainer saves them).
- Triton kernels on the CPU: run_in_triton_interpreter (a check script in a fresh Python under
  TRITON_INTERPRET=1, with Triton 3.6's interpreter patched for numpy 2).
"""
from __future__ import annotations

import importlib.util
import itertools
import json
import re
import os
import signal
import socket
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest
import torch

from hpcmeg.checkpoint.store import save_checkpoint
from hpcmeg.megatron.args import make_checkpoint_dict, make_megatron_args
from hpcmeg.megatron.layout import pad_vocab_size, to_megatron_model
from hpcmeg.model.config import GPTConfig
from hpcmeg.fused.model import build_gpt
from hpcmeg.model.gpt import GPT
from hpcmeg.recipe import load_recipe
from hpcmeg.train.metrics import read_metrics

TINY_RECIPE = "recipes/codeparrot_tiny.yaml"
EOD = 50256
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
# last transformers release whose wheel ships models/megatron_gpt2/convert_megatron_gpt2_checkpoint.py
CONVERTER_WHEEL = "transformers==4.46.3"
CONVERTER_REL = "transformers/models/megatron_gpt2/convert_megatron_gpt2_checkpoint.py"


SMALL = ["data.split=949,50,0", "data.seq_length=32", "model.num_layers=2", "model.hidden_size=32",
         "model.num_attention_heads=2", "model.max_position_embeddings=32", "train.micro_batch_size=2",
         "train.global_batch_size=4", "train.train_iters=8", "train.lr_warmup_iters=2", "train.log_interval=1",
         "train.eval_interval=4", "train.eval_iters=1", "checkpoint.save_interval=0",
         "cluster.cpu_tasks_per_node=1"]


def stdlib_dataset(directory, n_files: int = 120) -> str:
    """Tokenize the first n_files stdlib modules (sorted, tests excluded) into <dir>/stdlib.{bin,idx}."""
    from hpcmeg.data.corpus import iter_stdlib_sources
    from hpcmeg.data.indexed import IndexedDatasetBuilder
    from hpcmeg.data.tokenizer import build_tokenizer

    prefix = os.path.join(str(directory), f"stdlib{n_files}")
    if os.path.exists(prefix + ".idx"):
        return prefix
    os.makedirs(str(directory), exist_ok=True)
    tok = build_tokenizer()
    b = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for _, text in itertools.islice(iter_stdlib_sources(include_tests=False), n_files):
        ids = tok.encode(text) + [EOD]
        b.add_document(ids, [len(ids)])
    b.finalize(prefix + ".idx")
    return prefix


def small_recipe(out, prefix, *overrides, name="t"):
    """The tiny recipe shrunk for tests, reading `prefix`, writing under `out`."""
    return load_recipe(TINY_RECIPE, [f"run.output_root={out}", f"run.name={name}", f"data.data_path=[{prefix}]",
                              *SMALL, *overrides])


def run_dir(r) -> str:
    return os.path.join(r.run.output_root, r.run.name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(nproc: int, *args: str) -> list[str]:
    """`python -m torch.distributed.run` with nproc local ranks on a free port, running hpcmeg.cli ARGS."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()), "-m", "hpcmeg.cli", *args]


class Ranks:
    """nproc local ranks of `python -m hpcmeg.cli ARGS`, started directly with the variables torchrun
    sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), as hpcmeg's
    local executor starts them. torchrun itself costs a torch import and an agent per launch (~3 s
    on 2 cores); the multi-process tests launch ~25 times. One torchrun test stays
    (tests/test_dp.py). Each rank is a process forked from tests/preloaded.py's server, which has
    imported torch already: a fresh interpreter per rank spent ~4 s of CPU on imports, ~90 ranks
    a session. Like srun --kill-on-bad-exit, the others are stopped when one rank fails.
    Output goes to files (pipes of N ranks could fill while we wait on one); stdout of all ranks,
    rank order, is returned as torchrun would merge it."""

    def __init__(self, nproc: int, args: list[str], env: dict):
        import tempfile

        from preloaded import CliProcess
        port = str(free_port())
        self.logs = [(tempfile.NamedTemporaryFile("w+"), tempfile.NamedTemporaryFile("w+")) for _ in range(nproc)]
        self.procs = [CliProcess(args, dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc),
                                            LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
                                 o.name, e.name)
                      for r, (o, e) in enumerate(self.logs)]

    def poll(self):
        return None if any(p.poll() is None for p in self.procs) else self.returncode()

    def returncode(self) -> int:
        return next((p.returncode for p in self.procs if p.returncode), 0)

    def send_signal(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(sig)

    def communicate(self, timeout: float) -> tuple[str, str]:
        deadline = time.time() + timeout
        while any(p.poll() is None for p in self.procs):
            if any(p.returncode for p in self.procs):  # one rank failed: stop the rest
                self.send_signal(signal.SIGKILL)
            if time.time() > deadline:
                self.send_signal(signal.SIGKILL)
                raise subprocess.TimeoutExpired("hpcmeg.cli ranks", timeout)
            time.sleep(0.05)
        out = []
        for f in itertools.chain.from_iterable(zip(*self.logs)):
            f.seek(0)
            out.append(f.read())
            f.close()
        n = len(self.procs)
        return "".join(out[:n]), "".join(out[n:])


def stop_after_first_log(ranks: Ranks, metrics: str, timeout: float = 300) -> str:
    """Once rank 0 has logged a training step to `metrics`, SIGTERM every rank (as torchrun and srun
    pass it on: the ranks agree, save, exit 3) and wait; returns their stderr."""
    deadline = time.time() + timeout
    while time.time() < deadline and ranks.poll() is None:
        if os.path.exists(metrics) and read_metrics(metrics)["train"]:
            break
        time.sleep(0.05)
    ranks.send_signal(signal.SIGTERM)
    return ranks.communicate(timeout=timeout)[1]


def run_ranks(nproc: int, args: list[str], env: dict, timeout: float = 900) -> subprocess.CompletedProcess:
    """Ranks(...) to the end: a CompletedProcess (returncode: the first non-zero rank's, else 0)."""
    r = Ranks(nproc, args, env)
    out, err = r.communicate(timeout)
    return subprocess.CompletedProcess(args, r.returncode(), out, err)


def real_tokens(n: int = 2, length: int = 40) -> torch.Tensor:
    """Token ids of real text (the stdlib's json/__init__.py) with the embedded GPT-2 tokenizer."""
    from hpcmeg.data.tokenizer import build_tokenizer

    text = open(json.__file__, encoding="utf-8").read()
    ids = build_tokenizer().encode(text)
    return torch.tensor([ids[i * length:(i + 1) * length] for i in range(n)])


def hf_logits(out_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(out_dir).eval()
    with torch.no_grad():
        return hf(tokens).logits


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def converter_script(cache_dir: str) -> str:
    """transformers' convert_megatron_gpt2_checkpoint.py: from the installed package when it ships
    it (transformers <= 4.46), else extracted from that release's wheel fetched with pip (PyPI)."""
    spec = importlib.util.find_spec("transformers")
    installed = os.path.join(os.path.dirname(os.path.dirname(spec.origin)), CONVERTER_REL)
    if os.path.isfile(installed):
        return installed
    target = os.path.join(cache_dir, CONVERTER_WHEEL.replace("==", "-"), os.path.basename(CONVERTER_REL))
    if os.path.isfile(target):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q",
                        "-d", os.path.dirname(target), CONVERTER_WHEEL], capture_output=True, text=True, timeout=600)
    wheels = [f for f in os.listdir(os.path.dirname(target)) if f.endswith(".whl")]
    if r.returncode != 0 or not wheels:
        pytest.skip(f"transformers' Megatron converter is not installed and pip could not fetch {CONVERTER_WHEEL}: "
                    f"{r.stderr.strip()[-300:]}")
    with zipfile.ZipFile(os.path.join(os.path.dirname(target), wheels[0])) as z:
        data = z.read(CONVERTER_REL)
    with open(target + ".partial", "wb") as f:
        f.write(data)
    os.replace(target + ".partial", target)
    os.remove(os.path.join(os.path.dirname(target), wheels[0]))
    return target


def offline_hub_with_gpt2_tokenizer(hub: str, files_from: str) -> None:
    """An HF hub cache holding 'openai-community/gpt2' (the tokenizer the script asks for) made from
    hpcmeg's own GPT-2 tokenizer files, so the script runs with HF_HUB_OFFLINE=1."""
    repo = os.path.join(hub, "models--openai-community--gpt2")
    commit = "0" * 40
    snap = os.path.join(repo, "snapshots", commit)
    os.makedirs(snap)
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(commit)
    for n in ("config.json", "vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json"):
        with open(os.path.join(files_from, n), "rb") as a, open(os.path.join(snap, n), "wb") as b:
            b.write(a.read())


VOCAB = 50257  # the embedded GPT-2 tokenizer
LAYERS, H, HEADS, FFN, POS = 4, 32, 4, 96, 64


def tiny_model(seed: int = 0) -> GPT:
    """A 4-layer GPT with the GPT-2 vocabulary; LayerNorms and biases randomized so that every
    mapping (including bias reordering) is exercised, not just the zero/one init."""
    torch.manual_seed(seed)
    cfg = GPTConfig(num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                    max_position_embeddings=POS, padded_vocab_size=pad_vocab_size(VOCAB, 128, 1),
                    hidden_dropout=0.0, attention_dropout=0.0)
    m = build_gpt(cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "layernorm" in n and n.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
    return m.eval()


def make_run(ckpt_dir: str, iterations=(10,), seed: int = 0) -> GPT:
    """Save a TP1 PP1 hpcmeg checkpoint (as the trainer does) at each iteration; returns the model
    of the last one. The recipe in the checkpoint names the embedded GPT-2 tokenizer."""
    recipe = {"data": {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": None, "merge_file": None,
                       "tokenizer_model": None},
              "model": {"num_layers": LAYERS, "hidden_size": H, "num_attention_heads": HEADS, "ffn_hidden_size": FFN,
                        "max_position_embeddings": POS, "hidden_dropout": 0.0, "attention_dropout": 0.0},
              "parallel": {"tensor": 1, "pipeline": 1}}
    for k, it in enumerate(iterations):
        m = tiny_model(seed + k)
        args = make_megatron_args(padded_vocab_size=m.cfg.padded_vocab_size, orig_vocab_size=VOCAB, hidden_size=H,
                                  num_layers=LAYERS, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                                  max_position_embeddings=POS, hidden_dropout=0.0, attention_dropout=0.0,
                                  consumed_train_samples=it * 8, iteration=it)
        ck = make_checkpoint_dict(args=args, iteration=it, model=to_megatron_model(m.state_dict(), True, 1),
                                  optimizer=None, opt_param_scheduler=None, rng_state=None, recipe=recipe)
        save_checkpoint(ckpt_dir, it, ck, tp_rank=0, pp_rank=0, tp_size=1, pp_size=1, is_shard_writer=True,
                        barrier=lambda: None, is_global_rank0=True)
    return m


TRAIN_BASE = [e for e in SMALL if not e.startswith("cluster.")] + [
    "train.train_iters=8", "train.eval_interval=4", "train.eval_iters=1", "checkpoint.save_interval=4",
    "checkpoint.keep_last=null", "train.global_batch_size=4", "train.micro_batch_size=2"]


def train_cli(nproc: int, out, prefix, name: str, extra: list[str], sigterm_after_first_log: bool = False) -> str:
    sets = [f"run.output_root={out}", f"run.name={name}", f"data.data_path=[{prefix}]", *TRAIN_BASE, *extra]
    args = ["train", TINY_RECIPE] + [x for s in sets for x in ("--set", s)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())
    rd = os.path.join(str(out), name)
    if sigterm_after_first_log:
        err = stop_after_first_log(Ranks(nproc, args, env), os.path.join(rd, "metrics.jsonl"))
        assert json.load(open(os.path.join(rd, "train_status.json")))["status"] == "preempted", err[-3000:]
    p = run_ranks(nproc, args, env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return rd


def curve(rd: str):
    m = read_metrics(os.path.join(rd, "metrics.jsonl"))
    return [(x["iteration"], x["loss"], x["grad_norm"]) for x in m["train"]], m


def assert_curves_close(a, b):
    assert [x[0] for x in a] == [x[0] for x in b]
    assert [x[1] for x in a] == pytest.approx([x[1] for x in b], rel=1e-5)
    assert [x[2] for x in a] == pytest.approx([x[2] for x in b], rel=1e-5)


def assert_weights_close(a: dict, b: dict, steps: int = 8, lr: float = 0.002):
    """Adam's sign-like first steps: round-off in a near-zero gradient can move an element the other way
    (see tests/test_tp_model.py); all within 2 x steps x lr, nearly all within rtol 1e-4 / atol 1e-5."""
    for k in b:
        d = (a[k].float() - b[k].float()).abs()
        assert d.max() <= 2 * steps * lr, (k, d.max().item())
        off = int((d > 1e-5 + 1e-4 * b[k].float().abs()).sum())
        assert k.endswith("query_key_value.bias") or off <= 2 + d.numel() // 1000, (k, off, d.max().item())


def run_transformers_converter(shard: str, tokenizer_dir: str, tmp_path) -> tuple[dict, dict]:
    """transformers' own Megatron GPT-2 converter on a copy of a TP1 PP1 shard file, offline (its hub
    cache holds 'openai-community/gpt2' made from `tokenizer_dir`): (its state dict, its config)."""
    cache = os.environ.get("HPCMEG_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "hpcmeg"))
    script = converter_script(cache)
    work = tmp_path / "theirs"  # the script writes next to its input
    work.mkdir()
    (work / "model_optim_rng.pt").write_bytes(open(shard, "rb").read())
    hub = str(tmp_path / "hub")
    offline_hub_with_gpt2_tokenizer(hub, tokenizer_dir)
    # older script versions call torch.load with the default weights_only=True (torch >= 2.6), which
    # refuses argparse.Namespace; allow-listing it is the documented fix and needs no hpcmeg import
    wrapper = ("import argparse, runpy, sys, torch\n"
               "torch.serialization.add_safe_globals([argparse.Namespace])\n"
               f"sys.argv = ['convert_megatron_gpt2_checkpoint.py', {str(work / 'model_optim_rng.pt')!r}]\n"
               f"runpy.run_path({script!r}, run_name='__main__')\n")
    env = {**os.environ, **OFFLINE_ENV, "HF_HUB_CACHE": hub, "HF_HOME": str(tmp_path / "hf_home")}
    r = subprocess.run([sys.executable, "-c", wrapper], env=env, capture_output=True, text=True, timeout=300,
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return torch.load(str(work / "pytorch_model.bin"), weights_only=True), json.load(open(work / "config.json"))


def random_batches(n: int, rows: int, seq: int, vocab: int, seed: int = 11) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n (tokens, labels) batches of random ids, [rows, seq] each, labels shifted by one."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, (rows, seq + 1), generator=g)
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


# Prepended to every interpreter check: Triton 3.6's interpreter turns a loop bound into
# int(1-element array), which numpy 2 refuses; give its tensors an __index__ that takes the element.
_INTERPRETER_PATCH = """
from triton.runtime import interpreter as _ti
_orig = _ti._patch_lang_tensor
def _patched(tensor, scope):
    _orig(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
_ti._patch_lang_tensor = _patched
"""


def run_in_triton_interpreter(script: str, expect: str = "ok", timeout: int = 300) -> None:
    """Run `script` in a fresh Python with TRITON_INTERPRET=1 (Triton kernels on CPU tensors) and
    assert it exits 0 with `expect` as the end of its output; skip when triton is not installed."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (slurm/setup-dev.sh installs it for this test)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", _INTERPRETER_PATCH + script], env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0 and r.stdout.strip().endswith(expect), r.stdout[-1000:] + r.stderr[-3000:]


def ptxas_spill_bytes(compiled) -> int:
    """Bytes of register spill stores + loads that sm90's ptxas (Triton's wheel's, -v) reports for a
    compile_for_hopper result: 0 when every value stays in registers."""
    import tempfile

    import triton
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(compiled.asm["ptx"])
        r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    found = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    assert found, r.stderr[-2000:]
    return sum(int(a) + int(b) for a, b in found)


def compile_for_hopper(kernel, types: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3,
                       aligned_ints: tuple = (), **options):
    """Compile a @triton.jit kernel for sm90 on this CPU machine (Triton's frontend, its MLIR passes
    and the ptxas its wheel ships) and return the CompiledKernel. Catches what Triton's interpreter
    accepts but its compiler rejects (a GPU call found one: returns of different shapes in constexpr
    branches). types: every non-constexpr parameter's Triton type ('*bf16', 'i32', 'fp32', ...).
    aligned_ints: integer parameters a real launch passes as multiples of 16 (Triton specializes
    them so, which decides vector widths); options: more compile options (enable_fp_fusion=False)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (slurm/setup-dev.sh installs it for this test)")
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    names = list(inspect.signature(kernel.fn).parameters)
    missing = [n for n in names if n not in types and n not in constexprs]
    assert not missing, f"compile_for_hopper: no type or value for {missing}"
    sig = {n: "constexpr" if n in constexprs else types[n] for n in names}
    # pointers 16-byte aligned, as a launch with torch's allocations specializes them (without it
    # every load compiles to scalar accesses, which the GPU never runs)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n not in constexprs and (types[n].startswith("*") or n in aligned_ints)}
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, attrs=attrs,
                                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages, **options))
