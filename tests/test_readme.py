"""The README's quick-start commands are the ones CI runs and the ones that exist."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_ci_runs_the_readme_test_command():
    blocks = _bash_blocks((REPO / "README.md").read_text())
    test_cmd = next(b for b in blocks if "pytest" in b)
    ci = (REPO / ".ci/run").read_text()
    assert test_cmd in ci


def test_quick_start_scripts_exist():
    blocks = _bash_blocks((REPO / "README.md").read_text())
    assert len([b for b in blocks if "setup-dev.sh" in b]) == 2
    for b in blocks:
        for script in re.findall(r"bash (\S+\.sh)", b):
            assert (REPO / script).exists(), script
