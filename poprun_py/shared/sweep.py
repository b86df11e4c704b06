"""What the sweeps of leftover processes share: finding a process in /proc, and killing only it.

The teardown's sweeps kill processes poprun did not start itself (whatever is left in mpiexec's
session, and the launcher agents mpiexec left to poprun with what they started here,
``teardown.Teardown.kill_leftovers`` and ``end_what_agents_left``); they end :func:`leftovers`:
poprun's descendants, which it adopts as their subreaper, and processes that carry the job's
marks in their environment. Each finds its targets by reading /proc;
between that read and the kill, a target may exit and its PID go to an unrelated process. So each
kill here pins the process first (a pidfd), checks it again through /proc, and signals it through
the pin: the signal reaches the process that passed the check, or none. Because the check is
made here again, no slip in a sweep's own search (a condition turned round, a mark matched by any
process) can widen what it kills; ``make mutants-launcher`` relies on that, and this module is
tested directly, not mutated (docs/mutation.md).

Built on ``os``, ``_signal`` and ``popcontract.compiled`` alone: the Python stub imports it under
``python -S``.
"""

from __future__ import annotations

import _signal
import errno
import os
import sys

from popcontract import compiled

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing under python -S
if TYPE_CHECKING:
    from collections.abc import Callable


def pids() -> list[int]:
    """Every PID /proc lists (none where there is no /proc)."""
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []


def _read_stat(pid: int) -> list[bytes] | None:
    """The fields of /proc/PID/stat after the command's name (state ppid pgrp session ...), zombie
    or not; None once the process is gone (reaped)."""
    try:  # os.open/os.read: a buffered file object per process would cost 3x as much
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
        try:
            stat = os.read(fd, 1024)
        finally:
            os.close(fd)
    except OSError:
        return None
    fields = stat.rsplit(b")", 1)[-1].split()
    return fields if len(fields) > _START_TIME else None


#: Index of the start time (clock ticks after boot) among :func:`_read_stat`'s fields (stat's 22nd).
_START_TIME = 19


def _stat_fields(pid: int) -> list[bytes] | None:
    """:func:`_read_stat`'s fields; None once the process is gone or a zombie."""
    fields = _read_stat(pid)
    return None if fields is None or fields[0] == b"Z" else fields


def has_ended(pid: int) -> bool:
    """Whether ``pid`` has exited: it is a zombie, or gone."""
    return _stat_fields(pid) is None


def start_time(pid: int) -> bytes | None:
    """When ``pid`` started, as /proc gives it, zombie or not; None once it has been reaped. While
    the value stays the same, ``pid`` is still the same process (PIDs are reused)."""
    fields = _read_stat(pid)
    return None if fields is None else fields[_START_TIME]


def _stat(pid: int) -> tuple[int, int] | None:
    """A live process's parent and session IDs; None once it is gone or a zombie."""
    fields = _stat_fields(pid)
    return None if fields is None else (int(fields[1]), int(fields[3]))


def is_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped: by SIGSTOP or SIGTSTP (state T), or at a debugger's stop (t)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] in (b"T", b"t")


def in_session(pid: int, session: int) -> bool:
    """Whether ``pid`` is alive, not a zombie, in ``session``, and not this process."""
    stat = _stat(pid)
    return stat is not None and stat[1] == session and pid != os.getpid()


def descendants(root: int) -> list[int]:
    """Live processes below ``root``: its children, theirs, and so on (one reading of /proc, which
    this process skips when it has no child: a stub's end, once its program is collected)."""
    if root == os.getpid() and not has_children():
        return []
    children: dict[int, list[int]] = {}
    for pid in pids():
        stat = _stat(pid)
        if stat is not None:
            children.setdefault(stat[0], []).append(pid)
    found, below = [], list(children.get(root, ()))
    while below:
        pid = below.pop()
        found.append(pid)
        below += children.get(pid, ())
    return found


def descends_from(pid: int, root: int) -> bool:
    """Whether ``pid`` is alive, not a zombie, and below ``root`` (its parent's parent's ... is it)."""
    seen = set()
    while pid not in seen:  # a chain read while processes come and go could loop
        seen.add(pid)
        stat = _stat(pid)
        if stat is None or stat[0] <= 0:
            return False
        if stat[0] == root:
            return True
        pid = stat[0]
    return False


