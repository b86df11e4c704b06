"""What every benchmark entry records: the machine, the MPI library, the date."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys


def machine_info() -> dict[str, object]:
    library = "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
    mpi = subprocess.run([sys.executable, "-c", library],
                         capture_output=True, text=True, timeout=60).stdout.strip().replace("\0", "")
    import numpy

    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cores": os.cpu_count(),
        "cpu": _cpu_model(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "mpi_library": mpi,
        "platform": platform.platform(),
        "commit": _commit(),
    }


def _commit() -> str:
    """The checkout's commit, "+" when its tracked files differ from it; "" outside a git checkout."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=30)
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=here, capture_output=True, timeout=30)
    except OSError:
        return ""
    return head.stdout.strip() + ("+" if dirty.returncode == 1 else "") if head.returncode == 0 else ""


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
