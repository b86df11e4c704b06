"""One process (alone, or one instance under poprun) of the ``training`` section.

    training_worker.py time   MATRICES ROWS ROUNDS     every setting's step, interleaved; fused reduction
    training_worker.py memory MATRICES ROWS SETTING    one setting: state bytes and peak resident memory

The model is ``MATRICES`` float32 weight matrices of ``ROWS x ROWS`` trained with Adam; its
``loss_and_grads`` returns a fixed synthetic gradient per replica (made once, before timing), so a
step is the engine's work alone: the fused gradient reduction across replicas, the optimizer, and
whatever gathering, sharding and off-chip mapping the setting asks for. Alone the process runs 4
replicas; under poprun it takes the replicas poprun gives it.

``time``: one runtime holds a trainer per setting (each with its own weights and state); after a
warm-up step each, every round steps each trainer once, the order rotating round by round, so the
machine's drift hits every setting alike. A step's time is the slowest instance's. Then the fused
reduction of 200 gradients of 16 KiB each is timed against one all-reduce of the same bytes (and
its parts: packing alone, and 200 separate all-reduces), batches alternating. Prints one JSON line.

``memory``: one setting per process, so its peak is its own: ``rt.state_nbytes()``, the file pages
still mapped in after a step (RssFile), the resident memory before the trainer (interpreter, the
synthetic gradients and the initial weights) and the peak (VmHWM, reset before the trainer).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from popdist_py.engine import Runtime, TensorStorage, TileSet, Trainer, TrainingOptions, fused, ops
from popdist_py.engine.optimizers import Adam

SETTINGS = ("replicated", "optimizer_sharded", "weights_sharded", "off_chip")
#: replicas when the process runs alone
REPLICAS = 4
FUSED_TENSORS, FUSED_ELEMENTS = 200, 4096  # 200 float32 gradients of 16 KiB
FUSED_ITERS, FUSED_BATCHES = 20, 7


def options(setting: str) -> TrainingOptions:
    """The tensor location settings of ``setting``; sharding is over all replicas (across instances too)."""
    opts = TrainingOptions()
    weights = opts.weight_tensor_location_settings.location
    state = opts.optimizer_state_tensor_location_settings.location
    if setting in ("optimizer_sharded", "weights_sharded"):
        state.replicated_tensor_sharding = True
    if setting == "weights_sharded":
        weights.replicated_tensor_sharding = True
    if setting == "off_chip":
        for location in (weights, state):
            location.storage = TensorStorage.OFF_CHIP
            location.load_tile_set = TileSet.IO
    if setting not in SETTINGS:
        raise SystemExit(f"setting {setting!r} is not one of {', '.join(SETTINGS)}")
    return opts


def status() -> dict[str, int]:
    """Resident memory fields of /proc/self/status, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak() -> None:
    """Start VmHWM afresh from the current resident size (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Model:
    """The weights' initial values and each local replica's synthetic gradients."""

    def __init__(self, rt: Runtime, matrices: int, rows: int) -> None:
        rng = np.random.default_rng(0)
        self.init = [rng.random((rows, rows), np.float32) - np.float32(0.5) for _ in range(matrices)]
        base = [rng.random((rows, rows), np.float32) - np.float32(0.5) for _ in range(matrices)]
        # replica r's gradient of matrix k: base[k] scaled by a factor of r (a multiply, no new random numbers)
        self.grads = [[b * np.float32(1 + 0.25 * r) for b in base] for r in rt.local_replicas]
        del base
        # each replica is told which one it is through its micro-batch (its index among the local ones)
        self.data = np.arange(rt.instance_replication_factor, dtype=np.float32).reshape(-1, 1)

    def trainer(self, rt: Runtime, setting: str) -> Trainer:
        names = [f"{setting}_W{k}" for k in range(len(self.init))]

        def loss_and_grads(params: dict[str, np.ndarray], x: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
            mine = self.grads[int(x[0])]
            return 0.0, dict(zip(names, mine, strict=True))

        return Trainer(rt, dict(zip(names, self.init, strict=True)), loss_and_grads, Adam(1e-3), [(1,)],
                       options(setting))


class Clock:
    """A step's seconds as the slowest instance saw them (instances start together at a barrier)."""

    def __init__(self, rt: Runtime) -> None:
        self.comm: Any = None
        if rt.num_instances > 1:
            from mpi4py import MPI

            self.comm = MPI.COMM_WORLD

    def time(self, call: Callable[[], object]) -> float:
        if self.comm is not None:
            self.comm.Barrier()
        start = time.perf_counter()
        call()
        seconds = time.perf_counter() - start
        return float(self.comm.allreduce(seconds, op=_max())) if self.comm is not None else seconds

    def worst(self, value: float) -> float:
        return float(self.comm.allreduce(value, op=_max())) if self.comm is not None else value

    @property
    def rank(self) -> int:
        return 0 if self.comm is None else int(self.comm.rank)


def _max() -> Any:
    from mpi4py import MPI

    return MPI.MAX


