"""Partial lines, carriage returns and binary output, for tests/launcher/test_poprun_output.py.

    progress GO       write 'progress <i>\\r' (no newline), wait until the file GO exists, then 'done <i>\\n'
    hold GO0 GO1      instance 0 writes 'partial 0' and, once GO0 exists, ' end\\n'; instance 1 waits
                      for GO1, then writes 'line 1\\n'
    pieces N          N lines of this instance's letter, each in flushed pieces with a carriage return
    copy FILE         FILE's bytes to stdout, in pieces of varying size
    streams MARKER    'out 1\\n' and 'out 2' (no newline) on stdout, 200 kB and 'ready\\n' on stderr, then
                      wait to be stopped (the marker names the process for the leftover check)
"""

import os
import sys
import time
from typing import TextIO

index = int(os.environ["POPDIST_INSTANCE_INDEX"])
letter = "abcdefgh"[index]
out = sys.stdout


def write(text: str, stream: TextIO = out) -> None:
    stream.write(text)
    stream.flush()


def wait_for(path: str) -> None:
    """Wait for the test's go-ahead: a file it creates once it has seen what it waits for."""
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(9)
        time.sleep(0.01)


mode = sys.argv[1]
if mode == "progress":
    write(f"progress {index}\r")
    wait_for(sys.argv[2])
    write(f"done {index}\n")
elif mode == "hold":
    if index == 0:
        write("partial 0")
        wait_for(sys.argv[2])
        write(" end\n")
    else:
        wait_for(sys.argv[3])
        write("line 1\n")
elif mode == "pieces":
    for n in range(int(sys.argv[2])):
        write(letter * (n % 7 + 1))
        time.sleep(0.001)
        write("\r")
        write(letter * 3)
        time.sleep(0.001)
        write("\n")
elif mode == "copy":
    with open(sys.argv[2], "rb") as f:
        data = f.read()
    position, size = 0, 1
    while position < len(data):
        out.buffer.write(data[position:position + size])
        out.buffer.flush()
        position += size
        size = size * 3 % 997 + 1
elif mode == "streams":
    write("out 1\nout 2")
    write("x" * 199_999 + "\n", sys.stderr)
    write("ready\n", sys.stderr)
    time.sleep(60)
