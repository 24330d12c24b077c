"""The bench tools on CPU. bench/nano_anchor.py, the dropout + accumulation anchor of bench/user_path.py:
at dropout 0 it is the project's baseline model (bench/anchors_gpt2.py's Nano) with the same weights;
dropout acts only in training mode; its batches are next-token windows of the token file. user_path's
item grammar, its table and its rows from an earlier tree (tree=). bench/lease.sh: which rows and
tools each stage asks for (every hpcmeg row a recipe hpcmeg accepts), its budget and its refusals.
gpu_agreement's parts, the attention probe's best launch, and that no bench script names something
hpcmeg no longer has."""
import importlib
import os
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "bench", "dev"))  # the probes lease.sh runs (attention_probe)

L, D, H, V = 2, 32, 4, 97


@pytest.fixture(scope="module")
def baseline(monkeypatch_module):
    monkeypatch_module.setenv("LDH", f"{L},{D},{H}")
    monkeypatch_module.setenv("VOCAB", str(V))
    import anchors_gpt2
    return importlib.reload(anchors_gpt2)  # module constants come from the environment


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _pair(baseline, dropout):
    import nano_anchor
    torch.manual_seed(0)
    ref = baseline.Nano()
    m = nano_anchor.Nano(nano_anchor.NanoConfig(L, D, H, V, 1024, dropout))
    m.load_state_dict(ref.state_dict())  # same parameter names: the twin adds only dropout modules
    return ref, m


def test_dropout_zero_is_the_baseline_function(baseline):
    ref, m = _pair(baseline, 0.0)
    x = torch.randint(0, V, (2, 1024))
    y = torch.randint(0, V, (2, 1024))
    # bit for bit (tests/TOLERANCES.md, case 1): the same modules and operations, dropout 0 adds none
    torch.testing.assert_close(m(x, y), ref(x, y), rtol=0, atol=0)
    m(x, y).backward()
    ref(x, y).backward()
    for (n, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)


def test_dropout_only_in_training(baseline):
    ref, m = _pair(baseline, 0.3)
    x, y = torch.randint(0, V, (2, 1024)), torch.randint(0, V, (2, 1024))
    assert not torch.equal(m(x, y), ref(x, y))  # training mode: dropout changes the loss
    m.eval()
    torch.testing.assert_close(m(x, y), ref(x, y), rtol=0, atol=0)  # eval: no dropout, case 1 as above


def test_batches_are_next_token_windows(tmp_path):
    import nano_anchor
    toks = np.arange(5000, dtype=np.uint16) % 50000
    path = tmp_path / "t.bin"
    toks.tofile(path)
    x, y = nano_anchor.Batches(str(path), 3, 16, device="cpu")()
    assert x.shape == y.shape == (3, 16)
    assert torch.equal(y[:, :-1], x[:, 1:])
    for row in x:  # a contiguous window of the file
        start = int(row[0])
        assert torch.equal(row, torch.from_numpy(toks[start:start + 16].astype(np.int64)))


def test_user_path_items():
    import user_path
    kind, o = user_path.parse_item("hpcmeg:d=0,gbs=12,set=train.compile=off|model.init_method_std=0.01", "124M")
    assert kind == "hpcmeg" and o["hd"] == o["ad"] == 0.0 and o["gbs"] == 12 and o["mb"] == 12
    assert o["set"] == ["train.compile=off", "model.init_method_std=0.01"]
    _, o = user_path.parse_item("hpcmeg:env=TORCHINDUCTOR_MIX_ORDER_REDUCTION:1|A:b:c", "124M")
    assert o["env"] == {"TORCHINDUCTOR_MIX_ORDER_REDUCTION": "1", "A": "b:c"}
    assert user_path.label("hpcmeg", o).endswith("gbs192 TORCHINDUCTOR_MIX_ORDER_REDUCTION=1 A=b:c")
    kind, o = user_path.parse_item("nano", "1.3B")
    assert (o["hd"], o["mb"], o["gbs"]) == (user_path.RECIPE_DROPOUT, 8, 64)  # the recipe's dropout by default
    with pytest.raises(SystemExit, match="unknown key"):
        user_path.parse_item("nano:dropout=0.1", "124M")
    # only=: an item for some sizes of a many-size call (each size's own best row in one call)
    _, o = user_path.parse_item("hpcmeg:only=124M|355M,mb=16", "1.3B")
    assert o["only"] == ["124M", "355M"] and o["mb"] == 16
    assert user_path.parse_item("hpcmeg", "124M")[1]["only"] == []
    with pytest.raises(SystemExit, match="unknown size"):
        user_path.parse_item("hpcmeg:only=125M", "124M")
    # tree=: an hpcmeg row from another checkout, labelled so the table finds this tree's same row
    _, o = user_path.parse_item("hpcmeg:mb=16,tree=.oldtree", "124M")
    assert o["tree"] == ".oldtree" and user_path.label("hpcmeg", o) == "hpcmeg d0.1 mb16 gbs192 tree=.oldtree"
    assert user_path.parse_item("hpcmeg", "124M")[1]["tree"] == ""
    with pytest.raises(SystemExit, match="unknown key 'tree'"):
        user_path.parse_item("nano:tree=.oldtree", "124M")  # the anchor has one tree


