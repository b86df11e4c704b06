"""An instance for tests/launcher/test_poprun_own_output.py: notes each start, writes LINES lines
of 500 bytes to STREAM (stdout or stderr), notes its end and exits with STATUS. With ``wait``, the
first start says ``waiting`` on stdout first and waits for the file DIR/go (the test makes it once
poprun's output has been cut off); with ``partial``, each start first writes ``partial`` to stdout,
a line it does not end.

argv: DIR STREAM LINES STATUS [wait|partial]
"""

import os
import sys
import time

directory, stream, lines, status = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
restart = int(os.environ["POPDIST_RESTART_COUNT"])
with open(os.path.join(directory, "starts"), "a") as starts:
    starts.write(f"{restart}\n")
if sys.argv[5:] == ["wait"] and restart == 0:
    print("waiting", flush=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(directory, "go")):
        if time.monotonic() > deadline:
            sys.exit(99)
        time.sleep(0.01)
if sys.argv[5:] == ["partial"]:
    print("partial", end="", flush=True)
out = sys.stdout if stream == "stdout" else sys.stderr
for i in range(lines):
    out.write(f"line {i:5d} {'x' * 488}\n")
    out.flush()
with open(os.path.join(directory, f"done-{restart}"), "w"):
    pass
sys.exit(status)
