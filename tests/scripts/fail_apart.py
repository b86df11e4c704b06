"""Two instances that fail by themselves, one after the other, each ordered by what the other did
(files in MARKER_DIR), not by a race; the other instances wait to be stopped.

``fail_apart.py MARKER_DIR FIRST SECOND GAP MODE``:

- MODE ``record``: instance FIRST records ``ValueError: first failure`` in its error file as torch's
  ``@record`` does, then lingers (poprun stops it); SECOND, GAP seconds after that record, records
  ``RuntimeError: second failure`` and exits 3.
- MODE ``no-record``: as ``record``, but SECOND records nothing (it only exits 3).
- MODE ``end``: FIRST exits 4 without an error file, leaving a child that holds its output open, so
  that its exit report comes about a second late (its stub drains the pipes first); SECOND, GAP
  seconds after FIRST has ended, records ``RuntimeError: second failure`` and exits 3 at once: its
  report comes first.
"""

import json
import os
import subprocess
import sys
import time

HOLD_SECONDS = 60


def record(message: str) -> None:
    """What torch's ``ErrorHandler.record_exception`` writes."""
    data = {"message": {"message": message, "extraInfo": {
        "py_callstack": f"Traceback (most recent call last):\n  File \"fail_apart.py\", line 1, in train\n{message}\n",
        "timestamp": str(int(time.time()))}}}
    with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as handle:
        json.dump(data, handle)


def wait_for(path: str) -> str:
    deadline = time.monotonic() + HOLD_SECONDS
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(9)
        time.sleep(0.005)
    with open(path) as handle:
        return handle.read()


def mark(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as handle:
        handle.write(text)
    os.replace(path + ".tmp", path)


def main() -> None:
    markers, first, second, gap, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
    me = int(os.environ["RANK"])
    done = os.path.join(markers, "first")
    if me == first:
        if mode == "end":
            subprocess.Popen(["sleep", str(HOLD_SECONDS)])  # holds this program's stdout and stderr
            mark(done, str(os.getpid()))
            sys.exit(4)
        record("ValueError: first failure")
        mark(done, str(os.getpid()))
        time.sleep(HOLD_SECONDS)
    elif me == second:
        pid = wait_for(done)
        if mode == "end":  # until its stub has collected its exit
            while os.path.exists(f"/proc/{pid}"):
                time.sleep(0.005)
        time.sleep(gap)
        if mode != "no-record":
            record("RuntimeError: second failure")
        sys.exit(3)
    else:
        time.sleep(HOLD_SECONDS)


if __name__ == "__main__":
    main()
