"""Deterministic pseudo-training on popdist_py.engine; prints a hash of the final weights.

The hash must be the same for every split of the same number of replicas into instances:

    python tests/scripts/engine_train.py --replicas 4                  # 1 instance x 4 replicas
    mpiexec -n 2 python tests/scripts/engine_train.py --replicas 4 --world
    poprun --num-instances 4 --num-replicas 4 python tests/scripts/engine_train.py

Without ``--replicas`` the replication comes from poprun's environment (``Runtime()``). Every
instance prints ``weights-sha256 <hex> replicas=R instances=I steps=S executor=E``.

A linear model ``y = x @ W + b`` (float32) trained with SGD + momentum: W's gradient (40 KiB)
takes the bulk path of the all-reduce, b's the small one; a ZeRO-like reduce-scatter/all-gather
pair, a grouped all-reduce and a per-replica variable with ``all_replicas`` retrieval feed the
hash too, so every collective kind is covered.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from popdist_py.engine import Runtime, ops
from popdist_py.engine.batch_invariant import matmul, outer_sum

FEATURES, OUTPUTS, BATCH = 64, 160, 8


def batch(step: int, replicas: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of a step: (R, BATCH, FEATURES) inputs and (R, BATCH, OUTPUTS) targets."""
    rng = np.random.default_rng([seed, step])
    x = rng.standard_normal((replicas, BATCH, FEATURES)).astype(np.float32)
    w_true = np.random.default_rng(seed).standard_normal((FEATURES, OUTPUTS)).astype(np.float32)
    # not x @ w_true: OpenBLAS's bits change with its thread count, which differs between hosts
    y = (matmul(x, w_true) + 0.1 * rng.standard_normal((replicas, BATCH, OUTPUTS))).astype(np.float32)
    return x, y


def train(rt: Runtime, steps: int = 5, seed: int = 0, lr: float = 0.01) -> dict[str, np.ndarray]:
    R, L, off = rt.replication_factor, rt.instance_replication_factor, rt.replica_index_offset
    rng = np.random.default_rng(seed + 1)
    w = rt.variable(0.01 * rng.standard_normal((FEATURES, OUTPUTS)).astype(np.float32), name="W")
    b = rt.variable(np.zeros(OUTPUTS, np.float32), name="b")
    mw = rt.variable(np.zeros((FEATURES, OUTPUTS), np.float32), name="W_momentum")
    seen = rt.variable(np.zeros(1, np.float32), name="seen_loss", retrieval_mode="all_replicas")
    halves = rt.replica_grouping(group_size=max(R // 2, 1))
    lr32, beta = np.float32(lr), np.float32(0.9)

    def step(ctx, x, y):  # type: ignore[no-untyped-def]
        err = matmul(x, ctx[w]) + ctx[b] - y
        gw = outer_sum(x, err) / np.float32(BATCH)
        gb = err.mean(axis=0)
        gw = ops.replicated_all_reduce(gw, op="mean")
        gb = ops.replicated_all_reduce(gb, op="mean")
        # the same mean, ZeRO-style: reduce-scatter, update the shard, all-gather
        shard = ops.replicated_reduce_scatter(ctx[mw] * beta + gw, op="add") / np.float32(R)
        full = ops.replicated_all_gather(shard)[: FEATURES * OUTPUTS].reshape(FEATURES, OUTPUTS)
        ctx[mw] = full
        ctx[w] = ctx[w] - lr32 * ctx[mw]
        ctx[b] = ctx[b] - lr32 * gb
        loss = np.float32((err * err).mean())
        ctx[seen] = ctx[seen] + ops.replicated_all_reduce(np.array([loss]), op="max", group=halves)
        return np.array(loss)

    for s in range(steps):
        x, y = batch(s, R, seed)
        rt.run(step, x[off : off + L], y[off : off + L])
    return {v.name: rt.get_tensor_data(v) for v in (w, b, mw, seen)}


def digest(weights: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(np.ascontiguousarray(weights[name]).tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, help="total replicas (default: from poprun's environment)")
    p.add_argument("--world", action="store_true", help="split --replicas over MPI.COMM_WORLD's ranks")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--executor", choices=["auto", "threads", "cooperative"],
                   help="how the local replicas run (default: $POPDIST_ENGINE_EXECUTOR, else auto)")
    args = p.parse_args(argv)
    comm = None
    if args.world:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    with Runtime(args.replicas, comm=comm, executor=args.executor) as rt:
        h = digest(train(rt, args.steps, args.seed))
        print(f"weights-sha256 {h} replicas={rt.replication_factor} instances={rt.num_instances} "
              f"steps={args.steps} executor={rt.executor}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
