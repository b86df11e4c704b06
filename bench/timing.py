"""Side-by-side timing: alternate the contenders in every round so machine noise hits all alike."""

from __future__ import annotations

import statistics
import subprocess
import time
from typing import Sequence


def time_commands(commands: dict[str, Sequence[str]], rounds: int, timeout: float = 120) -> dict[str, dict[str, float]]:
    """Wall time of whole commands: median, min, max over ``rounds`` interleaved runs (seconds)."""
    samples: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(rounds):
        for name, command in commands.items():
            start = time.perf_counter()
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=timeout, stdin=subprocess.DEVNULL)
            samples[name].append(time.perf_counter() - start)
    return {name: summarize(values) for name, values in samples.items()}


def summarize(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": len(values)}
