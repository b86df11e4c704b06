"""examples/mnist_rts.py, except that on its first run (POPDIST_RESTART_COUNT=0) instance 1
kills itself with SIGKILL in the middle of the second epoch: a crash for --max-restarts to
recover from, at a point fixed by the program itself rather than by a timer."""

import os
import runpy
import signal
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

# E402: mnist needs the examples directory on the path first
from mnist import datasets  # noqa: E402

train_batches = datasets.train_batches


def crashing_batches(*args, **kwargs):  # type: ignore[no-untyped-def]
    crash = (kwargs["epoch"] == 1 and os.environ.get("POPDIST_RESTART_COUNT") == "0"
             and os.environ.get("POPDIST_INSTANCE_INDEX") == "1")
    for step, batch in enumerate(train_batches(*args, **kwargs)):
        if crash and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        yield batch


datasets.train_batches = crashing_batches
sys.argv[0] = str(EXAMPLES / "mnist_rts.py")
runpy.run_path(sys.argv[0], run_name="__main__")
