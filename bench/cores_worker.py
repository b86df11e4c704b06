"""In one process: the engine's collectives over L local replicas, their local work on one thread
against on several, batches alternating; prints one JSON line ``{L: {op: {threads: seconds}}}``.

    cores_worker.py THREADS BYTES L [L ...]
    cores_worker.py steps L [L ...]
    cores_worker.py cut THREADS L BYTES [BYTES ...]

BYTES per replica (float32). ``Runtime(threads=1)`` leaves the combining replica to do the local
work alone; ``Runtime(threads=THREADS)`` cuts it into slices on THREADS threads. Each time is the
median over batches of the mean call. Beside them, under ``"memory"``, the host's own limit:
plain ``np.add`` of two such arrays into a third, whole on one thread against split in equal
parts over THREADS threads (fresh outputs, as a collective's result is). ``steps``: instead, the
median time of a Trainer step on a negligible model under each executor, ``{executor: {L: s}}``.
``cut``: the all-reduce of L local replicas at each size, on one thread against cut over THREADS
threads at every size (``POPDIST_ENGINE_SLICE_BYTES`` lowered to 64 KiB), ``{BYTES: {threads: s}}``:
where cutting starts to pay on this host.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise

import numpy as np

from popcontract.environment import ENGINE_SLICE_BYTES
from popdist_py.engine import Runtime, StepContext, ops

BATCHES = 15
#: ``cut``'s slice size: every size measured is cut over all the threads
CUT_EVERYWHERE = 64 << 10
ITERATIONS = 4
OPS: dict[str, Callable[[np.ndarray], object]] = {
    "allreduce": lambda x: ops.replicated_all_reduce(x, op="add"),
    "reduce_scatter": lambda x: ops.replicated_reduce_scatter(x, op="add"),
    "allgather": lambda x: ops.replicated_all_gather(x),
}


def batch(rt: Runtime, call: Callable[[np.ndarray], object], data: np.ndarray) -> Callable[[], None]:
    def step(ctx: StepContext, x: np.ndarray) -> None:
        for _ in range(ITERATIONS):
            call(x)

    return lambda: rt.run(step, data)


def measure(threads: int, nbytes: int, local: int, ops_: tuple[str, ...] = tuple(OPS)) -> dict[str, dict[str, float]]:
    data = np.random.default_rng(local).standard_normal((local, nbytes // 4), dtype=np.float32)
    runtimes = {"1": Runtime(local, threads=1), str(threads): Runtime(local, threads=threads)}
    result: dict[str, dict[str, float]] = {}
    try:
        for op in ops_:
            call = OPS[op]
            batches = {name: batch(rt, call, data) for name, rt in runtimes.items()}
            for run in batches.values():  # warm-up: plans, pool threads
                run()
            means: dict[str, list[float]] = {name: [] for name in batches}
            for _ in range(BATCHES):
                for name, run in batches.items():
                    start = time.perf_counter()
                    run()
                    means[name].append((time.perf_counter() - start) / ITERATIONS)
            result[op] = {name: float(np.median(m)) for name, m in means.items()}
    finally:
        for rt in runtimes.values():
            rt.close()
    return result


def memory_limit(threads: int, nbytes: int) -> dict[str, float]:
    """Seconds of ``np.add`` into a fresh array, on one thread and split over ``threads``."""
    n = nbytes // 4
    a, b = np.ones(n, np.float32), np.ones(n, np.float32)
    cuts = [n * i // threads for i in range(threads + 1)]
    with ThreadPoolExecutor(threads - 1 or 1) as pool:
        def split() -> None:
            out = np.empty(n, np.float32)
            futures = [pool.submit(np.add, a[lo:hi], b[lo:hi], out=out[lo:hi]) for lo, hi in pairwise(cuts[1:])]
            np.add(a[: cuts[1]], b[: cuts[1]], out=out[: cuts[1]])
            for f in futures:
                f.result()

        calls = {"1": lambda: np.add(a, b, out=np.empty(n, np.float32)), str(threads): split}
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(BATCHES * ITERATIONS):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}


def step_times(locals_: list[int], steps: int = 200) -> dict[str, dict[str, float]]:
    """Seconds of a Trainer step on a negligible model (an 8 x 8 weight, SGD), per executor and L:
    the engine's own time per step, which the GIL serializes across local replicas."""
    from popdist_py.engine import Trainer, TrainingOptions
    from popdist_py.engine.optimizers import SGD

    width = 8

    def loss_and_grads(p: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray
                       ) -> tuple[np.float32, dict[str, np.ndarray]]:
        return np.float32(0.0), {"w": p["w"] * 0 + x[0, 0]}

    result: dict[str, dict[str, float]] = {}
    for executor in ("threads", "cooperative"):
        result[executor] = {}
        for L in locals_:
            x, y = np.ones((L, 4, width), np.float32), np.zeros((L, 4), np.int64)
            with Runtime(L, executor=executor if L > 1 else None) as rt, Trainer(
                    rt, {"w": np.ones((width, width), np.float32)}, loss_and_grads, SGD(0.01),
                    [x.shape[1:], y.shape[1:]], TrainingOptions(reduction="mean")) as trainer:
                for _ in range(20):
                    trainer.step(x, y)
                seconds = []
                for _ in range(steps):
                    start = time.perf_counter()
                    trainer.step(x, y)
                    seconds.append(time.perf_counter() - start)
            result[executor][str(L)] = float(np.median(seconds))
    return result


def cut(threads: int, local: int, sizes: list[int]) -> dict[str, dict[str, float]]:
    """The all-reduce at each size per replica, one thread against cut over ``threads`` at every size."""
    os.environ[ENGINE_SLICE_BYTES] = str(CUT_EVERYWHERE)
    return {str(nbytes): measure(threads, nbytes, local, ("allreduce",))["allreduce"] for nbytes in sizes}


def main() -> None:
    if sys.argv[1] == "steps":
        print(json.dumps(step_times([int(a) for a in sys.argv[2:]])), flush=True)
        return
    if sys.argv[1] == "cut":
        threads, local, sizes = int(sys.argv[2]), int(sys.argv[3]), [int(a) for a in sys.argv[4:]]
        print(json.dumps(cut(threads, local, sizes)), flush=True)
        return
    threads, nbytes, locals_ = int(sys.argv[1]), int(sys.argv[2]), [int(a) for a in sys.argv[3:]]
    result: dict[str, object] = {str(local): measure(threads, nbytes, local) for local in locals_}
    result["memory"] = memory_limit(threads, nbytes)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
