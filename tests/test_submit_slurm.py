"""`hpcmeg submit` on the local Slurm cluster: the whole chain, status/logs/cancel for real, injection.

The chain: preprocess array (2 shards) -> merge -> train (1 node x 2 CPU ranks, gloo) -> convert array
(one task per checkpoint), every job through submitit and the host-side supervisor; the converted
model must load in transformers.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, hpcmeg_cmd
from cli_helpers import TINY, corpus_shards, hpcmeg, longest_silence, sets, status, timed, wait_states

pytestmark = pytest.mark.slurm

@pytest.fixture(scope="module")
def no_sacct(tmp_path_factory):
    """A real client view of a cluster without accounting: the cluster's own slurm.conf with
    AccountingStorageType=accounting_storage/none, so the real `sacct` answers "Slurm accounting
    storage is disabled" (rc 1) while squeue/scontrol still talk to the same controller."""
    d = tmp_path_factory.mktemp("noacct")
    conf = Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")).read_text().splitlines()
    out = []
    for line in conf:
        if line.startswith("AccountingStorageType="):
            out.append("AccountingStorageType=accounting_storage/none")
        elif line.startswith(("AccountingStorageHost=", "JobAcctGatherType=")):
            continue
        else:
            out.append(line)
    (d / "slurm.conf").write_text("\n".join(out) + "\n")
    env = {"SLURM_CONF": str(d / "slurm.conf")}
    r = subprocess.run(["sacct", "-n", "-j", "1"], capture_output=True, text=True, env={**os.environ, **env})
    assert r.returncode != 0 and "accounting storage is disabled" in (r.stdout + r.stderr).lower()
    return env


SECRET = "s3cr3t-VALUE-7f3a9c"  # given in cluster.env, marked secret
PASSED = "p4ss-THROUGH-51e0b2"  # only in the submitting environment, passed by name


