"""Does the model at TP=1 run the same operations as before a change? (CPU, no GPU needed)

Traces one training step of the GPT (forward, loss, backward: the joint graph AOTAutograd hands to
Inductor) with ``make_fx`` in two source trees, this checkout and a git ref (default ``main``), and
compares the aten operations in order. Identical sequences mean the compiled step is the same
program: same kernels after Inductor, same speed on any GPU. This is the CPU half of checking that
a refactor of the model (for tensor/pipeline parallelism) costs nothing at TP=1; the GPU half is
``bench/train_throughput.py``.

    python bench/graph_compare.py [--ref main] [--fused] [--config JSON] [--out bench/results/graph_compare.json]

Each tree is traced in its own subprocess (both define the package ``hpcmeg``). The tracer calls
``build_gpt(cfg)(tokens, labels)`` and ``torch.autograd.grad`` on the mean loss; the plain PyTorch twins
are traced unless ``--fused`` (the fused ops that exist on CPU).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TRACE = r"""
import dataclasses, json, sys
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from hpcmeg.model.config import GPTConfig
import os
if os.path.exists("hpcmeg/fused/model.py"):  # (cwd: the traced tree; an editable install could resolve it elsewhere)
    from hpcmeg.fused.model import build_gpt
else:  # a tree from before hpcmeg/fused/model.py, where GPT(cfg) read cfg.fused itself
    from hpcmeg.model.gpt import GPT as build_gpt

fused = sys.argv[1] == "1"
extra = json.loads(sys.argv[2])
fields = {f.name for f in dataclasses.fields(GPTConfig)}
kw = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, max_position_embeddings=32,
          padded_vocab_size=128, hidden_dropout=0.0, attention_dropout=0.0, fused=fused)
kw = {k: v for k, v in {**kw, **extra}.items() if k in fields}
torch.manual_seed(0)
model = build_gpt(GPTConfig(**kw))
params = [p for p in model.parameters() if p.requires_grad]
tokens = torch.randint(0, 128, (2, 32))
labels = torch.randint(0, 128, (2, 32))

def step(tokens, labels, *ps):
    loss = model(tokens, labels).float().mean()
    return (loss, *torch.autograd.grad(loss, ps))

loss_eager = step(tokens, labels, *params)[0].item()
g = make_fx(step)(tokens, labels, *params)
ops = [str(n.target) for n in g.graph.nodes if n.op == "call_function"]
print(json.dumps({"ops": ops, "n_params": len(params), "loss": loss_eager}))
"""


def trace(tree: Path, fused: bool, extra: str = "{}") -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    r = subprocess.run([sys.executable, "-c", TRACE, "1" if fused else "0", extra], env=env, cwd=tree,
                       capture_output=True, text=True, timeout=600)
    if r.returncode:
        raise SystemExit(f"graph_compare: tracing {tree} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def export_ref(ref: str, into: Path) -> Path:
    """The ref's hpcmeg/ package, extracted with `git archive` (no worktree, no checkout)."""
    tar = into / "ref.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(tar), ref, "hpcmeg"], check=True)
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")
    return into


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default="main", help="git ref to compare this checkout with")
    ap.add_argument("--fused", action="store_true", help="trace the fused ops (those that run on CPU)")
    ap.add_argument("--config", default="{}", help='GPTConfig fields as JSON, e.g. \'{"attention_backend": "triton", '
                    '"recompute_gelu_layers": 1}\' (fields a tree does not have are left out there)')
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old = trace(export_ref(a.ref, Path(tmp)), a.fused, a.config)
    new = trace(REPO, a.fused, a.config)
    same = old["ops"] == new["ops"]
    diff = collections.Counter(new["ops"]) - collections.Counter(old["ops"])
    gone = collections.Counter(old["ops"]) - collections.Counter(new["ops"])
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", a.ref], capture_output=True, text=True)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    res = {"ref": a.ref, "ref_commit": rev.stdout.strip(), "head": head.stdout.strip(), "fused": a.fused, "config": json.loads(a.config),
           "ops_ref": len(old["ops"]), "ops_head": len(new["ops"]), "identical_sequence": same,
           "added": dict(diff), "removed": dict(gone), "loss_ref": old["loss"], "loss_head": new["loss"],
           "params_ref": old["n_params"], "params_head": new["n_params"]}
    print(json.dumps(res, indent=1))
    if a.out:
        tmp_out = a.out + ".tmp"
        with open(tmp_out, "w") as f:
            json.dump(res, f, indent=1)
        os.replace(tmp_out, a.out)
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
