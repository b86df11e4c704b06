"""Writes to stdout and stderr in an order that survives only where both are one pipe or file.

Each round: a ``print``, a ``logging`` record on stderr, a line begun on stdout and ended on
stderr, a real tqdm bar on stderr (redrawn with ``\\r``, closed with its newline) and the
``print`` that follows it; at the end a line without a newline. Every write is flushed, so the
order of the writes is the order of the program (``python two_streams.py N > f 2>&1``).
"""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm

rounds = int(sys.argv[1])
logging.basicConfig(stream=sys.stderr, format="%(levelname)s %(message)s", level=logging.INFO)
log = logging.getLogger("two_streams")


def out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def err(text: str) -> None:
    sys.stderr.write(text)
    sys.stderr.flush()


for n in range(rounds):
    print(f"print {n}", flush=True)
    log.info("logging %d", n)
    out(f"begun on stdout {n}, ")
    err(f"ended on stderr {n}\n")
    for _ in tqdm(range(3), file=sys.stderr, bar_format=f"bar {n} {{n}}/{{total}}", mininterval=0, miniters=1):
        pass
    print(f"after the bar {n}", flush=True)
out("stdout without a newline, ")
err("stderr without a newline")
