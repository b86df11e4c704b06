"""A poprun job bounded by a timeout, its output in a file: what the Horovod suite's runs share."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: How long poprun has to end its instances after SIGTERM before its whole process group is killed.
GRACE_S = 30.0


@dataclass
class Ended:
    """How a job ended: its exit status (None: stopped at the timeout) and its wall time."""

    status: int | None
    wall_s: float


def poprun(instances: int, *program: str) -> list[str]:
    """The command running ``program`` under this venv's ``poprun --horovod`` as ``instances`` instances."""
    launcher = Path(sys.executable).with_name("poprun")
    return [str(launcher), "--horovod", "--num-instances", str(instances), *program]


def shown(argv: list[str], work: Path) -> str:
    """``argv`` as a shell line, with the run's own folder as $WORK and this repository's paths relative."""
    line = shlex.join(argv).replace(str(work), "$WORK")
    return line.replace(f"{REPO}/", "")


def run(argv: list[str], cwd: Path, log: Path, timeout_s: float, env: dict[str, str] | None = None) -> Ended:
    """Run ``argv`` with its stdout and stderr in ``log``; at ``timeout_s``, SIGTERM (poprun ends its
    instances), then SIGKILL to its process group after GRACE_S."""
    start = time.monotonic()
    with log.open("wb") as out:
        process = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, **(env or {})}, start_new_session=True)
        try:
            status: int | None = process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            status = None
            process.terminate()
            try:
                process.wait(GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    return Ended(status, round(time.monotonic() - start, 1))
