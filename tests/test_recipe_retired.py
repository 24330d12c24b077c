"""Recipe keys that were removed (recipe_choices.RETIRED) are named as such, one line each with the
file line that set them, instead of as unknown keys; and every choice key's values are the ones
the code that reads them accepts (the lists are written once, in recipe_choices.CHOICES)."""
from __future__ import annotations

import subprocess
import sys

from hpcmeg.recipe_choices import CHOICES, RETIRED


def test_each_retired_key_is_named_with_its_line_and_the_fix(tmp_path):
    body = ["run: {name: x}", "data: {data_path: [/nonexistent/x]}"]
    sections: dict[str, list[str]] = {}
    for key in RETIRED:
        sec, name = key.split(".")
        sections.setdefault(sec, []).append(name)
    lines = {}
    for sec, names in sections.items():
        body.append(f"{sec}:")
        if sec == "train":
            body.append("  train_iters: 2")
        for name in names:
            body.append(f"  {name}: auto")
            lines[f"{sec}.{name}"] = len(body)  # 1-based: the line just appended
    path = tmp_path / "r.yaml"
    path.write_text("\n".join(body) + "\n")
    proc = subprocess.run([sys.executable, "-m", "hpcmeg.cli", "validate", str(path)], capture_output=True, text=True)
    assert proc.returncode != 0
    out = proc.stderr + proc.stdout
    for key, line in lines.items():
        want = f"{path}:{line}: {key}: no longer a recipe key ("
        assert want in out, (want, out)
    assert "unknown key" not in out, out


def test_the_model_config_takes_its_choices_from_the_schema():
    from hpcmeg.model.config import ATTENTION_BACKENDS, CE_IMPLS
    assert ATTENTION_BACKENDS is CHOICES[("model", "attention_backend")]
    assert CE_IMPLS is CHOICES[("model", "cross_entropy")]
    assert not any(f"{sec}.{key}" in RETIRED for sec, key in CHOICES)
