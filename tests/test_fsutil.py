"""hpcmeg.fsutil: atomic writes replace whole files, leave the old file and no temporary behind on
failure, and give the modes callers rely on (open()'s umask default; explicit bits such as 0o755)."""
from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
import threading

import pytest

from hpcmeg import fsutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@contextlib.contextmanager
def _umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def test_write_text_and_bytes_replace_whole_file(tmp_path):
    p = tmp_path / "a.json"
    fsutil.write_text_atomic(p, "first\n")
    fsutil.write_text_atomic(str(p), "second, longer text\n", sync_dir=True)
    assert p.read_text() == "second, longer text\n"
    fsutil.write_bytes_atomic(p, b"\x00\xffraw", fsync=False)
    assert p.read_bytes() == b"\x00\xffraw"
    assert os.listdir(tmp_path) == ["a.json"]


def test_atomic_path_renames_a_temp_from_the_same_dir(tmp_path):
    target = tmp_path / "x.bin"
    with fsutil.atomic_path(target) as tmp:
        assert os.path.dirname(tmp) == str(tmp_path)  # same dir: the rename never crosses filesystems
        assert os.path.basename(tmp).startswith(fsutil.temp_prefix(target))
        assert not target.exists()  # nothing under the real name while writing
        with open(tmp, "wb") as f:
            f.write(b"payload")
    assert target.read_bytes() == b"payload" and not os.path.exists(tmp)
    assert os.listdir(tmp_path) == ["x.bin"]


def test_exception_in_atomic_path_keeps_old_file_and_removes_temp(tmp_path):
    target = tmp_path / "state.txt"
    target.write_text("old\n")
    with pytest.raises(RuntimeError, match="boom"):
        with fsutil.atomic_path(target, mode=0o755) as tmp:
            with open(tmp, "w") as f:
                f.write("half of the new")
            raise RuntimeError("boom")
    assert target.read_text() == "old\n" and not os.access(target, os.X_OK)
    assert os.listdir(tmp_path) == ["state.txt"]


def test_failing_writes_keep_old_file_and_remove_temp(tmp_path):
    target = tmp_path / "recipe.yaml"
    target.write_text("old\n")
    with pytest.raises(UnicodeEncodeError):  # fails inside f.write, after the temp file exists
        fsutil.write_text_atomic(target, "new text with \u00e9", encoding="ascii")
    with pytest.raises(TypeError):
        fsutil.write_bytes_atomic(target, "str is not bytes")  # type: ignore[arg-type]
    assert target.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["recipe.yaml"]


def test_modes_umask_default_and_explicit_bits(tmp_path):
    with _umask(0o027):
        fsutil.write_text_atomic(tmp_path / "jobs.json", "{}\n")
        with open(tmp_path / "plain.txt", "w"):
            pass
        fsutil.write_text_atomic(tmp_path / "train_step.sh", "#!/bin/bash\n", mode=0o755)
    # same bits as a plain open() under the same umask (not mkstemp's 0o600)
    assert _mode(tmp_path / "jobs.json") == _mode(tmp_path / "plain.txt") == 0o640
    assert _mode(tmp_path / "train_step.sh") == 0o755
    # an existing target's bits are not inherited: the rename installs a new inode (callers that need
    # bits pass mode= every time, as submit does for step scripts)
    with _umask(0o027):
        fsutil.write_text_atomic(tmp_path / "train_step.sh", "#!/bin/bash\necho hi\n")
    assert _mode(tmp_path / "train_step.sh") == 0o640
    fsutil.write_bytes_atomic(tmp_path / "cache.npy", b"x", mode=0o600)
    assert _mode(tmp_path / "cache.npy") == 0o600


