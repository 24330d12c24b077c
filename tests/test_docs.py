"""The user docs' checkable claims: docs/parallelism.md's command for each layout is a recipe hpcmeg
accepts, with the data-parallel size and gradient accumulation that its comment states and a run.name
of its own; every link to a section (``file.md#anchor``) in README.md and docs/*.md names a heading
that exists (GitHub's anchors).

Each ``hpcmeg submit RECIPE --profile P --set ...   # DP n, accumulation m`` line of the page is
loaded as ``hpcmeg validate`` loads it (hpcmeg.recipe.load_recipe: profile merge and every recipe
check, the layout's divisibility and the global batch's included), with ``<site>`` read as the
local-slurm profile; derive() gives the sizes the train job runs with. No inputs are read (the GPU
recipe's /lustre paths do not exist here), nothing is written or submitted.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from hpcmeg.recipe import derive, load_recipe

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "parallelism.md"
LINE = re.compile(r"^(hpcmeg submit [^#\n]*?)\s+# DP (\d+), accumulation (\d+)\s*$", re.M)


def _commands() -> list[tuple[str, int, int]]:
    return [(m.group(1), int(m.group(2)), int(m.group(3))) for m in LINE.finditer(PAGE.read_text())]


def _parse(cmd: str) -> tuple[str, str, list[str]]:
    """(recipe, profile, --set values) of one documented command; anything else fails the test."""
    argv = shlex.split(cmd.replace("<site>", "local-slurm"))
    assert argv[:2] == ["hpcmeg", "submit"], cmd
    recipe, rest = argv[2], argv[3:]
    profile, sets = None, []
    while rest:
        flag, value, rest = rest[0], rest[1], rest[2:]
        assert flag in ("--profile", "--set"), f"{cmd}: unexpected {flag}"
        if flag == "--profile":
            profile = value
        else:
            sets.append(value)
    return recipe, profile, sets


def test_every_layout_has_a_command_with_its_own_run_name():
    cmds = _commands()
    names = [s for _, _, sets in (_parse(c) for c, _, _ in cmds) for s in sets if s.startswith("run.name=")]
    assert len(names) == len(cmds) and len(set(names)) == len(names), names
    text = " ".join(c for c, _, _ in cmds)
    for key in ("parallel.tensor=", "parallel.sequence_parallel=true", "parallel.pipeline=",
                "parallel.virtual_pipeline=", "parallel.distributed_optimizer=true", "cluster.nodes=2"):
        assert key in text, f"no command in {PAGE.name} sets {key}"


@pytest.mark.parametrize("cmd,dp,accum", _commands(), ids=lambda v: v.split("run.name=")[1].split()[0]
                         if isinstance(v, str) else str(v))
def test_command_is_accepted_with_the_stated_dp_and_accumulation(cmd, dp, accum):
    recipe, profile, sets = _parse(cmd)
    r = load_recipe(REPO / recipe, sets, profile)
    d = derive(r)
    assert (d.data_parallel_size, d.grad_accum_steps) == (dp, accum), cmd
    assert d.world_size == r.parallel.tensor * r.parallel.pipeline * dp
    assert d.grad_accum_steps * r.train.micro_batch_size * dp == r.train.global_batch_size


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_section_links_name_existing_headings():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    anchors = {p: {_anchor(m.group(1)) for m in re.finditer(r"^#+ (.*)$", p.read_text(), re.M)} for p in pages}
    bad = []
    for page in pages:
        for m in re.finditer(r"\]\(([^)\s]*?\.md)?#([^)\s]+)\)", page.read_text()):
            target = (page.parent / m.group(1)).resolve() if m.group(1) else page
            if m.group(2) not in anchors.get(target, set()):
                bad.append(f"{page.relative_to(REPO)}: {m.group(0)}")
    assert not bad, bad
