"""hpcmeg reshard keeps the whole training state, and shards that do not belong together are refused.

Real runs (`hpcmeg train`, gloo ranks, dropout 0.1 so every RNG stream matters) at three layouts:
TP2 x PP2 x V2 (4 ranks: TP streams, per-stage default streams, model chunks), TP2 + SP and DP2 with
the distributed optimizer (2 ranks each), 6 iterations, saved at 3 and 6.
- An identity reshard of iteration 3 is the source checkpoint tensor for tensor (weights, Adam moments,
  fp32 masters, every rank's RNG state), and a run resumed from it equals the uninterrupted run: losses
  and grad norms ==, and every tensor of its iteration-6 shards.
- TP2 -> TP1 -> TP2 keeps masters and moments bit for bit; a rank the source lacks gets the streams a
  fresh run gives it (its stage's default stream, or the fresh seeding for a new stage).
- A shard from an earlier iteration or another save of the same architecture, or whose replicated
  tensors or tied-embedding half disagree, is refused in one line naming it by reshard, convert and
  the trainer's resume (manifest-less, as a Megatron-LM checkpoint).
"""
from __future__ import annotations

import argparse
import os
import shutil

import pytest
import torch

from helpers import curve, stdlib_dataset, train_cli as train
from hpcmeg.checkpoint.store import load_checkpoint
from hpcmeg.cli import main as hpcmeg_main
from hpcmeg.megatron.names import MANIFEST_FILENAME, checkpoint_path, iter_dirname

pytestmark = pytest.mark.dist

BASE = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1", "model.make_vocab_size_divisible_by=128",
        "train.train_iters=6", "checkpoint.save_interval=3", "train.eval_interval=0"]
LAYOUTS = {  # name: (processes, overrides, (tp, pp, vpp))
    "tp2pp2v2": (4, ["model.num_layers=4", "train.global_batch_size=8", "parallel.tensor=2", "parallel.pipeline=2",
                     "parallel.virtual_pipeline=2", "cluster.cpu_tasks_per_node=4"], (2, 2, 2)),
    "tp2sp": (2, ["parallel.tensor=2", "parallel.sequence_parallel=true", "cluster.cpu_tasks_per_node=2"], (2, 1, 1)),
    "dp2dist": (2, ["parallel.distributed_optimizer=true", "cluster.cpu_tasks_per_node=2"], (1, 1, 1)),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each layout's uninterrupted run, trained the first time a test asks for it."""
    out = tmp_path_factory.mktemp("reshard_state")
    prefix = stdlib_dataset(out / "data")
    done: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in done:
            nproc, extra, _ = LAYOUTS[name]
            done[name] = train(nproc, out, prefix, name, BASE + extra)
        return done[name]

    get.out, get.prefix = out, prefix
    return get


def ckpt(rd: str) -> str:
    return os.path.join(rd, "checkpoints")


def reshard(src: str, dst: str, tp: int, pp: int, vpp: int = 1, iteration: int | None = None) -> None:
    args = ["reshard", src, dst, "--tp", str(tp), "--pp", str(pp)] + (["--vpp", str(vpp)] if vpp > 1 else [])
    assert hpcmeg_main(args + (["--iteration", str(iteration)] if iteration is not None else [])) == 0


def shards(ckpt_dir: str, tp: int, pp: int, iteration: int) -> dict[tuple[int, int], dict]:
    return {(t, p): load_checkpoint(ckpt_dir, tp_rank=t, pp_rank=p, tp_size=tp, pp_size=pp, iteration=iteration)[1]
            for p in range(pp) for t in range(tp)}


SKIP = {("hpcmeg", "extra"), ("hpcmeg", "save_id")}  # the reshard's own note and the save's id


def diff(a, b, path=(), skip=SKIP, same_tensor=torch.equal) -> list[str]:
    """Every place two checkpoint dicts differ: tensors by dtype, shape and `same_tensor` (bits); the
    rest by ==."""
    if path in skip:
        return []
    where = ".".join(map(str, path)) or "<root>"
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and same_tensor(a, b)
        return [] if same else [where]
    if isinstance(a, argparse.Namespace) and isinstance(b, argparse.Namespace):
        a, b = vars(a), vars(b)
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a.keys() ^ b.keys()))}"]
        return [d for k in a for d in diff(a[k], b[k], path + (k,), skip, same_tensor)]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, path + (i,), skip, same_tensor)]
    return [] if type(a) is type(b) and a == b else [f"{where}: {a!r} vs {b!r}"]


