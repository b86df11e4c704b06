"""``matmul``: the batch-invariant products against numpy's ``@`` (OpenBLAS), one thread each.

Forward ``x @ w`` (the target), the input's gradient ``dz @ w.T`` and the weight's gradient
``x.T @ dz`` (``outer_sum``, the canonical tree over samples), from 8x64x64 to 2048x1024x1024
(rows x inputs x outputs). Measured in one worker process with ``OPENBLAS_NUM_THREADS=1``, the
contenders alternated within every round; ratios are medians over rounds of the ratio within a
round. The worker also checks the batch invariance it pays for: each size's rows alone equal
the rows of the whole call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET = 1.3
SIZES = [(8, 64, 64), (64, 256, 256), (256, 1024, 1024), (2048, 1024, 1024), (8, 1024, 1024), (2048, 784, 64)]
#: The issue's range: the target holds from the first to the last of these (rows x inputs x outputs).
TARGET_SIZES = [(8, 64, 64), (64, 256, 256), (256, 1024, 1024), (2048, 1024, 1024)]


def run(quick: bool) -> dict[str, object]:
    rounds = 5 if quick else 15
    out = subprocess.run([sys.executable, "-m", "bench.matmul_worker", str(rounds)], capture_output=True,
                         text=True, timeout=1800, cwd=REPO,
                         env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})
    if out.returncode != 0:
        raise RuntimeError(f"matmul_worker failed:\n{out.stderr[-3000:]}")
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    worst = max(r["ratio"]["forward"] for r in rows if tuple(r["shape"]) in TARGET_SIZES)
    return {
        "rows": rows,
        "rounds": rounds,
        "target": {"what": "batch-invariant matmul / x @ w, worst of 8x64x64 .. 2048x1024x1024",
                   "limit": TARGET, "value": worst, "holds": worst <= TARGET},
    }
