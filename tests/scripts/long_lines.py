"""Write many long lines at once, to prove poprun never interleaves lines of instances."""

import os
import sys

index = int(os.environ["POPDIST_INSTANCE_INDEX"])
char = "abcdefgh"[index]
count, width = int(sys.argv[1]), int(sys.argv[2])
out = sys.stdout
for n in range(count):
    out.write(f"{n}:" + char * width + "\n")
    if n % 3 == 0:
        out.write(f"{n}:" + char * 7)  # a partial line, finished by the next write
        out.flush()
        out.write(char * (width - 7) + "\n")
out.write("no newline at the end")