@pytest.mark.slow  # 45-75 s on 2 busy cores; an acceptance test, so it must exist
def test_chain_end_to_end(slurm_cluster, tmp_path, no_sacct):
    """...and, on the same real run: the console never goes 15 s without a line; secret and pass-through
    values reach the job but no file under the run directory (recipes, scripts, checkpoints, logs,
    markers, jobs.json, submitit pickles); every file follows the submitting umask (0o007 here)."""
    corpus_shards(tmp_path)
    run = tmp_path / "runs" / "codeparrot-tiny"
    # the batch shell proves the values arrived, writing only their digests into the run directory
    digest = ['printf %s "$HPCMEG_T_SECRET" | sha256sum > ' + str(run) + '/secret.sha',
              'printf %s "$HPCMEG_T_PASSED" | sha256sum > ' + str(run) + '/passed.sha']
    over = TINY + ["run.output_root=" + str(tmp_path / "runs"), f"data.inputs=[{tmp_path}/shard*.jsonl]",
                   "train.train_iters=10", "checkpoint.save_interval=5", "convert.iterations=all",
                   "cluster.env={OMP_NUM_THREADS: '1', HPCMEG_T_SECRET: " + SECRET + "}",
                   "cluster.secret_env=[HPCMEG_T_SECRET]", "cluster.env_passthrough=[HPCMEG_T_PASSED]",
                   "cluster.setup=" + json.dumps(digest)]
    t0 = time.time()
    rc, lines, err = timed("submit", str(REPO / "recipes" / "codeparrot_tiny.yaml"), "--profile", "local-slurm",
                           *sets(over), "--wait", cwd=tmp_path, env={"HPCMEG_T_PASSED": PASSED}, umask=0o007)
    elapsed = time.time() - t0
    out = "\n".join(t for _, t in lines)
    assert rc == 0, out[-3000:] + err[-3000:]
    gap, after = longest_silence(lines)
    assert gap < 15, f"{gap:.1f} s without a line before {after!r}"
    assert "train: RUNNING on node" in out and "train: iteration 10/10" in out and "| ETA " in out
    assert "preprocess: COMPLETED" in out and "convert: COMPLETED" in out
    assert f"run directory: {run}" in out and "submitted convert" in out
    # the values reached the batch shell (digests match) and are in no file of the run directory
    import hashlib
    import stat

    for name, val in (("secret.sha", SECRET), ("passed.sha", PASSED)):
        assert (run / name).read_text().split()[0] == hashlib.sha256(val.encode()).hexdigest(), name
    files = [p for p in run.rglob("*") if p.is_file() and not p.is_symlink()]
    kinds = {p.suffix for p in files}
    assert {".pt", ".pkl", ".safetensors", ".yaml", ".sbatch", ".sh", ".log", ".json"} <= kinds, kinds
    for p in files:
        data = p.read_bytes()
        assert SECRET.encode() not in data and PASSED.encode() not in data, p
    assert "HPCMEG_T_SECRET" in (run / "recipe.yaml").read_text()  # the name is kept, the value is not
    assert "--export=ALL,HPCMEG_T_PASSED,HPCMEG_T_SECRET" in (run / "scripts" / "train.sbatch").read_text()
    # modes (before the dry run below rewrites the scripts): umask 0o007 -> files 0o660, step scripts
    # 0o770 (nothing forced to 0o600 or 0o755)
    bad = {str(p.relative_to(run)): oct(stat.S_IMODE(p.stat().st_mode)) for p in files
           if stat.S_IMODE(p.stat().st_mode) != (0o770 if p.name.endswith("_step.sh") else 0o660)}
    assert not bad, bad
    st = status(run)
    states = {s: v["state"] for s, v in st["stages"].items()}
    assert states == {"preprocess": "COMPLETED", "merge": "COMPLETED", "train": "COMPLETED",
                      "convert": "COMPLETED"}, (states, elapsed)
    assert len(st["stages"]["preprocess"]["tasks"]) == 2 and len(st["stages"]["convert"]["tasks"]) == 2
    assert "checkpoint iteration 10/10" in st["stages"]["train"]["detail"]
    # every job wrote its markers; the dataset manifest makes a resubmission skip preprocessing
    names = {p.name for p in (run / "markers").iterdir()}
    assert {"preprocess.0.done", "preprocess.1.done", "merge.done", "train.done", "convert.0.done",
            "convert.1.done"} <= names
    dry = hpcmeg("submit", str(REPO / "recipes" / "codeparrot_tiny.yaml"), "--profile", "local-slurm",
                 *sets(over), "--dry-run", cwd=tmp_path)
    assert "preprocess: skipped" in dry.stdout and "nothing submitted" in dry.stdout
    # status without accounting: same answers (squeue/scontrol still know the jobs)
    st2 = status(run, env=no_sacct)
    assert {s: v["state"] for s, v in st2["stages"].items()} == states
    assert all(t["source"] != "sacct" for v in st2["stages"].values() for t in v["tasks"].values())
    # logs: rank 0's metrics by default, rank 1 on request, batch logs with the supervisor's decisions
    logs = hpcmeg("logs", str(run), "--stage", "train", "-n", "200").stdout
    assert "iteration 10/10" in logs and "decision: done" in logs and ".r0.0.log" in logs and ".r0.1.log" not in logs
    assert ".r0.1.log" in hpcmeg("logs", str(run), "--stage", "train", "--rank", "1").stdout
    # the converted checkpoints load in transformers and predict finite logits
    import torch
    from transformers import GPT2LMHeadModel

    for it in (5, 10):
        model = GPT2LMHeadModel.from_pretrained(run / "hf" / f"iter_{it:07d}").eval()
        with torch.no_grad():
            logits = model(torch.tensor([[15496, 995, 198]])).logits
        assert logits.shape == (1, 3, 50304) or logits.shape[:2] == (1, 3)
        assert torch.isfinite(logits).all()
    print(f"chain end to end: {elapsed:.1f} s, longest silence {gap:.1f} s")


