"""Print COUNT numbered lines, one every INTERVAL seconds: a job that makes steady progress. (Any
further argument is a marker for the tests to find it by.)"""

import sys
import time

count, interval = int(sys.argv[1]), float(sys.argv[2])
for n in range(count):
    print(n, flush=True)
    time.sleep(interval)
