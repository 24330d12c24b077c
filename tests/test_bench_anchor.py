"""bench/nano_anchor.py, the dropout + accumulation anchor of bench/user_path.py: at dropout 0 it is the
project's baseline model (bench/anchors_gpt2.py's Nano) with the same weights; dropout acts only in
training mode; its batches are next-token windows of the token file; user_path's item grammar."""
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


def test_user_path_table_and_the_one_call_stage(tmp_path):
    """The table's ratio is against the nano row after an hpcmeg row, else the last one before it
    (the lease runs the anchor first); lease.sh uall runs each size's anchor and best row in one
    user_path call (only=), with UALL_EXTRA added to every hpcmeg row's settings."""
    import subprocess
    import tarfile

    import user_path
    rows = [dict(row="nano d0.1 mb12 gbs192", tokens_per_s=400), dict(row="hpcmeg d0.1 mb16 gbs192", tokens_per_s=520)]
    assert "**1.300** vs nano d0.1 mb12 gbs192" in user_path.table(rows)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "out"
    r = subprocess.run(["bash", os.path.join(root, "bench", "lease.sh"), "uall"], capture_output=True, text=True,
                       cwd=str(tmp_path), timeout=120,
                       env={**os.environ, "OUT": str(out), "LEASE_BUDGET_S": "200", "CUDA_VISIBLE_DEVICES": "",
                            "UALL_EXTRA": "|model.layernorm_impl=triton_forward"})
    assert r.returncode == 0, r.stderr
    with tarfile.open(out / "lease.tgz") as t:
        logged = t.extractfile("lease.log").read().decode()
    cmd = logged.split("== user_path_all ")[1].split("\n", 1)[0]
    assert "--sizes 124M,355M,1.3B " in cmd, cmd
    items = cmd.split("--items ")[1].split()
    tf = "model.layernorm_impl=triton_forward"
    got = {size: [(k, o["mb"], o["set"]) for k, o in (user_path.parse_item(i, size) for i in items)
                  if not o["only"] or size in o["only"]] for size in ("124M", "355M", "1.3B")}
    assert got == {"124M": [("nano", 12, []), ("hpcmeg", 16, ["model.recompute_gelu_layers=1", tf])],
                   "355M": [("nano", 12, []), ("hpcmeg", 16, ["model.cross_entropy=backward_in_forward", tf])],
                   "1.3B": [("nano", 8, []), ("hpcmeg", 8, [tf])]}, got