def _lease(tmp_path, *stages, **env):
    """bench/lease.sh STAGES without a GPU (CUDA_VISIBLE_DEVICES empty: never a real run, even on a GPU
    machine; each tool fails after the script logged its command): (the CompletedProcess, lease.log
    from the one lease.tgz, the names in it)."""
    import subprocess
    import tarfile
    out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
    r = subprocess.run(["bash", os.path.join(ROOT, "bench", "lease.sh"), *stages], capture_output=True, text=True,
                       cwd=str(tmp_path), timeout=300,
                       env={**os.environ, "OUT": str(out), "LEASE_BUDGET_S": "3000", "CUDA_VISIBLE_DEVICES": "", **env})
    if r.returncode or not (out / "lease.tgz").exists():
        return r, None, None
    assert [p.name for p in out.iterdir()] == ["lease.tgz"]  # everything in one file
    with tarfile.open(out / "lease.tgz") as t:
        return r, t.extractfile("lease.log").read().decode(), set(t.getnames())


def _rows(logged: str, step: str) -> list[str]:
    """The --items of the user_path step `step` as lease.log logged its command."""
    cmd = logged.split(f"== {step} (")[1].split("\n", 1)[0]
    return cmd.split("--items ")[1].split()


def _accepted(size: str, item: str):
    """(kind, options) of a lease row, after checking that its hpcmeg settings are a recipe hpcmeg
    accepts (the shipped recipe with user_path's overrides: no removed key, a valid batch)."""
    import user_path

    from hpcmeg.recipe import load_recipe
    kind, o = user_path.parse_item(item, size)
    if kind == "hpcmeg":
        data = dict(out="/tmp/bench", prefix="/tmp/bench/stdlib", vocab="/tmp/v.json", merge="/tmp/m.txt")
        load_recipe(os.path.join(ROOT, user_path.RECIPE), user_path.train_sets(size, o, data, "row"))
    return kind, o


def test_user_path_table_and_the_one_call_stage(tmp_path):
    """The table's ratio is against the nano row after an hpcmeg row, else the last one before it
    (the lease runs the anchor first), and a tree= row gets this tree's same row over it; lease.sh uall
    runs, per size, the anchor, hpcmeg as shipped and the size's memory trade-off row, UALL_EXTRA added
    to every hpcmeg row's settings, each a recipe hpcmeg accepts."""
    import user_path
    rows = [dict(row="nano d0.1 mb12 gbs192", tokens_per_s=400), dict(row="hpcmeg d0.1 mb16 gbs192", tokens_per_s=520),
            dict(row="hpcmeg d0.1 mb16 gbs192 tree=.oldtree", tokens_per_s=500)]
    t = user_path.table(rows)
    assert "**1.300** vs nano d0.1 mb12 gbs192" in t and "this tree / that tree 1.0400" in t, t
    extra = "model.attention_backend=cudnn"
    r, logged, _ = _lease(tmp_path, "uall", UALL_EXTRA=f"|{extra}")
    assert r.returncode == 0, r.stderr
    got = {size: [(k, o["mb"], o["set"]) for k, o in (_accepted(size, i) for i in _rows(logged, f"user_path_uall_{size}"))]
           for size in ("124M", "355M", "1.3B")}
    assert got == {"124M": [("nano", 12, []), ("hpcmeg", 12, [extra]),
                            ("hpcmeg", 16, ["model.recompute_gelu_layers=1", extra])],
                   "355M": [("nano", 12, []), ("hpcmeg", 12, [extra]),
                            ("hpcmeg", 16, ["model.cross_entropy=backward_in_forward", extra])],
                   "1.3B": [("nano", 8, []), ("hpcmeg", 8, [extra])]}, got


