"""``training``: the Trainer's step with Adam under four tensor location settings, 4 replicas in one
process and 2 instances x 2 replicas under poprun: optimizer state per process and step time.

Settings: replicated (weights and Adam state whole on every replica), optimizer state sharded over
all replicas (ZeRO-1/2), weights and state sharded (ZeRO-3), and weights and state off chip
(whole, in memory-mapped files, read ahead: ``load_tile_set=TileSet.IO``). Sharding is over all 4
replicas in both splits (across the instances under poprun).

The model is a few large weight matrices whose ``loss_and_grads`` hands back a fixed synthetic
gradient per replica, so a step is the engine's own work (reduction, optimizer, gathering,
off-chip mapping), the part the settings change; a real model's compute would add the same time
to every setting and shrink the ratios. Step times are measured in one process (or one poprun job)
holding a runtime per setting, the settings stepping in turn round by round; a ratio is the median
over rounds of the setting's step over the replicated step of the same round. State memory is
``rt.state_nbytes()``; peak resident memory is measured in a process of its own per setting
(4 replicas in one process). Also: the fused reduction of 200 gradients of 16 KiB each against one
all-reduce of the same bytes, with packing alone and 200 separate all-reduces beside it.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parent.parent
WORKER = ["-m", "bench.training_worker"]
SETTINGS = ("replicated", "optimizer_sharded", "weights_sharded", "off_chip")
MiB = 1 << 20
#: (matrices, rows): 4 x 4096 x 4096 = 64 Mi parameters; quick: 16 Mi
FULL, QUICK = (4, 4096), (4, 2048)
MEMORY_LIMITS = {"optimizer_sharded": 0.55, "weights_sharded": 0.3, "off_chip": 0.1}
TIME_LIMITS = {"optimizer_sharded": 1.15, "weights_sharded": 1.15, "off_chip": 1.25}
FUSED_LIMIT = 1.3
SPLITS = {"1x4": "1 process x 4 replicas", "2x2": "2 instances x 2 replicas"}


def _run(command: list[str]) -> dict[str, Any]:
    out = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    line = [ln for ln in out.stdout.splitlines() if "{" in ln][-1]
    result: dict[str, Any] = json.loads(line[line.index("{"):])
    return result


def _steps(raw: dict[str, Any]) -> dict[str, Any]:
    """Median step seconds per setting and the median over rounds of each setting / replicated."""
    seconds = raw["seconds"]
    base = seconds["replicated"]
    return {"seconds": {s: statistics.median(seconds[s]) for s in SETTINGS},
            "ratio": {s: statistics.median([t / b for t, b in zip(seconds[s], base, strict=True)]) for s in SETTINGS},
            "rounds": len(base)}


def _state(raw: dict[str, Any]) -> dict[str, Any]:
    nbytes = raw["state_nbytes"]
    memory = {s: nbytes[s]["memory"] / MiB for s in SETTINGS}
    return {"mib": memory, "file_mib": {s: nbytes[s]["file"] / MiB for s in SETTINGS},
            "ratio": {s: memory[s] / memory["replicated"] for s in SETTINGS}}


def run(quick: bool, size: tuple[int, int] | None = None, rounds: int | None = None) -> dict[str, object]:
    """``size`` (matrices, rows) and ``rounds`` override the defaults (the tests' small runs)."""
    matrices, rows = size or (QUICK if quick else FULL)
    rounds = rounds or (2 if quick else 3)
    python = sys.executable
    args = [str(matrices), str(rows)]
    times = {"1x4": _run([python, *WORKER, "time", *args, str(rounds)]),
             "2x2": _run([str(BIN / "poprun"), "--num-instances", "2", "--num-replicas", "4",
                          python, *WORKER, "time", *args, str(rounds)])}
    memory = {s: _run([python, *WORKER, "memory", *args, s]) for s in SETTINGS}
    splits: dict[str, Any] = {}
    for split, raw in times.items():
        fused = raw["fused"]
        splits[split] = {"steps": _steps(raw), "state": _state(raw), "executor": raw["executor"],
                         "fused_seconds": fused, "fused_ratio": fused["fused"] / fused["one_all_reduce"]}
    splits["1x4"]["peak_rss_mib"] = {s: memory[s]["peak_rss_bytes"] / MiB for s in SETTINGS}
    splits["1x4"]["baseline_rss_mib"] = {s: memory[s]["baseline_rss_bytes"] / MiB for s in SETTINGS}
    splits["1x4"]["file_resident_mib"] = {s: memory[s]["file_resident_bytes"] / MiB for s in SETTINGS}
    targets = []
    for split, label in SPLITS.items():
        m, t = splits[split]["state"]["ratio"], splits[split]["steps"]["ratio"]
        for s, limit in MEMORY_LIMITS.items():
            targets.append({"what": f"training {label}: {s.replace('_', ' ')} state memory / replicated",
                            "limit": limit, "value": m[s], "holds": m[s] <= limit})
        for s, limit in TIME_LIMITS.items():
            targets.append({"what": f"training {label}: {s.replace('_', ' ')} step / replicated",
                            "limit": limit, "value": t[s], "holds": t[s] <= limit})
    for split, label in SPLITS.items():
        ratio = splits[split]["fused_ratio"]
        targets.append({"what": f"fused reduction 200 x 16 KiB / one all-reduce of the bytes, {label}",
                        "limit": FUSED_LIMIT, "value": ratio, "holds": ratio <= FUSED_LIMIT})
    params = matrices * rows * rows
    return {
        "model": (f"{matrices} x {rows}x{rows} float32 weights ({params / MiB:g} Mi parameters, "
                  f"{params * 4 // MiB} MiB), Adam, a fixed synthetic gradient per replica"),
        "parameters": params,
        "splits": splits,
        "targets": targets,
    }
