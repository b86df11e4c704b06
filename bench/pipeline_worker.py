"""One process of the ``pipeline`` section: one replica of a 4-layer MLP in two pipeline stages.

    pipeline_worker.py time   WIDTH MICRO ACCUMULATION ROUNDS     every mode's step, interleaved
    pipeline_worker.py sync   WIDTH MICRO ACCUMULATION ROUNDS     every sync pattern's step with a host feed
    pipeline_worker.py memory WIDTH MICRO ACCUMULATION MODE       one mode's peak resident memory

The model: 4 float32 layers of ``WIDTH x WIDTH`` (tanh after the first 3, a mean squared error
after the last), layers 0-1 a stage on device 0 and layers 2-3 a stage on device 1, so the stages
cost alike; micro-batches of ``MICRO`` samples, ``ACCUMULATION`` of them per update, SGD. Its
matmuls are the work (compute bound): run it with ``OPENBLAS_NUM_THREADS=1`` so each device thread
computes on one core.

Modes: ``sequential`` (``Pipeline.sequential``: the same stages one after the other on one thread,
the model on one device), ``1f1b`` and ``gpipe`` (pipelined over 2 devices).

``time``: one runtime and trainer per mode, same initial weights and data; after a warm-up step
each, every round steps each trainer once, the order rotating round by round, so the machine's
drift hits every mode alike. Records each step's seconds, the bubble of each pipelined step (from
its trace) and each stage's busy time. Each round also times the machine's two-core capacity: the
model's matmul on one of the pipeline's device threads, then on both at once (a shared machine's
other load shows there, and bounds what pipelining can gain). At the end every mode has taken the
same steps on the same data, and the worker asserts their weights are bitwise equal. Prints one
JSON line.

``sync``: 1F1B with a host data feed that costs about as much as a stage (6 matmuls a
micro-batch), under each sync pattern: ``full`` feeds inside each input exchange with both devices
waiting; ``single_pipeline`` and ``replica_and_ladder`` (the same with two devices) feed one
micro-batch ahead while the devices compute. On 2 cores the host thread shares them with the
devices, so hiding the feed can gain at most (3 + 3) / (9 / 2) = 1.33x here.

``memory``: one mode per process, so the peak is its own: after a warm-up step, the resident
memory before a step and its peak during it (VmHWM, reset just before).
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

from bench.training_worker import reset_peak, status
from popdist_py.engine import Runtime, Trainer, TrainingOptions, canonical_sum
from popdist_py.engine.batch_invariant import matmul, outer_sum
from popdist_py.engine.optimizers import SGD
from popdist_py.engine.pipeline import GPIPE, ONE_F_ONE_B, Pipeline, Stage, bubble, ideal_bubble
from popdist_py.engine.pipeline.devices import Devices
from popdist_py.engine.pipeline.schedule import BACKWARD, FORWARD

LAYERS, DEVICES = 4, 2
MODES = ("sequential", ONE_F_ONE_B, GPIPE)
LR = 0.01
#: matmuls per thread in a round's two-core capacity check
CAPACITY_MATMULS = 60
#: the feed's matmuls per micro-batch: a stage's forward (2) and backward (4)
FEED_MATMULS = 6
SYNC_MODES = ("full", "single_pipeline", "replica_and_ladder")


def init(width: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {}
    for k in range(LAYERS):
        out[f"W{k}"] = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        out[f"b{k}"] = np.zeros(width, np.float32)
    return out


def stage(layers: range, device: int) -> Stage:
    """Layers ``layers`` as one stage; the model's last layer is linear, then the loss."""
    last = LAYERS - 1

    def forward(params: dict[str, np.ndarray], carry: Any, x: np.ndarray, y: np.ndarray) -> tuple[Any, Any]:
        h = x if carry is None else carry
        saved = []
        for k in layers:
            z = matmul(h, params[f"W{k}"]) + params[f"b{k}"]
            if k == last:
                err = z - y
                saved.append((h, err))
                return float(np.mean(err * err)), saved
            a = np.tanh(z)
            saved.append((h, a))
            h = a
        return h, saved

    def backward(params: dict[str, np.ndarray], saved: Any, grad_out: Any) -> tuple[Any, dict[str, np.ndarray]]:
        grads: dict[str, np.ndarray] = {}
        g = grad_out
        for k, (h, other) in zip(reversed(layers), reversed(saved), strict=True):
            # the loss's gradient, or tanh's
            dz = np.float32(2) * other / np.float32(other.size) if k == last else g * (np.float32(1) - other * other)
            grads[f"W{k}"] = outer_sum(h, dz)
            grads[f"b{k}"] = canonical_sum(dz)
            g = matmul(dz, params[f"W{k}"].T)
        return g, grads

    weights = tuple(f"{w}{k}" for k in layers for w in ("W", "b"))
    return Stage(forward, backward, device, weights, name=f"layers {layers.start}-{layers.stop - 1}")