def test_lease_script_items(tmp_path, monkeypatch):
    """bench/lease.sh: an unknown stage fails with one line and exit 2 before any stage runs; a
    user-path stage checks cuBLASLt's epilogues on this call's GPU, builds its rows from an earlier
    call's probe files (LEASE_BEST), and those rows
    parse into the settings and the attention spec the kernels read from the environment (the run
    itself fails here, without a GPU, after logging its command); everything ends up in one
    lease.tgz (the device tool returns at most 8 files)."""
    import subprocess
    import tarfile

    import user_path

    from hpcmeg.model import triton_attention
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    lease = os.path.join(root, "bench", "lease.sh")
    out, best = tmp_path / "out", tmp_path / "best"
    best.mkdir()
    r = subprocess.run(["bash", lease, "loss", "u125"], capture_output=True, text=True,
                       env={**os.environ, "OUT": str(out)}, timeout=60)
    assert r.returncode == 2 and "unknown stage 'u125'" in r.stderr
    assert not (out / "loss_parity.log").exists()  # the valid stage before it did not start
    spec = "heavy_first=1+dkv_m=64"
    (best / "attention_best_124M.txt").write_text(spec)
    (best / "attention_best_355M.txt").write_text("default")
    (best / "lt_ok").write_text("agreed\n")  # an earlier call's cuBLASLt check: says nothing about this GPU
    ce = "block=8192+warps=16+prefetch=1+reverse=1"
    (best / "ce_best.txt").write_text(ce)  # an earlier call's ce stage found a faster CE launch
    r = subprocess.run(["bash", lease, "gemm", "u124", "b124", "u355", "p355", "p1.3B", "mlpbwd", "bdaln",
                        "a1.3B"],
                       capture_output=True, text=True, cwd=str(tmp_path), timeout=120,
                       env={**os.environ, "OUT": str(out), "LEASE_BEST": str(best), "LEASE_BUDGET_S": "200",
                            "GEMM_SIZES": "124M", "CUDA_VISIBLE_DEVICES": ""})  # never a real run, even on a GPU machine
    assert r.returncode == 0, r.stderr
    assert [p.name for p in out.iterdir()] == ["lease.tgz"]
    with tarfile.open(out / "lease.tgz") as t:
        assert {"gemm_probe.log", "user_path_124M.log", "user_path_124M_bif.log", "user_path_355M.log"} <= set(t.getnames())
        assert "lt_check.log" in t.getnames()  # checked once per call, whatever LEASE_BEST holds
        logged = t.extractfile("lease.log").read().decode()
    assert "bench/dev/gemm_probe.py --sizes 124M " in logged
    items, bif, u355 = (part.split("\n", 1)[0].split() for part in logged.split("--items ")[1:4])
    # u124: the anchor, the shipped defaults, the CE launch at micro 12 and 16, the probe's tiles,
    # plain micro 16, micro 16 with one and two layers' GELU recomputed, the Triton forward of the
    # bias-dropout-add + LayerNorm, then the A/B rows of the defaults
    # (cuDNN attention, session 18's cuBLASLt GELU forward epilogue only, the Triton GELU)
    tf = "model.layernorm_impl=triton_forward"
    assert items[:2] == ["nano", "hpcmeg"] and len(items) == 12, items
    got = [user_path.parse_item(i, "124M")[1] for i in items[2:]]
    assert [o["mb"] for o in got] == [12, 16, 12, 16, 16, 16, 12, 12, 12, 12]
    assert [o.get("env", {}) for o in got] == [{"HPCMEG_CE_LAUNCH": ce}, {"HPCMEG_CE_LAUNCH": ce},
                                              {"HPCMEG_ATTENTION_BLOCKS": spec}, {}, {}, {}, {}, {}, {}, {}]
    assert [o["set"] for o in got][-6:] == [["model.recompute_gelu_layers=1"], ["model.recompute_gelu_layers=2"],
                                            [tf], ["model.attention_backend=cudnn"],
                                            ["model.gelu_impl=cublaslt"], ["model.gelu_impl=triton"]]
    attn_env = got[2]["env"]
    # b124: backward_in_forward at micro 12, 16 and 24, then plain micro 16
    bif_set = "model.cross_entropy=backward_in_forward"
    assert bif[:2] == ["nano", "hpcmeg"] and len(bif) == 6, bif
    got = [user_path.parse_item(i, "124M")[1] for i in bif[2:]]
    assert [(o2["mb"], o2["set"]) for o2 in got] == [(12, [bif_set]), (16, [bif_set]), (24, [bif_set]), (16, [])]
    # u355: the CE launch too; the probe's tiles are the defaults there: no tiles row
    assert u355 == ["nano", "hpcmeg", f"hpcmeg:env=HPCMEG_CE_LAUNCH:{ce}", f"hpcmeg:mb=16,env=HPCMEG_CE_LAUNCH:{ce}",
                    f"hpcmeg:mb=16,set={bif_set}", f"hpcmeg:set={tf}",
                    "hpcmeg:set=model.attention_backend=cudnn",
                    "hpcmeg:set=model.gelu_impl=cublaslt", "hpcmeg:set=model.gelu_impl=triton"], u355
    # the profiles of the two missed targets, each at its user path's micro and global batch
    for size, mb_gbs in (("355M", "--set train.global_batch_size=192"),
                         ("1.3B", "--set train.micro_batch_size=8 --set train.global_batch_size=64")):
        cmd = logged.split(f"== profile_{size} ")[1].split("\n", 1)[0]
        assert f"--size {size} " in cmd and "model.hidden_dropout=0.1" in cmd and cmd.endswith(mb_gbs), cmd
    # the MLP backward probe (session 18's backward against gelu_impl cublaslt_dgelu's), the
    # bias-dropout-add + LayerNorm forward kernel's check
    assert "bench/dev/mlp_bwd_probe.py --out" in logged
    assert "bench/gpu_agreement.py --parts bdaln" in logged
    # the attention tiles at 1.3B's head dim, checked against the twin
    cmd = logged.split("== attention_probe_1.3B ")[1].split("\n", 1)[0]
    assert "--sizes 1.3B " in cmd and "--agree fwd_n=32+dkv_m=16+dq_n=16 dkv_n=128+bwd_warps=8+fwd_draw=1 " in cmd, cmd
    # without an earlier check the u stage checks cuBLASLt's epilogues first and says when they failed
    # (no GPU here); the rows are the shipped ones either way
    out2, best2 = tmp_path / "out2", tmp_path / "best2"
    best2.mkdir()
    r = subprocess.run(["bash", lease, "u1.3B"], capture_output=True, text=True, cwd=str(tmp_path), timeout=120,
                       env={**os.environ, "OUT": str(out2), "LEASE_BEST": str(best2), "LEASE_BUDGET_S": "200",
                            "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr
    with tarfile.open(out2 / "lease.tgz") as t:
        assert "lt_check.log" in t.getnames()
        logged = t.extractfile("lease.log").read().decode()
    assert "did NOT agree" in logged
    assert logged.split("--items ")[1].split("\n", 1)[0].split() == [
        "nano", "hpcmeg", f"hpcmeg:set={tf}", "hpcmeg:set=model.attention_backend=cudnn",
        "hpcmeg:set=model.gelu_impl=cublaslt", "hpcmeg:set=model.gelu_impl=triton"]
    monkeypatch.setenv(triton_attention.BLOCKS_ENV, attn_env[triton_attention.BLOCKS_ENV])
    b = triton_attention.blocks_from_env()
    assert (b.heavy_first, b.dkv_m, b.fwd_m) == (1, 64, triton_attention.DEFAULT_BLOCKS.fwd_m)


def test_attention_probe_best_spec_takes_a_faster_bits_launch():
    """bench/dev/attention_probe.py: the best spec (what $HPCMEG_ATTENTION_BLOCKS gets in the lease's
    Triton rows) takes the keep-bits launch of the fastest --bits variant only when it beat the
    default launch by >= 5 %, and never a variant that failed."""
    import attention_probe as ap
    res = {"triton p=0.1 keep bits": 0.050, "triton p=0.1 keep bits [bits_loop=1]": 0.030,
           "triton p=0.1 keep bits [bits_warps=8]": 0.049, "triton p=0.1 keep bits [bits_rows=32]": "failed: x"}
    assert ap.with_best_bits(res, 0.1, "default") == "bits_loop=1"
    assert ap.with_best_bits(res, 0.1, "heavy_first=1") == "heavy_first=1+bits_loop=1"
    assert ap.blocks("heavy_first=1+bits_loop=1").bits_loop == 1
    res["triton p=0.1 keep bits [bits_loop=1]"] = 0.048  # 4 % faster: not enough
    assert ap.with_best_bits(res, 0.1, "heavy_first=1") == "heavy_first=1"
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