def test_lease_stages(tmp_path):
    """bench/lease.sh: no stage, an unknown one, or a bad LEASE_SIZES fails with one line and exit 2
    before anything runs; the user-path stages ask for the anchor, hpcmeg as shipped and the A/B rows
    of the choices a recipe still offers (each a recipe hpcmeg accepts); the profiles run each size's
    user-path batch; checks runs every part of gpu_agreement; loss the defaults and
    backward_in_forward; probes the bench/dev sweeps that exist; a size whose rows need more than what
    is left of the budget is skipped with the line that says how to run it."""
    import gpu_agreement
    import loss_parity
    for stages, env, msg in (((), {}, "name the stages"), (("loss", "u125"), {}, "unknown stage 'u125'"),
                             (("ab124",), {}, "unknown stage 'ab124'"),
                             (("uall",), {"LEASE_SIZES": "124M 125M"}, "LEASE_SIZES holds '125M'")):
        r, _, _ = _lease(tmp_path, *stages, **env)
        assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not list(tmp_path.glob("out*/*"))  # nothing ran
    r, logged, names = _lease(tmp_path, "u124", "u355", "u1.3B", "p355", "p1.3B", "checks", "loss", "probes")
    assert r.returncode == 0, r.stderr
    assert {"user_path_u_124M.log", "user_path_u_355M.log", "user_path_u_1.3B.log", "gpu_agreement.log",
            "loss_parity.log", "attention_probe.log", "gelu_probe.log", "layernorm_probe.log"} <= names, names
    cudnn, bif = ["model.attention_backend=cudnn"], ["model.cross_entropy=backward_in_forward"]
    got = {size: [(k, o["mb"], o["set"]) for k, o in (_accepted(size, i) for i in _rows(logged, f"user_path_u_{size}"))]
           for size in ("124M", "355M", "1.3B")}
    assert got == {"124M": [("nano", 12, []), ("hpcmeg", 12, []), ("hpcmeg", 12, cudnn), ("hpcmeg", 16, []),
                            ("hpcmeg", 16, ["model.recompute_gelu_layers=1"]), ("hpcmeg", 16, bif)],
                   "355M": [("nano", 12, []), ("hpcmeg", 12, []), ("hpcmeg", 12, cudnn), ("hpcmeg", 16, bif)],
                   "1.3B": [("nano", 8, []), ("hpcmeg", 8, []), ("hpcmeg", 8, cudnn)]}, got
    for size, mb_gbs in (("355M", "--set train.global_batch_size=192"),
                         ("1.3B", "--set train.micro_batch_size=8 --set train.global_batch_size=64")):
        cmd = logged.split(f"== profile_{size} (")[1].split("\n", 1)[0]
        assert f"--size {size} " in cmd and "model.hidden_dropout=0.1" in cmd and cmd.endswith(mb_gbs), cmd
    parts = logged.split("bench/gpu_agreement.py --parts ")[1].split()[0].split(",")
    assert sorted(parts) == sorted(gpu_agreement.PARTS), parts
    variants = logged.split("--hpcmeg-variants ")[1].split()[0].split(",")
    assert variants == ["default", "backward_in_forward"] and set(variants) <= set(loss_parity.VARIANTS)
    for probe in ("attention_probe", "gelu_probe", "layernorm_probe"):
        path = logged.split(f"== {probe} (")[1].split("\n", 1)[0].split("python ")[1].split()[0]
        assert os.path.isfile(os.path.join(ROOT, path)), path
    # the budget: 124M's three rows need ~160 s of the 200 left, 355M's ~280: skipped, not started
    r, logged, names = _lease(tmp_path, "uall", LEASE_BUDGET_S="200")
    assert r.returncode == 0, r.stderr
    assert "user_path_uall_124M.log" in names and "user_path_uall_355M.log" not in names, names
    assert "== user_path_uall_355M: skipped" in logged and "LEASE_SIZES=355M in another call" in logged


