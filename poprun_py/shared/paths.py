"""``which``: find a program on PATH, as ``shutil.which`` does for the common case.

``shutil`` is not imported on the launch path: it pulls in ``fnmatch``/``re`` and the
compression modules, ~4 ms that every launch would pay before mpiexec starts.
"""

from __future__ import annotations

import os


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
