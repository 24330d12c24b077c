"""`hpcmeg validate` reports every independent problem of a recipe in one run, each blamed on where
the user set the value: the `--set` item, the recipe's file and line, or the profile's file and line
only when the value came from there.

Everything runs the real CLI on real files (a recipe and a profile written here, the shipped
CodeParrot recipe); nothing is written or submitted. Lines about the run directory or the compute-node
interpreter being on this machine's local disk depend on whether the Slurm nodes are this host (they
are on slurm/local-cluster.sh), so those two kinds of line are tolerated, never required.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

from conftest import hpcmeg_cmd
from cli_helpers import sets

REPO = Path(__file__).resolve().parents[1]
MACHINE_DEPENDENT = ("run.output_root", "cluster.python")


def cli(*args, cwd=REPO):
    r = subprocess.run([*hpcmeg_cmd(), *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=120)
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, r.stderr.strip().splitlines()


def line_of(path: Path, needle: str) -> int:
    """1-based number of the first line of ``path`` containing ``needle``."""
    return next(i for i, text in enumerate(path.read_text().splitlines(), 1) if needle in text)


def problems(lines: list[str]) -> list[str]:
    """The problem lines without the tolerated machine-dependent ones (see the header)."""
    assert all(line.startswith("hpcmeg: ") for line in lines), lines
    return [x for x in lines if not any(f"{k} " in x or f"{k}:" in x for k in MACHINE_DEPENDENT)]


def test_shipped_recipe_reports_missing_image_and_unmatched_inputs_together():
    """The issue's example: the image the profile names and the recipe's input glob are both missing."""
    recipe = REPO / "recipes" / "codeparrot_small.yaml"
    profile = REPO / "hpcmeg" / "profiles" / "example-apptainer.yaml"
    rc, lines = cli("validate", "recipes/codeparrot_small.yaml")
    assert rc == 2, lines
    found = problems(lines)
    assert len(found) == 2, lines
    image = f"hpcmeg: {profile}:{line_of(profile, 'image:')}: container.image: /lustre/containers/hpcmeg.sif " \
            f"does not exist"
    assert any(x.startswith(image) for x in found), found
    inputs = (f"hpcmeg: recipes/codeparrot_small.yaml:{line_of(recipe, 'inputs:')}: data.inputs[0]: "
              f"'/lustre/datasets/codeparrot-clean-train/*.jsonl.gz' matches no file")
    assert any(x.startswith(inputs) for x in found), found


def _faulty(tmp_path: Path) -> tuple[Path, Path]:
    """A profile and a recipe with independent faults: an unknown recipe key, an input glob matching
    nothing, a missing image and a time Slurm cannot read (both set in the profile)."""
    profile = tmp_path / "site.yaml"
    profile.write_text(f"""cluster:
  executor: slurm
  nodes: 1
  time: forever
  python_check: false
container:
  runtime: apptainer
  image: {tmp_path}/missing.sif
""")
    recipe = tmp_path / "faulty.yaml"
    recipe.write_text(f"""run:
  name: faulty
  output_root: {tmp_path}/runs
