"""What `hpcmeg submit` refuses before it writes or submits anything: settings known to fail on the cluster.

Contract: ``preflight(r, d, host_python, stages, dry_run, submitting) -> (problems, warnings)``, one
line each naming the recipe key and the fix; ``slurm_refusals(plan, python)`` asks Slurm itself
(``sbatch --test-only``) whether it would accept each job of the plan (a real submission only, like
the check that ``sbatch`` is there: ``hpcmeg validate`` runs everything else, also on a laptop). Pure functions
(``node_local_reason``, ``fs_type``, ``addresses_are_local``) carry the logic; the rest reads this
machine (``/proc/self/mounts``, ``scontrol show node``, running cluster.python once).

What is checked, and why:
- the profile fits the executor: pyxis needs Slurm's srun (no local executor), the local executor
  with Apptainer needs ``apptainer`` here, the Slurm executor needs ``sbatch`` here;
- cluster.python (the compute-node interpreter) and run.output_root: an absolute path must exist
  (the interpreter) and must not be node-local when the nodes are other hosts: under /tmp, /var/tmp,
  /dev/shm, /run or $TMPDIR, on tmpfs, or on a local disk filesystem (ext4, xfs...; network
  filesystems such as NFS, Lustre or GPFS are what the nodes share). On a cluster whose nodes are
  this host (``slurm/local-cluster.sh``) every local path is shared with them, so only existence counts;
- cluster.python imports the same hpcmeg as the submitter (otherwise every job would stop at its
  version check) and submitit;
- resource shapes: the preprocess job's ``--cpus-per-task`` (cluster.preprocess_cpus) is not below
  data.workers.
On ``--dry-run`` (e.g. rendering a cluster's scripts on a laptop) what depends on this machine is a
warning, not a refusal. The checks are independent: all of them run, so one submit reports every problem.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from typing import Iterable, Optional

NODE_LOCAL_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run")
NODE_LOCAL_FS = {"tmpfs", "ramfs", "devtmpfs"}
LOCAL_DISK_FS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "overlay", "zfs", "f2fs", "vfat", "reiserfs", "jfs"}


def _under(path: str, root: str) -> bool:
    root = root.rstrip("/")
    return path == root or path.startswith(root + "/")  # root "/" -> "": every absolute path


def mounts(text: Optional[str] = None) -> list[tuple[str, str]]:
    """(mount point, fs type) of /proc/self/mounts, in mount order (octal escapes decoded)."""
    if text is None:
        try:
            with open("/proc/self/mounts") as f:
                text = f.read()
        except OSError:
            return []
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3:
            out.append((parts[1].encode().decode("unicode_escape"), parts[2]))
    return out


def fs_type(path: str, table: Optional[list[tuple[str, str]]] = None) -> Optional[str]:
    """Filesystem type holding ``path``: the longest mount point above it (a later mount shadows)."""
    best, best_len = None, -1
    for mnt, typ in (mounts() if table is None else table):
        if _under(path, mnt) and len(mnt) >= best_len:
            best, best_len = typ, len(mnt)
    return best


def node_local_reason(path: str, environ=None, table=None) -> Optional[str]:
    """Why ``path`` (absolute) would not exist on other hosts, or None (shared or unknown)."""
    env = os.environ if environ is None else environ
    dirs = list(NODE_LOCAL_DIRS)
    tmpdir = (env.get("TMPDIR") or "").rstrip("/")
    if tmpdir:
        dirs.append(tmpdir)
    for p in dict.fromkeys([os.path.abspath(path), os.path.realpath(path)]):
        for d in dirs:
            if _under(p, d):
                return f"it is under {d}{' ($TMPDIR)' if d == tmpdir else ''}, which every node has for itself"
        typ = fs_type(p, table)
        if typ in NODE_LOCAL_FS:
            return f"it is on a {typ} filesystem (memory of this machine)"
        if typ in LOCAL_DISK_FS:
            return f"it is on a local {typ} disk of this machine, not a shared filesystem"
    return None


def addresses_are_local(addrs: Iterable[str], own: Iterable[str]) -> bool:
    """True when every node address is this host (loopback or one of ``own``)."""
    own = set(own)
    addrs = [a for a in addrs if a]
    return bool(addrs) and all(a.startswith("127.") or a in ("::1", "localhost") or a in own for a in addrs)


def nodes_are_this_host() -> Optional[bool]:
    """Whether every Slurm node is this machine (``slurm/local-cluster.sh``); None when unknown."""
    if not shutil.which("scontrol"):
        return None
    try:
        out = subprocess.run(["scontrol", "-o", "show", "node"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    addrs = [tok.split("=", 1)[1] for line in out.splitlines() for tok in line.split()
             if tok.startswith(("NodeAddr=", "NodeHostName="))]
    if not addrs:
        return None
    host = socket.gethostname()
    own = {host, socket.getfqdn()}
    try:
        own.update(socket.gethostbyname_ex(host)[2])
    except OSError:
        pass
    return addresses_are_local(addrs, own)


_PROBE = ("import json, sys, submitit; from hpcmeg.launch.provenance import fingerprint; "
          "print(json.dumps({**fingerprint(), 'python': '.'.join(map(str, sys.version_info[:3]))}))")


def probe_interpreter(python: str) -> tuple[Optional[dict], str]:
    """Run ``python`` once: (its hpcmeg fingerprint, '') or (None, why it failed)."""
    import json

    try:
        # this environment, as the job inherits it (sbatch --export=ALL)
        r = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    except OSError as e:
        return None, f"it does not run here ({e.strerror or e})"
    except subprocess.TimeoutExpired:
        return None, "it did not answer within 120 s"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"it cannot import hpcmeg and submitit ({last[:200]})"
    try:
        return json.loads(r.stdout.strip().splitlines()[-1]), ""
    except (ValueError, IndexError):
        return None, f"it printed no version ({r.stdout[-200:]!r})"


def check_python(recipe, host_python: str, nodes_local: Optional[bool]) -> list[str]:
    """Problems with cluster.python (the compute-node interpreter), see the module docstring."""
    c = recipe.cluster
    key = "cluster.python"
    where = f"{key} '{host_python}'" + ("" if c.python else " (default: the interpreter running hpcmeg submit)")
    if "/" not in host_python:
        return []  # a command name, found on the node's PATH after cluster.setup: nothing to check here
    if not os.path.isabs(host_python):
        return [f"{where}: must be an absolute path (or a bare command name looked up on the node's PATH)"]
    if c.python_check and nodes_local is not True:
        why = node_local_reason(host_python)
        if why:
            return [f"{where}: the compute nodes cannot run it: {why}. Put the venv on the shared filesystem "
                    f"(e.g. python3 -m venv $HOME/hpcmeg-venv && $HOME/hpcmeg-venv/bin/pip install -e .) and set "
                    f"cluster.python to its bin/python; --set cluster.python_check=false if it is installed at "
                    f"this path on every node"]
    if not os.path.exists(host_python):
        return [f"{where}: does not exist; set cluster.python to the interpreter of a venv with hpcmeg installed "
                f"on the shared filesystem"]
    if not os.access(host_python, os.X_OK) or os.path.isdir(host_python):
        return [f"{where}: is not an executable file"]
    if os.path.realpath(host_python) == os.path.realpath(sys.executable) and \
            os.path.abspath(host_python) == os.path.abspath(sys.executable):
        return []  # the submitting interpreter itself: same hpcmeg by construction
    fp, why = probe_interpreter(host_python)
    if fp is None:
        return [f"{where}: {why}; install hpcmeg (pip install -e <checkout>) into that environment"]
    if c.version_check:
        from hpcmeg.launch.provenance import describe, fingerprint

        mine = fingerprint()
        if (fp.get("version"), fp.get("source")) != (mine["version"], mine["source"]):
            return [f"{where}: runs {describe(fp)} from {fp.get('path')}, but this submit is {describe(mine)}: "
                    f"every job would stop at its version check; reinstall the checkout you submit from into "
                    f"that environment, or --set cluster.version_check=false"]
    return []


def check_output_root(recipe, run_dir: str, nodes_local: Optional[bool]) -> list[str]:
    if nodes_local is True:
        return []
    why = node_local_reason(run_dir)
    if why:
        return [f"run.output_root: the run directory {run_dir} must be on a filesystem the compute nodes share "
                f"(logs, checkpoints and the job's scripts live there), but {why}; set run.output_root to a "
                f"directory on the shared filesystem"]
    return []


def check_fit(recipe, dry_run: bool, submitting: bool = True) -> tuple[list[str], list[str]]:
    """The profile's executor and container runtime can work together, with the tools at hand
    (``submitting``: also that sbatch is here)."""
    c, ct = recipe.cluster, recipe.container
    problems, machine = [], []
    prof = f"profile '{c.profile}'"
    if c.executor == "local" and ct.runtime == "pyxis":
        problems.append(f"container.runtime: pyxis starts containers through Slurm's srun, which the local "
                        f"executor of {prof} does not use; use container.runtime none or apptainer, or a Slurm "
                        f"profile (--profile local-slurm or your site's)")
    if c.executor == "local" and ct.runtime == "apptainer" and not shutil.which("apptainer"):
        machine.append(f"container.runtime: apptainer is not on PATH here, and the local executor of {prof} runs "
                       f"the ranks on this machine; install Apptainer or use container.runtime none")
    if submitting and c.executor == "slurm" and not shutil.which("sbatch"):
        machine.append(f"cluster.executor: {prof} submits to Slurm, but sbatch is not on PATH here; run hpcmeg "
                       f"submit on a login node of the cluster, or use --profile local (no Slurm)")
    if ct.runtime != "none":
        from hpcmeg.launch.container import ContainerError, normalized_binds

        try:
            normalized_binds(ct.binds)
        except ContainerError as e:
            problems.append(str(e))
    from hpcmeg.launch.scripts import ScriptError, env_exports

    try:
        env_exports(c.env)
    except ScriptError as e:
        problems.append(str(e))
    img = ct.image or ""
    if machine:
        pass  # one problem, one line: a missing runtime or Slurm makes the image question moot
    elif ct.runtime in ("apptainer", "pyxis") and img.startswith("/") and not os.path.exists(img):
        machine.append(f"container.image: {img} does not exist; build it with bash containers/build.sh <dir> "
                       f"(docs/guide.md, section 1) or set container.image to the image's path")
    if dry_run:
        return problems, [f"warning (dry run): {m}" for m in machine]
    return problems + machine, []


def check_shapes(recipe, stages: tuple[str, ...]) -> list[str]:
    c, d = recipe.cluster, recipe.data
    out = []
    if c.preprocess_cpus is not None and c.preprocess_cpus < 1:
        out.append(f"cluster.preprocess_cpus: must be at least 1 (or null = data.workers), got {c.preprocess_cpus}")
    elif (c.executor == "slurm" and "preprocess" in stages and not d.data_path and c.preprocess_cpus is not None
          and d.workers > c.preprocess_cpus):
        out.append(f"data.workers: {d.workers} tokenizer workers would share the {c.preprocess_cpus} core(s) of "
                   f"each preprocess task (cluster.preprocess_cpus); set cluster.preprocess_cpus to {d.workers} or "
                   f"null (= data.workers), or data.workers to {c.preprocess_cpus}")
    return out


def _any_key(*keys: str) -> bool:
    return True


def preflight(recipe, derived, host_python: str, stages: tuple[str, ...], dry_run: bool = False,
              submitting: bool = True, ok=_any_key) -> tuple[list[str], list[str]]:
    """Every check above, each independent of the others; (problems that refuse the submission,
    warnings to print). ``ok(*keys)``: False when one of the keys was already refused while loading
    the recipe (its value is a placeholder), and the checks reading it are skipped."""
    problems: list[str] = []
    warnings: list[str] = []
    if ok("cluster.executor", "container.runtime", "container.image", "container.binds", "cluster.env"):
        problems, warnings = check_fit(recipe, dry_run, submitting)
    if ok("cluster.executor", "cluster.preprocess_cpus", "data.workers", "data.data_path"):
        problems += check_shapes(recipe, stages)
    if recipe.cluster.executor != "slurm" or not ok("cluster.executor"):
        return problems, warnings
    if submitting and not shutil.which("sbatch"):
        return problems, warnings  # refused above: this is no login node, so its paths say nothing of the nodes
    nodes_local = nodes_are_this_host()
    machine = []
    if ok("cluster.python", "cluster.python_check", "cluster.version_check"):
        machine += check_python(recipe, host_python, nodes_local)
    if ok("run.output_root", "run.name"):
        machine += check_output_root(recipe, derived.run_dir, nodes_local)
    if dry_run:
        warnings += [f"warning (dry run): {m}" for m in machine]
    else:
        problems += machine
    return problems, warnings


_HINTS = (("partition", "cluster.partition / cluster.cpu_partition"), ("account", "cluster.account"),
          ("qos", "cluster.qos"), ("gres", "cluster.gpus_per_node"), ("time limit", "cluster.time"),
          ("node configuration", "cluster.nodes, cpus_per_task, gpus_per_node or mem"),
          ("memory", "cluster.mem"), ("feature", "cluster.constraint"))


def slurm_refusals(plan, python: str) -> list[str]:
    """``sbatch --test-only`` of every job of the plan (no dependency): Slurm's own refusals, one line each."""
    from hpcmeg.launch.scripts import render_sbatch

    refused: dict[str, list[str]] = {}  # Slurm's message -> the stages it refuses (one problem, one line)
    for job in plan.jobs:
        text = render_sbatch(job, f"{plan.run_dir}/submitit/{job.stage}", python)
        try:
            r = subprocess.run(["sbatch", "--test-only"], input=text, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as e:
            return [f"cluster: sbatch --test-only of the {job.stage} job failed to run: {e}"]
        if r.returncode != 0:
            refused.setdefault(" ".join((r.stderr or r.stdout).replace("sbatch: error:", "").split()), []).append(job.stage)
    out = []
    for msg, stages in refused.items():
        hint = next((k for w, k in _HINTS if w in msg.lower()), "the cluster settings of the profile")
        which = stages[0] if len(stages) == 1 else ", ".join(stages[:-1]) + " and " + stages[-1]
        out.append(f"cluster: Slurm would refuse the {which} job{'s' if len(stages) > 1 else ''} ({msg}); check {hint}")
    return out
