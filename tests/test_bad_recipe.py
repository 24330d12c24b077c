"""Bad recipes and command lines: exit 2, exactly one stderr line per problem that names the file,
line or key (or the --set item) and the fix, no traceback, nothing written.

Classes: unreadable recipe files (binary, not a mapping, empty, missing, a directory, YAML syntax,
control characters); every numeric field out of its schema range (derived from the schema, so a
new field is covered); one problem = one line (type errors and typos leave no follow-on lines, a
--set value is blamed on --set); argparse errors. Everything here runs `validate` (no torch).
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import typing
from pathlib import Path

import pytest

from conftest import hpcmeg_cmd
from hpcmeg import recipe_schema
from hpcmeg.recipe import RecipeError, load_recipe

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "codeparrot_tiny.yaml"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A directory to run from where the tiny recipe's relative data.inputs (runs/corpus/stdlib.jsonl) is a
    real JSONL file, so that a test's one recipe problem is the only problem (an input matching nothing is
    one more, reported in the same run)."""
    d = tmp_path_factory.mktemp("work")
    (d / "runs" / "corpus").mkdir(parents=True)
    (d / "runs" / "corpus" / "stdlib.jsonl").write_text(json.dumps({"content": Path(json.__file__).read_text()}) + "\n")
    return d