def test_lease_accept_stage(tmp_path):
    """lease.sh accept: without the earlier tree it stops before anything runs, saying how to make it;
    with one (here an archive of HEAD) each size's rows are the anchor, this tree's hpcmeg and the
    earlier tree's with the same settings (ACCEPT_KEYS on both)."""
    import subprocess
    r, _, _ = _lease(tmp_path, "accept", OLD_TREE=str(tmp_path / "none"))
    assert r.returncode == 2 and "git archive REF" in r.stderr, r.stderr
    old = tmp_path / "old"
    old.mkdir()
    arch = subprocess.run(f"git -C {ROOT} archive HEAD | tar -x -C {old}", shell=True, capture_output=True, text=True)
    if arch.returncode:
        pytest.skip(f"no git history to archive here: {arch.stderr.strip()[:200]}")
    keys = "mb=16,set=model.recompute_gelu_layers=1"
    r, logged, _ = _lease(tmp_path, "accept", OLD_TREE=str(old), ACCEPT_KEYS=keys, LEASE_SIZES="124M 1.3B")
    assert r.returncode == 0, r.stderr
    for size in ("124M", "1.3B"):
        items = _rows(logged, f"user_path_accept_{size}")
        assert items == ["nano", f"hpcmeg:{keys}", f"hpcmeg:{keys},tree={old}"], items
        rows = [_accepted(size, i) for i in items]
        assert rows[1][1]["set"] == rows[2][1]["set"] == ["model.recompute_gelu_layers=1"]
        assert rows[2][1]["tree"] == str(old) and not rows[1][1]["tree"]
    assert "user_path_accept_355M" not in logged


def test_user_path_runs_a_row_from_an_earlier_tree(tmp_path):
    """user_path's tree= row runs `hpcmeg train` from that checkout (here an archive of HEAD, on CPU, a
    2-layer model at sequence 64): its metrics come back, the tree's COMMIT is in the row, and a
    folder without hpcmeg is refused with one line saying how to make the tree."""
    import subprocess

    import train_throughput as tt
    import user_path
    with pytest.raises(SystemExit, match="git archive REF"):
        user_path.tree_root(str(tmp_path))
    old = tmp_path / "old"
    old.mkdir()
    arch = subprocess.run(f"git -C {ROOT} archive HEAD | tar -x -C {old}", shell=True, capture_output=True, text=True)
    if arch.returncode:
        pytest.skip(f"no git history to archive here: {arch.stderr.strip()[:200]}")
    (old / "COMMIT").write_text("HEAD-archive\n")
    assert user_path.tree_root(str(old)) == os.path.realpath(old)
    vocab, merge = tt.gpt2_files(None)
    prefix = tt.stdlib_dataset(str(tmp_path / "data"), vocab, merge, n_files=5)
    data = dict(out=str(tmp_path / "data"), prefix=prefix, vocab=vocab, merge=merge)  # as user_path's main
    _, o = user_path.parse_item(f"hpcmeg:d=0,mb=1,gbs=1,iters=3,tree={old},set=train.precision=fp32|"
                                "train.device=cpu|data.seq_length=64|model.max_position_embeddings=64", "tiny")
    r = user_path.run_hpcmeg("tiny", o, data, peak=1e12, log_interval=1)
    assert r["tree_commit"] == "HEAD-archive" and len(r["window_tokens_per_s"]) == 2 and r["tokens_per_s"] > 0, r


def test_gpu_agreement_parts():
    """bench/gpu_agreement.py's parts are today's checks; a removed one (the cuBLASLt epilogues, the
    bias-dropout-add + LayerNorm forward kernel) is refused with one line naming the parts."""
    import gpu_agreement
    assert list(gpu_agreement.PARTS) == ["ops", "model", "dropout", "wgrad", "ce", "attention"]
    for part in ("lt", "ltstep", "bdaln", "kernels", "adamw"):
        with pytest.raises(SystemExit, match=f"unknown --parts \\['{part}'\\]"):
            gpu_agreement.main(["--parts", f"ops,{part}"])


