"""The ``matmul`` section's measurements (bench/matmul.py starts it with one BLAS thread)."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from bench.matmul import SIZES
from popdist_py.engine.batch_invariant import matmul, outer_sum

#: Each timing repeats its call for about this long, so small sizes are not lost in the clock.
SPAN = 0.02


def seconds(call: Callable[[], object], reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        call()
    return (time.perf_counter() - start) / reps


def measure(m: int, k: int, n: int, rounds: int) -> dict[str, object]:
    rng = np.random.default_rng([m, k, n])
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    dz = rng.standard_normal((m, n)).astype(np.float32)
    alone = np.concatenate([matmul(x[i:i + 1], w) for i in range(min(m, 64))])
    invariant = bool(np.array_equal(matmul(x, w)[:len(alone)], alone))
    pairs = {"forward": (lambda: x @ w, lambda: matmul(x, w)),
             "input_grad": (lambda: dz @ w.T, lambda: matmul(dz, w.T)),
             "weight_grad": (lambda: x.T @ dz, lambda: outer_sum(x, dz))}
    times: dict[str, dict[str, list[float]]] = {name: {"blas": [], "invariant": []} for name in pairs}
    reps = {name: max(1, int(SPAN / min(seconds(f, 1) for f in fs))) for name, fs in pairs.items()}
    for _ in range(rounds):
        for name, (blas, ours) in pairs.items():
            times[name]["blas"].append(seconds(blas, reps[name]))
            times[name]["invariant"].append(seconds(ours, reps[name]))
    return {
        "shape": [m, k, n],
        "seconds": {name: {who: statistics.median(v) for who, v in t.items()} for name, t in times.items()},
        "ratio": {name: statistics.median(a / b for a, b in zip(t["invariant"], t["blas"], strict=True))
                  for name, t in times.items()},
        "rows_alone_equal_the_call": invariant,
    }


if __name__ == "__main__":
    rounds = int(sys.argv[1])
    print(json.dumps([measure(m, k, n, rounds) for m, k, n in SIZES]))
