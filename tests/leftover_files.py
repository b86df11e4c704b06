"""What a test run leaves in /dev/shm and /tmp: ``make test`` lists both before it starts and
fails if it ends with a file of MPI, poprun or the test suite there that was not there before.

    python -m tests.leftover_files snapshot FILE    # before: the names there now, into FILE
    python -m tests.leftover_files check FILE       # after: one line per new name; status 1 if any

Only names of the kinds this project's jobs make are counted (another program on the machine
may make files there at any time): MPICH's shared memory and Hydra's topology files, Open MPI's
session directories, poprun's error directories and mpiexec files, the MPI suites' temp roots.
"""

from __future__ import annotations

import os
import sys

PLACES = ("/dev/shm", "/tmp")
KINDS = ("mpich_shm_", "hydra_hwloc_xmlfile_", "ompi.", "prted.", "poprun-", "pytest-mpi-", "torchelastic_")


def names() -> set[str]:
    found = set()
    for place in PLACES:
        try:
            entries = os.listdir(place)
        except OSError:
            continue
        found |= {os.path.join(place, name) for name in entries if name.startswith(KINDS)}
    return found


def describe(path: str, since: float) -> str:
    """``path`` with what tells where it came from: its age against ``since`` (a ``time.time()``)
    and the processes that still have it open or mapped."""
    from poprun_py.shared.leftovers import users

    try:
        modified = os.lstat(path).st_mtime
    except OSError:
        return f"{path} (gone since)"
    pids = users({path}).get(path)
    held = f"; in use by PID {', '.join(map(str, pids))}" if pids else ""
    return f"{path} (modified {modified - since:+.3f} s from the start{held})"


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("snapshot", "check"):
        print(__doc__, file=sys.stderr)
        return 2
    command, path = argv
    if command == "snapshot":
        with open(path, "w") as handle:
            handle.write("".join(f"{name}\n" for name in sorted(names())))
        return 0
    with open(path) as handle:
        before = set(handle.read().splitlines())
    left = sorted(names() - before)
    for name in left:
        print(f"left behind by the tests: {name}", file=sys.stderr)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
