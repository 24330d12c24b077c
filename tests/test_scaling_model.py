"""bench/scaling_model.py: the byte counts agree with docs/parallelism.md's table, and the step time
is its parts: compute alone when no bytes move, the bubble only with a pipeline, the reduction hidden
behind the backward on NVLink but not across nodes for 1.3B."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import scaling_model as sm  # noqa: E402


def test_bytes_match_the_docs_table_and_the_parts_add_up():
    dp8 = sm.predict(sm.SIZES["124M"], 8, 1, 1)
    assert dp8["dp_bytes"] / 1e9 == pytest.approx(0.87, abs=0.005)  # docs: DP8 fp32 all-reduce, 124M
    zero = sm.predict(sm.SIZES["124M"], 8, 1, 1, distributed_optimizer=True)
    assert zero["dp_bytes"] / 1e9 == pytest.approx(0.65, abs=0.005)
    for r in (dp8, sm.predict(sm.SIZES["1.3B"], 16, 2, 2)):
        assert r["step_s"] == pytest.approx(r["compute_s"] + r["bubble_s"] + r["dp_exposed_s"] + r["tp_s"] + r["pp_s"])
    assert dp8["bubble_s"] == 0 and dp8["tp_s"] == 0
    assert sm.predict(sm.SIZES["124M"], 8, 1, 2)["bubble_s"] > 0
    one_node, two = sm.predict(sm.SIZES["1.3B"], 8, 1, 1), sm.predict(sm.SIZES["1.3B"], 16, 1, 1)
    assert one_node["dp_exposed_s"] < 0.1 * one_node["dp_s"] < two["dp_exposed_s"]
    assert sm.predict(sm.SIZES["1.3B"], 8, 1, 1, compute_s=1.0)["compute_s"] == 1.0
    assert "| 2.7B | 32 | TP2 x PP2 x DP8 |" in sm.table(["2.7B"], [4])