def cli(*args, cwd=REPO):
    r = subprocess.run([*hpcmeg_cmd(), *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, lines, r.stdout


# ----------------------------------------------------------------------------- unreadable recipe files

def _recipe_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name -> (path, a text the one line must contain)."""
    out = {}
    p = tmp_path / "binary.yaml"
    p.write_bytes(bytes(range(256)) * 4)
    out["binary"] = (p, "not a UTF-8 text file")
    p = tmp_path / "list.yaml"
    p.write_text("- run\n- data\n")
    out["not a mapping"] = (p, "must be a mapping")
    p = tmp_path / "scalar.yaml"
    p.write_text("just words\n")
    out["scalar"] = (p, "must be a mapping")
    p = tmp_path / "empty.yaml"
    p.write_text("# only a comment\n")
    out["empty"] = (p, "empty")
    out["missing"] = (tmp_path / "nope.yaml", "No such file")
    d = tmp_path / "adir.yaml"
    d.mkdir()
    out["directory"] = (d, "is a directory")
    p = tmp_path / "syntax.yaml"
    p.write_text("run:\n  name: x\ntrain:\n  lr: [1, 2\n  seed: 3\n")
    out["yaml syntax"] = (p, "invalid YAML")
    p = tmp_path / "nul.yaml"
    p.write_text("run:\n  name: x\x00\n")
    out["control character"] = (p, "invalid YAML")
    return out


@pytest.mark.parametrize("case", ["binary", "not a mapping", "scalar", "empty", "missing", "directory",
                                  "yaml syntax", "control character"])
def test_unreadable_recipe_file_is_one_line(tmp_path, case):
    path, needle = _recipe_files(tmp_path)[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    rc, lines, _ = cli("validate", path, "--set", f"run.output_root={tmp_path / 'runs'}")
    assert rc == 2 and len(lines) == 1, lines
    assert str(path) in lines[0] and needle in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_yaml_syntax_error_names_the_line(tmp_path):
    path, _ = _recipe_files(tmp_path)["yaml syntax"]
    rc, lines, _ = cli("validate", path)
    assert rc == 2 and len(lines) == 1
    assert f"{path}:5:" in lines[0] or f"{path}:4:" in lines[0], lines  # the unclosed [ of line 4


def test_control_character_names_the_line(tmp_path):
    path, _ = _recipe_files(tmp_path)["control character"]
    _, lines, _ = cli("validate", path)
    assert f"{path}:2:" in lines[0], lines


# ----------------------------------------------------------------------------- numeric ranges

def _numeric(tp) -> type | None:
    """int or float for a numeric field type (Optional included), else None."""
    args = [a for a in typing.get_args(tp) if a is not type(None)] if typing.get_origin(tp) is typing.Union else [tp]
    return args[0] if len(args) == 1 and args[0] in (int, float) else None


def _numeric_fields():
    for name, cls in typing.get_type_hints(recipe_schema.Recipe).items():
        if not dataclasses.is_dataclass(cls):
            continue
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = _numeric(hints[f.name])
            if kind is not None:
                yield f"{name}.{f.name}", kind, recipe_schema.field_range(f)


NUMERIC = list(_numeric_fields())


def test_every_numeric_field_has_a_range():
    # the range lives next to the field (recipe_schema.ranged): a new numeric field without one fails here
    missing = [key for key, _, rng in NUMERIC if rng is None]
    assert not missing, missing
    assert len(NUMERIC) >= 45


def _outside(rng: recipe_schema.Range, kind: type) -> list:
    """Values just outside the range, on every bounded side."""
    step = 1 if kind is int else 0.5
    bad = []
    if rng.ge is not None:
        bad.append(rng.ge - step)
    if rng.gt is not None:
        bad.append(rng.gt)
    if rng.le is not None:
        bad.append(rng.le + step)
    if rng.lt is not None:
        bad.append(rng.lt)
    return [kind(v) for v in bad]


def _edges(rng: recipe_schema.Range, kind: type) -> list:
    """Values on the closed edges: accepted."""
    return [kind(v) for v in (rng.ge, rng.le) if v is not None]


@pytest.mark.parametrize("key,kind,rng", NUMERIC, ids=[k for k, _, _ in NUMERIC])
def test_out_of_range_is_one_problem_naming_the_key(key, kind, rng):
    for bad in _outside(rng, kind):
        item = f"{key}={bad}"
        with pytest.raises(RecipeError) as e:
            load_recipe(TINY, [item])
        assert len(e.value.problems) == 1, (item, e.value.problems)
        line = e.value.problems[0]
        assert line.startswith(f"--set {item}:") and "out of range" in line and "use a value" in line, line
    for edge in _edges(rng, kind):
        try:
            load_recipe(TINY, [f"{key}={edge}"])
        except RecipeError as e:  # another check may object to the value; the range must not
            assert not any("out of range" in p for p in e.problems), (key, edge, e.problems)


def test_issue_cases_refused_at_validate_one_line_each(tmp_path, workdir):
    cases = ["train.log_interval=0", "train.log_interval=-1", "checkpoint.keep_last=0", "checkpoint.save_interval=-1",
             "train.eval_interval=-1", "train.clip_grad=-1", "train.weight_decay=-0.1",
             "train.exit_duration_minutes=-5", "cluster.cpus_per_task=0", "cluster.signal_lead_s=-5", "train.lr=-1",
             "train.adam_beta1=1", "train.adam_eps=0", "model.hidden_dropout=1.0", "train.lr=.nan"]
    for item in cases:
        rc, lines, _ = cli("validate", TINY, "--set", item, "--set", f"run.output_root={tmp_path}", cwd=workdir)
        assert rc == 2 and len(lines) == 1, (item, lines)
        assert lines[0].startswith(f"hpcmeg: --set {item}:") and "out of range" in lines[0], lines
    assert not list(tmp_path.iterdir())


def test_out_of_range_in_the_file_names_its_line(tmp_path, workdir):
    p = tmp_path / "r.yaml"
    p.write_text(TINY.read_text().replace("lr: 0.002", "lr: -1"))
    lineno = next(i for i, ln in enumerate(p.read_text().splitlines(), 1) if ln.strip() == "lr: -1")
    rc, lines, _ = cli("validate", p, cwd=workdir)
    assert rc == 2 and lines == [f"hpcmeg: {p}:{lineno}: train.lr: -1.0 is out of range; use a value greater than 0"]


# ----------------------------------------------------------------------------- one problem, one line

@pytest.mark.parametrize("item,needle", [("train.lr=abc", "expected a number"),
                                         ("model.num_layers=four", "expected an integer"),
                                         ("train.train_iters=2.5", "expected an integer"),
                                         ("train.device=gpu", "not one of"),
                                         ("model.hidden_size=0", "out of range"),
                                         ("data.json_keys=[]", "at least one"),
                                         ("trian.lr=1", "did you mean 'train'")])
def test_one_problem_is_one_line_blamed_on_set(item, needle, workdir):
    rc, lines, _ = cli("validate", TINY, "--set", item, cwd=workdir)
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"hpcmeg: --set {item}:") and needle in lines[0], lines
    assert str(TINY) not in lines[0]  # not a line of the recipe file: the value came from --set


def test_type_error_in_the_file_has_no_follow_on_lines(tmp_path, workdir):
    p = tmp_path / "r.yaml"
    p.write_text(TINY.read_text().replace("lr: 0.002", "lr: fast").replace("num_layers: 4", "num_layers: four"))
    rc, lines, _ = cli("validate", p, cwd=workdir)
    assert rc == 2 and len(lines) == 2, lines  # two mistakes, two lines; nothing about min_lr or divisibility
    assert any("train.lr" in ln and "expected a number" in ln for ln in lines)
    assert any("model.num_layers" in ln and "expected an integer" in ln for ln in lines)


def test_misspelled_key_in_a_section_has_no_follow_on_lines(tmp_path, workdir):
    p = tmp_path / "r.yaml"
    p.write_text(TINY.read_text().replace("  train_iters: 200", "  train_iter: 200"))
    rc, lines, _ = cli("validate", p, cwd=workdir)
    assert rc == 2 and len(lines) == 1 and "did you mean 'train_iters'" in lines[0], lines


def test_newline_in_run_name_is_reported_against_run_name(tmp_path, workdir):
    p = tmp_path / "r.yaml"
    p.write_text(TINY.read_text().replace("name: codeparrot-tiny", 'name: "codeparrot\\ntiny"'))
    for args in (["validate", p], ["submit", p, "--dry-run", "--set", f"run.output_root={tmp_path / 'runs'}"]):
        rc, lines, _ = cli(*args, cwd=workdir)
        assert rc == 2 and len(lines) == 1, lines
        assert f"{p}:6: run.name:" in lines[0] and "control character" in lines[0], lines
    assert not (tmp_path / "runs").exists()


def test_set_value_errors_name_set_and_profile_values_name_the_profile(tmp_path, workdir):
    prof = tmp_path / "p.yaml"
    prof.write_text("cluster:\n  executor: slurm\n  cpus_per_task: 0\n")
    rc, lines, _ = cli("validate", TINY, "--profile", prof, cwd=workdir)
    assert rc == 2 and lines == [f"hpcmeg: {prof}:3: cluster.cpus_per_task: 0 is out of range; use a value of at least 1"]


# ----------------------------------------------------------------------------- command line

@pytest.mark.parametrize("args,needle", [(["convert"], "required"),
                                         (["reshard", "a", "b", "--tp", "0", "--pp", "1"], "--tp: 0 is below 1"),
                                         (["convert", "a", "b", "--iteration", "-2"], "--iteration: -2"),
                                         (["logs", "x", "-n", "many"], "not an integer"),
                                         (["frobnicate"], "invalid choice"),
                                         (["validate", str(TINY), "--bogus"], "unrecognized arguments")])
def test_command_line_errors_are_one_line(args, needle):
    rc, lines, _ = cli(*args)
    assert rc == 2 and len(lines) == 1 and needle in lines[0] and "--help" in lines[0], lines
