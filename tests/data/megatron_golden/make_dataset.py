"""Deterministic tiny indexed datasets for the Megatron parity tests (rebuilt by the tests themselves).

`make_dataset(prefix, which)` writes `<prefix>.bin/.idx` with hpcmeg's IndexedDatasetBuilder:
- "A": 600 documents, one sequence each, uint16 tokens (GPT-2 sized vocab), EOD 50256 at each end;
- "B": 150 documents of 1-4 sequences each (sentence-split style), int32 tokens (vocab 70,000).
Token values and lengths come from numpy RandomState, so the files are identical on every machine.
"""

import numpy as np

from hpcmeg.data.indexed import IndexedDatasetBuilder

EOD = 50256


def make_dataset(prefix: str, which: str) -> str:
    if which == "A":
        rs = np.random.RandomState(7)
        builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
        for _ in range(600):
            n = int(min(400, 1 + rs.lognormal(4.0, 1.0)))
            toks = np.append(rs.randint(0, EOD, size=n - 1), EOD) if n > 1 else np.array([EOD])
            builder.add_document(toks, [n])
    elif which == "B":
        rs = np.random.RandomState(8)
        builder = IndexedDatasetBuilder(prefix + ".bin", np.int32)
        for _ in range(150):
            lengths = [int(v) for v in rs.randint(1, 120, size=rs.randint(1, 5))]
            builder.add_document(rs.randint(0, 70000, size=sum(lengths)), lengths)
    else:
        raise ValueError(which)
    builder.finalize(prefix + ".idx")
    return prefix
