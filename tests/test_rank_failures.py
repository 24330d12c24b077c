"""A failure on one rank of `hpcmeg train` is seen on every rank, and a stop asked during start-up is kept.

On real gloo ranks (`hpcmeg train` processes with the variables torchrun sets, forked from
tests/preloaded.py's server, which has imported torch) and a real TP2 checkpoint: one rank's shard
is altered so that only that rank finds the problem while loading (a tensor of another
architecture's size, the manifest updated to match, so nothing before the load notices). That
rank prints its one line; the other prints one line naming it; both exit 2 together, no traceback.
And a SIGTERM that arrives while the recipe is still being read (the recipe is a FIFO the test
writes only after the signal; a fresh interpreter, so torch is not imported yet) ends the run
before its first step with a line and exit 3.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading

import pytest
import torch

from helpers import TINY_RECIPE, TRAIN_BASE, Ranks, run_ranks, stdlib_dataset
from preloaded import run_cli
from hpcmeg.checkpoint.store import file_crc32
from hpcmeg.megatron.names import EXIT_BAD_RECIPE, EXIT_REQUEUE, MANIFEST_FILENAME

pytestmark = pytest.mark.dist
TP2 = ["parallel.tensor=2", "model.make_vocab_size_divisible_by=128", "train.train_iters=4", "train.lr_warmup_iters=1",
       "checkpoint.save_interval=4"]


def _args(out, prefix, name: str, extra: list[str]) -> list[str]:
    sets = [f"run.output_root={out}", f"run.name={name}", f"data.data_path=[{prefix}]", *TRAIN_BASE, *extra]
    return ["train", TINY_RECIPE] + [x for s in sets for x in ("--set", s)]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """A TP2 run of 4 iterations, saved at the end: (output root, dataset prefix)."""
    out = tmp_path_factory.mktemp("fail")
    prefix = stdlib_dataset(out / "data")
    p = run_ranks(2, _args(out, prefix, "base", TP2), _env())
    assert p.returncode == 0, p.stderr[-3000:]
    return out, prefix


def _alter_shard(iter_dir: str, tp_rank: int) -> None:
    """Give TP rank `tp_rank`'s shard a final LayerNorm of another width, and its manifest entry the
    new file's size and crc (as if that shard had been saved by another architecture's run)."""
    rel = os.path.join(f"mp_rank_{tp_rank:02d}", "model_optim_rng.pt")
    path = os.path.join(iter_dir, rel)
    state = torch.load(path, weights_only=False)
    enc = state["model"]["language_model"]["encoder"]
    (key,) = [k for k in enc if k.endswith("final_layernorm.weight")]
    enc[key] = torch.ones(enc[key].numel() + 16)
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)
    mpath = os.path.join(iter_dir, MANIFEST_FILENAME)
    manifest = json.load(open(mpath))
    manifest["files"][rel].update(size=os.path.getsize(path), crc32=file_crc32(path))
    with open(mpath, "w") as f:
        json.dump(manifest, f)


def _wait_all(ranks: Ranks, timeout: float = 300) -> tuple[list[int], list[str]]:
    """Every rank's exit code and stderr, each rank left to end by itself (no kill-on-bad-exit here:
    what each rank says on its own is the point)."""
    codes = [p.wait(timeout=timeout) for p in ranks.procs]
    errs = []
    for _, e in ranks.logs:
        e.seek(0)
        errs.append(e.read())
    return codes, errs


@pytest.mark.parametrize("bad", [1, 0])
def test_one_ranks_load_failure_is_reported_by_every_rank(tp2, bad):
    out, prefix = tp2
    name = f"bad{bad}"
    shutil.copytree(out / "base", out / name)
    _alter_shard(str(out / name / "checkpoints" / "iter_0000004"), bad)
    codes, errs = _wait_all(Ranks(2, _args(out, prefix, name, TP2), _env()))
    assert codes == [EXIT_BAD_RECIPE, EXIT_BAD_RECIPE], errs
    assert not any("Traceback" in e for e in errs), errs
    mine = [ln for ln in errs[bad].splitlines() if ln.startswith("hpcmeg train")]
    other = [ln for ln in errs[1 - bad].splitlines() if ln.startswith("hpcmeg train")]
    # the rank that found it: one line naming the checkpoint and what differs
    assert len(mine) == 1 and mine[0].startswith(f"hpcmeg train [rank {bad}]: "), errs
    assert "checkpoints" in mine[0] and "final_layernorm" in mine[0], mine
    # the other: one line saying which rank failed (rank 0 repeats its line for the job's main log)
    assert len(other) == 1 and other[0].startswith(f"hpcmeg train [rank {1 - bad}]: stopping: rank {bad} failed"), errs
    if bad == 1:
        assert other[0].endswith(mine[0].split(": ", 1)[1]), other
    status = json.load(open(out / name / "train_status.json"))
    assert (status["status"], status["exit_code"]) == ("failed", EXIT_BAD_RECIPE), status
    assert status["reason"].startswith("rank 1: ") if bad == 1 else "final_layernorm" in status["reason"]


def test_a_problem_every_rank_finds_is_printed_once_by_rank_0(tp2):
    """The recipe's model differs from the checkpoint's: both ranks find it; rank 0 alone prints it
    (its log is the one `hpcmeg status` reads first), rank 1 prints nothing, both exit 2."""
    out, prefix = tp2
    shutil.copytree(out / "base", out / "arch")
    codes, errs = _wait_all(Ranks(2, _args(out, prefix, "arch", TP2 + ["model.num_layers=3"]), _env()))
    assert codes == [EXIT_BAD_RECIPE, EXIT_BAD_RECIPE], errs
    lines = [[ln for ln in e.splitlines() if ln.startswith("hpcmeg train")] for e in errs]
    assert len(lines[0]) == 1 and lines[1] == [], errs
    assert lines[0][0].startswith("hpcmeg train [rank 0]: ") and "num_layers: checkpoint 2 vs recipe 3" in lines[0][0]


def test_a_sigterm_while_the_recipe_loads_stops_before_the_first_step(tmp_path):
    """The recipe is a FIFO: the process is provably inside its start-up (reading the recipe) when the
    signal comes, before torch is imported. It must not die of it: it finishes start-up, stops before
    the first step with one line, records 'preempted' and exits 3 (resume me)."""
    prefix = stdlib_dataset(tmp_path / "data")
    recipe = tmp_path / "recipe.yaml"
    os.mkfifo(recipe)
    text = open(TINY_RECIPE).read()
    args = _args(tmp_path, prefix, "early", ["cluster.cpu_tasks_per_node=1"])
    args[1] = str(recipe)
    p = subprocess.Popen([sys.executable, "-m", "hpcmeg.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=_env())
    stop = threading.Event()

    def serve():  # each open of the recipe reads the whole text, however many times it is opened
        first = True
        while not stop.is_set():
            try:
                with open(recipe, "w") as f:  # blocks until the process opens the recipe
                    if first and p.poll() is None:
                        p.send_signal(signal.SIGTERM)  # the process is inside load_recipe, torch not imported
                    first = False
                    f.write(text)
            except BrokenPipeError:  # that reader closed before the text was flushed: serve the next open
                pass

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    try:
        out, err = p.communicate(timeout=300)
    finally:
        stop.set()
    assert p.returncode == EXIT_REQUEUE, (p.returncode, out[-2000:], err[-2000:])
    assert "stopping before the first step at iteration 0 (signal SIGTERM)" in out, out
    assert "Traceback" not in err, err
    rd = tmp_path / "early"
    status = json.load(open(rd / "train_status.json"))
    assert (status["status"], status["iteration"], status["exit_code"]) == ("preempted", 0, EXIT_REQUEUE)
    assert not (rd / "checkpoints" / "latest_checkpointed_iteration.txt").exists()  # no step, nothing saved



def test_a_process_count_other_than_the_recipes_is_one_warning_line(tmp_path):
    """One process started for a recipe that plans 1 node x 2 CPU tasks: a warning naming both counts
    and the keys, on stderr before anything is built (the run itself then fails on its missing data)."""
    args = _args(tmp_path, tmp_path / "no-such-data", "count", ["cluster.nodes=1", "cluster.cpu_tasks_per_node=2"])
    p = run_cli(args, _env(), timeout=300)
    lines = p.stderr.splitlines()
    assert lines and lines[0] == ("hpcmeg train: warning: 1 process(es) are running but the recipe plans 2 "
                                  "(cluster.nodes 1 x cluster.cpu_tasks_per_node 2); data parallelism and gradient "
                                  "accumulation follow the 1 running (train.global_batch_size 4 is kept); start 2 "
                                  "to run as planned"), p.stderr
    assert p.returncode != 0 and "no-such-data" in lines[-1] and "Traceback" not in p.stderr, p.stderr
