"""containers/hpcmeg.def is a well-formed Apptainer definition whose installs match pyproject.toml.

The image itself cannot be built here (no Apptainer, no NGC registry); this checks its structure
with our own parser: header keys, a pinned NGC PyTorch tag, known sections, the package list, and
that the build script is valid bash.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEF = REPO / "containers" / "hpcmeg.def"
KNOWN = {"labels", "files", "post", "environment", "test", "runscript", "help", "setup", "startscript", "arguments"}


def parse_def(text: str) -> tuple[dict, dict]:
    header, sections, cur = {}, {}, None
    for line in text.splitlines():
        m = re.match(r"^%(\w+)\s*$", line)
        if m:
            cur = m.group(1)
            assert cur not in sections, f"duplicate section %{cur}"
            sections[cur] = []
        elif cur is None:
            if line.strip() and not line.lstrip().startswith("#"):
                k, sep, v = line.partition(":")
                assert sep, f"header line without 'Key: value': {line!r}"
                header[k.strip()] = v.strip()
        else:
            sections[cur].append(line)
    return header, {k: "\n".join(v) for k, v in sections.items()}


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ]", req, maxsplit=1)[0].lower().replace("_", "-")


def test_header_and_sections():
    header, sections = parse_def(DEF.read_text())
    assert header["Bootstrap"] == "docker"
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d{2}\.\d{2}-py3", header["From"]), header["From"]
    assert set(sections) <= KNOWN, set(sections) - KNOWN
    for needed in ("labels", "post", "environment", "test", "runscript", "files"):
        assert needed in sections
    assert "hpcmeg doctor" in sections["test"]
    assert 'exec hpcmeg "$@"' in sections["runscript"]
    assert "NLTK_DATA" in sections["environment"] and "HF_HUB_OFFLINE=1" in sections["environment"]
    # the reason for the pinned tag is written next to it
    assert "Pin the tag" in DEF.read_text().split("%labels")[0]


def test_installed_packages_match_pyproject():
    _, sections = parse_def(DEF.read_text())
    post = sections["post"]
    joined = post.replace("\\\n", " ")  # join shell continuation lines
    pip_lines = " ".join(ln.strip()[len("pip install"):] for ln in joined.splitlines() if ln.strip().startswith("pip install"))
    installed = {_name(t) for t in shlex.split(pip_lines) if not t.startswith("-") and not t.startswith("/")}
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = {_name(d) for d in deps} - {"torch"}  # torch comes from the NGC base image, never from pip
    assert wanted <= installed, f"missing from %post: {sorted(wanted - installed)}"
    assert "torch" not in installed and "apex" not in installed
    assert "--no-deps /opt/hpcmeg/src" in post  # hpcmeg itself must not drag in another torch


def test_files_section_ships_the_package():
    _, sections = parse_def(DEF.read_text())
    srcs = [ln.split()[0] for ln in sections["files"].splitlines() if ln.strip()]
    for s in srcs:
        assert (REPO / s).exists(), s
    assert "hpcmeg" in srcs and "pyproject.toml" in srcs


def test_build_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(REPO / "containers" / "build.sh")], check=True)
    text = (REPO / "containers" / "build.sh").read_text()
    assert "apptainer build --fakeroot" in text and "APPTAINER_CACHEDIR" in text and "enroot" in text
