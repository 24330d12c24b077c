"""Recipe schema: loading, profiles, overrides, validation messages, derived values."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from hpcmeg import recipe_schema
from hpcmeg.recipe import (RecipeError, derive, dump_yaml, from_dict, load_recipe, parse_blend, parse_split,
                           to_dict, write_resolved)

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def write(tmp_path, text: str) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


MINIMAL = "run: {name: t}\ndata: {inputs: [x.jsonl]}\ntrain: {train_iters: 10, micro_batch_size: 1, global_batch_size: 1}\n"


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_shipped_recipes_validate(path):
    r = load_recipe(path)
    d = derive(r)
    assert d.grad_accum_steps * r.train.micro_batch_size * d.data_parallel_size == r.train.global_batch_size


def test_codeparrot_small_is_the_megatron_configuration():
    r = load_recipe(REPO / "recipes/codeparrot_small.yaml")
    d = derive(r)
    assert (r.model.num_layers, r.model.hidden_size, r.model.num_attention_heads, r.data.seq_length) == (12, 768, 12, 1024)
    assert (r.train.micro_batch_size, r.train.global_batch_size, d.world_size, d.grad_accum_steps) == (12, 192, 8, 2)
    assert d.padded_vocab_size == 50304 and d.orig_vocab_size == 50257
    assert (r.parallel.tensor, r.parallel.pipeline, r.train.precision) == (1, 1, "bf16")


def test_every_field_has_a_docstring():
    # one docstring per field: the attribute docstring follows each field in the source
    import inspect

    src = inspect.getsource(recipe_schema)
    for cls in [recipe_schema.Recipe, *[f.type for f in dataclasses.fields(recipe_schema.Recipe) if dataclasses.is_dataclass(f.type)]]:
        cls = cls if isinstance(cls, type) else getattr(recipe_schema, cls)
        csrc = inspect.getsource(cls)
        for f in dataclasses.fields(cls):
            idx = csrc.index(f"    {f.name}:")
            after = csrc[idx:].split("\n", 2)
            assert after[1].strip().startswith('"""'), f"{cls.__name__}.{f.name} has no docstring"
    assert src


