"""Horovod's PyTorch examples, unchanged, under ``poprun --horovod``, with arguments small enough for a
minute on two cores; each one's command, exit status, wall time and last lines.

The synthetic benchmark trains resnet18 on random images (its img/sec); MNIST trains on the digits of
bench/mnist_idx.py (its test accuracy), which it finds in ``--data-dir`` and so does not download.
Each runs with HOME in the run's folder, where pytorch_mnist.py takes its ``~/.horovod_lock``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from bench import horovod_jobs
from bench.horovod_source import MNIST, SYNTHETIC
from bench.mnist_idx import write_mnist

#: The lines of each run's output kept.
LAST_LINES = 10


def examples(data: Path) -> dict[str, list[str]]:
    """Each example's script and its arguments."""
    return {SYNTHETIC: ["--model", "resnet18", "--batch-size", "4", "--num-warmup-batches", "2",
                        "--num-batches-per-iter", "2", "--num-iters", "3"],
            MNIST: ["--epochs", "10", "--data-dir", str(data)]}


def result_line(output: str, ok: bool) -> str:
    """What a run came to: instance 0's last line where it ended well, else the output's last line."""
    lines = [line for line in output.splitlines() if line.strip()]
    if ok:
        own = [line[4:].strip() for line in lines if line.startswith("[0] ") and line[4:].strip()]
        if own:
            return own[-1]
    return lines[-1].strip() if lines else ""


def run_one(script: str, arguments: list[str], instances: int, folder: Path, work: Path,
            timeout_s: float) -> dict[str, Any]:
    argv = horovod_jobs.poprun(instances, sys.executable, "-m", "bench.horovod_example", script, *arguments)
    log = work / f"{Path(script).stem}-{instances}.log"
    ended = horovod_jobs.run(argv, folder, log, timeout_s, env={"HOME": str(work)})
    output = log.read_text(errors="replace")
    return {"example": script, "instances": instances, "command": horovod_jobs.shown(argv, work),
            "exit_status": ended.status, "timed_out": ended.status is None, "wall_s": ended.wall_s,
            "result": result_line(output, ended.status == 0), "last_lines": output.splitlines()[-LAST_LINES:]}


def run(instance_counts: list[int], folder: Path, work: Path, timeout_s: float) -> dict[str, Any]:
    """Each example at each number of instances, and the MNIST files written for them."""
    data = work / "data"
    images = write_mnist(data)
    runs = [run_one(script, arguments, n, folder, work, timeout_s)
            for script, arguments in examples(data).items() for n in instance_counts]
    return {"mnist_images": images, "runs": runs}