def has_children() -> bool:
    """Whether this process has a child, alive or ended and not yet collected (none is collected
    here): one system call, where finding them in /proc reads every process on the host."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


#: Whether :func:`adopt_orphans` made this process the subreaper of its descendants.
_adopting = {"held": False}


def adopt_orphans() -> bool:
    """Become the subreaper of this process's descendants (``_subreaper``): an orphan among them is
    then adopted by this process, not by init. A stub ends the program's daemons it adopts;
    poprun collects the ends of what the job orphans on its host
    (:func:`reap_adopted`). Where the system does not allow it, nothing changes. Whether it is now."""
    subreaper = compiled.load(compiled.SUBREAPER)
    try:
        _adopting["held"] = bool(subreaper.become() if subreaper is not None else _become_through_libc())
    except OSError:
        pass  # the teardown's search by environment still finds marked daemons
    return _adopting["held"]


#: prctl's option (linux/prctl.h): make the calling process the subreaper of its descendants.
PR_SET_CHILD_SUBREAPER = 36


def _become_through_libc() -> bool:
    """``_subreaper.become()`` where it was not built: the same prctl call, made through libc by ctypes
    (imported here only: with the call about 2 ms against 0.5 ms, at every instance's start); False off Linux."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(ctypes.c_int(PR_SET_CHILD_SUBREAPER), ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0),
                  ctypes.c_ulong(0)) != 0:
        number = ctypes.get_errno()
        raise OSError(number, os.strerror(number))
    return True


def adopts_orphans() -> bool:
    """Whether :func:`adopt_orphans` made this process the subreaper of its descendants: then every
    process they start stays below this one, whatever its parents do (an orphan goes to the nearest
    subreaper above it), until it ends."""
    return _adopting["held"]


def reap_adopted() -> int:
    """Collect the end of every child of this process that is a zombie (call it once the children
    whose status it reads itself are collected); how many. An adopted orphan would otherwise stay
    a zombie for as long as this process lives, and go on to init, which in a container may reap
    nothing. Asked of the kernel, one ended child at a time: poprun's end waits for this, and a
    reading of /proc would read every process on the host."""
    count = 0
    while True:
        try:
            if os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG) is None:
                return count  # children, none ended
        except ChildProcessError:
            return count  # no child left
        count += 1


def holds_marks(pid: int, marks: tuple[bytes, ...]) -> bool:
    """Whether ``pid`` is alive, not a zombie, not this process, and its environment holds every
    one of ``marks`` (each a whole ``NAME=value`` entry); never true for no marks.

    The environment is read first, and the process's state only for a match: a search by
    environment (the teardown's, where poprun is no subreaper) asks this of every process on
    the host, nearly all of them unmarked or not its user's: one failed open or one read each."""
    if not marks or pid == os.getpid():
        return False
    try:
        fd = os.open(f"/proc/{pid}/environ", os.O_RDONLY)
    except OSError:
        return False  # gone, or not ours to read
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except OSError:
        return False  # gone meanwhile
    finally:
        os.close(fd)
    environ = b"\0" + b"".join(chunks) + b"\0"
    return all(b"\0" + mark + b"\0" in environ for mark in marks) and _stat(pid) is not None


def leftovers(root: int, marks: tuple[bytes, ...] = (), spare: int = 0) -> list[int]:
    """What a sweep ends: the live processes below ``root`` (whatever they orphaned too, where ``root``
    is their subreaper) and, given ``marks`` (where it is none), every process whose environment
    holds them; never ``spare`` (a PID, 0: none) nor what is below it."""
    found = descendants(root) + ([pid for pid in pids() if holds_marks(pid, marks)] if marks else [])
    spared = {spare, *descendants(spare)} if spare else set()
    return [pid for pid in dict.fromkeys(found) if pid not in spared]


def kill_leftover(pid: int, root: int, marks: tuple[bytes, ...] = (), spare: int = 0) -> bool:
    """SIGKILL ``pid`` if, once pinned, it is still one of :func:`leftovers`' (below ``root``, or
    holding ``marks``; not ``spare`` nor below it) and not this process."""
    return _kill_checked(pid, lambda: pid != os.getpid() and (descends_from(pid, root) or holds_marks(pid, marks))
                         and not (spare and (pid == spare or descends_from(pid, spare))))


def kill_in_session(pid: int, session: int) -> bool:
    """SIGKILL ``pid`` if, once pinned, it is still in ``session``; whether it was signalled."""
    return _kill_checked(pid, lambda: in_session(pid, session))




def _kill_checked(pid: int, check: Callable[[], bool]) -> bool:
    if pid <= 1:
        return False
    try:
        pin = os.pidfd_open(pid)
    except OSError as error:
        if error.errno != errno.ENOSYS:
            return False  # gone
        pin = None  # a kernel before 5.3: checked, then signalled by PID
    try:
        if not check():
            return False
        if pin is None:
            os.kill(pid, _signal.SIGKILL)
        else:
            _signal.pidfd_send_signal(pin, _signal.SIGKILL)
        return True
    except (ProcessLookupError, PermissionError):
        return False
    finally:
        if pin is not None:
            os.close(pin)
