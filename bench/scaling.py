"""``scaling``: samples/s with 1 and 2 instances at the same global batch, one BLAS thread each,
and 1 instance x 2 local replicas (threads).

Measured at two global batches. The target is checked at the larger one (1024 samples per
instance), the compute-bound configuration. At the smaller one, each step's unsplittable work
(every replica updates all its weights, and the gradients are all-reduced) weighs twice as much
against the split compute. It is reported beside it, so the cost of a small per-instance batch
is visible.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parent.parent
ONE_THREAD = dict.fromkeys(("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"), "1")
TARGET = 1.7
GLOBAL_BATCH = 2048
SMALL_BATCH = 1024


def throughput(command: list[str], one_blas_thread: bool = True) -> float:
    """The samples/s a training worker run by ``command`` prints, one BLAS thread per process
    (else as many as poprun gives each instance: its cores)."""
    env = {**os.environ, **ONE_THREAD} if one_blas_thread else {
        name: value for name, value in os.environ.items() if name not in ONE_THREAD}
    out = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{out.stderr[-3000:]}")
    line = [ln for ln in out.stdout.splitlines() if "samples_per_s" in ln][-1]
    return float(json.loads(line[line.index("{"):])["samples_per_s"])


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def run(quick: bool) -> dict[str, object]:
    steps = "3" if quick else "9"
    rounds = 1 if quick else 3

    def worker(batch: int) -> list[str]:
        return [sys.executable, "-m", "bench.scaling_worker", str(batch), steps]

    poprun2 = [str(BIN / "poprun"), "--num-instances", "2"]
    configs = {
        "1_instance": [*worker(GLOBAL_BATCH), "--replication", "1"],
        "2_instances": [*poprun2, *worker(GLOBAL_BATCH)],
        "1_instance_2_replicas": [*worker(GLOBAL_BATCH), "--replication", "2"],
        "small_batch_1_instance": [*worker(SMALL_BATCH), "--replication", "1"],
        "small_batch_2_instances": [*poprun2, *worker(SMALL_BATCH)],
    }
    runs: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(rounds):  # interleaved, medians below
        for name, command in configs.items():
            runs[name].append(throughput(command))
    median = {name: _median(values) for name, values in runs.items()}
    speedup = median["2_instances"] / median["1_instance"]
    small = {"1_instance": median.pop("small_batch_1_instance"), "2_instances": median.pop("small_batch_2_instances")}
    return {
        "model": f"MLP 1024-1024-1024-16, float32, global batch {GLOBAL_BATCH}, one BLAS thread per process",
        "global_batch": GLOBAL_BATCH,
        "samples_per_s": median,
        "speedup_2_instances": speedup,
        "speedup_1_instance_2_replicas": median["1_instance_2_replicas"] / median["1_instance"],
        "small_batch": {"global_batch": SMALL_BATCH, "samples_per_s": small,
                        "speedup_2_instances": small["2_instances"] / small["1_instance"]},
        "target": {"what": f"2 instances / 1 instance samples/s (global batch {GLOBAL_BATCH})", "limit": TARGET,
                   "value": speedup, "holds": speedup >= TARGET},
    }
