"""``horovod``: Horovod's PyTorch API (``popdist_py.horovod.torch``) against what a Horovod user
would otherwise run, 2 instances under poprun, each pair side by side in the same processes
(``bench.horovod_worker``), so the machine's drift hits both alike.

- ``training``: a step of ``hvd.DistributedOptimizer`` against torch DistributedDataParallel
  (gloo) on the same MLP, batches, SGD with momentum and processes, steps alternating; the two
  end with the same parameters (checked), so the step times compare like for like. The ratio is
  the median over rounds of Horovod's step over DDP's of the same round.
- ``allreduce``: ``hvd.allreduce`` (Sum, float32, synchronous) against mpi4py's ``Allreduce`` on
  numpy arrays, per size, batches alternating; ``hvd.allreduce_`` (in place) beside them, which
  separates the new tensor's cost from the rest of Horovod's.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.collectives import worker_times

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parent.parent
WORKER = ["-m", "bench.horovod_worker"]
#: 1 KiB to 64 MiB in powers of 4; quick: three of them.
SIZES = [1 << 10 << 2 * k for k in range(9)]
QUICK_SIZES = [1 << 10, 1 << 20, 16 << 20]
#: (warm-up steps, timed rounds) of the training comparison.
STEPS, QUICK_STEPS = (5, 40), (3, 10)
#: Targets: DistributedOptimizer's step at most DDP's; hvd.allreduce within 1.1x mpi4py's from 1 MiB up.
TRAINING_LIMIT = 1.0
ALLREDUCE_LIMIT, ALLREDUCE_FROM = 1.1, 1 << 20
MiB = 1 << 20


def _job(*args: str) -> list[str]:
    return [str(BIN / "poprun"), "--num-instances", "2", sys.executable, *WORKER, *args]


def training(warmup: int, steps: int) -> dict[str, Any]:
    """Step seconds of both (medians), the median per-round ratio, and how far their parameters ended apart."""
    out = subprocess.run(_job("training", str(warmup), str(steps)), capture_output=True, text=True, timeout=900,
                         cwd=REPO)
    if out.returncode != 0:
        raise RuntimeError(f"the horovod training worker failed ({out.returncode}):\n{out.stderr[-3000:]}")
    line = [ln for ln in out.stdout.splitlines() if "{" in ln][-1]
    raw: dict[str, Any] = json.loads(line[line.index("{"):])
    seconds = raw.pop("seconds")
    ratios = [h / d for h, d in zip(seconds["horovod"], seconds["ddp"], strict=True)]
    return {**raw, "seconds": {name: statistics.median(values) for name, values in seconds.items()},
            "ratio": statistics.median(ratios), "rounds": steps, "warmup": warmup}


def allreduce(sizes: list[int]) -> list[dict[str, Any]]:
    times = worker_times(_job("allreduce", *map(str, sizes)))
    return [{"bytes": size, **times[size], "ratio": times[size]["horovod"] / times[size]["mpi4py"],
             "in_place_ratio": times[size]["horovod_in_place"] / times[size]["mpi4py"]} for size in sizes]


def run(quick: bool, sizes: list[int] | None = None, steps: tuple[int, int] | None = None) -> dict[str, object]:
    """``sizes`` and ``steps`` (warm-up, rounds) override the defaults (the tests' small runs)."""
    trained = training(*(steps or (QUICK_STEPS if quick else STEPS)))
    rows = allreduce(sizes or (QUICK_SIZES if quick else SIZES))
    targets = [{"what": "horovod: DistributedOptimizer step / torch DDP (gloo) step, 2 processes",
                "limit": TRAINING_LIMIT, "value": trained["ratio"], "holds": trained["ratio"] <= TRAINING_LIMIT}]
    targets += [{"what": f"horovod: hvd.allreduce {row['bytes'] // MiB} MiB / mpi4py Allreduce, 2 ranks",
                 "limit": ALLREDUCE_LIMIT, "value": row["ratio"], "holds": row["ratio"] <= ALLREDUCE_LIMIT}
                for row in rows if row["bytes"] >= ALLREDUCE_FROM]
    return {"training": trained, "allreduce": rows, "targets": targets}
