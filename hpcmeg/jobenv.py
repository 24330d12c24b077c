"""Environment variables for the jobs: written values, pass-through names and secrets.

Contract (pure functions of a ``ClusterConfig``; no torch, importable from the recipe loader):
- ``written_env(c)``: the ``cluster.env`` entries that may be written into files (``export`` lines of
  the batch scripts, recipe copies): every entry except the names in ``cluster.secret_env``.
- ``passed_names(c)``: names handed to the job by name only: ``cluster.env_passthrough`` +
  ``cluster.secret_env``. On Slurm they go through sbatch's own environment propagation
  (``--export=ALL,NAME...``, rendered by hpcmeg.launch.scripts); locally the child processes inherit.
- ``submission_values(c)``: what the submitting process must carry in its environment while
  it runs sbatch: secret values given in ``cluster.env`` (pass-through values already are there).
- ``problems(c, environ, lenient)``: one line per name that is malformed, doubly given, or has no
  value to pass (``lenient``: a dry run on a machine without the variables: those become warnings),
  and per written ``cluster.env`` entry holding a secret's value (``copied_secrets``: refused).
- ``redact_recipe_dict(d)``: a ``recipe.to_dict`` result without the secret values (the one root
  every recipe copy goes through: recipe.yaml, train_recipe.yaml, the copy inside checkpoints).
- ``secret_looking(c)``: ``cluster.env`` names that look like credentials but are not marked secret.

Why by name: HPC users expect an API key to travel the way ``sbatch --export`` moves it, from the
shell that submits to the job's environment, never into a world-readable script. Slurm keeps the
job's environment in its own (root-only) state; hpcmeg writes the names, never the values.
"""
from __future__ import annotations

import re
from typing import Mapping

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CREDENTIAL = re.compile(r"(KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH)", re.IGNORECASE)


def written_env(c) -> dict[str, str]:
    secret = set(c.secret_env)
    return {k: str(v) for k, v in c.env.items() if k not in secret}


def passed_names(c) -> list[str]:
    out: list[str] = []
    for n in [*c.env_passthrough, *c.secret_env]:
        if n not in out:
            out.append(n)
    return out


def submission_values(c) -> dict[str, str]:
    """Secret values given in cluster.env: set in the submitting process's environment for sbatch."""
    return {n: str(c.env[n]) for n in c.secret_env if n in c.env}


def problems(c, environ: Mapping[str, str], lenient: bool = False) -> tuple[list[str], list[str]]:
    """(errors, warnings) about the pass-through and secret names; see the module docstring."""
    errors: list[str] = []
    warnings: list[str] = []
    for key, names in (("cluster.env_passthrough", c.env_passthrough), ("cluster.secret_env", c.secret_env)):
        for n in names:
            if not isinstance(n, str) or not ENV_NAME.match(n):
                errors.append(f"{key}: {n!r} is not a valid environment variable name (letters, digits and _ "
                              f"only, not starting with a digit)")
                continue
            if key == "cluster.env_passthrough" and n in c.env:
                errors.append(f"{key}: {n} is also set in cluster.env; keep one (the pass-through value comes "
                              f"from the environment you submit from)")
                continue
            if n in environ or (key == "cluster.secret_env" and n in c.env):
                continue
            line = (f"{key}: {n} is not set in this environment; export it before submitting (its value "
                    f"is handed to the jobs and written to no file)")
            (warnings if lenient else errors).append(line + ("; the dry run goes on without it" if lenient else ""))
    errors += copied_secrets(c, environ)
    return errors, warnings


def copied_secrets(c, environ: Mapping[str, str]) -> list[str]:
    """One line per cluster.env entry that is written (not in cluster.secret_env) but holds a secret's
    value, from cluster.env or the submitting environment: refused, since recipe.yaml and the batch
    scripts would carry the secret in clear under the second name."""
    values: dict[str, str] = {}
    for n in c.secret_env:
        if not isinstance(n, str):
            continue
        v = c.env[n] if n in c.env else environ.get(n)
        if v is not None and str(v) != "":
            values.setdefault(str(v), n)
    return [f"cluster.env: {k} holds the value of the secret {values[v]} (cluster.secret_env), and would write it "
            f"in clear into recipe.yaml and the job scripts; add {k} to cluster.secret_env as well, or remove it"
            for k, v in written_env(c).items() if v in values]


def secret_looking(c) -> list[str]:
    secret = set(c.secret_env)
    return [k for k in c.env if k not in secret and _CREDENTIAL.search(k)]


def redact_recipe_dict(data: dict) -> dict:
    """``data`` (a ``recipe.to_dict`` result) with the ``cluster.secret_env`` entries dropped from cluster.env."""
    cl = data.get("cluster")
    if not isinstance(cl, dict) or not cl.get("secret_env") or not isinstance(cl.get("env"), dict):
        return data
    secret = set(cl["secret_env"])
    return {**data, "cluster": {**cl, "env": {k: v for k, v in cl["env"].items() if k not in secret}}}
