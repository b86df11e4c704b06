"""``scaling``: samples/s with 1 and 2 instances at the same global batch, one BLAS thread each,
and 1 instance x 2 local replicas (threads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parent.parent
ONE_THREAD = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
TARGET = 1.7


def _throughput(command: list[str]) -> dict[str, float]:
    env = {**os.environ, **ONE_THREAD}
    out = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{out.stderr[-3000:]}")
    line = [ln for ln in out.stdout.splitlines() if "samples_per_s" in ln][-1]
    return json.loads(line[line.index("{"):])


def run(quick: bool) -> dict[str, object]:
    batch, steps = "1024", "3" if quick else "8"
    worker = [sys.executable, "-m", "bench.scaling_worker", batch, steps]
    rounds = 1 if quick else 3
    runs: dict[str, list[dict[str, float]]] = {"1_instance": [], "2_instances": [], "1_instance_2_replicas": []}
    for _ in range(rounds):  # interleaved, medians below
        runs["1_instance"].append(_throughput([*worker, "--replication", "1"]))
        runs["2_instances"].append(_throughput([str(BIN / "poprun"), "--num-instances", "2", *worker]))
        runs["1_instance_2_replicas"].append(_throughput([*worker, "--replication", "2"]))
    median = {name: sorted(r["samples_per_s"] for r in rs)[len(rs) // 2] for name, rs in runs.items()}
    speedup = median["2_instances"] / median["1_instance"]
    return {
        "model": "MLP 1024-1024-1024-16, float32, global batch 1024, one BLAS thread per process",
        "samples_per_s": median,
        "speedup_2_instances": speedup,
        "speedup_1_instance_2_replicas": median["1_instance_2_replicas"] / median["1_instance"],
        "target": {"what": "2 instances / 1 instance samples/s", "limit": TARGET, "value": speedup,
                   "holds": speedup >= TARGET},
    }
