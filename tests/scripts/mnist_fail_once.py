"""examples/mnist_rts.py, except that on its first run (POPDIST_RESTART_COUNT=0) one instance
fails in the middle of the second epoch: a crash for --max-restarts to recover from, at a point
fixed by the program itself rather than by a timer.

$MNIST_FAIL_INSTANCE names the instance (default 1); $MNIST_FAIL_HOW is ``kill`` (default: it
kills itself with SIGKILL) or ``pause`` (it prints "pausing mid-epoch" and waits to be ended: the
test then takes its host away)."""

import os
import runpy
import signal
import sys
import time
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

# E402: mnist needs the examples directory on the path first
from mnist import datasets  # noqa: E402

train_batches = datasets.train_batches


def crashing_batches(*args, **kwargs):  # type: ignore[no-untyped-def]
    crash = (kwargs["epoch"] == 1 and os.environ.get("POPDIST_RESTART_COUNT") == "0"
             and os.environ.get("POPDIST_INSTANCE_INDEX") == os.environ.get("MNIST_FAIL_INSTANCE", "1"))
    for step, batch in enumerate(train_batches(*args, **kwargs)):
        if crash and step == 3:
            if os.environ.get("MNIST_FAIL_HOW", "kill") == "pause":
                print("pausing mid-epoch", flush=True)
                while True:
                    time.sleep(1)
            os.kill(os.getpid(), signal.SIGKILL)
        yield batch


datasets.train_batches = crashing_batches
sys.argv[0] = str(EXAMPLES / "mnist_rts.py")
runpy.run_path(sys.argv[0], run_name="__main__")