def pipeline(schedule: str = ONE_F_ONE_B, sync_pattern: str = "single_pipeline", feed: Any = None) -> Pipeline:
    half = LAYERS // DEVICES
    return Pipeline([stage(range(half), 0), stage(range(half, LAYERS), 1)], DEVICES, schedule, sync_pattern, feed)


def make_feed(width: int) -> Any:
    """A host data feed that costs about what a stage does per micro-batch (its forward and
    backward: 6 matmuls): a fixed preprocessing of the raw features by 6 tanh projections."""
    rng = np.random.default_rng(3)
    projections = [(rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
                   for _ in range(FEED_MATMULS)]

    def feed(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        for p in projections:
            x = np.tanh(matmul(x, p))
        return x, y

    return feed


class Bench:
    """A runtime and trainer of ``mode`` on the shared weights and data (a sync pattern's mode
    pipelines with 1F1B and the host feed)."""

    def __init__(self, mode: str, width: int, micro: int, accumulation: int, data: tuple[np.ndarray, ...]) -> None:
        if mode in SYNC_MODES:
            self.pipe = pipeline(ONE_F_ONE_B, mode, make_feed(width))
        else:
            self.pipe = pipeline(GPIPE if mode == GPIPE else ONE_F_ONE_B)
        self.rt = Runtime(replication=1)
        model: Any = self.pipe.sequential if mode == "sequential" else self.pipe
        self.trainer = Trainer(self.rt, init(width), model, SGD(LR), [(micro, width), (micro, width)],
                               TrainingOptions(accumulation_factor=accumulation))
        self.data = data

    def step(self) -> float:
        start = time.perf_counter()
        self.trainer.step(*self.data)
        return time.perf_counter() - start

    def close(self) -> None:
        self.trainer.close()
        self.rt.close()


def make_data(width: int, micro: int, accumulation: int) -> tuple[np.ndarray, np.ndarray]:
    """One batch, ``[accumulation, micro, width]`` features and targets, used at every step."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((accumulation, micro, width)).astype(np.float32)
    return x, np.tanh(x[..., ::-1] * np.float32(0.5)).astype(np.float32)


def busy_ms(pipe: Pipeline) -> list[float]:
    """Each stage's compute time (forwards and backwards) in the last step, in ms."""
    out = [0.0] * len(pipe.stages)
    for e in pipe.events[0]:
        if e.kind in (FORWARD, BACKWARD):
            out[e.stage] += (e.end_ns - e.start_ns) / 1e6
    return out


def stashed_bytes(width: int, micro: int, data: tuple[np.ndarray, ...]) -> list[int]:
    """Bytes each stage stashes per micro-batch in flight (the arrays its forward saves, not the
    host's input), from one forward of each stage."""
    params, pipe = init(width), pipeline()
    x, y = data[0][0], data[1][0]
    carry: Any = None
    out = []
    for st in pipe.stages:
        carry, saved = st.forward(params, carry, x, y)
        arrays = {id(a): a for pair in saved for a in pair if a is not x}
        out.append(sum(a.nbytes for a in arrays.values()))
    return out


class Capacity:
    """Two-core capacity: ``2 x`` (one device thread's time for a block of matmuls) / (both
    device threads' time, each doing the block at once), on threads pinned as the pipeline's are."""

    def __init__(self, width: int, micro: int) -> None:
        rng = np.random.default_rng(2)
        self.devices = Devices(1, DEVICES)
        self.a = [rng.standard_normal((micro, width)).astype(np.float32) for _ in range(DEVICES)]
        self.w = [rng.standard_normal((width, width)).astype(np.float32) for _ in range(DEVICES)]
        self.measure()  # warm-up: the threads

    def _block(self, device: int) -> None:
        a, w = self.a[device], self.w[device]
        for _ in range(CAPACITY_MATMULS):
            matmul(a, w)

    def measure(self) -> float:
        start = time.perf_counter()
        self.devices.submit(0, 0, functools.partial(self._block, 0)).result()
        one = time.perf_counter() - start
        start = time.perf_counter()
        jobs = [self.devices.submit(0, d, functools.partial(self._block, d)) for d in range(DEVICES)]
        for job in jobs:
            job.result()
        return DEVICES * one / (time.perf_counter() - start)

    def close(self) -> None:
        self.devices.close()


def time_modes(width: int, micro: int, accumulation: int, rounds: int) -> dict[str, Any]:
    data = make_data(width, micro, accumulation)
    benches = {m: Bench(m, width, micro, accumulation, data) for m in MODES}
    for b in benches.values():  # warm-up: first touch of every array, the device threads
        b.step()
    capacity = Capacity(width, micro)
    capacities = []
    seconds: dict[str, list[float]] = {m: [] for m in MODES}
    bubbles: dict[str, list[float]] = {m: [] for m in MODES[1:]}
    busy: dict[str, list[list[float]]] = {m: [] for m in MODES[1:]}
    for r in range(rounds):
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
        for mode in order:
            seconds[mode].append(benches[mode].step())
            if mode != "sequential":
                bubbles[mode].append(bubble(benches[mode].pipe.events[0]))
                busy[mode].append(busy_ms(benches[mode].pipe))
        capacities.append(capacity.measure())
    capacity.close()
    weights = {m: b.trainer.weights() for m, b in benches.items()}
    reference = weights["sequential"]
    for mode in MODES[1:]:  # the same steps on the same data: the same bits
        differ = [n for n in reference if weights[mode][n].tobytes() != reference[n].tobytes()]
        assert not differ, f"{mode}: weights {differ} differ from the sequential run's"
    assert not np.array_equal(reference["W0"], init(width)["W0"]), "the weights did not change"
    pinned = benches[ONE_F_ONE_B].pipe.pinned
    stashed = {m: benches[m].pipe.stashed(accumulation) for m in MODES[1:]}
    for b in benches.values():
        b.close()
    return {"seconds": seconds, "bubble": bubbles, "busy_ms": busy, "bitwise_equal": True, "pinned": pinned,
            "two_core_capacity": capacities, "stashed": stashed, "ideal_bubble": ideal_bubble(DEVICES, accumulation),
            "stash_bytes_per_micro_batch": stashed_bytes(width, micro, data)}


def time_sync_patterns(width: int, micro: int, accumulation: int, rounds: int) -> dict[str, Any]:
    """Every sync pattern's step with the host feed, interleaved as :func:`time_modes` does; their
    weights bitwise equal at the end."""
    data = make_data(width, micro, accumulation)
    benches = {m: Bench(m, width, micro, accumulation, data) for m in SYNC_MODES}
    for b in benches.values():
        b.step()
    seconds: dict[str, list[float]] = {m: [] for m in SYNC_MODES}
    for r in range(rounds):
        for mode in SYNC_MODES[r % 3:] + SYNC_MODES[:r % 3]:
            seconds[mode].append(benches[mode].step())
    weights = {m: b.trainer.weights() for m, b in benches.items()}
    for mode in SYNC_MODES[1:]:
        differ = [n for n in weights["full"] if weights[mode][n].tobytes() != weights["full"][n].tobytes()]
        assert not differ, f"{mode}: weights {differ} differ from full's"
    feed = [e for e in benches["full"].pipe.events[0] if e.device < 0]
    feed_ms = statistics.median((e.end_ns - e.start_ns) / 1e6 for e in feed)
    for b in benches.values():
        b.close()
    return {"seconds": seconds, "feed_ms": feed_ms}


def memory(width: int, micro: int, accumulation: int, mode: str) -> dict[str, Any]:
    data = make_data(width, micro, accumulation)
    bench = Bench(mode, width, micro, accumulation, data)
    bench.step()  # warm-up: the accumulators', stash's and threads' first allocations
    before = status()
    reset_peak()
    bench.step()
    after = status()
    bench.close()
    return {"rss_before_bytes": before["VmRSS"], "peak_rss_bytes": after["VmHWM"]}


def main() -> None:
    mode, width, micro, accumulation, arg = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \
        sys.argv[5]
    if mode == "time":
        result = time_modes(width, micro, accumulation, int(arg))
    elif mode == "sync":
        result = time_sync_patterns(width, micro, accumulation, int(arg))
    elif mode == "memory":
        if arg not in MODES:
            raise SystemExit(f"mode {arg!r} is not one of {', '.join(MODES)}")
        result = memory(width, micro, accumulation, arg)
    else:
        raise SystemExit(f"mode {mode!r} is not one of time, sync, memory")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
