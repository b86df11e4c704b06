"""Prints the OpenBLAS kernels (``OPENBLAS_CORETYPE`` values) this CPU can run, other than the one
OpenBLAS picks by itself, one per line: ``make test`` runs the determinism tests under each.

A kernel is listed when the CPU has the instructions it needs and numpy's OpenBLAS, asked for it,
reports a core of its own (a build maps several names onto one core, e.g. Zen onto Haswell).
Nothing is printed where numpy's BLAS is not OpenBLAS or the CPU is not x86-64."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

#: OpenBLAS's x86-64 core names, oldest first, with the /proc/cpuinfo flags each needs.
NEEDS: dict[str, set[str]] = {
    "Prescott": {"pni"},
    "Nehalem": {"ssse3", "sse4_1", "sse4_2"},
    "Sandybridge": {"avx"},
    "Haswell": {"avx2", "fma"},
    "Zen": {"avx2", "fma"},
    "SkylakeX": {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"},
    "Cooperlake": {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "avx512_bf16"},
    "SapphireRapids": {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "avx512_bf16", "avx512_fp16"},
}
PROBE = "import numpy; numpy.ones((4, 4)) @ numpy.ones((4, 4))"


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    m = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    return set(m.group(1).split()) if m else set()


def core(coretype: str | None) -> str | None:
    """The core numpy's OpenBLAS runs when asked for ``coretype`` (None: its own choice)."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    env["OPENBLAS_VERBOSE"] = "2"
    if coretype:
        env["OPENBLAS_CORETYPE"] = coretype
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
    m = re.search(r"^Core: (\S+)", out.stdout + out.stderr, re.MULTILINE)
    return m.group(1) if m else None


def kernels() -> list[str]:
    flags = cpu_flags()
    seen = {core(None)}
    if None in seen:
        return []
    found = []
    for name, needs in NEEDS.items():
        if needs <= flags:
            actual = core(name)
            if actual is not None and actual not in seen:
                seen.add(actual)
                found.append(name)
    return found


if __name__ == "__main__":
    print("\n".join(kernels()))