def test_cancel_stops_the_whole_chain(slurm_cluster, tmp_path, tiny_dataset):
    over = TINY + ["run.output_root=" + str(tmp_path / "runs"), f"data.data_path=[{tiny_dataset}]",
                   "train.train_iters=100000", "checkpoint.save_interval=0"]
    hpcmeg("submit", str(REPO / "recipes" / "codeparrot_tiny.yaml"), "--profile", "local-slurm", *sets(over),
           cwd=tmp_path)
    run = tmp_path / "runs" / "codeparrot-tiny"
    st = wait_states(run, lambda s: s["stages"]["train"]["state"] == "RUNNING")
    assert st["stages"]["convert"]["state"] == "PENDING"
    # a second submit while the chain is queued is refused
    again = hpcmeg("submit", str(REPO / "recipes" / "codeparrot_tiny.yaml"), "--profile", "local-slurm",
                   *sets(over), cwd=tmp_path, check=False)
    assert again.returncode == 1 and "still has jobs in the queue" in again.stderr
    # Slurm says RUNNING as soon as the batch shell starts; the supervisor's banner follows once its
    # Python is up (seconds on a loaded machine): cancel only after it, so `logs -f` has it to show
    deadline = time.time() + 60
    while not any("===== hpcmeg train" in p.read_text(errors="replace")
                  for p in (run / "logs" / "train").glob("*.batch.log")) and time.time() < deadline:
        time.sleep(0.5)
    follow = subprocess.Popen([*hpcmeg_cmd(), "logs", str(run), "-f", "--stage", "train"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))
    out = hpcmeg("cancel", str(run)).stdout
    assert "cancelled train (job" in out and "convert (job" in out
    st = wait_states(run, lambda s: all(v["state"] in ("CANCELLED", "FAILED", "COMPLETED")
                                        for v in s["stages"].values()), timeout=60)
    assert st["stages"]["train"]["state"] == "CANCELLED" and st["stages"]["convert"]["state"] == "CANCELLED"
    assert st["cancelled"]
    out, _ = follow.communicate(timeout=60)  # `logs -f` ends by itself once the chain has ended
    assert follow.returncode == 0 and "===== hpcmeg train" in out
    # the supervisor saw Slurm end the job and said so
    deadline = time.time() + 20
    while not (run / "markers" / "train.interrupted").exists() and time.time() < deadline:
        time.sleep(0.5)
    assert (run / "markers" / "train.interrupted").exists()


def test_metacharacters_stay_literal_and_the_job_runs(slurm_cluster, tmp_path):
    """Run name, output root, input path and env value with $(...), backticks, ;, quotes (and a newline in
    the env value): the preprocess job runs and sees every value literally; nothing executes."""
    nasty = "r $(touch CANARY1) `touch CANARY2`; 'q\""
    env_val = "v $(touch CANARY3)\n`touch CANARY4`; 'x\""
    src_dir = tmp_path / "in $(touch CANARY5);`x`"
    src_dir.mkdir()
    (src,) = corpus_shards(src_dir, n=1, files=20)
    over = [f"run.name={json.dumps(nasty)}", "run.output_root=" + json.dumps(str(tmp_path / "out ;$(x)")),
            f"data.inputs=[{json.dumps(str(src))}]", "cluster.env={INJ: " + json.dumps(env_val) + "}",
            "cluster.setup=['printf \"INJ=[%s]\\n\" \"$INJ\"']"]
    hpcmeg("submit", str(REPO / "recipes" / "codeparrot_tiny.yaml"), "--profile", "local-slurm", *sets(over),
           "--stages", "preprocess", "--wait", cwd=tmp_path, timeout=200)
    run = tmp_path / "out ;$(x)" / nasty
    st = status(run)
    assert st["stages"]["preprocess"]["state"] == "COMPLETED"
    assert (run / "data" / f"{nasty}_content_document.bin").stat().st_size > 0
    batch = next((run / "logs" / "preprocess").glob("*.batch.log")).read_text()
    assert f"INJ=[{env_val}]" in batch
    assert not list(tmp_path.rglob("CANARY*")) and not list(Path.home().glob("CANARY*"))