def _rewrite(path: str, edit) -> None:
    """Load a shard file, edit its dict in place, save it back (a hand-made change to a real shard)."""
    st = torch.load(path, weights_only=False)
    edit(st)
    torch.save(st, path)


# ------------------------------------------------------------------------------------- item 1: state

@pytest.mark.parametrize("name", ["tp2pp2v2", "dp2dist", "tp2sp"])
def test_identity_reshard_is_the_checkpoint_and_resumes_bit_exact(runs, name):
    nproc, extra, (tp, pp, vpp) = LAYOUTS[name]
    ref = runs(name)
    rd = os.path.join(str(runs.out), name + "_resharded")
    reshard(ckpt(ref), ckpt(rd), tp, pp, vpp, iteration=3)
    src, got = shards(ckpt(ref), tp, pp, 3), shards(ckpt(rd), tp, pp, 3)
    for key in src:
        assert diff(src[key], got[key]) == [], key
        assert src[key]["optimizer"]["optimizer"]["fp32_from_fp16_params"]  # the masters are there to keep
    resumed = train(nproc, runs.out, runs.prefix, name + "_resharded", BASE + extra)
    (a, _), (b, m) = curve(ref), curve(resumed)
    assert m["start"][-1]["start"].endswith("at iteration 3")
    assert b == a[3:] and len(b) == 3
    final_ref, final = shards(ckpt(ref), tp, pp, 6), shards(ckpt(resumed), tp, pp, 6)
    skip = SKIP | {("hpcmeg", "recipe")}  # the recipes differ in run.name only
    for key in final_ref:
        assert diff(final_ref[key], final[key], skip=skip) == [], key


