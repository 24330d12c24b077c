"""hpcmeg.checkpoint.saved_layout on real checkpoints: the layout written by the trainer's save and by
`hpcmeg reshard` (tensor, pipeline and virtual-pipeline chunks), the same sizes from the mp_rank_*
names alone when there is no hpcmeg manifest (a Megatron-LM checkpoint), iterations newer than the
tracker ignored, without a tracker the newest iteration (as the loader does), no layout where there
is no checkpoint, and a garbled tracker named."""
from __future__ import annotations

import os
import shutil

import pytest

from hpcmeg.checkpoint.saved_layout import SavedLayout, saved_layout
from hpcmeg.cli import main as hpcmeg_main
from hpcmeg.megatron.names import MANIFEST_FILENAME, TRACKER_FILENAME
from helpers import make_run


def test_layouts_of_trainer_and_reshard_checkpoints(tmp_path):
    src = str(tmp_path / "ckpt")
    make_run(src, iterations=(10, 20))
    assert saved_layout(src) == SavedLayout(src, 20, 1, 1, 1)

    out = str(tmp_path / "tp2-pp2-vpp2")
    assert hpcmeg_main(["reshard", src, out, "--tp", "2", "--pp", "2", "--vpp", "2"]) == 0
    assert saved_layout(out) == SavedLayout(out, 20, 2, 2, 2)
    # without hpcmeg's manifest, as Megatron-LM writes it: the sizes from the shard directory names
    os.remove(os.path.join(out, "iter_0000020", MANIFEST_FILENAME))
    assert saved_layout(out) == SavedLayout(out, 20, 2, 2, 2)

    # an iteration newer than the tracker is an interrupted save's: the tracker's iteration is read
    shutil.copytree(os.path.join(out, "iter_0000020"), os.path.join(src, "iter_0000030"))
    assert saved_layout(src) == SavedLayout(src, 20, 1, 1, 1)


def test_without_a_tracker_and_without_a_checkpoint(tmp_path):
    assert saved_layout(str(tmp_path / "absent")) is None
    assert saved_layout(str(tmp_path)) is None  # empty
    ck = str(tmp_path / "ck")
    make_run(ck, iterations=(5,))
    os.remove(os.path.join(ck, TRACKER_FILENAME))  # the loader then takes the newest iteration directory
    assert saved_layout(ck) == SavedLayout(ck, 5, 1, 1, 1)
    shutil.rmtree(os.path.join(ck, "iter_0000005"))
    assert saved_layout(ck) is None
    (tmp_path / "ck" / TRACKER_FILENAME).write_text("five\n")
    with pytest.raises(ValueError, match=f"{TRACKER_FILENAME}: expected an iteration number"):
        saved_layout(str(tmp_path / "ck"))
