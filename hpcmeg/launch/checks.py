"""The checks `hpcmeg validate` and `hpcmeg submit` share, beyond the recipe's own validation.

Contract (called from ``hpcmeg.launch.submit.prepare``, the one function both commands run):
- ``run_dir_problems(recipe, run_dir) -> [line]``: the run directory's path must not hold ``%``.
- ``expand_inputs(specs, allow_missing) -> files``: data.inputs -> files; an unmatched spec is a
  RecipeError line naming ``data.inputs[i]`` and the pattern (a dry run keeps it and warns);
  ``input_files`` returns those lines instead of raising (``prepare`` reports them with the rest).
- ``first_document_problems(files, keys) -> (recipe lines, data lines)``: the first non-blank line of
  every input (plain or gzip; one line read per file, so cheap even for thousands of shards) must be a
  JSON object with every ``data.json_keys`` key holding text: the mismatch preprocess would otherwise
  find minutes later inside its Slurm job.
- ``dataset_problems(recipe, paths, stages) -> [line]``: a train stage without its preprocess stage
  needs the tokenized dataset (data.data_path, or an earlier preprocess output under
  ``paths.data_prefix``: a Derived or RunPaths) to exist already.
- ``DataError``: a data fault found by these checks (exit 1; recipe faults are RecipeError, exit 2).

Why '%' is refused rather than escaped: submitit substitutes ``%j``/``%t``/``%A``/``%a`` in its job
folder path textually, at submission and inside the job, with no escape syntax, so a run directory
holding ``%j`` sends its pickles to a sibling directory named after the job id. Slurm's own patterns
could be escaped (``%%``), submitit's cannot, and a name without '%' loses nothing.
"""
from __future__ import annotations

import fnmatch
import glob
import gzip
import os
import sys
import zlib

from hpcmeg.recipe import RecipeError, dataset_blend

_FIRST_LINE_LIMIT = 64 << 20  # bytes: a first document longer than this is not checked
_BLANK_LINES = 64  # leading blank lines skipped before giving up on a file's first document


class DataError(Exception):
    """A data file that cannot be used as given; ``lines`` are the one-line messages."""

    def __init__(self, lines: list[str]):
        super().__init__("; ".join(lines))
        self.lines = lines


def run_dir_problems(recipe, run_dir: str) -> list[str]:
    if "%" in recipe.run.name:
        return [f"run.name: '{recipe.run.name}' contains '%'; Slurm and submitit expand %j, %A, %a, %t in the paths "
                f"of the run directory (submitit has no escape for it), which would put job files outside it; "
                f"choose a name without '%'"]
    if "%" in run_dir:
        return [f"run.output_root: the run directory '{run_dir}' contains '%'; Slurm and submitit expand "
                f"%j, %A, %a, %t in its paths, which would put job files outside it; choose an output_root "
                f"(and a directory to submit from) without '%'"]
    return []


def expand_inputs(specs: list[str], allow_missing: bool = False) -> list[str]:
    """data.inputs -> sorted files per spec, in spec order; one line per spec that matches nothing.

    With ``allow_missing`` (``--dry-run`` on a machine that does not see the data, e.g. a laptop
    rendering a cluster's scripts) an unmatched spec stays as one literal shard and a warning is
    printed instead of an error."""
    out, bad = input_files(specs, allow_missing)
    if bad:
        raise RecipeError(bad)
    return out


def input_files(specs: list[str], allow_missing: bool = False) -> tuple[list[str], list[str]]:
    """``expand_inputs`` returning (files, one line per spec that matches nothing) rather than raising."""
    out, bad = [], []
    for i, spec in enumerate(specs):
        if any(c in spec for c in "*?["):
            found = sorted(p for p in glob.glob(spec) if os.path.isfile(p))
        else:
            found = [spec] if os.path.isfile(spec) else []
        if not found:
            what = "is a directory, not a JSONL file" if os.path.isdir(spec) else "matches no file"
            bad.append(f"data.inputs[{i}]: '{spec}' {what} (relative paths are taken from the directory you "
                       f"submit from)")
        out += found
    if bad and allow_missing:
        for line in bad:
            print(f"hpcmeg submit: warning (dry run): {line}; kept as one literal shard", file=sys.stderr)
        return out + [spec for spec in specs if not any(f == spec or fnmatch.fnmatch(f, spec) for f in out)], []
    return out, bad


def dataset_problems(recipe, paths, stages: tuple[str, ...]) -> list[str]:
    """A train stage needs its dataset: data.data_path's prefixes, or (without the preprocess stage in
    this submission) the preprocess output of an earlier one. One line for the first one missing."""
    if "train" not in stages or ("preprocess" in stages and not recipe.data.data_path):
        return []
    for _, prefix in dataset_blend(recipe.data, paths.data_prefix):
        if not (os.path.isfile(f"{prefix}.bin") and os.path.isfile(f"{prefix}.idx")):
            if recipe.data.data_path:
                return [f"data.data_path: no tokenized dataset at {prefix}.bin/.idx; give the prefix of an "
                        f"existing .bin/.idx pair (without the extension)"]
            return [f"--stages: no 'preprocess' stage and no dataset at {prefix}.bin/.idx yet; submit with "
                    f"--stages preprocess first (or include it), or set data.data_path"]
    return []


def _first_line(path: str) -> tuple[int, bytes] | None:
    """(line number, first non-blank line) of a plain or gzip JSONL file (None: only blank lines, or too long)."""
    with open(path, "rb") as raw:
        magic = raw.read(2)
        raw.seek(0)
        f = gzip.GzipFile(fileobj=raw) if magic == b"\x1f\x8b" else raw
        for n in range(1, _BLANK_LINES + 1):
            line = f.readline(_FIRST_LINE_LIMIT)
            if not line:
                return None
            if len(line) >= _FIRST_LINE_LIMIT and not line.endswith(b"\n"):
                return None
            if line.strip():
                return n, line
    return None


def first_document_problems(files: list[str], keys: list[str]) -> tuple[list[str], list[str]]:
    """(recipe lines, data lines): see the module docstring. Only the first problem of each kind."""
    from hpcmeg.data.jsonl import parse_document

    for path in files:
        try:
            first = _first_line(path)
        except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
            return [], [f"{path}: cannot read it as JSONL ({type(e).__name__}: {e}); fix or replace the file"]
        if first is None:
            continue
        n, line = first
        _, reason = parse_document(line, keys)
        if reason is None:
            continue
        if reason.startswith("missing key") or reason.startswith("key "):
            reason = reason.replace("; pick the key with --json-keys", "")
            return [f"data.json_keys: {path}:{n}: {reason}; set data.json_keys to the key that holds the text"], []
        return [], [f"{path}:{n}: the first document is not usable: {reason}; fix the file or remove it from "
                    f"data.inputs"]
    return [], []