def _bf16_weights_copy(src_dir: str, dst: str, iteration: int, tp: int, pp: int) -> str:
    """One iteration of `src_dir` with the model's tensors in bf16 (optimizer and masters untouched);
    without its manifest, whose sizes no longer hold."""
    it = os.path.join(dst, iter_dirname(iteration))
    shutil.copytree(os.path.join(src_dir, iter_dirname(iteration)), it)
    os.remove(os.path.join(it, MANIFEST_FILENAME))
    with open(os.path.join(dst, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(f"{iteration}\n")

    def cast(d):
        return {k: cast(v) if isinstance(v, dict) else v.bfloat16() for k, v in d.items()}

    for p in range(pp):
        for t in range(tp):
            _rewrite(checkpoint_path(dst, iteration, t, p, pp),
                     lambda st: st.update({k: cast(v) for k, v in st.items() if k.startswith("model")}))
    return dst


@pytest.mark.filterwarnings("ignore::hpcmeg.checkpoint.store.CheckpointWarning")  # the bf16 copy has no manifest
def test_layout_changes_keep_masters_moments_and_give_each_rank_its_streams(runs, tmp_path):
    from hpcmeg.checkpoint.safe import capture_rng_state, restore_rng_state
    from hpcmeg.convert.reshard import STAGE_SEED_STRIDE, fresh_default_stream
    from hpcmeg.parallel.random import RNGStreams
    from hpcmeg.train.build import seed_everything

    # the weights as a GPU bf16 run saves them (bf16 parameters beside their fp32 masters)
    src_dir = _bf16_weights_copy(ckpt(runs("tp2pp2v2")), str(tmp_path / "bf16"), 3, 2, 2)
    one, back, four = (str(tmp_path / n) for n in ("tp1", "tp2", "pp4"))
    reshard(src_dir, one, 1, 2, 2, iteration=3)
    reshard(one, back, 2, 2, 2)
    src, got = shards(src_dir, 2, 2, 3), shards(back, 2, 2, 3)
    seed, padded = src[(0, 0)]["args"].seed, src[(0, 0)]["args"].padded_vocab_size
    kept = shards(one, 1, 2, 3)[(0, 0)]["args"].padded_vocab_size  # 50304: TP1 pads to 128, TP2 to 256
    assert kept < padded
    qkv = src[(0, 0)]["model0"]["language_model"]["encoder"]["layers.0.self_attention.query_key_value.weight"]
    assert qkv.dtype == torch.bfloat16
    masters = [m for group in src[(0, 0)]["optimizer"]["optimizer"]["fp32_from_fp16_params"] for m in group]
    assert any(m.shape == qkv.shape and torch.equal(m.bfloat16(), qkv) and not torch.equal(m, qkv.float())
               for m in masters)  # the master is more than its bf16 parameter: rebuilding it would round it
    for (t, p), s in src.items():
        g = got[(t, p)]
        rows = padded // 2

        def same(x, y, t=t, rows=rows):
            """Bit for bit; but the vocabulary rows TP1's padding has not (global row >= kept): zero."""
            if x.ndim == 2 and x.shape[0] == rows:
                keep = max(0, min(rows, kept - t * rows))
                return torch.equal(x[:keep], y[:keep]) and not y[keep:].any()
            return torch.equal(x, y)
        # weights, moments and fp32 masters bit for bit (masters: the parameters' own rules)
        for part in ("model0", "model1", ("optimizer", "optimizer", "state"),
                     ("optimizer", "optimizer", "fp32_from_fp16_params")):
            a, b = (s, g) if isinstance(part, str) else (s[part[0]][part[1]], g[part[0]][part[1]])
            key = part if isinstance(part, str) else part[2]
            assert diff(a[key], b[key], same_tensor=same) == [], (t, p, part)
        rs, rg = s["rng_state"][0], g["rng_state"][0]
        # the default stream is one per stage (TP ranks draw the same masks): rank 0's went through TP1
        assert diff({k: v for k, v in rs.items() if k != "rng_tracker_states"},
                    {k: v for k, v in rg.items() if k != "rng_tracker_states"}) == [], (t, p)
        want = rs["rng_tracker_states"] if t == 0 else RNGStreams(seed, t, torch.device("cpu")).state_dict()
        assert diff(rg["rng_tracker_states"], want) == [], (t, p)
    # a stage the source lacks: a fresh run's seeding, as build.py does it
    reshard(src_dir, four, 1, 4, iteration=3)
    got4 = shards(four, 1, 4, 3)
    saved = capture_rng_state()
    try:
        for p in range(4):
            entry = got4[(0, p)]["rng_state"][0]
            if p < 2:
                assert diff(entry, src[(0, p)]["rng_state"][0]) == []
                continue
            seed_everything(seed + STAGE_SEED_STRIDE * p)
            fresh = capture_rng_state(RNGStreams(seed, 0, torch.device("cpu")).state_dict())
            assert diff(entry, {**fresh, "cuda_rng_state": None}) == [], p
            assert diff(fresh_default_stream(seed + STAGE_SEED_STRIDE * p),
                        {**fresh, "cuda_rng_state": None, "rng_tracker_states": {}}) == []
    finally:
        restore_rng_state(saved)


# ------------------------------------------------------------------------ item 3: shards that belong

def _mixed(src_dir: str, dst: str, iteration: int) -> str:
    """A copy of one iteration of `src_dir` as a Megatron-LM checkpoint has it (no hpcmeg manifest)."""
    it = os.path.join(dst, iter_dirname(iteration))
    shutil.copytree(os.path.join(src_dir, iter_dirname(iteration)), it)
    os.remove(os.path.join(it, MANIFEST_FILENAME))
    with open(os.path.join(dst, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(f"{iteration}\n")
    return dst


def _no_save_id(st: dict) -> None:
    st["hpcmeg"].pop("save_id", None)


def _strip_save_ids(d: str, tp: int, pp: int, it: int) -> None:
    for p in range(pp):
        for t in range(tp):
            _rewrite(checkpoint_path(d, it, t, p, pp), _no_save_id)


@pytest.mark.parametrize("case", ["earlier_iteration", "another_save", "other_args", "replicated", "tied_half"])
def test_shards_from_different_saves_are_refused_by_reshard_and_convert(runs, tmp_path, capsys, case):
    src_dir = ckpt(runs("tp2pp2v2"))
    d = _mixed(src_dir, str(tmp_path / "mixed"), 6)
    bad = checkpoint_path(d, 6, 1, 0, 2)
    old = checkpoint_path(src_dir, 3, 1, 0, 2)
    if case == "earlier_iteration":  # rank (1, 0) copied from iteration 3 of the same run
        shutil.copyfile(old, bad)
        want = "holds iteration 3"
    elif case == "another_save":  # the same tensors, from a second save of the same model
        other = str(tmp_path / "again")
        reshard(src_dir, other, 2, 2, 2, iteration=6)
        shutil.copyfile(checkpoint_path(other, 6, 1, 0, 2), bad)
        want = "another save"
    else:  # a Megatron-LM checkpoint has no save ids: the args and the tensors must tell
        _strip_save_ids(d, 2, 2, 6)
        earlier = torch.load(old, weights_only=False)
        if case == "other_args":
            _rewrite(bad, lambda st: setattr(st["args"], "seed", st["args"].seed + 1))
            want = "args.seed"
        elif case == "replicated":
            key = "layers.0.input_layernorm.weight"
            _rewrite(bad, lambda st: st["model1"]["language_model"]["encoder"].__setitem__(
                key, earlier["model1"]["language_model"]["encoder"][key]))
            want = "encoder.layers.0.input_layernorm.weight (model chunk 1) differs from tensor-parallel rank 0's"
        else:
            bad = checkpoint_path(d, 6, 1, 1, 2)
            late = torch.load(checkpoint_path(src_dir, 3, 1, 1, 2), weights_only=False)
            _rewrite(bad, lambda st: st["model1"].__setitem__("word_embeddings_for_head",
                                                               late["model1"]["word_embeddings_for_head"]))
            want = "word_embeddings_for_head differs"
    for cmd in (["reshard", d, str(tmp_path / "out"), "--tp", "1", "--pp", "1"], ["convert", d, str(tmp_path / "hf")]):
        assert hpcmeg_main(cmd) == 1, cmd
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.split(": ")[1] == bad and want in err, err
        assert not os.path.exists(str(tmp_path / "out")) and not os.path.exists(str(tmp_path / "hf"))


def _load_on_rank(rank, world, ckpt_dir):
    import torch.distributed as dist

    from hpcmeg.checkpoint.store import CheckpointLoadError

    def all_reduce_max(v: int) -> int:
        t = torch.tensor([int(v)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    try:
        load_checkpoint(ckpt_dir, tp_rank=rank, pp_rank=0, tp_size=world, pp_size=1, all_reduce_max=all_reduce_max)
    except CheckpointLoadError as e:
        return str(e)
    return None


def test_shard_of_another_save_is_refused_at_resume(runs, tmp_path, dist_pool):
    """The trainer's resume: each rank reads its own shard. An earlier iteration's shard (rank 1) stops
    `hpcmeg train` on every rank, rank 1 naming the file; a shard of another save of the same iteration
    is found by comparing the ranks' fingerprints (iteration, args, save id) over the process group."""
    nproc, extra, _ = LAYOUTS["tp2sp"]
    src_dir = ckpt(runs("tp2sp"))
    other = str(tmp_path / "again")
    reshard(src_dir, other, 2, 1, iteration=6)
    d = _mixed(src_dir, str(tmp_path / "another"), 6)
    shutil.copyfile(checkpoint_path(other, 6, 1, 0, 1), checkpoint_path(d, 6, 1, 0, 1))
    got = dist_pool(2).run(_load_on_rank, d)
    assert got[1].startswith(checkpoint_path(d, 6, 1, 0, 1) + ": its iteration, args or save id differ"), got
    assert "another rank's shard" in got[0]

    rd = os.path.join(str(runs.out), "tp2sp_mixed")
    mixed = _mixed(src_dir, ckpt(rd), 6)
    shutil.copyfile(checkpoint_path(src_dir, 3, 1, 0, 1), checkpoint_path(mixed, 6, 1, 0, 1))
    with pytest.raises(AssertionError) as e:  # the same recipe as the source run: it would resume at 6
        train(nproc, runs.out, runs.prefix, "tp2sp_mixed", BASE + extra)
    text = str(e.value)
    assert f"[rank 1]: {checkpoint_path(mixed, 6, 1, 0, 1)}: holds iteration 3" in text, text[-3000:]
    # and no rank talked to the store after rank 0 (its host) had gone: torch prints that broken pipe
    # with a C++ stack beside the ranks' lines (train/peers.py: rank 0 leaves last)
    assert "another rank's shard" in text and "Traceback" not in text and "Broken pipe" not in text, text[-3000:]
