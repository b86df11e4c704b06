"""Print numbered lines of 100 bytes as fast as they are taken until FOLDER/stop exists, then write
how many to FOLDER/done-<instance>: the reader can check that every line arrived, in order."""

import os
import sys

folder = sys.argv[1]
index = os.environ["POPDIST_INSTANCE_INDEX"]
stop = os.path.join(folder, "stop")
pad = "x" * 90
out = sys.stdout
count = 0
while not os.path.exists(stop):
    for _ in range(1000):
        out.write(f"{count:9d} {pad}\n")
        count += 1
    out.flush()
with open(os.path.join(folder, f"done-{index}"), "w") as done:
    done.write(str(count))
