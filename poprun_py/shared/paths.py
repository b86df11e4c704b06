"""``which``: find a program on PATH, as ``shutil.which`` does for the common case.

``shutil`` is not imported on the launch path: it pulls in ``fnmatch``/``re`` and the
compression modules, ~4 ms that every launch would pay before mpiexec starts.
"""

from __future__ import annotations

import os

from popcontract import settings


def which(name: str, path: str | None = None) -> str | None:
    """The first executable file called ``name`` on ``path`` (default: $PATH); a name with a
    slash is checked as it is. None when there is none."""
    if os.sep in name:
        return name if _is_executable_file(name) else None
    search = os.environ.get("PATH", os.defpath) if path is None else path
    for folder in search.split(os.pathsep):
        candidate = os.path.join(folder or os.curdir, name)
        if _is_executable_file(candidate):
            return candidate
    return None


def _is_executable_file(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


#: Where the job's directory of error files (and poprun's stubs' socket) may go, in order, as
#: ``tempfile.gettempdir`` looks (without importing ``tempfile``, which brings ``shutil`` and
#: ``random`` to every launch): the folder the environment names, then the usual ones.
TEMPORARY_VARIABLES = ("TMPDIR", "TEMP", "TMP")
TEMPORARY_FOLDERS = ("/tmp", "/var/tmp", "/usr/tmp")


def private_folder(folder: str) -> bool:
    """Whether ``folder`` is a folder of this user's that no one else may enter (not a link)."""
    import stat

    try:
        info = os.lstat(folder)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o077


def temporary_folder() -> str:
    """The folder of the job's directory of error files, the same path on every host (a remote
    host's supervisor has it), and of the private directory of its host's stubs' socket: the first
    of TMPDIR, TEMP, TMP, /tmp, /var/tmp, /usr/tmp that is a folder poprun can write to here (a
    read-only /tmp is passed over); /tmp when none is, so that the warning names it."""
    named = [settings.passed(name, "") for name in TEMPORARY_VARIABLES]
    for folder in [os.path.abspath(path) for path in named if path] + list(TEMPORARY_FOLDERS):
        if os.path.isdir(folder) and os.access(folder, os.W_OK | os.X_OK):
            return folder
    return TEMPORARY_FOLDERS[0]
