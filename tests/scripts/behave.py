"""A test program whose behaviour per instance is chosen on the command line.

    behave.py MARKER [I:ACTION ...]   actions: exit=N, signal=NAME, sleep=S, stderr=TEXT, ok
Instances without an action sleep for a long time (until poprun stops them).
"""

import os
import signal
import sys
import time

index = os.environ["POPDIST_INSTANCE_INDEX"]
actions = dict(arg.split(":", 1) for arg in sys.argv[2:])
print(f"instance {index} started", flush=True)
for step in actions.get(index, "sleep=120").split(","):
    what, _, value = step.partition("=")
    if what == "exit":
        time.sleep(0.3)  # let the others start, so there is something to tear down
        sys.exit(int(value))
    elif what == "signal":
        time.sleep(0.3)
        os.kill(os.getpid(), getattr(signal, value))
    elif what == "sleep":
        time.sleep(float(value))
    elif what == "stderr":
        print(value, file=sys.stderr, flush=True)
    elif what == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(f"instance {index} done", flush=True)
