"""Bad inputs to train / convert / reshard / import-hf / plot / status: non-zero exit (2 when the
recipe or command line is at fault, 1 for data and runtime faults), exactly one stderr line that
names the file or key and the fix, no traceback, nothing written.

Classes: hostile or damaged checkpoints under `hpcmeg train` (a malicious pickle that weights_only
refuses; every checkpoint corrupt); a recipe that does not fit the data or the machine (token ids
beyond model.vocab_size, train.device=cuda without CUDA); outputs that cannot be written (a file in
the way, a directory the user cannot write: as `nobody` through setpriv when the tests run as root,
else a read-only directory); garbage in latest_checkpointed_iteration.txt; directories that are not
runs. Every case runs the real CLI in a process of its own: forked from tests/preloaded.py's server,
which has imported torch (a fresh interpreter spent ~3 s of each case on that), or, for the cases
run as another user, the console script under setpriv.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

from conftest import hpcmeg_cmd
from hpcmeg.checkpoint.store import CheckpointWarning, file_crc32, save_checkpoint
from hpcmeg.megatron.names import MANIFEST_FILENAME, SHARD_FILENAME, TRACKER_FILENAME, iter_dirname
from helpers import SMALL, TINY_RECIPE as TINY, stdlib_dataset
from preloaded import run_cli

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def cli(*args, prefix=(), timeout=300):
    if prefix:  # another user (setpriv execs the console script as nobody), with a HOME it can use
        r = subprocess.run([*prefix, *hpcmeg_cmd(), *map(str, args)], capture_output=True, text=True, cwd=REPO,
                           timeout=timeout, env=dict(ENV, HOME="/tmp"))
    else:
        r = run_cli(list(map(str, args)), ENV, timeout, cwd=REPO)
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return r.returncode, r.stderr.strip().splitlines()


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


def save(ckpt_dir: Path, it: int, state=None) -> Path:
    save_checkpoint(str(ckpt_dir), it, state or {"iteration": it, "model": {}}, tp_rank=0, pp_rank=0, tp_size=1,
                      pp_size=1, is_shard_writer=True, barrier=lambda: None, is_global_rank0=True)
    return ckpt_dir / iter_dirname(it) / "mp_rank_00" / SHARD_FILENAME


# ----------------------------------------------------------------------------- hpcmeg train

@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return stdlib_dataset(tmp_path_factory.mktemp("data"), n_files=20)


def train_args(root: Path, prefix: str, *extra: str) -> list[str]:
    out = ["train", TINY, "--set", f"run.output_root={root}", "--set", "run.name=r", "--set", f"data.data_path=[{prefix}]"]
    for item in [*SMALL, *extra]:
        out += ["--set", item]
    return out


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_train_refuses_a_malicious_pickle_in_one_line(tmp_path, data):
    ck = tmp_path / "r" / "checkpoints"
    shard = save(ck, 2)
    marker = tmp_path / "PWNED"
    # torch.save writes the reduce call into the pickle (nothing runs at save time); an attacker
    # who also rewrites the manifest to match leaves only weights_only between it and os.system
    torch.save({"iteration": 2, "model": _Evil(str(marker))}, str(shard))
    manifest = json.loads((ck / iter_dirname(2) / MANIFEST_FILENAME).read_text())
    manifest["files"]["mp_rank_00/model_optim_rng.pt"] = {"size": shard.stat().st_size, "crc32": file_crc32(str(shard))}
    (ck / iter_dirname(2) / MANIFEST_FILENAME).write_text(json.dumps(manifest))
    before = tree(ck)
    rc, lines = cli(*train_args(tmp_path, data))
    assert rc == 1 and len(lines) == 1, lines
    assert str(shard) in lines[0] and "arbitrary code" in lines[0] and "refuses" in lines[0], lines
    assert not marker.exists()  # refused, not executed
    assert tree(ck) == before


def test_train_with_every_checkpoint_corrupt_names_them_in_one_line(tmp_path, data):
    ck = tmp_path / "r" / "checkpoints"
    shards = [save(ck, it) for it in (2, 4)]
    for s in shards:
        with open(s, "r+b") as f:
            f.truncate(s.stat().st_size // 2)
    before = tree(ck)
    rc, lines = cli(*train_args(tmp_path, data))
    assert rc == 1 and len(lines) == 1, lines
    assert all(str(s) in lines[0] for s in shards), lines
    assert "no checkpoint is usable" in lines[0] and "away to start from scratch" in lines[0]
    assert tree(ck) == before  # no fresh start over the user's checkpoints, nothing added


def test_train_token_ids_beyond_the_vocabulary_are_one_line(tmp_path, data):
    # a DataLoader worker (num_workers=1) raises it: its traceback must not reach the user
    rc, lines = cli(*train_args(tmp_path, data, "model.vocab_size=100", "data.num_workers=1", "train.eval_interval=0"))
    assert rc == 2 and len(lines) == 1, lines
    assert "model.vocab_size=100" in lines[0] and "token id" in lines[0] and "ids 0..99" in lines[0], lines
    assert not (tmp_path / "r" / "checkpoints").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_train_device_cuda_without_cuda_is_one_line(tmp_path, data):
    rc, lines = cli(*train_args(tmp_path, data, "train.device=cuda"))
    assert rc == 2 and len(lines) == 1 and "train.device=cuda" in lines[0], lines
    assert tree(tmp_path) == []  # failed before anything was written: no run directory


def test_train_output_under_a_regular_file_is_one_line(tmp_path, data):
    (tmp_path / "afile").write_text("x")
    rc, lines = cli(*train_args(tmp_path / "afile", data))
    assert rc == 1 and len(lines) == 1 and str(tmp_path / "afile") in lines[0], lines


def test_skipped_checkpoint_warning_is_one_line(capsys):
    from hpcmeg.train.entry import _show_warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("skipping checkpoint: /x/iter_0000004/mp_rank_00/model_optim_rng.pt is corrupt", CheckpointWarning)
    _show_warnings(caught, "hpcmeg train")
    assert capsys.readouterr().err.splitlines() == [
        "hpcmeg train: warning: skipping checkpoint: /x/iter_0000004/mp_rank_00/model_optim_rng.pt is corrupt"]


def test_one_line_of_an_exception_from_a_dataloader_worker():
    from hpcmeg.errors import one_line

    msg = ("Caught TokenIdError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
           '  File "x.py", line 1, in f\n    raise TokenIdError(m)\nhpcmeg.train.entry.TokenIdError: the data holds '
           "token id 7; fix it\n")
    assert one_line(ValueError(msg)) == "the data holds token id 7; fix it"
    assert one_line(PermissionError(13, "Permission denied", "/p/q")).startswith("/p/q: Permission denied; ")


# ----------------------------------------------------------------------------- convert / reshard / import-hf

@pytest.fixture(scope="module")
def shared():
    """A directory `nobody` can traverse (pytest's tmp dirs are 0700), with a small checkpoint in it."""
    d = Path(tempfile.mkdtemp(prefix="hpcmeg-bad-input-", dir="/tmp"))
    d.chmod(0o755)
    save(d / "ckpt", 2)
    for p in [d, *d.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _as_other_user(shared: Path) -> tuple[list[str], Path]:
    """(command prefix, a directory that user cannot write)."""
    ro = shared / "readonly"
    ro.mkdir(exist_ok=True)
    if os.geteuid() != 0:
        ro.chmod(0o555)
        return [], ro
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: cannot test an unwritable directory honestly")
    prefix = [setpriv, "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    probe = subprocess.run([*prefix, *hpcmeg_cmd(), "--version"], capture_output=True, text=True, cwd=REPO,
                           env=dict(ENV, HOME="/tmp"))
    if probe.returncode != 0:
        pytest.skip(f"nobody cannot run hpcmeg here: {probe.stderr.strip()[-200:]}")
    return prefix, ro


COMMANDS = {"convert": lambda ck, out: ["convert", ck, out],
            "convert --all": lambda ck, out: ["convert", ck, out, "--all"],
            "reshard": lambda ck, out: ["reshard", ck, out, "--tp", "1", "--pp", "1"],
            "import-hf": lambda ck, out: ["import-hf", ck, out]}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_output_that_cannot_be_written_is_one_line_and_nothing_is_left(shared, command):
    ck = shared / "ckpt"
    afile = shared / "afile"
    afile.write_text("x")
    before = tree(shared)
    # a regular file where a directory is needed
    rc, lines = cli(*COMMANDS[command](ck, afile / "sub" / "out"))
    assert rc == 1 and len(lines) == 1 and f"{afile} is a file" in lines[0], lines
    # a directory this user cannot write (as nobody: root could write anywhere)
    prefix, ro = _as_other_user(shared)
    before = tree(shared)
    rc, lines = cli(*COMMANDS[command](ck, ro / "a" / "out"), prefix=prefix)
    assert rc == 1 and len(lines) == 1 and str(ro) in lines[0] and "permission denied" in lines[0], lines
    assert tree(shared) == before  # no out dir, no staging dir, no parent dirs


@pytest.mark.parametrize("command", ["convert", "reshard"])
def test_garbage_tracker_is_one_line(tmp_path, command):
    ck = tmp_path / "ckpt"
    save(ck, 2)
    (ck / TRACKER_FILENAME).write_text("\x00garbage\n")
    rc, lines = cli(*COMMANDS[command](ck, tmp_path / "out"))
    assert rc == 1 and len(lines) == 1, lines
    assert str(ck / TRACKER_FILENAME) in lines[0] and "fix or delete the file" in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_unreadable_shard_is_named_and_nothing_written(tmp_path):
    ck = tmp_path / "ckpt"
    shard = save(ck, 2)
    shard.write_bytes(os.urandom(4096))
    man = ck / iter_dirname(2) / MANIFEST_FILENAME
    man.unlink()  # a foreign checkpoint: no manifest, so the bytes themselves must be judged
    rc, lines = cli("convert", ck, tmp_path / "out")
    assert rc == 1 and len(lines) == 1 and str(shard) in lines[0] and "not a readable torch checkpoint" in lines[0], lines
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- not a run

@pytest.mark.parametrize("command", ["plot", "status", "logs", "cancel"])
def test_a_directory_that_is_not_a_run(tmp_path, command):
    rc, lines = cli(command, tmp_path)
    assert rc != 0 and len(lines) == 1 and str(tmp_path) in lines[0], lines
    assert tree(tmp_path) == []


def test_plot_output_that_is_a_directory(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "train", "iteration": 1, "loss": 3.0}) + "\n")
    (tmp_path / "out").mkdir()
    rc, lines = cli("plot", tmp_path, "-o", tmp_path / "out")
    assert rc == 1 and len(lines) == 1 and "is a directory" in lines[0], lines
    assert tree(tmp_path) == ["metrics.jsonl", "out"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
