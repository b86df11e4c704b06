"""How many processes the kernel's out-of-memory killer has killed in this process's memory cgroup.

A program killed by SIGKILL looks the same to its supervisor whoever sent the signal; the kernel's count
of its cgroup's OOM kills, read before the program runs and after it died, tells whether the
out-of-memory killer did it (torchrun users must guess). cgroup v2 keeps the count in
``memory.events``, cgroup v1 in ``memory.oom_control`` (``oom_kill N`` in both; kernels >= 4.13
for v1). The cgroup is shared by the processes in it: an increase says that the OOM killer ran in
the program's cgroup while the program died of SIGKILL. Built-in modules only.
"""

from __future__ import annotations

import os

CGROUP_ROOT = "/sys/fs/cgroup"


def kills() -> int | None:
    """The OOM kills counted in this process's memory cgroup (and those below it); None when no
    count can be read (no cgroup file system, no memory controller, an older kernel). The file that
    counts them is found once (a process does not change its cgroup: poprun asks for each instance)."""
    global _FOUND
    if _FOUND is None:
        _FOUND = _counter()
    return _oom_kill(_FOUND) if _FOUND else None


#: The file ``kills`` reads ("" where there is none); None until it has been looked for.
_FOUND: str | None = None


def _counter() -> str:
    """The file of this process's memory cgroup that counts its OOM kills; "" where none can be read."""
    try:
        with open("/proc/self/cgroup", "rb") as lines:
            memberships = lines.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    for line in memberships:
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        path = path.lstrip("/")
        if controllers == "":  # cgroup v2: the unified hierarchy, alone or beside v1 ("unified")
            candidates = [os.path.join(CGROUP_ROOT, path, "memory.events"),
                          os.path.join(CGROUP_ROOT, "unified", path, "memory.events")]
        elif "memory" in controllers.split(","):
            candidates = [os.path.join(CGROUP_ROOT, "memory", path, "memory.oom_control")]
        else:
            continue
        for candidate in candidates:
            if _oom_kill(candidate) is not None:
                return candidate
    return ""


def _oom_kill(path: str) -> int | None:
    """The ``oom_kill`` line's count in ``path``; None when the file or the line is not there."""
    try:
        with open(path, "rb") as file:
            text = file.read().decode(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None
