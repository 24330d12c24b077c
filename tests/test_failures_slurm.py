"""A job that fails for a reason of its own, on the local Slurm cluster: the console (`submit --wait`)
and `hpcmeg status` name the failing rank's log and its own one-line cause, status exits 1 and points
to `hpcmeg logs`, the batch log holds one line and no submitit traceback, and `hpcmeg cancel` on the
ended chain cancels nothing."""
from __future__ import annotations

import json
import re

import pytest

from conftest import REPO
from cli_helpers import TINY, hpcmeg, longest_silence, sets, timed

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def other_model_checkpoint(tmp_path_factory):
    """A 'release' checkpoint of a 1-layer model (TINY trains 2 layers): a checkpoint/recipe mismatch."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from hpcmeg.convert.import_hf import import_hf

    tmp = tmp_path_factory.mktemp("othermodel")
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, n_positions=64, vocab_size=50257)).save_pretrained(
        tmp / "hf")
    import_hf(str(tmp / "hf"), str(tmp / "ck"), 1, 1, 128)
    return tmp / "ck"


def test_failed_train_is_surfaced_in_one_line(slurm_cluster, tmp_path, tiny_dataset, other_model_checkpoint):
    over = TINY + ["run.output_root=" + str(tmp_path), f"data.data_path=[{tiny_dataset}]", "train.train_iters=10",
                   f"checkpoint.load={other_model_checkpoint}"]
    rc, lines, err = timed("submit", str(REPO / "recipes" / "codeparrot_tiny.yaml"), "--profile", "local-slurm",
                           *sets(over), "--stages", "train,convert", "--wait", cwd=tmp_path, timeout=300)
    run = tmp_path / "codeparrot-tiny"
    out = "\n".join(t for _, t in lines)
    err_lines = err.strip().splitlines()
    assert rc == 1, out[-3000:] + err
    # exactly one line on stderr, the last: stage, rank, the rank's own cause, its log, where to look
    assert len(err_lines) == 1, err
    line = err_lines[0]
    assert line.startswith("hpcmeg submit: train FAILED: ") and "rank 0: hpcmeg train" in line, line
    assert "the checkpoint's model differs from the recipe's" in line and "num_layers: checkpoint 1 vs recipe 2" in line
    m = re.search(r"\(log: (logs/train/train\.\d+\.r0\.0\.log)\)", line)
    assert m and (run / m.group(1)).is_file(), line
    assert f"more: hpcmeg logs {run} --stage train" in line
    assert "see the rank logs" not in line and "Traceback" not in err
    # seen running, or (when it failed within one Slurm poll) where and how long it ran
    assert re.search(r"train: (RUNNING on node\d|FAILED on node\d after )", out) and "train: FAILED" in out, out
    gap, after = longest_silence(lines)
    assert gap < 15, f"{gap:.1f} s without a line before {after!r}"
    # the batch log: the supervisor's one-line verdict, no submitit traceback
    batch = next((run / "logs" / "train").glob("train.*.batch.log")).read_text()
    assert "Traceback" not in batch and "submitit ERROR" not in batch and "triggered an exception" not in batch
    verdict = [ln for ln in batch.splitlines() if ln.startswith("[hpcmeg supervisor] train failed:")]
    assert len(verdict) == 1 and "num_layers: checkpoint 1 vs recipe 2" in verdict[0]
    # status: exit 1, the same cause, a pointer to `hpcmeg logs`
    st = hpcmeg("status", str(run), check=False)
    assert st.returncode == 1 and "FAILED" in st.stdout
    (sline,) = st.stderr.strip().splitlines()
    assert sline.startswith("hpcmeg status: train FAILED: ") and "num_layers: checkpoint 1 vs recipe 2" in sline
    assert f"hpcmeg logs {run} --stage train" in sline
    assert hpcmeg("status", str(run), "--json", check=False).returncode == 1
    # cancel on the ended chain: nothing to cancel, the final states listed, the run not marked cancelled
    c = hpcmeg("cancel", str(run))
    assert c.stdout.startswith("nothing to cancel") and "train FAILED" in c.stdout and "convert CANCELLED" in c.stdout
    assert "cancelled_at" not in json.loads((run / "jobs.json").read_text())
