"""Run under poprun: data-parallel training throughput of one framework, printed as one JSON line
by instance 0.

    peers_training_worker.py engine|ddp GLOBAL_BATCH STEPS

The same model, data and optimizer in both: an MLP 1024-1024-1024-16 without biases (ReLU,
softmax cross-entropy), float32, plain SGD (lr 0.01), the global batch split evenly over the
replicas (``engine``: an instance may run several, ``poprun --num-replicas``), one BLAS thread per
process. ``engine``: popdist_py.engine's Trainer (its fused
gradient reduction, mean over replicas, and its optimizer), the model in numpy (BLAS products,
as torch's). ``ddp``: torch DistributedDataParallel over gloo, set up from the torchrun variables
poprun gives. Throughput is the global batch over the median step time, after one warm-up step.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping

import numpy as np

WIDTH, CLASSES = 1024, 16
SHAPES = {"w0": (WIDTH, WIDTH), "w1": (WIDTH, WIDTH), "w2": (WIDTH, CLASSES)}
LEARNING_RATE = 0.01


def _initial() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {name: (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32) for name, shape in SHAPES.items()}


def _data(global_batch: int, rank: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((global_batch, WIDTH)).astype(np.float32)
    y = rng.integers(0, CLASSES, global_batch)
    share = global_batch // size
    return x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]


def _loss_and_grads(p: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray
                    ) -> tuple[np.float32, dict[str, np.ndarray]]:
    h1 = np.maximum(x @ p["w0"], 0)
    h2 = np.maximum(h1 @ p["w1"], 0)
    logits = h2 @ p["w2"]
    shifted = logits - logits.max(axis=1, keepdims=True)
    probabilities = np.exp(shifted)
    probabilities /= probabilities.sum(axis=1, keepdims=True)
    rows = np.arange(len(y))
    loss = np.float32(-np.log(probabilities[rows, y]).mean())
    grad = probabilities
    grad[rows, y] -= 1
    grad /= len(y)
    g2 = h2.T @ grad
    grad = (grad @ p["w2"].T) * (h2 > 0)
    g1 = h1.T @ grad
    grad = (grad @ p["w1"].T) * (h1 > 0)
    return loss, {"w0": x.T @ grad, "w1": g1, "w2": g2}


def engine(global_batch: int) -> tuple[Callable[[], None], int, Callable[[], None]]:
    from popdist_py.engine import Runtime, Trainer, TrainingOptions
    from popdist_py.engine.optimizers import SGD

    rt = Runtime()
    # each local replica its share of the global batch: inputs [L, share, ...]
    shares = [_data(global_batch, rt.replica_index_offset + i, rt.replication_factor)
              for i in range(rt.instance_replication_factor)]
    x, y = np.stack([s[0] for s in shares]), np.stack([s[1] for s in shares])
    trainer = Trainer(rt, _initial(), _loss_and_grads, SGD(LEARNING_RATE), [x.shape[1:], y.shape[1:]],
                      TrainingOptions(reduction="mean"))

    def step() -> None:
        trainer.step(x, y)

    def close() -> None:
        trainer.close()
        rt.close()

    return step, rt.replica_index_offset, close


def ddp(global_batch: int) -> tuple[Callable[[], None], int, Callable[[], None]]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: poprun's
    rank, size = dist.get_rank(), dist.get_world_size()
    layers = [torch.nn.Linear(*SHAPES[name], bias=False) for name in SHAPES]
    with torch.no_grad():
        for layer, value in zip(layers, _initial().values(), strict=True):
            layer.weight.copy_(torch.from_numpy(value.T.copy()))  # Linear keeps (out, in)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(layers[0], torch.nn.ReLU(), layers[1], torch.nn.ReLU(), layers[2]))
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    x_np, y_np = _data(global_batch, rank, size)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        optimizer.step()

    return step, rank, dist.destroy_process_group


def main() -> None:
    framework, global_batch, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if framework not in ("engine", "ddp"):
        raise SystemExit(f"framework {framework!r} is not engine or ddp")
    step, rank, close = (engine if framework == "engine" else ddp)(global_batch)
    step()  # warm-up
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    step_seconds = float(np.median(seconds))
    if rank == 0:
        print(json.dumps({"samples_per_s": global_batch / step_seconds, "step_seconds": step_seconds}), flush=True)
    close()


if __name__ == "__main__":
    main()
