"""What the MNIST example prints at its end, read back: each instance's final accuracy and weights hash."""

from __future__ import annotations

import re

FINAL = re.compile(r"^(?:\[(\d+)\] )?final: test_accuracy=(\d\.\d{4}) weights_sha256=([0-9a-f]{64})$")


def finals(stdout: str) -> dict[int, tuple[float, str]]:
    """instance -> (accuracy, hash) from the ``final:`` lines (untagged: instance 0)."""
    found = {}
    for line in stdout.splitlines():
        m = FINAL.match(line)
        if m:
            found[int(m.group(1) or 0)] = (float(m.group(2)), m.group(3))
    return found
