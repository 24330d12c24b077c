"""Container wrapping of one task's command: Apptainer, pyxis/enroot, or none.

Contract: ``wrap(spec, argv, gpus) -> Wrapped(srun_opts, prefix, argv)``: the extra ``srun`` options
(pyxis puts its container there), the runtime prefix (``apptainer exec ... IMAGE``) and the command;
``.command`` = prefix + argv is what the step's task runs. All lists of plain strings; quoting happens
once, where scripts are rendered.

Why no Slurm command ever runs inside the container: images rarely carry scontrol/libslurm/munge
(pyxis issue #31), so every Slurm call (srun, scontrol requeue) is made by the host-side supervisor
and the container only ever runs ``python -m hpcmeg.cli <stage> ...``.

Binds: the run directory is always bound at the same path (recipe, logs, checkpoints and data live
there by default) plus ``container.binds``; a bind is ``/path`` or ``/host:/container[:opts]``.
Apptainer and pyxis both split bind lists on commas, so a path holding ',' cannot be bound; such a
path is refused with a clear message instead of being silently mangled.
"""
from __future__ import annotations

from dataclasses import dataclass, field


class ContainerError(ValueError):
    """A container setting that cannot work; the message names the key and the fix."""


@dataclass(frozen=True)
class Wrapped:
    srun_opts: list[str]
    prefix: list[str]
    argv: list[str]

    @property
    def command(self) -> list[str]:
        return [*self.prefix, *self.argv]


@dataclass(frozen=True)
class ContainerSpec:
    runtime: str  # apptainer | pyxis | none
    image: str | None = None
    binds: tuple[str, ...] = field(default_factory=tuple)
    python: str = "python3"


def normalized_binds(binds: list[str] | tuple[str, ...], always: list[str] | tuple[str, ...] = ()) -> list[str]:
    """``always`` (e.g. the run dir) + ``binds`` as ``src:dst[:opts]`` strings, duplicates removed, in order."""
    out: list[str] = []
    seen_dst: set[str] = set()
    for b in [*always, *binds]:
        b = str(b).strip()
        if not b:
            continue
        if "," in b:
            raise ContainerError(f"container.binds: '{b}' contains ',', which Apptainer and pyxis read as a list "
                                 f"separator; bind a parent directory without ',' instead")
        if "\n" in b or "\0" in b:
            raise ContainerError(f"container.binds: {b!r} contains a newline or NUL; use a plain path")
        parts = b.split(":")
        if len(parts) == 1:
            parts = [parts[0], parts[0]]
        if not parts[0].startswith("/") or not parts[1].startswith("/"):
            raise ContainerError(f"container.binds: '{b}' must be an absolute path or /host:/container[:opts]")
        spec = ":".join(parts)
        if parts[1] in seen_dst:
            continue
        seen_dst.add(parts[1])
        out.append(spec)
    # /lustre/runs/x:/lustre/runs/x next to /lustre:/lustre adds nothing (the parent bind already shows it
    # at the same path) and only makes the command line harder to read: keep the parent
    plain = [b.split(":")[0] for b in out if b.count(":") == 1 and b.split(":")[0] == b.split(":")[1]]
    return [b for b in out if not (b.count(":") == 1 and b.split(":")[0] == b.split(":")[1] and
                                   any(b.split(":")[0].startswith(q.rstrip("/") + "/") for q in plain))]


def python_argv(spec: ContainerSpec, host_python: str) -> list[str]:
    """The interpreter for ``-m hpcmeg.cli``: the container's python, or the host's own without a container."""
    return [host_python] if spec.runtime == "none" else [spec.python]


def wrap(spec: ContainerSpec, argv: list[str], gpus: bool, always_bind: list[str] | tuple[str, ...] = (),
         workdir: str | None = None) -> Wrapped:
    """How to run ``argv`` inside the container described by ``spec`` (see the module docstring)."""
    if spec.runtime == "none":
        return Wrapped([], [], list(argv))
    if not spec.image:
        raise ContainerError(f"container.image: container.runtime={spec.runtime} needs an image")
    binds = normalized_binds(spec.binds, always_bind)
    if spec.runtime == "apptainer":
        pre = ["apptainer", "exec"]
        if gpus:
            pre.append("--nv")  # binds the host driver libraries; harmless to omit on CPU steps
        for b in binds:
            pre += ["--bind", b]
        if workdir:
            pre += ["--pwd", workdir]
        return Wrapped([], [*pre, spec.image], list(argv))
    if spec.runtime == "pyxis":
        opts = [f"--container-image={spec.image}"]
        if binds:
            opts.append(f"--container-mounts={','.join(binds)}")
        # $HOME inside the image would shadow its site-packages with the user's ~/.local ones
        opts.append("--no-container-mount-home")
        if workdir:
            opts.append(f"--container-workdir={workdir}")
        return Wrapped(opts, [], list(argv))
    raise ContainerError(f"container.runtime: '{spec.runtime}' is not one of apptainer, pyxis, none")


def local_wrap(spec: ContainerSpec, argv: list[str], gpus: bool, always_bind: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Command for the no-Slurm local executor: Apptainer works without srun, pyxis cannot."""
    if spec.runtime == "pyxis":
        raise ContainerError("container.runtime: pyxis only works through Slurm's srun; the local executor needs "
                             "container.runtime apptainer or none (e.g. --set container.runtime=none)")
    return wrap(spec, argv, gpus, always_bind).command