data:
  inputs: [{tmp_path}/nothing/*.jsonl]
  json_keys: [content]
  seq_length: 64
model:
  num_layers: 2
  hidden_size: 64
  num_attention_heads: 2
  max_position_embeddings: 64
  hiden_dropout: 0.1
train:
  micro_batch_size: 2
  global_batch_size: 4
  train_iters: 10
  lr_warmup_iters: 2
cluster:
  gpus_per_node: 0
  cpu_tasks_per_node: 2
""")
    return profile, recipe


def test_every_independent_problem_in_one_run(tmp_path):
    profile, recipe = _faulty(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    rc, lines = cli("validate", recipe, "--profile", profile, *sets(["train.lr=abc", "parallel.tensor=3"]))
    assert rc == 2, lines
    found = problems(lines)
    expected = [
        "hpcmeg: --set train.lr=abc: expected a number, got 'abc'",
        f"hpcmeg: {recipe}:{line_of(recipe, 'hiden_dropout')}: model.hiden_dropout: unknown key 'hiden_dropout'; "
        f"did you mean 'hidden_dropout'?",
        f"hpcmeg: {profile}:{line_of(profile, 'time:')}: cluster.time: 'forever' is not a Slurm time",
        f"hpcmeg: --set parallel.tensor=3: 2 ranks (cluster.nodes=1 from {profile}:{line_of(profile, 'nodes:')} x "
        f"cluster.cpu_tasks_per_node=2 from {recipe}:{line_of(recipe, 'cpu_tasks_per_node')}) are not divisible by "
        f"parallel.tensor x parallel.pipeline = 3 x 1",
        f"hpcmeg: {profile}:{line_of(profile, 'image:')}: container.image: {tmp_path}/missing.sif does not exist",
        f"hpcmeg: {recipe}:{line_of(recipe, 'inputs:')}: data.inputs[0]: '{tmp_path}/nothing/*.jsonl' matches no file",
    ]
    for want in expected:  # each problem exactly once, on its own line
        assert sum(x.startswith(want) for x in found) == 1, (want, lines)
    assert len(found) == len(expected), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_each_fix_leaves_the_others(tmp_path):
    """Fixing one problem does not reveal a new one: the rest were all there in the first run."""
    profile, recipe = _faulty(tmp_path)
    rc, first = cli("validate", recipe, "--profile", profile, *sets(["parallel.tensor=3"]))
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "a.jsonl").write_text('{"content": "print(1)"}\n')
    rc2, second = cli("validate", recipe, "--profile", profile, *sets(["parallel.tensor=3"]))
    assert rc == rc2 == 2
    assert set(problems(second)) < set(problems(first)), (first, second)
    assert not any("data.inputs" in x for x in second), second


def _tiny(tmp_path: Path, extra: str = "") -> Path:
    """The tiny recipe on real inputs (the local profile: no Slurm, no container)."""
    data = tmp_path / "in.jsonl"
    data.write_text('{"content": "def f():\\n    return 1\\n"}\n')
    text = (REPO / "recipes" / "codeparrot_tiny.yaml").read_text()
    text = text.replace("inputs: [runs/corpus/stdlib.jsonl]", f"inputs: [{data}]")
    text = text.replace("output_root: runs", f"output_root: {tmp_path}/runs")
    path = tmp_path / "tiny.yaml"
    path.write_text(text + extra)
    return path


def test_set_layout_is_blamed_on_the_set_not_the_profile(tmp_path):
    recipe = _tiny(tmp_path)
    local = REPO / "hpcmeg" / "profiles" / "local.yaml"
    rc, lines = cli("validate", recipe, "--set", "parallel.tensor=3")
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("hpcmeg: --set parallel.tensor=3: 2 ranks "), lines
    # the values it is checked against are named with where they were set
    assert f"cluster.nodes=1 from {local}:{line_of(local, 'nodes:')}" in lines[0], lines
    assert f"cluster.cpu_tasks_per_node=2 from {recipe}:{line_of(recipe, 'cpu_tasks_per_node')}" in lines[0], lines


def test_layout_set_in_the_recipe_is_blamed_on_its_line(tmp_path):
    recipe = _tiny(tmp_path, "parallel:\n  tensor: 3\n")
    rc, lines = cli("validate", recipe)
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"hpcmeg: {recipe}:{line_of(recipe, 'tensor: 3')}: parallel.tensor: 2 ranks "), lines


def test_set_of_a_divisor_is_blamed_on_the_set(tmp_path):
    """Model sizes checked against the layout: the --set that broke the fit carries the blame, and the
    line names the recipe's value it was checked against."""
    recipe = _tiny(tmp_path)
    rc, lines = cli("validate", recipe, *sets(["cluster.cpu_tasks_per_node=3", "parallel.tensor=3"]))
    assert rc == 2, lines
    heads = line_of(recipe, "num_attention_heads")
    assert lines == [  # 3 ranks = TP 3 fit; the 4 heads and the 4 x 128 = 512 wide MLP do not split in 3
        f"hpcmeg: --set parallel.tensor=3: model.num_attention_heads: 4 heads are not divisible by "
        f"parallel.tensor=3 (model.num_attention_heads=4 from {recipe}:{heads})",
        f"hpcmeg: --set parallel.tensor=3: model.ffn_hidden_size: 512 is not divisible by parallel.tensor=3 "
        f"(model.ffn_hidden_size=None by default)",
    ], lines


def test_value_set_in_a_profile_is_blamed_on_the_profile_line(tmp_path):
    profile = tmp_path / "site.yaml"
    profile.write_text("cluster:\n  executor: local\n  nodes: 0\ncontainer:\n  runtime: none\n")
    recipe = _tiny(tmp_path)
    recipe.write_text(recipe.read_text().replace("  profile: local\n", ""))
    rc, lines = cli("validate", recipe, "--profile", profile)
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"hpcmeg: {profile}:3: cluster.nodes: 0 is out of range"), lines
    # the same value given on the command line is the command line's
    rc, lines = cli("validate", recipe, "--profile", profile, "--set", "cluster.nodes=-1")
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("hpcmeg: --set cluster.nodes=-1: -1 is out of range"), lines
