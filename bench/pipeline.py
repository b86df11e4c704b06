"""``pipeline``: one replica of a compute-bound MLP pipelined over K=2 devices (two cores, one BLAS
thread each) against the same stages one after the other on one device, and 1F1B against GPipe.

The model is 4 float32 layers of 1024 x 1024 (tanh; mean squared error after the last), layers 0-1
on device 0 and 2-3 on device 1, micro-batches of 64 samples, 16 per update (quick: 512 wide).
Its matmuls are the work, so the speedup is what pipelining gives, bounded by the bubble
(``(K-1)/(M+K-1)`` = 1/17 of each device's time: at most about 1.9x) and the step's unpipelined
part (reduction, update). Step times are measured in one process holding a trainer per mode, the
modes stepping in turn round by round; a ratio is the median over rounds of the ratio within a
round. Each round also measures the machine's two-core capacity (the model's matmul on one device
thread, then on both at once), which shows whether other load on a shared machine took a core.
The worker asserts that every mode's weights are bitwise equal after the same steps.

Sync patterns: 1F1B with a host data feed that costs about as much as a stage, under ``full``
(the feed inside each input exchange, both devices waiting) against ``single_pipeline`` and
``replica_and_ladder`` (the host feeds one micro-batch ahead while the devices compute; with two
devices the two patterns are the same); target: one of them >= 1.3x full's samples/s.

The bubble is measured from each step's trace (idle fraction of the devices over the step's
compute span) beside the ideal. Memory: each stage's stash depth (micro-batches in flight) and its
bytes (depth x what the stage saves per micro-batch; stage 1's input counts on both stages, as on
separate devices it would be a copy on each), and the peak resident memory of a step, in a process
of its own per mode (glibc's mmap threshold fixed, so freed arrays leave resident memory at once
and the peak is what was live).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WORKER = ["-m", "bench.pipeline_worker"]
ONE_THREAD = dict.fromkeys(("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"), "1")
#: arrays of 64 KiB and more are mapped and unmapped on their own: resident memory follows what is live
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}
MODES = ("sequential", "1f1b", "gpipe")
#: (width, micro-batch, accumulation factor, rounds)
FULL, QUICK = (1024, 64, 16, 40), (512, 64, 16, 5)
TARGET = 1.6
SYNC_TARGET = 1.3
MiB = 1 << 20


def _run(command: list[str], env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO,
                         env={**os.environ, **ONE_THREAD, **env})
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    line = [ln for ln in out.stdout.splitlines() if "{" in ln][-1]
    result: dict[str, Any] = json.loads(line[line.index("{"):])
    return result


def _ratio(over: list[float], under: list[float]) -> float:
    return statistics.median([a / b for a, b in zip(over, under, strict=True)])


def run(quick: bool, size: tuple[int, int, int] | None = None, rounds: int | None = None) -> dict[str, object]:
    """``size`` (width, micro-batch, accumulation factor) and ``rounds`` override the defaults (the
    tests' small runs)."""
    width, micro, accumulation, default_rounds = QUICK if quick else FULL
    if size is not None:
        width, micro, accumulation = size
    rounds = rounds or default_rounds
    python = sys.executable
    args = [str(width), str(micro), str(accumulation)]
    raw = _run([python, *WORKER, "time", *args, str(rounds)], {})
    memory = {m: _run([python, *WORKER, "memory", *args, m], MALLOC) for m in MODES}
    seconds = {m: statistics.median(raw["seconds"][m]) for m in MODES}
    samples = micro * accumulation
    per_micro_batch = raw["stash_bytes_per_micro_batch"]
    stashed = {"sequential": [1] * len(per_micro_batch), **raw["stashed"]}  # one micro-batch at a time
    speedup = _ratio(raw["seconds"]["sequential"], raw["seconds"]["1f1b"])
    section: dict[str, Any] = {
        "model": (f"4 x {width}x{width} float32 layers (tanh, MSE), 2 stages of 2 layers, "
                  f"micro-batch {micro}, accumulation {accumulation}, SGD"),
        "width": width, "micro_batch": micro, "accumulation": accumulation, "devices": 2, "rounds": rounds,
        "seconds": seconds,
        "samples_per_s": {m: samples / seconds[m] for m in MODES},
        "speedup": {m: _ratio(raw["seconds"]["sequential"], raw["seconds"][m]) for m in MODES[1:]},
        "gpipe_over_1f1b": _ratio(raw["seconds"]["gpipe"], raw["seconds"]["1f1b"]),
        "bubble": {m: statistics.median(raw["bubble"][m]) for m in MODES[1:]},
        "ideal_bubble": raw["ideal_bubble"],
        "busy_ms": {m: [statistics.median(step[s] for step in raw["busy_ms"][m]) for s in range(2)]
                    for m in MODES[1:]},
        "two_core_capacity": statistics.median(raw["two_core_capacity"]),
        "pinned": raw["pinned"],
        "bitwise_equal": raw["bitwise_equal"],
        "stashed": stashed,
        "stash_mib": {m: [n * b / MiB for n, b in zip(stashed[m], per_micro_batch, strict=True)] for m in MODES},
        "peak_rss_mib": {m: memory[m]["peak_rss_bytes"] / MiB for m in MODES},
        "rss_before_mib": {m: memory[m]["rss_before_bytes"] / MiB for m in MODES},
    }
    sync = _run([python, *WORKER, "sync", *args, str(max(3, rounds // 2))], {})
    full = sync["seconds"]["full"]
    section["sync"] = {"seconds": {m: statistics.median(v) for m, v in sync["seconds"].items()},
                       "over_full": {m: _ratio(full, v) for m, v in sync["seconds"].items() if m != "full"},
                       "feed_ms": sync["feed_ms"], "rounds": len(full)}
    best = max(section["sync"]["over_full"].values())
    section["targets"] = [{"what": "pipeline: 1F1B on 2 devices / the same stages on 1 device, samples/s",
                           "limit": TARGET, "value": speedup, "holds": speedup >= TARGET},
                          {"what": "pipeline with a host feed: single_pipeline or replica_and_ladder / full, samples/s",
                           "limit": SYNC_TARGET, "value": best, "holds": best >= SYNC_TARGET}]
    return section
