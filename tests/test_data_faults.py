"""Bad input to the data tools is exactly one line on stderr with the right exit code (issue 14 §2, §3).

One test per class of bad input, each running the real CLI (`python -m hpcmeg.cli ...`) as a
subprocess: missing inputs, corrupt inputs, bad lines, wrong --json-keys, bad tokenizer files,
bad numeric flags, unwritable or impossible outputs, inputs without documents; for preprocess,
merge-datasets, corpus and tokenizer train. Each case checks: the exit status (2 = the command line
is at fault, 1 = data or runtime fault), one line that names the file/flag and says what to do, no
traceback, and that nothing was written (the directory is unchanged: no output, no temporary file).
The cases of a test run concurrently (a few at a time) to keep the suite cheap.
"""

import gzip
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from hpcmeg.data.corpus import write_stdlib_corpus
from hpcmeg.data.indexed import IndexedDatasetBuilder
from hpcmeg.data.tokenizer import default_gpt2_files

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=REPO)
CLI = [sys.executable, "-m", "hpcmeg.cli"]


def _tree(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, dirs, files in os.walk(root)
                  for f in files + dirs)


def _check_all(root, cases, prefix_cmd=(), cwd=None):
    """cases: [(label, argv, exit code, [substrings of the line])]. Runs them 3 at a time; then
    checks every one and that `root` is unchanged."""
    before = _tree(root)

    def run(i, case):
        # each case its own output directory: concurrent runs must not see each other's files
        argv = [a.replace("out/", f"out{i}/") for a in case[1]]
        return subprocess.run([*prefix_cmd, *CLI, *argv], capture_output=True, text=True, timeout=120, env=ENV,
                              cwd=cwd or root)

    with ThreadPoolExecutor(3) as ex:
        results = list(ex.map(run, range(len(cases)), cases))
    for (label, argv, code, needles), p in zip(cases, results):
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert p.returncode == code, f"{label}: exit {p.returncode}, want {code}: {p.stderr}"
        assert len(lines) == 1 and "Traceback" not in p.stderr, f"{label}: {p.stderr}"
        assert lines[0].startswith(f"hpcmeg {argv[0]}"), f"{label}: {lines[0]}"
        for n in needles:
            assert n in lines[0], f"{label}: {n!r} not in {lines[0]!r}"
    assert _tree(root) == before, "something was written"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A directory of good and bad inputs shared by the tests (read-only use)."""
    d = tmp_path_factory.mktemp("faults")
    write_stdlib_corpus(str(d / "good.jsonl"), key="content", include_tests=False, max_files=8)
    good = (d / "good.jsonl").read_bytes()
    (d / "good.jsonl.gz").write_bytes(gzip.compress(good))
    (d / "trunc.jsonl.gz").write_bytes(gzip.compress(good * 3)[:4000])
    (d / "garbage.jsonl.gz").write_bytes(b"\x1f\x8b" + bytes(range(256)) * 20)
    (d / "empty.jsonl").write_bytes(b"")
    (d / "blank.jsonl").write_bytes(b"\n  \n\n")
    (d / "allbad.jsonl").write_bytes(b'{"content": 1}\n[2]\n{"content": ""}\n')
    lines = good.splitlines(keepends=True)
    (d / "malformed.jsonl").write_bytes(b"".join(lines[:5]) + b'{"content": "x",}\n' + b"".join(lines[5:]))
    (d / "badutf8.jsonl").write_bytes(lines[0] + b'{"content": "caf\xe9"}\n')
    (d / "notobject.jsonl").write_bytes(lines[0] + b'"just a string"\n')
    (d / "laterkey.jsonl").write_bytes(lines[0] + b'{"text": "other key"}\n')
    (d / "otherkeys.jsonl").write_text(json.dumps({"text": "a", "meta": {"id": 1}}) + "\n")
    (d / "binary.bin").write_bytes(bytes(range(256)) * 8)
    (d / "list.json").write_text('["not", "a", "vocab"]')
    (d / "sparse.json").write_text(json.dumps({"a": 0, "b": 7, "<|endoftext|>": 9}))
    (d / "text.txt").write_text("hello\n")
    (d / "badmerge.txt").write_text("#version: 0.2\nĠ t h e\n")
    (d / "oovmerge.txt").write_text("#version: 0.2\nqqzz zzqq\n")
    (d / "afile").write_text("a regular file\n")
    (d / "hf_garbage").mkdir()
    (d / "hf_garbage" / "tokenizer.json").write_bytes(bytes(range(256)))
    (d / "dir").mkdir()
    # datasets for merge-datasets: two good uint16 ones, an int32 one, corrupt ones
    for name, dtype in (("ds_a", np.uint16), ("ds_b", np.uint16), ("ds_i32", np.int32)):
        b = IndexedDatasetBuilder(str(d / f"{name}.bin"), dtype)
        b.add_document(np.arange(10), [4, 6])
        b.finalize(str(d / f"{name}.idx"))
    (d / "ds_garbage.idx").write_bytes(bytes(range(256)))
    (d / "ds_garbage.bin").write_bytes(b"\0" * 64)
    (d / "ds_trunc.idx").write_bytes((d / "ds_a.idx").read_bytes()[:40])
    (d / "ds_trunc.bin").write_bytes((d / "ds_a.bin").read_bytes())
    (d / "ds_short.idx").write_bytes((d / "ds_a.idx").read_bytes())
    (d / "ds_short.bin").write_bytes((d / "ds_a.bin").read_bytes()[:6])
    (d / "ds_noidx.bin").write_bytes(b"\0" * 4)
    return d


def _pre(*args):
    return ["preprocess", "--output-prefix", "out/o", "--json-keys", "content", "--workers", "2", *args]


def test_preprocess_missing_inputs(data):
    _check_all(data, [
        ("missing file", _pre("--input", "nope.jsonl"), 2, ["--input nope.jsonl", "no such file"]),
        ("glob matches nothing", _pre("--input", "nope_*.jsonl"), 2, ["nope_*.jsonl", "glob matches no file"]),
        ("second of two missing", _pre("--input", "good.jsonl", "gone.jsonl"), 2, ["gone.jsonl"]),
        ("a directory", _pre("--input", "dir"), 2, ["--input dir", "is a directory"]),
        ("no --input", ["preprocess", "--output-prefix", "o"], 2, ["required", "--input", "--help"]),
    ])


def test_preprocess_corrupt_input_files(data):
    _check_all(data, [
        ("truncated gzip", _pre("--input", "trunc.jsonl.gz"), 1, ["trunc.jsonl.gz", "truncated gzip", "line"]),
        ("garbage gzip", _pre("--input", "garbage.jsonl.gz"), 1, ["garbage.jsonl.gz", "corrupt gzip"]),
        ("truncated after a good file", _pre("--input", "good.jsonl.gz", "trunc.jsonl.gz"), 1, ["trunc.jsonl.gz"]),
    ])


def test_preprocess_bad_lines(data):
    fix = "--skip-bad-lines"
    _check_all(data, [
        ("malformed JSON", _pre("--input", "malformed.jsonl"), 1, ["malformed.jsonl:6: malformed JSON", fix]),
        ("invalid UTF-8", _pre("--input", "badutf8.jsonl"), 1, ["badutf8.jsonl:2: invalid UTF-8", fix]),
        ("not an object", _pre("--input", "notobject.jsonl"), 1, ["notobject.jsonl:2: expected a JSON object", fix]),
        ("key missing from a later line", _pre("--input", "laterkey.jsonl"), 1,
         ["laterkey.jsonl:2: missing key 'content'", "keys present: text", fix]),
        ("one worker", ["preprocess", "--input", "malformed.jsonl", "--output-prefix", "out/o", "--json-keys",
                        "content", "--workers", "1"], 1, ["malformed.jsonl:6:"]),
    ])


def test_preprocess_wrong_json_keys(data):
    _check_all(data, [
        ("key not in the documents", _pre("--input", "otherkeys.jsonl"), 2,
         ["--json-keys content", "otherkeys.jsonl", "'content'", "keys present: text, meta"]),
        ("second key wrong", ["preprocess", "--input", "good.jsonl", "--output-prefix", "out/o", "--json-keys",
                              "content", "body"], 2, ["'body'", "good.jsonl", "keys present: content, path"]),
        ("gzip input", ["preprocess", "--input", "good.jsonl.gz", "--output-prefix", "out/o", "--json-keys", "text"],
         2, ["good.jsonl.gz", "'text'"]),
        ("repeated key", _pre("--input", "good.jsonl") + ["--json-keys", "content", "content"], 2, ["repeated"]),
    ])


def test_preprocess_bad_tokenizer_files(data):
    vocab, merges = default_gpt2_files()
    fix = "merges.txt"

    def tok(*a):
        return _pre("--input", "good.jsonl", *a)

    _check_all(data, [
        ("vocab: binary", tok("--vocab-file", "binary.bin", "--merge-file", merges), 1,
         ["--vocab-file binary.bin", "not a GPT-2 vocab.json", fix]),
        ("vocab: text, not JSON", tok("--vocab-file", "text.txt", "--merge-file", merges), 1,
         ["--vocab-file text.txt", "invalid JSON at line 1"]),
        ("vocab: JSON list", tok("--vocab-file", "list.json", "--merge-file", merges), 1,
         ["list.json", "JSON object of token -> integer id"]),
        ("vocab: sparse ids", tok("--vocab-file", "sparse.json", "--merge-file", merges), 1,
         ["sparse.json", "ids are not 0..2"]),
        ("vocab: missing", tok("--vocab-file", "nope.json", "--merge-file", merges), 2, ["--vocab-file nope.json"]),
        ("vocab: a directory", tok("--vocab-file", "dir", "--merge-file", merges), 2, ["--vocab-file dir", "directory"]),
        ("merges: binary", tok("--vocab-file", vocab, "--merge-file", "binary.bin"), 1,
         ["--merge-file binary.bin", "not a merges.txt"]),
        ("merges: not pairs", tok("--vocab-file", vocab, "--merge-file", "badmerge.txt"), 1,
         ["--merge-file badmerge.txt:2", "two tokens"]),
        ("merges: unknown tokens", tok("--vocab-file", vocab, "--merge-file", "oovmerge.txt"), 1,
         ["oovmerge.txt:2", "not in the vocabulary"]),
        ("merges: missing", tok("--vocab-file", vocab, "--merge-file", "nope.txt"), 2, ["--merge-file nope.txt"]),
        ("only one of the two", tok("--vocab-file", vocab), 2, ["--vocab-file and --merge-file"]),
        ("unknown --tokenizer-type", tok("--tokenizer-type", "SentencePieceTokenizer"), 2,
         ["--tokenizer-type", "invalid choice", "GPT2BPETokenizer"]),
        ("HF dir of garbage", tok("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "hf_garbage"), 1,
         ["--tokenizer-model hf_garbage", "cannot load"]),
        ("HF without a dir", tok("--tokenizer-type", "HuggingFaceTokenizer"), 2, ["needs --tokenizer-model"]),
        ("unknown --lang", tok("--split-sentences", "--lang", "klingon"), 2, ["--lang klingon"]),
    ])


def test_preprocess_bad_numeric_flags(data):
    def flag(*a):
        return ["preprocess", "--input", "good.jsonl", "--output-prefix", "out/o", "--json-keys", "content", *a]

    _check_all(data, [
        ("--workers -3", flag("--workers", "-3"), 2, ["--workers", "at least 1, got -3"]),
        ("--workers 0", flag("--workers", "0"), 2, ["--workers", "at least 1, got 0"]),
        ("--workers abc", flag("--workers", "abc"), 2, ["--workers", "expected an integer"]),
        ("--partitions 0", flag("--partitions", "0"), 2, ["--partitions"]),
        ("--batch-bytes -1", flag("--batch-bytes", "-1"), 2, ["--batch-bytes"]),
        ("--log-interval -5", flag("--log-interval", "-5"), 2, ["--log-interval"]),
    ])


def test_preprocess_no_documents_writes_nothing(data):
    _check_all(data, [
        ("empty file", _pre("--input", "empty.jsonl"), 1, ["empty.jsonl: no documents", "nothing written"]),
        ("blank lines", _pre("--input", "blank.jsonl"), 1, ["blank.jsonl: no documents"]),
        ("every line skipped", _pre("--input", "allbad.jsonl", "--skip-bad-lines"), 1,
         ["allbad.jsonl", "all 3 non-blank line(s) were bad", "--skip-bad-lines", "nothing written"]),
        ("several empty files", _pre("--input", "empty.jsonl", "blank.jsonl"), 1, ["the 2 input files"]),
    ])


def test_outputs_under_a_regular_file(data):
    # an output location that cannot be created is a runtime fault (exit 1), as for hpcmeg convert
    _check_all(data, [
        ("preprocess", ["preprocess", "--input", "good.jsonl", "--json-keys", "content", "--output-prefix",
                        "afile/o"], 1, ["--output-prefix afile/o", "not a directory"]),
        ("preprocess, deeper", ["preprocess", "--input", "good.jsonl", "--json-keys", "content", "--output-prefix",
                                "afile/x/y/o"], 1, ["afile", "not a directory"]),
        ("merge-datasets", ["merge-datasets", "--input", "ds_a", "ds_b", "--output-prefix", "afile/m"], 1,
         ["--output-prefix afile/m", "not a directory"]),
        ("corpus", ["corpus", "-o", "afile/c.jsonl"], 1, ["--output afile/c.jsonl", "not a directory"]),
        ("corpus into a directory", ["corpus", "-o", "dir"], 1, ["--output dir", "is a directory"]),
        ("tokenizer train", ["tokenizer", "train", "--input", "good.jsonl", "--json-key", "content", "-o", "afile"],
         1, ["--output afile", "not a directory"]),
    ])


def _as_nobody():
    """argv prefix that runs a command as an unprivileged user, or None (root writes anywhere, so an
    unwritable directory can only be tested as someone else)."""
    if os.geteuid() != 0:
        return []
    exe = shutil.which("setpriv")
    if exe is None:
        return None
    return [exe, "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


def test_unwritable_and_unreadable_paths():
    """As an unprivileged user: outputs in a directory without write permission, an unreadable input."""
    prefix = _as_nobody()
    if prefix is None:
        pytest.skip("running as root without setpriv: cannot test permissions honestly")
    root = tempfile.mkdtemp(prefix="hpcmeg-perm-")  # pytest's tmp dirs are 0700 root: unreachable for nobody
    try:
        os.chmod(root, 0o755)
        write_stdlib_corpus(os.path.join(root, "good.jsonl"), key="content", include_tests=False, max_files=3)
        shutil.copy(os.path.join(root, "good.jsonl"), os.path.join(root, "secret.jsonl"))
        os.chmod(os.path.join(root, "secret.jsonl"), 0)
        for d, mode in (("ro", 0o555), ("rw", 0o777)):
            os.mkdir(os.path.join(root, d))
            os.chmod(os.path.join(root, d), mode)
        b = IndexedDatasetBuilder(os.path.join(root, "ds.bin"), np.uint16)
        b.add_document(np.arange(5), [5])
        b.finalize(os.path.join(root, "ds.idx"))
        for f in ("good.jsonl", "ds.bin", "ds.idx"):
            os.chmod(os.path.join(root, f), 0o644)
        denied = "permission denied"
        _check_all(root, [
            ("preprocess into ro/", ["preprocess", "--input", "good.jsonl", "--json-keys", "content",
                                     "--output-prefix", "ro/o"], 1, ["--output-prefix ro/o", "cannot write", denied]),
            ("preprocess into ro/new/", ["preprocess", "--input", "good.jsonl", "--json-keys", "content",
                                         "--output-prefix", "ro/new/o"], 1, ["cannot write", "/ro", denied]),
            ("preprocess, unreadable input", ["preprocess", "--input", "secret.jsonl", "--json-keys", "content",
                                              "--output-prefix", "rw/o"], 1, ["secret.jsonl", "Permission denied"]),
            ("merge-datasets into ro/", ["merge-datasets", "--input", "ds", "--output-prefix", "ro/m"], 1,
             ["--output-prefix ro/m", denied]),
            ("corpus into ro/", ["corpus", "-o", "ro/c.jsonl", "--max-files", "2"], 1, ["--output ro/c.jsonl", denied]),
            ("tokenizer train into ro/", ["tokenizer", "train", "--input", "good.jsonl", "--json-key", "content",
                                          "-o", "ro/tok"], 1, ["--output ro/tok", denied]),
        ], prefix_cmd=prefix)
    finally:
        os.chmod(os.path.join(root, "secret.jsonl"), stat.S_IRUSR | stat.S_IWUSR)
        shutil.rmtree(root)


def test_merge_datasets_bad_inputs(data):
    def merge(*inputs):
        return ["merge-datasets", "--input", *inputs, "--output-prefix", "out/m"]

    _check_all(data, [
        ("missing prefix", merge("ds_a", "nope"), 2, ["--input nope", "no such dataset", "nope.idx"]),
        (".bin without .idx", merge("ds_a", "ds_noidx"), 2, ["ds_noidx.idx"]),
        ("glob matches nothing", merge("zz_*"), 2, ["no .bin/.idx dataset found"]),
        ("garbage .idx", merge("ds_a", "ds_garbage"), 1, ["ds_garbage.idx", "not a Megatron MMIDIDX index"]),
        ("truncated .idx", merge("ds_a", "ds_trunc"), 1, ["ds_trunc.idx", "truncated or corrupt"]),
        ("short .bin", merge("ds_a", "ds_short"), 1, ["ds_short.bin", "shorter than its index"]),
        ("mixed dtypes", merge("ds_a", "ds_i32"), 1, ["ds_i32", "dtype", "same tokenizer"]),
        ("--multimodal", merge("ds_a", "ds_b") + ["--multimodal"], 2, ["--multimodal", "not supported"]),
        ("no --output-prefix", ["merge-datasets", "--input", "ds_a"], 2, ["required", "--output-prefix"]),
    ])


def test_corpus_bad_flags(data):
    _check_all(data, [
        ("--max-files 0", ["corpus", "-o", "out/c.jsonl", "--max-files", "0"], 2, ["--max-files", "at least 1"]),
        ("--max-files -2", ["corpus", "-o", "out/c.jsonl", "--max-files", "-2"], 2, ["--max-files"]),
        ("--max-files x", ["corpus", "-o", "out/c.jsonl", "--max-files", "x"], 2, ["--max-files", "integer"]),
        ("empty --key", ["corpus", "-o", "out/c.jsonl", "--key", ""], 2, ["--key"]),
        ("no --output", ["corpus"], 2, ["required", "--output"]),
    ])


def test_tokenizer_train_bad_inputs(data):
    def train(*a, key="content"):
        return ["tokenizer", "train", "--json-key", key, "--vocab-size", "300", "-o", "out/tok", *a]

    _check_all(data, [
        ("missing input", train("--input", "nope.jsonl"), 2, ["--input nope.jsonl"]),
        ("truncated gzip", train("--input", "trunc.jsonl.gz"), 1, ["trunc.jsonl.gz", "truncated gzip"]),
        ("garbage gzip", train("--input", "garbage.jsonl.gz"), 1, ["garbage.jsonl.gz", "corrupt gzip"]),
        ("malformed line", train("--input", "malformed.jsonl"), 1, ["malformed.jsonl:6: malformed JSON"]),
        ("wrong --json-key", train("--input", "otherkeys.jsonl"), 2,
         ["--json-key content", "otherkeys.jsonl", "keys present: text, meta"]),
        ("key missing later", train("--input", "laterkey.jsonl"), 1, ["laterkey.jsonl:2: missing key"]),
        ("no documents", train("--input", "blank.jsonl"), 1, ["blank.jsonl: no documents", "nothing written"]),
        ("--vocab-size 6", train("--input", "good.jsonl") + ["--vocab-size", "6"], 2, ["--vocab-size", "257"]),
        ("--max-docs 0", train("--input", "good.jsonl", "--max-docs", "0"), 2, ["--max-docs"]),
        ("--min-frequency -1", train("--input", "good.jsonl", "--min-frequency", "-1"), 2, ["--min-frequency"]),
    ])


def test_write_failure_midway_leaves_no_dataset(tmp_path, data):
    """An I/O error while committing the second key's dataset (its .idx name is taken by a directory):
    one line naming the file, exit 1, and the first key's finished dataset is removed again."""
    src = tmp_path / "two.jsonl"
    src.write_text("".join(json.dumps({"a": f"first {i}", "b": f"second {i}"}) + "\n" for i in range(20)))
    (tmp_path / "o_b_document.idx").mkdir()
    before = _tree(tmp_path)
    p = subprocess.run([*CLI, "preprocess", "--input", str(src), "--output-prefix", str(tmp_path / "o"),
                        "--json-keys", "a", "b", "--workers", "1"], capture_output=True, text=True, timeout=120,
                       env=ENV)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "o_b_document.idx" in lines[0] and "directory" in lines[0].lower()
    assert _tree(tmp_path) == before  # o_a_document.{bin,idx} were committed, then removed


def test_stop_during_merge_leaves_nothing(tmp_path, data):
    import signal

    from hpcmeg.data.faults import Interrupted, StopSignal
    from hpcmeg.data.indexed import merge_datasets

    stop = StopSignal()
    stop.received = signal.SIGTERM  # as if the handler had run
    with pytest.raises(Interrupted):
        merge_datasets([str(data / "ds_a"), str(data / "ds_b")], str(tmp_path / "m"), stop=stop)
    assert os.listdir(tmp_path) == []
