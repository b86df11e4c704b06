"""Files MPICH leaves behind when its processes are killed, and their removal.

A rank killed during a teardown never unlinks its shared-memory segments (``/dev/shm/
mpich_shm_*``, megabytes each), and a killed Hydra proxy never removes its topology file
(``/tmp/hydra_hwloc_xmlfile_*``). After a job, a file is removed only when it is this user's,
was created since the job started, and no live process has it open or mapped: so the files
of other jobs running on the host are left alone. A killed process still lists its mappings for
a few milliseconds while it exits; it is no user (else its segment would stay), but a process
whose main thread has ended while another thread runs is one. (A file that another job has created but not
yet mapped, a window of microseconds inside MPI_Init, is the one case this cannot tell apart.)

Built-in modules only: a host's supervisor may use it under ``python -S``.
"""

from __future__ import annotations

import os
from stat import S_ISDIR

SHARED_MEMORY = ("/dev/shm", "mpich_shm_")
HYDRA_TOPOLOGY = ("/tmp", "hydra_hwloc_xmlfile_")


def remove_openmpi_session(launcher_pid: int, since: float) -> str | None:
    """Open MPI's session directory of its launcher (``prterun``, the PID poprun started as
    mpiexec), ``$TMPDIR/ompi.<pid>``, which a killed prterun leaves: removed once the launcher is
    gone, when it is this user's and was changed since the job started (``since``, a
    ``time.time()``; an older one with that name is another launcher's that had the same PID).
    The path removed, or None."""
    path = os.path.join(os.environ.get("TMPDIR") or "/tmp", f"ompi.{launcher_pid}")
    try:
        info = os.lstat(path)
    except OSError:
        return None
    if not S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mtime < since:
        return None
    import shutil

    shutil.rmtree(path, ignore_errors=True)
    return None if os.path.lexists(path) else path


def remove_unused(place: tuple[str, str], since: float) -> list[str]:
    """Remove the files named ``prefix*`` in ``directory`` (``place``) that are this user's, were
    modified at or after ``since`` (a ``time.time()``), and are not in use; the paths removed."""
    directory, prefix = place
    me = os.geteuid()
    candidates = []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        if not name.startswith(prefix):
            continue
        path = os.path.join(directory, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if info.st_uid == me and info.st_mtime >= since:
            candidates.append(path)
    if not candidates:
        return []
    busy = users(set(candidates))
    removed = []
    for path in candidates:
        if path in busy:
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


#: The task flag that is set once a thread has begun to exit (``PF_EXITING``, in the flags field of
#: /proc/<pid>/stat).
_EXITING = 0x4


def open_files(pid: int) -> list[str]:
    """What process ``pid``'s descriptors point at (paths, ``socket:[inode]``, ...); OSError if it
    is gone or not ours to read."""
    return _open_files(f"/proc/{pid}")


def _open_files(task: str) -> list[str]:
    found = []
    for fd in os.listdir(f"{task}/fd"):
        try:
            found.append(os.readlink(f"{task}/fd/{fd}"))
        except OSError:
            continue  # closed meanwhile
    return found


def _exiting(task: str) -> bool:
    with open(f"{task}/stat") as stat:
        flags = stat.read().rpartition(")")[2].split()[6]
    return int(flags) & _EXITING != 0


def _running_task(pid: str) -> str | None:
    """The /proc directory that shows what process ``pid`` holds: its own while its main thread runs;
    once that thread has ended, another thread's (the process's own then shows no descriptors and no
    mappings, though its other threads go on using them); None when every thread is exiting, as a
    killed process is for a few milliseconds, with its mappings still listed."""
    process = f"/proc/{pid}"
    if not _exiting(process):
        return process
    for tid in os.listdir(f"{process}/task"):
        if tid != pid and not _exiting(f"{process}/task/{tid}"):
            return f"{process}/task/{tid}"
    return None


def users(paths: set[str]) -> dict[str, list[int]]:
    """Each of ``paths`` that some live process has open or mapped, with their PIDs (from /proc). A
    process all of whose threads are exiting is no user: what it holds goes with it."""
    found: dict[str, list[int]] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            task = _running_task(pid)
            if task is None:
                continue
            held = paths.intersection(_open_files(task))
            with open(f"{task}/maps") as maps:
                for line in maps:
                    path = "/" + line.rstrip("\n").partition("/")[2]
                    if path in paths:
                        held.add(path)
        except OSError:
            continue  # gone, or not ours to read
        for path in held:
            found.setdefault(path, []).append(int(pid))
    return found
