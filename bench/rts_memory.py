"""``rts_memory``: state memory per process for a large variable plus optimizer state at L=4:
replicated vs RTS vs RTS with off-chip (memory-mapped) optimizer state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET = 0.3
MiB = 1 << 20
#: glibc raises its mmap threshold after large frees and then keeps freed step temporaries in the
#: heap; a fixed threshold returns them, so resident memory measures the state, not the allocator.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def _measure(mode: str, elements: int) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-m", "bench.rts_memory_worker", mode, str(elements)],
                         capture_output=True, text=True, timeout=600, cwd=REPO,
                         env={**os.environ, **MALLOC_ENV})
    if out.returncode != 0:
        raise RuntimeError(f"rts_memory_worker {mode} failed:\n{out.stderr[-3000:]}")
    measured: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return measured


def run(quick: bool) -> dict[str, object]:
    elements = (4 if quick else 16) * MiB  # float32: 16 or 64 MiB per tensor
    raw = {mode: _measure(mode, elements) for mode in ("replicated", "rts", "rts_offchip")}
    mib = {mode: r["ram_bytes"] / MiB for mode, r in raw.items()}  # type: ignore[operator]
    ratio = mib["rts"] / mib["replicated"]
    return {
        "description": f"{elements * 4 // MiB} MiB float32 weight + 2 Adam states, 4 replicas in one process",
        "mib": mib,
        "file_resident_mib": {mode: r["file_resident_bytes"] / MiB for mode, r in raw.items()},  # type: ignore[operator]
        "accounted": {mode: r["accounted"] for mode, r in raw.items()},
        "ratio_rts_to_replicated": ratio,
        "ratio_offchip_to_replicated": mib["rts_offchip"] / mib["replicated"],
        "target": {"what": "RTS state memory / replicated (L=4)", "limit": TARGET, "value": ratio,
                   "holds": ratio <= TARGET},
    }
