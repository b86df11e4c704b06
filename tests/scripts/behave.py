"""A test program whose behaviour per instance is chosen on the command line.

    behave.py MARKER [I:ACTION ...]   actions: exit=N, signal=NAME, sleep=S, stderr=TEXT, ok,
                                      ignore-term, term-cleanup=S (S seconds after SIGTERM, exit 0),
                                      waitfile=PATH (until the test creates it; 30 s at most)
Instances without an action sleep for a long time (until poprun stops them).
"""

import os
import shutil
import signal
import sys
import tempfile
import time

index = os.environ["POPDIST_INSTANCE_INDEX"]
actions = dict(arg.split(":", 1) for arg in sys.argv[2:])
steps = actions.get(index, "sleep=120").split(",")


cleanup_seconds = next((float(step.split("=", 1)[1]) for step in steps if step.startswith("term-cleanup=")), None)


def clean_up(signum: int, frame: object) -> None:
    """term-cleanup: on SIGTERM, take that long to clean up, say so, end with status 0."""
    time.sleep(cleanup_seconds or 0.0)
    print(f"instance {index} cleaned up", flush=True)
    os._exit(0)


# What it does on SIGTERM is set before it says it started: a test signals it as soon as it has.
if "ignore-term" in steps:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if cleanup_seconds is not None:
    signal.signal(signal.SIGTERM, clean_up)
print(f"instance {index} started", flush=True)
# Each instance says it has started with a file in a folder of this job (named by poprun's control
# address, unique per job) and this host (the instances of other hosts cannot see it).
_job = os.environ.get("POPRUN_CONTROL", "no-poprun").replace(":", "-")
started_dir = os.path.join(tempfile.gettempdir(), f"behave-{os.getuid()}-{sys.argv[1]}-{_job}")
os.makedirs(started_dir, exist_ok=True)
open(os.path.join(started_dir, index), "w").close()


def remove_if_all_started() -> None:
    """Remove the folder once every instance on this host has written to it (before that, one
    that is still starting would find it gone); what is left is removed by the test session."""
    try:
        if len(os.listdir(started_dir)) >= int(os.environ.get("LOCAL_WORLD_SIZE", "1")):
            shutil.rmtree(started_dir, ignore_errors=True)
    except FileNotFoundError:
        pass


def others_started() -> None:
    """Wait until every instance on this host has started, so there is something to tear down
    (ordered by their files, not by a guess at how long they take; gives up after 30 s)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    give_up = time.monotonic() + 30
    try:
        while len(os.listdir(started_dir)) < local and time.monotonic() < give_up:
            time.sleep(0.01)
    except FileNotFoundError:  # another instance saw them all and removed the folder
        return
    shutil.rmtree(started_dir, ignore_errors=True)  # every instance here has written: nothing is left


for step in steps:
    what, _, value = step.partition("=")
    if what == "exit":
        others_started()
        sys.exit(int(value))
    elif what == "signal":
        others_started()
        os.kill(os.getpid(), getattr(signal, value))
    elif what == "sleep":
        time.sleep(float(value))
    elif what == "stderr":
        print(value, file=sys.stderr, flush=True)
    elif what == "waitfile":
        give_up = time.monotonic() + 30
        while not os.path.exists(value) and time.monotonic() < give_up:
            time.sleep(0.01)
remove_if_all_started()
print(f"instance {index} done", flush=True)
