"""The package's import structure: no import cycle between files and no import that points up the layers
(cli -> launch / convert / train -> parallel / model / kernels / data / checkpoint -> megatron / recipe),
as the shared checker `shared/tools/import_graph.py` reads them (function-local imports included).

The checker lives beside the clone (`<repo>/../shared/tools/import_graph.py`, where CI has it); without it
the first test is skipped with that reason. It only knows the layer of the names in its table, so the
bottom-layer file it does not list yet (hpcmeg/procenv.py) is checked here directly: it imports nothing
from hpcmeg.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(os.path.dirname(REPO), "shared", "tools", "import_graph.py")


@pytest.mark.skipif(not os.path.isfile(TOOL), reason=f"the import checker is not beside this clone ({TOOL})")
def test_no_import_cycle_and_no_upward_import():
    proc = subprocess.run([sys.executable, TOOL, "hpcmeg"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 cycle(s), 0 import(s) against the layer order" in proc.stdout


def test_process_environment_reader_is_bottom_layer():
    """procenv is read by train and launch alike, so it may not import any other hpcmeg file."""
    path = os.path.join(REPO, "hpcmeg", "procenv.py")
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level]
    names += ["(relative)" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
    assert [m for m in names if m == "hpcmeg" or m.startswith("hpcmeg.") or m == "(relative)"] == []


def _hpcmeg_imports(path: str) -> list[str]:
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level]
    return [m for m in names if m == "hpcmeg" or m.startswith("hpcmeg.")]


def test_recipe_files_are_bottom_layer():
    """The recipe's schema, YAML reader, checks and derived plan sit in the bottom layer with megatron/
    (the checker's table does not list these files by name): they import only each other and
    megatron/."""
    for name in ("recipe_schema", "recipe_choices", "recipe_yaml", "recipe_checks", "recipe_plan"):
        path = os.path.join(REPO, "hpcmeg", f"{name}.py")
        bad = [m for m in _hpcmeg_imports(path)
               if not (m.startswith("hpcmeg.megatron.") or m.startswith("hpcmeg.recipe_"))]
        assert bad == [], (name, bad)


def test_fused_package_sits_beside_the_model():
    """hpcmeg/fused/ (the fast path applied to the plain model from outside; the checker's table does
    not list it) imports only itself, model/, kernels/ and the bottom layer; model/ and kernels/
    never import it, so the plain model stands alone."""
    below = ("hpcmeg.fused", "hpcmeg.model", "hpcmeg.kernels", "hpcmeg.megatron", "hpcmeg.recipe_")
    fused_dir = os.path.join(REPO, "hpcmeg", "fused")
    for name in sorted(os.listdir(fused_dir)):
        if name.endswith(".py"):
            bad = [m for m in _hpcmeg_imports(os.path.join(fused_dir, name)) if not m.startswith(below)]
            assert bad == [], (name, bad)
    for pkg in ("model", "kernels"):
        for name in sorted(os.listdir(os.path.join(REPO, "hpcmeg", pkg))):
            if name.endswith(".py"):
                up = [m for m in _hpcmeg_imports(os.path.join(REPO, "hpcmeg", pkg, name)) if m.startswith("hpcmeg.fused")]
                assert up == [], (pkg, name, up)