def _missing_names(path: str) -> list[str]:
    """What a bench script names in hpcmeg that does not exist: a module it imports, an attribute of an
    imported hpcmeg module or class, a torch.ops.hpcmeg op, or a call to an hpcmeg function with
    arguments its signature does not take (positional count, keyword names)."""
    import ast
    import inspect

    import hpcmeg.fused.ops  # noqa: F401  (registers torch.ops.hpcmeg)
    tree = ast.parse(open(path).read())
    aliases, funcs, bad = {}, {}, []
    for node in ast.walk(tree):
        mods = []
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hpcmeg":
            mods = [(node.module, a.name, a.asname or a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            mods = [(a.name, None, a.asname) for a in node.names if a.name.split(".")[0] == "hpcmeg"]
        for module, name, local in mods:
            try:
                obj = importlib.import_module(module)
                if name is not None:
                    obj = getattr(obj, name) if hasattr(obj, name) else importlib.import_module(f"{module}.{name}")
            except ImportError:
                bad.append(f"import {module}{'.' + name if name else ''}")
                continue
            if local and (inspect.ismodule(obj) or inspect.isclass(obj)):
                aliases[local] = obj
            if local and callable(obj):
                funcs[local] = obj
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if not hasattr(aliases[node.value.id], node.attr):
                bad.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "hpcmeg"
                and isinstance(node.value.value, ast.Attribute) and node.value.value.attr == "ops"
                and not hasattr(torch.ops.hpcmeg, node.attr)):
            bad.append(f"line {node.lineno}: torch.ops.hpcmeg.{node.attr}")
        if isinstance(node, ast.Call) and not any(isinstance(x, ast.Starred) for x in node.args) \
                and all(k.arg for k in node.keywords):
            f = node.func
            fn = funcs.get(f.id) if isinstance(f, ast.Name) else (
                getattr(aliases[f.value.id], f.attr, None)
                if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in aliases else None)
            try:
                sig = inspect.signature(fn) if fn is not None else None
            except (TypeError, ValueError):  # a builtin or custom op without a Python signature
                sig = None
            if sig is not None:
                try:
                    sig.bind(*node.args, **{k.arg: None for k in node.keywords})
                except TypeError as ex:
                    bad.append(f"line {node.lineno}: {ast.unparse(f)}(...): {ex}")
    return bad


def test_bench_tools_name_only_what_hpcmeg_has(tmp_path):
    """Every script in bench/ and bench/dev/ names only modules, attributes, custom ops and call
    signatures that exist in today's hpcmeg (a removed kernel, launch class or keyword shows here, on
    CPU, not in a GPU lease); the check itself catches a name that is gone."""
    import glob
    scripts = sorted(glob.glob(os.path.join(ROOT, "bench", "*.py")) + glob.glob(os.path.join(ROOT, "bench", "dev", "*.py")))
    assert len(scripts) > 15
    bad = {os.path.relpath(p, ROOT): m for p in scripts if (m := _missing_names(p))}
    assert not bad, bad
    # the check itself: a script naming what the fused path lost is caught, each name once
    removed = tmp_path / "removed.py"
    removed.write_text("from hpcmeg.kernels import attention as ta\nfrom hpcmeg.fused import ops\n"
                       "from hpcmeg.model import cublaslt\n"
                       "ta.DEFAULT_BLOCKS\nops.bias_dropout_add_layer_norm(1, 2, 3, 4, 5, 6, 7, 8, dropout_impl=0)\n"
                       "torch.ops.hpcmeg.bda_layer_norm\n")
    found = _missing_names(str(removed))
    assert len(found) == 4 and all(any(w in m for m in found)
                                   for w in ("cublaslt", "DEFAULT_BLOCKS", "dropout_impl", "bda_layer_norm")), found


def test_attention_probe_best_spec():
    """bench/dev/attention_probe.py: the best spec joins the fastest forward's fwd_* fields with the
    fastest backward's other fields (a Launch to try as DEFAULT_LAUNCH), and takes the keep-bits launch
    of the fastest --bits variant only when it beat the default launch by >= 5 %, never one that failed."""
    import attention_probe as ap

    from hpcmeg.kernels import attention as triton_attention
    res = {"triton p=0.1 fwd [default]": 0.10, "triton p=0.1 fwd [fwd_warps=8]": 0.09,
           "triton p=0.1 bwd [default]": 0.30, "triton p=0.1 bwd [dkv_m=16+dq_n=16]": 0.28,
           "triton p=0.1 bwd [bwd_stages=2]": "failed: x"}
    assert ap.best_spec(res, 0.1) == "fwd_warps=8+dkv_m=16+dq_n=16"
    assert ap.launch("fwd_warps=8+dkv_m=16").fwd_warps == 8
    assert ap.launch("default") is triton_attention.DEFAULT_LAUNCH
    bits = {"triton p=0.1 keep bits": 0.050, "triton p=0.1 keep bits [bits_warps=8]": 0.030,
            "triton p=0.1 keep bits [bits_rows=32]": 0.049, "triton p=0.1 keep bits [bits_groups=4]": "failed: x"}
    assert ap.with_best_bits(bits, 0.1, "default") == "bits_warps=8"
    assert ap.with_best_bits(bits, 0.1, "fwd_warps=8") == "fwd_warps=8+bits_warps=8"
    bits["triton p=0.1 keep bits [bits_warps=8]"] = 0.048  # 4 % faster: not enough
    assert ap.with_best_bits(bits, 0.1, "fwd_warps=8") == "fwd_warps=8"
    assert ap.with_best_bits({}, 0.1, "default") == "default"


def test_anchor_vocabulary_is_nanogpts_padded_default():
    """nanoGPT trains GPT-2 from scratch at its GPTConfig default 50304 (50257 padded), so the anchor
    does too: its embedding / LM head have 50304 rows while the data's ids stay < 50257; the
    baseline copy's nano_compile runs at 50304 and the Hugging Face anchors at GPT-2's 50257."""
    import nano_anchor
    import train_throughput as tt
    assert nano_anchor.NanoConfig().vocab_size == nano_anchor.NANOGPT_VOCAB == 50304
    m = nano_anchor.Nano(nano_anchor.NanoConfig(n_layer=1, n_embd=8, n_head=2))
    assert m.head.weight.shape == (50304, 8) and m.head.weight is m.wte.weight
    x = torch.randint(0, nano_anchor.GPT2_VOCAB, (1, 16))
    assert torch.isfinite(m(x, x))
    assert tt.anchor_vocab("nano_compile") == 50304
    assert tt.anchor_vocab("hf_sdpa") == tt.anchor_vocab("hf_eager") == nano_anchor.GPT2_VOCAB == 50257


def test_anchor_module_takes_the_vocabulary(monkeypatch, baseline):
    """train_throughput._anchor_module (user_path's `ref`, profile_step's nano) builds the baseline
    copy at the vocabulary asked for; the module-scoped baseline is restored afterwards."""
    import train_throughput as tt
    for k in ("LDH", "MB", "STEPS", "VOCAB", "OUT"):
        monkeypatch.setenv(k, os.environ.get(k, ""))
    try:
        A = tt._anchor_module("124M", 12, 5, vocab=tt.anchor_vocab("nano_compile"))
        assert (A.V, A.L, A.MB) == (50304, 12, 12)
    finally:
        monkeypatch.undo()
        importlib.reload(baseline)  # back to the module fixture's LDH / VOCAB
    assert baseline.V == V


def test_peak_memory_is_one_definition():
    """user_path's hpcmeg rows and the anchor's rows use nano_anchor.PEAK_MEMORY: the largest running
    peak over every metrics window, the first (warm-up, CUDA-graph capture) included, in GB; the
    anchor subtracts what its process held before the run."""
    import nano_anchor
    import user_path
    recs = [dict(peak_mem_gib=9.0), dict(peak_mem_gib=8.5), dict(peak_mem_gib=8.5)]  # warm-up window highest
    assert user_path.hpcmeg_peak_gb(recs) == nano_anchor.peak_mem_gb(9.0 * 2**30) == round(9.0 * 2**30 / 1e9, 2)
    assert nano_anchor.peak_mem_gb(9.5e9, held_before_bytes=1.5e9) == 8.0
    assert "nano_anchor.PEAK_MEMORY" in user_path.__doc__ and "PEAK_MEMORY" in nano_anchor.__doc__
    assert "warm-up included" in nano_anchor.PEAK_MEMORY
