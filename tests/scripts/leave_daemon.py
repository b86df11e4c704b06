"""Leave a daemon behind (fork, setsid, fork: out of the program's process group and session),
then: ``ok`` exit 0; ``fail`` instance 1 exits 3, the others wait; ``wait`` sleep until stopped.
``bare``: the daemon then runs a new program with an empty environment (nothing in it says
whose it is); either way it keeps the program's stdout and stderr.

    leave_daemon.py MARKER ok|fail|wait [bare]
"""

import os
import sys
import time

mode = sys.argv[2]
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        if sys.argv[3:] == ["bare"]:
            os.execve(sys.executable, [sys.executable, "-c", "import time; time.sleep(120)", sys.argv[1]], {})
        time.sleep(120)  # the daemon; its command line carries the marker
    os._exit(0)
os.wait()
print(f"instance {os.environ['POPDIST_INSTANCE_INDEX']} started", flush=True)
if mode == "fail" and os.environ["POPDIST_INSTANCE_INDEX"] == "1":
    sys.exit(3)
if mode in ("fail", "wait"):
    time.sleep(120)
