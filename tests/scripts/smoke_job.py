"""The installed wheel's job (tests/integration/test_package.py): a 2-stage pipelined MLP trained by the engine.

    poprun --num-instances 2 --num-replicas 4 --ipus-per-replica 2 python -P tests/scripts/smoke_job.py
    python -P tests/scripts/smoke_job.py --replicas 4 --sequential    # the same weights, bitwise

Run by path and never part of the wheel: it imports only what the installed packages provide.
Every instance prints ``smoke-job instance=I of=N replicas=R devices=K weights-sha256 <hex>
order-sha256 <hex> trained=<bool> popdist_py=<path>``; the weights are full on every instance, so
the hashes agree, and they are those of the stages run one after the other in one process
(``--sequential``). ``order-sha256`` is this instance's shuffled sampler order (torch's randperm,
the swap pass of ``_swaps.c`` or its Python fallback).

``--products numpy`` takes numpy's products instead of the batch-invariant ones, for an install
built without a C compiler (tests/integration/test_dist.py), which has no batch-invariant kernels:
the same job on the same machine then gives the same bits in every install, though no longer the
same bits for every split. ``--rts`` shards the weights and their optimizer state over the
replicas (the same bits), so that the gradients' reduction runs the reduction tree's compiled
additions (``_tree.c``) or their numpy fallback.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

import popdist_py
from popdist_py.data import DistributedSampler
from popdist_py.engine import Pipeline, Runtime, Stage, Trainer, TrainingOptions
from popdist_py.engine._training.training import canonical_sum
from popdist_py.engine.batch_invariant import matmul, outer_sum
from popdist_py.engine.optimizers import Adam

SIZES = (6, 8, 3)  # features, hidden, outputs: one layer per stage
MICRO, ACCUMULATION, STEPS = 4, 4, 2
SAMPLES = 5000  # the shuffled sampler's dataset: its swap pass in Python takes milliseconds
Product = Callable[[np.ndarray, np.ndarray], np.ndarray]


def numpy_matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return np.asarray(x @ w)


def numpy_outer_sum(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.asarray(x.T @ y)


#: Each kind's (x @ w, the sum over rows s of x[s] (x) y[s]).
PRODUCTS: dict[str, tuple[Product, Product]] = {
    "batch-invariant": (matmul, outer_sum),
    "numpy": (numpy_matmul, numpy_outer_sum),
}


def init() -> dict[str, np.ndarray]:
    r = np.random.default_rng(1)
    out = {}
    for k, (a, b) in enumerate(itertools.pairwise(SIZES)):
        out[f"W{k}"] = (r.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        out[f"b{k}"] = np.zeros(b, np.float32)
    return out


def layer_stage(k: int, last: bool, products: str = "batch-invariant") -> Stage:
    """Layer ``k`` (tanh inside, mean squared error after the last) as one stage on device ``k``."""
    W, b = f"W{k}", f"b{k}"
    product, outer = PRODUCTS[products]

    def forward(params: dict[str, np.ndarray], carry: Any, x: np.ndarray, y: np.ndarray) -> tuple[Any, Any]:
        h = x if carry is None else carry
        z = product(h, params[W]) + params[b]
        if last:
            err = z - y
            return float(np.mean(err * err)), (h, err)
        a = np.tanh(z)
        return a, (h, a)

    def backward(params: dict[str, np.ndarray], saved: Any, grad_out: Any) -> tuple[Any, dict[str, np.ndarray]]:
        h, other = saved
        dz = np.float32(2) * other / np.float32(other.size) if last else grad_out * (np.float32(1) - other * other)
        return product(dz, params[W].T), {W: outer(h, dz), b: canonical_sum(dz)}

    return Stage(forward, backward, k, (W, b), name=f"layer {k}")


def global_batch(step: int, replicas: int, size: int) -> np.ndarray:
    """[accumulation, replicas, micro-batch, size]: the same on every instance."""
    rng = np.random.default_rng([7, step, size])
    return rng.standard_normal((ACCUMULATION, replicas, MICRO, size)).astype(np.float32)


def options(rts: bool) -> TrainingOptions:
    opts = TrainingOptions(accumulation_factor=ACCUMULATION)
    for settings in (opts.optimizer_state_tensor_location_settings, opts.weight_tensor_location_settings):
        settings.location.replicated_tensor_sharding = rts
    return opts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, help="total replicas in this process (default: from poprun)")
    p.add_argument("--sequential", action="store_true", help="the stages one after the other, no pipeline")
    p.add_argument("--products", choices=sorted(PRODUCTS), default="batch-invariant",
                   help="numpy: for an install without the compiled kernels (same bits as another install, not split)")
    p.add_argument("--rts", action="store_true", help="weights and optimizer state sharded over the replicas")
    args = p.parse_args(argv)
    pipe = Pipeline([layer_stage(0, False, args.products), layer_stage(1, True, args.products)])  # --ipus-per-replica
    with Runtime(args.replicas) as rt:
        R, L, off = rt.replication_factor, rt.instance_replication_factor, rt.replica_index_offset
        start = init()
        model = pipe.sequential if args.sequential else pipe
        trainer = Trainer(rt, start, model, Adam(0.01), [(MICRO, SIZES[0]), (MICRO, SIZES[-1])],
                          options(args.rts))
        with trainer:
            for s in range(STEPS):
                x, y = global_batch(s, R, SIZES[0]), global_batch(s, R, SIZES[-1])
                trainer.step(x[:, off : off + L], y[:, off : off + L])
            weights = trainer.weights()
        digest = hashlib.sha256()
        for name in sorted(weights):
            digest.update(name.encode())
            digest.update(np.ascontiguousarray(weights[name]).tobytes())
        trained = not np.array_equal(weights["W0"], start["W0"])
        order = hashlib.sha256(np.array(list(DistributedSampler(SAMPLES, shuffle=True, seed=5)), np.int64).tobytes())
        print(f"smoke-job instance={rt.instance_index} of={rt.num_instances} replicas={R} "
              f"devices={pipe.devices_per_replica} weights-sha256 {digest.hexdigest()} "
              f"order-sha256 {order.hexdigest()} trained={trained} popdist_py={popdist_py.__file__}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