def test_misspelled_section_suggests(tmp_path):
    p = write(tmp_path, MINIMAL + "trian:\n  lr: 0.1\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    assert len(e.value.problems) == 1
    line = e.value.problems[0]
    assert "trian" in line and "did you mean 'train'" in line and f"{p}:4" in line


def test_batch_not_divisible_names_all_three(tmp_path):
    p = write(tmp_path, "run: {name: t}\ndata: {inputs: [x]}\ntrain: {train_iters: 1, micro_batch_size: 12, global_batch_size: 190}\n"
                        "cluster: {profile: example-apptainer, nodes: 1, gpus_per_node: 8}\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    (line,) = e.value.problems
    assert "190" in line and "12" in line and "8" in line and "global_batch_size" in line


def test_all_problems_reported_at_once(tmp_path):
    p = write(tmp_path, "run: {name: t}\ndata: {inputs: [x], seq_length: 4096}\n"
                        "model: {num_layers: 5, num_attention_heads: 7, hidden_size: 70, dropout: 0.1}\n"
                        "train: {train_iters: ten, micro_batch_size: 1, global_batch_size: 1, precision: bf32}\n"
                        "parallel: {pipeline: 2}\ncluster: {cpu_tasks_per_node: 2}\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    text = "\n".join(e.value.problems)
    for needle in ["model.dropout", "train.train_iters", "precision", "bf16", "num_layers", "seq_length"]:
        assert needle in text, needle
    assert len(e.value.problems) >= 5


def test_type_errors_and_missing(tmp_path):
    p = write(tmp_path, "run: {name: t}\ndata: {inputs: [x]}\ntrain: {micro_batch_size: 1, global_batch_size: 1, lr: fast}\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    text = "\n".join(e.value.problems)
    assert "train.lr" in text and "expected a number" in text
    assert "exactly one of train.train_iters and train.train_samples" in text


def test_overrides_and_precedence(tmp_path):
    p = write(tmp_path, MINIMAL + "cluster: {profile: local-slurm}\n")
    r = load_recipe(p, ["train.lr=3e-4", "cluster.cpu_tasks_per_node=1", "data.json_keys=[content, text]"])
    assert r.train.lr == pytest.approx(3e-4)
    assert r.cluster.executor == "slurm" and r.cluster.partition == "debug"  # from the profile
    assert r.cluster.cpu_tasks_per_node == 1  # --set beats the profile
    assert r.data.json_keys == ["content", "text"]
    with pytest.raises(RecipeError, match="needs a section"):
        load_recipe(p, ["lr=1"])


def test_unknown_profile(tmp_path):
    p = write(tmp_path, MINIMAL + "cluster: {profile: local-slrum}\n")
    with pytest.raises(RecipeError, match="did you mean 'local-slurm'"):
        load_recipe(p)


def test_yaml_is_safe_loaded(tmp_path):
    p = write(tmp_path, "run: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(RecipeError, match="invalid YAML"):
        load_recipe(p)


def test_roundtrip_and_atomic_write(tmp_path):
    r = load_recipe(REPO / "recipes/codeparrot_tiny.yaml")
    out = write_resolved(r, tmp_path / "run" / "recipe.yaml")
    assert not list(out.parent.glob(".*tmp*"))
    r2 = load_recipe(out)
    assert to_dict(r2) == to_dict(r)
    assert to_dict(from_dict(to_dict(r))) == to_dict(r)
    assert "codeparrot-tiny" in dump_yaml(r)


def test_split_and_blend_parsing():
    assert parse_split("949,50,1") == pytest.approx([0.949, 0.05, 0.001])
    assert parse_split("98:2") == pytest.approx([0.98, 0.02, 0.0])
    assert parse_blend(["a"]) == [(1.0, "a")]
    assert parse_blend([0.3, "a", "0.7", "b"]) == [(0.3, "a"), (0.7, "b")]
    with pytest.raises(ValueError):
        parse_blend([0.3, "a", "b"])


def test_time_limits():
    c = recipe_schema.ClusterConfig()
    assert c.time_limit_minutes("04:00:00") == 240
    assert c.time_limit_minutes("1-00:00:00") == 1440
    assert c.time_limit_minutes("30") == 30
    assert c.time_limit_minutes("soon") is None


def test_recipe_module_does_not_import_torch():
    code = "import sys, hpcmeg.recipe, hpcmeg.cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_typing_of_all_fields_supported():
    # every field type is one the loader converts (catches a new field of an unsupported type)
    for f in dataclasses.fields(recipe_schema.Recipe):
        if f.name == "source":
            continue
        for sub in dataclasses.fields(f.type if isinstance(f.type, type) else getattr(recipe_schema, f.type)):
            tp = typing.get_type_hints(getattr(recipe_schema, type(getattr(recipe_schema.Recipe(), f.name)).__name__))[sub.name]
            assert tp in (int, float, str, bool) or typing.get_origin(tp) in (list, dict, typing.Union), (f.name, sub.name, tp)


def test_yaml_booleans_mean_on_and_off_where_the_choices_are_on_off(tmp_path):
    """YAML 1.1 reads `compile: off` as False: for a key whose choices include on/off that is the word
    (file and --set alike); a free string keeps refusing a boolean."""
    p = write(tmp_path, MINIMAL + "model:\n  fused: on\n")
    r = load_recipe(p, ["train.compile=on"])
    assert (r.train.compile, r.model.fused) == ("on", "on")
    assert load_recipe(p, ["train.compile=off"]).train.compile == "off"
    with pytest.raises(RecipeError, match="run.name=yes: expected a string, got True"):
        load_recipe(p, ["run.name=yes"])