def time_steps(runtimes: dict[str, Runtime], model: Model, rounds: int, clock: Clock) -> dict[str, Any]:
    """One runtime and trainer per setting (a runtime holds one trainer)."""
    trainers = {s: model.trainer(rt, s) for s, rt in runtimes.items()}
    state = {s: {k: clock.worst(v) for k, v in rt.state_nbytes().items()} for s, rt in runtimes.items()}
    for trainer in trainers.values():  # warm-up: first touch of every array, plans, read-ahead threads
        trainer.step(model.data)
    seconds: dict[str, list[float]] = {s: [] for s in SETTINGS}
    for r in range(rounds):
        order = SETTINGS[r % len(SETTINGS):] + SETTINGS[:r % len(SETTINGS)]
        for setting in order:
            seconds[setting].append(clock.time(functools.partial(trainers[setting].step, model.data)))
    for trainer in trainers.values():
        trainer.close()
    return {"seconds": seconds, "state_nbytes": state}


def time_fused(rt: Runtime, clock: Clock) -> dict[str, float]:
    """Seconds per call: fused reduction of 200 x 16 KiB, one all-reduce of the same bytes, packing
    alone (the copy into the bucket), and 200 all-reduces (one per tensor); batches alternate."""
    L = rt.instance_replication_factor
    names = [f"g{k}" for k in range(FUSED_TENSORS)]
    rng = np.random.default_rng(1)
    grads = [{n: rng.random(FUSED_ELEMENTS, np.float32) for n in names} for _ in range(L)]
    flat = [np.concatenate(list(g.values())) for g in grads]
    fusion = fused.plan_buckets({n: (FUSED_ELEMENTS, np.dtype(np.float32), None) for n in names}, 4 << 20)
    assert len(fusion.buckets) == 1, fusion.buckets
    everyone = rt.replica_grouping()

    def fused_reduce(ctx: Any) -> None:
        fused.reduce(fusion, grads[ctx.local_index], "mean", ctx.replica_index, everyone)

    def one_all_reduce(ctx: Any) -> None:
        ops.replicated_all_reduce(flat[ctx.local_index], op="mean")

    packed = [np.empty(FUSED_TENSORS * FUSED_ELEMENTS, np.float32) for _ in range(L)]

    def pack(ctx: Any) -> None:
        np.concatenate([g.reshape(-1) for g in grads[ctx.local_index].values()], out=packed[ctx.local_index])

    def per_tensor(ctx: Any) -> None:
        for g in grads[ctx.local_index].values():
            ops.replicated_all_reduce(g, op="mean")

    kinds = {"fused": fused_reduce, "one_all_reduce": one_all_reduce, "pack_only": pack, "per_tensor": per_tensor}

    def batch(body: Callable[[Any], None], iters: int) -> Callable[[], object]:
        def step(ctx: Any) -> None:
            for _ in range(iters):
                body(ctx)

        return lambda: rt.run(step)

    runs = {k: (batch(body, FUSED_ITERS if k != "per_tensor" else 2), FUSED_ITERS if k != "per_tensor" else 2)
            for k, body in kinds.items()}
    for call, _ in runs.values():  # warm-up: plans, scratch buffers
        call()
    means: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(FUSED_BATCHES):
        for k, (call, iters) in runs.items():
            means[k].append(clock.time(call) / iters)
    return {k: float(np.median(v)) for k, v in means.items()}


def memory(rt: Runtime, model: Model, setting: str, clock: Clock) -> dict[str, Any]:
    before = status()
    reset_peak()
    trainer = model.trainer(rt, setting)
    nbytes = rt.state_nbytes()
    trainer.step(model.data)
    after = status()
    trainer.close()
    return {"state_nbytes": {k: clock.worst(v) for k, v in nbytes.items()},
            "file_resident_bytes": clock.worst(max(0, after["RssFile"] - before["RssFile"])),
            "baseline_rss_bytes": clock.worst(before["VmRSS"]),
            "peak_rss_bytes": clock.worst(after["VmHWM"])}


def main() -> None:
    mode, matrices, rows, arg = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    if mode not in ("time", "memory"):
        raise SystemExit(f"mode {mode!r} is not one of time, memory")
    def runtime() -> Runtime:
        return Runtime() if "POPDIST_NUM_INSTANCES" in os.environ else Runtime(replication=REPLICAS)

    rt = runtime()
    clock = Clock(rt)
    model = Model(rt, matrices, rows)
    result: dict[str, Any] = {"instances": rt.num_instances, "replicas_per_instance": rt.instance_replication_factor,
                              "executor": rt.executor}
    if mode == "time":
        runtimes = {SETTINGS[0]: rt, **{s: runtime() for s in SETTINGS[1:]}}
        result.update(time_steps(runtimes, model, int(arg), clock))
        result["fused"] = time_fused(rt, clock)
        for other in runtimes.values():
            other.close()
    else:
        options(arg)
        result.update(memory(rt, model, arg, clock))
    if clock.rank == 0:
        print(json.dumps(result), flush=True)
    rt.close()


if __name__ == "__main__":
    main()
