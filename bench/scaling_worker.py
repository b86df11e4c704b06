"""Data-parallel MLP training throughput on the engine: prints samples/s from instance 0.

    scaling_worker.py GLOBAL_BATCH STEPS [--replication N]

A compute-bound MLP (1024-wide layers, float32, batch-invariant: ``batch_invariant.matmul`` and
``outer_sum``): forward, backward, one fused all-reduce (mean) of all gradients, SGD. The global
batch is the same whatever the split. Throughput is the global batch over the median step time.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from popdist_py.engine import Runtime, StepContext, canonical_sum, ops
from popdist_py.engine.batch_invariant import matmul, outer_sum

WIDTH, LAYERS, CLASSES = 1024, 2, 16


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("global_batch", type=int)
    parser.add_argument("steps", type=int)
    parser.add_argument("--replication", type=int, default=None)
    args = parser.parse_args()
    rt = Runtime(replication=args.replication) if args.replication else Runtime()
    local, total = rt.instance_replication_factor, rt.replication_factor
    per_replica = args.global_batch // total
    rng = np.random.default_rng(0)
    shapes = [(WIDTH, WIDTH)] * LAYERS + [(WIDTH, CLASSES)]
    weights = [rt.variable((rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32)) for s in shapes]
    x_all = rng.standard_normal((total, per_replica, WIDTH)).astype(np.float32)
    y_all = rng.integers(0, CLASSES, (total, per_replica))
    offset = rt.replica_index_offset
    x, y = x_all[offset:offset + local], y_all[offset:offset + local]
    sizes = [int(np.prod(s)) for s in shapes]

    def step(ctx: StepContext, xb: np.ndarray, yb: np.ndarray) -> None:
        acts, h = [xb], xb
        ws = [ctx[w] for w in weights]
        for w in ws[:-1]:
            h = np.maximum(matmul(h, w), 0)
            acts.append(h)
        logits = matmul(h, ws[-1])
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= canonical_sum(p, axis=1)[:, None]
        p[np.arange(len(yb)), yb] -= 1
        grad = p / len(yb)
        grads = []
        for i in range(len(ws) - 1, -1, -1):
            grads.append(outer_sum(acts[i], grad))
            if i:
                grad = matmul(grad, ws[i].T) * (acts[i] > 0)
        flat = np.concatenate([g.ravel() for g in reversed(grads)])
        mean = ops.replicated_all_reduce(flat, op="mean")
        start = 0
        for weight, value, n, shape in zip(weights, ws, sizes, shapes, strict=True):
            ctx[weight] = value - 0.01 * mean[start:start + n].reshape(shape)
            start += n

    rt.run(step, x, y)  # warm-up
    seconds = []
    for _ in range(args.steps):
        start = time.perf_counter()
        rt.run(step, x, y)
        seconds.append(time.perf_counter() - start)
    # The median step: one step slowed by a burst of the machine's noise does not move it.
    step_seconds = float(np.median(seconds))
    if rt.replica_index_offset == 0:
        print(json.dumps({"samples_per_s": args.global_batch / step_seconds, "step_seconds": step_seconds,
                          "replicas": total, "local_replicas": local}), flush=True)
    rt.close()


if __name__ == "__main__":
    main()
