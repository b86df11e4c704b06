"""Every instance fails by itself, at once: each waits until all have arrived (marker files in
the directory given), then exits with status 3 + its index. SIGTERM is ignored, so poprun's stop
request cannot turn one of these failures into a "stopped" instance."""

import os
import signal
import sys
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
directory, rank, size = sys.argv[1], int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
open(os.path.join(directory, str(rank)), "w").close()
deadline = time.monotonic() + 30
while len(os.listdir(directory)) < size and time.monotonic() < deadline:
    time.sleep(0.01)
sys.exit(3 + rank)