def _sacct_state(job: str, timeout=240) -> str:
    end = time.time() + timeout
    while time.time() < end:
        if not subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
            rows = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "State"], capture_output=True,
                                  text=True).stdout.split()
            if rows and all(x.split()[0] not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING") for x in rows):
                return " ".join(rows)
        time.sleep(0.5)
    raise AssertionError(f"job {job} did not end in {timeout} s")


@pytest.mark.slow  # 45-75 s on 2 busy cores; an acceptance test, so it must exist
def test_plain_sbatch_scripts_train_requeue_and_convert(slurm_cluster, tmp_path, tiny_dataset):
    """slurm/train.sh + slurm/convert.sh driven by hand: the lead signal makes train.sh requeue itself
    (same job id), the restart resumes and finishes, then the convert array converts every checkpoint."""
    over = TINY + ["run.output_root=" + str(tmp_path), f"data.data_path=[{tiny_dataset}]", "train.train_iters=12",
                   "checkpoint.save_interval=4", "checkpoint.keep_last=null"]
    hpcmeg("submit", str(REPO / "recipes" / "codeparrot_tiny.yaml"), "--profile", "local-slurm", *sets(over),
           "--dry-run", cwd=tmp_path)  # writes <run>/recipe.yaml with absolute paths
    run = tmp_path / "codeparrot-tiny"
    env = dict(os.environ, PYTHONPATH=str(REPO), HPCMEG=f"{sys.executable} -m hpcmeg.cli")
    sb = ["sbatch", "--parsable", "--cpus-per-task=1", "--time=10", "--partition=debug"]
    train = subprocess.run([*sb, "--ntasks-per-node=2", f"--output={tmp_path}/train-%j.out",
                            f"--export=ALL,RECIPE={run / 'recipe.yaml'},MAX_REQUEUES=2",
                            str(REPO / "slurm" / "train.sh")], env=env, capture_output=True, text=True, check=True)
    job = train.stdout.strip().split(";")[0]
    conv = subprocess.run([*sb, "--array=0-3", f"--dependency=afterok:{job}", "--kill-on-invalid-dep=yes",
                           f"--output={tmp_path}/convert-%A_%a.out",
                           f"--export=ALL,CKPT_DIR={run / 'checkpoints'},OUT_DIR={run / 'hf'},ITERATIONS=all",
                           str(REPO / "slurm" / "convert.sh")], env=env, capture_output=True, text=True, check=True)
    from hpcmeg.megatron.names import latest_iteration

    end = time.time() + 180
    while (latest_iteration(run / "checkpoints") or 0) < 4:
        assert time.time() < end, (tmp_path / f"train-{job}.out").read_text()
        time.sleep(0.25)
    subprocess.run(["scancel", "--signal=TERM", job], check=True)  # the time-limit lead signal, to the ranks
    assert _sacct_state(job) == "COMPLETED", (tmp_path / f"train-{job}.out").read_text()
    out = (tmp_path / f"train-{job}.out").read_text()
    assert "requeueing job" in out and out.count("restart 1:") == 1 and "finished" in out
    assert (run / "logs" / "train" / f"train.{job}.r1.1.log").exists()
    assert _sacct_state(conv.stdout.strip().split(";")[0]) == "COMPLETED COMPLETED COMPLETED COMPLETED"
    its = sorted(p.name for p in (run / "hf").iterdir())
    assert its[-1] == "iter_0000012" and len(its) >= 3 and all((run / "hf" / i / "config.json").exists() for i in its)