def test_a_library_replacing_the_temp_still_gets_the_umask_mode(tmp_path):
    """safetensors (and others) write their own 0o600 file over the path they are given: the final file
    must still get 0o666 & ~umask; executables get 0o777 & ~umask; a real safetensors save as convert does."""
    for mask in (0o022, 0o007):
        with _umask(mask):
            assert fsutil.current_umask() == mask
            assert fsutil.default_mode() == 0o666 & ~mask and fsutil.executable_mode() == 0o777 & ~mask
            with fsutil.atomic_path(tmp_path / "model.bin") as tmp:
                fd = os.open(tmp + ".own", os.O_WRONLY | os.O_CREAT, 0o600)
                os.close(fd)
                os.replace(tmp + ".own", tmp)
            assert _mode(tmp_path / "model.bin") == 0o666 & ~mask
            import torch
            from safetensors.torch import save_file

            with fsutil.atomic_path(tmp_path / "model.safetensors", fsync=False) as tmp:
                save_file({"w": torch.zeros(2)}, tmp)
            assert _mode(tmp_path / "model.safetensors") == 0o666 & ~mask
            fsutil.write_text_atomic(tmp_path / "s.sh", "#!/bin/bash\n", mode=fsutil.executable_mode())
            assert _mode(tmp_path / "s.sh") == 0o777 & ~mask


def test_concurrent_writers_never_collide_or_tear(tmp_path):
    # threads share a pid, so a pid-only temp name would collide; every write must land whole
    target = tmp_path / "marker.done"
    bodies = [(f"writer {i} " * 2000).encode() for i in range(8)]
    errors = []

    def write(body: bytes) -> None:
        try:
            for _ in range(20):
                fsutil.write_bytes_atomic(target, body, fsync=False)
        except BaseException as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert target.read_bytes() in bodies
    assert os.listdir(tmp_path) == ["marker.done"]


def test_sigkilled_writer_leaves_old_file_and_a_recognisable_temp(tmp_path):
    target = tmp_path / "latest_checkpointed_iteration.txt"
    target.write_text("10\n")
    code = ("import os, signal, sys\nfrom hpcmeg import fsutil\n"
            "with fsutil.atomic_path(sys.argv[1]) as tmp:\n"
            "    open(tmp, 'w').write('2')\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", code, str(target)], env=env)
    assert r.returncode == -signal.SIGKILL
    assert target.read_text() == "10\n"
    left = [e for e in os.listdir(tmp_path) if e != target.name]
    assert len(left) == 1 and left[0].startswith(fsutil.temp_prefix(target))


def test_checkpoint_save_removes_a_killed_tracker_temp(tmp_path):
    # the checkpoint protocol's crash cleanup must recognise the temporaries fsutil names
    from hpcmeg.checkpoint.store import save_checkpoint
    from hpcmeg.megatron.names import TRACKER_FILENAME

    leftover = tmp_path / (fsutil.temp_prefix(TRACKER_FILENAME) + "123-deadbeef")
    old_style = tmp_path / (TRACKER_FILENAME + ".tmp-123")
    leftover.write_text("7")
    old_style.write_text("7")
    save_checkpoint(str(tmp_path), 3, {"iteration": 3, "model": {}}, tp_rank=0, pp_rank=0, tp_size=1,
                      pp_size=1, is_shard_writer=True, barrier=lambda: None, is_global_rank0=True)
    assert sorted(os.listdir(tmp_path)) == sorted([TRACKER_FILENAME, "iter_0000003"])
    assert (tmp_path / TRACKER_FILENAME).read_text() == "3\n"


# -- callers that moved onto fsutil: what they write must not depend on the temporary's name --------

def test_corpus_gzip_bytes_do_not_carry_the_temp_name(tmp_path):
    from hpcmeg.data.corpus import write_stdlib_corpus

    a, b = tmp_path / "a" / "c.jsonl.gz", tmp_path / "b" / "c.jsonl.gz"
    write_stdlib_corpus(str(a), max_files=3)
    write_stdlib_corpus(str(b), max_files=3)  # another random temp name
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes()[3] == 0  # gzip FLG: no FNAME field (it used to hold ".../c.jsonl.gz.tmp<pid>")
    assert os.listdir(a.parent) == ["c.jsonl.gz"]


def test_plot_replaces_the_png_and_leaves_no_temp(tmp_path):
    import json

    from hpcmeg.train.plot import plot_run

    with open(tmp_path / "metrics.jsonl", "w") as f:
        for i in range(1, 6):
            f.write(json.dumps({"kind": "train", "iteration": i, "loss": 4.0 - 0.1 * i}) + "\n")
    out = tmp_path / "curves.svg"  # any name: the format is PNG, as it always was
    out.write_bytes(b"old")
    assert plot_run(str(tmp_path), str(out)) == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path)) == ["curves.svg", "metrics.jsonl"]
