"""Horovod's elastic state and ``run`` loop, over poprun's restarts.

An elastic job keeps its progress in a :class:`State`: ``commit()`` saves it; a failure restores
the last commit and carries on. Horovod's driver changes the set of workers under a running
job; an MPI world cannot change its size, so here a lost rank or host ends the start and
``poprun --max-restarts N`` (with ``--min-hosts``) starts the job again on the hosts left. So
that a new start resumes where the last commit left off, ``commit()`` also writes the state to
the job's folder on this host (the folder of TORCHELASTIC_ERROR_FILE, which poprun keeps for
every start of the job and removes at its end); ``run`` loads the newest commit any rank finds
there and broadcasts it before the function runs. Without poprun (no job folder) the state lives
in memory only, as in Horovod.

Within one start, a :class:`HorovodInternalError` (an op that failed on every rank) restores the
last commit, restarts Horovod, calls the reset callbacks and runs the function again; a second
failure with no commit in between is raised, so that a failure that repeats ends the start
instead of looping.
"""

from __future__ import annotations

import functools
import os
import pickle
import tempfile
from collections.abc import Callable
from typing import Any

from popcontract import settings
from popcontract.environment import TORCHELASTIC_ERROR_FILE
from popdist_py.horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

#: Where a rank's last commit goes in the job's folder (one file per rank of the start).
STATE_FILE = "horovod-state-{rank}.pickle"


class State:
    """What an elastic job keeps: saved at ``commit()``, restored after a failure, synced from rank 0."""

    def __init__(self, bcast_object: Callable[..., Any], get_rank: Callable[[], int]) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: list[Callable[[], None]] = []
        self.commits = 0

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Functions called after Horovod restarts (to rescale the learning rate, re-shard data...)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, update_res: int) -> None:
        """Horovod's driver calls it; hosts change here by poprun's restarts, so nothing arrives."""

    def commit(self) -> None:
        """Save the state (in memory, and in the job's folder for a restart), then check for new hosts."""
        self.save()
        self.commits += 1
        persist(self, self._rank())
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Horovod raises HostsUpdatedInterrupt when hosts were added; poprun adds hosts only at a
        restart, so a running start never sees one."""

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Called after Horovod restarted, before the reset callbacks."""

    def snapshot(self) -> Any:
        """What ``commit`` writes to the job's folder (picklable)."""
        raise NotImplementedError

    def load_snapshot(self, snapshot: Any) -> None:
        """Take a snapshot written by a commit of an earlier start as the state, and save it."""
        raise NotImplementedError


class ObjectState(State):
    """State of plain Python attributes (``epoch``, ``batch``, ...), given as keywords."""

    def __init__(self, bcast_object: Callable[..., Any], get_rank: Callable[[], int], **kwargs: Any) -> None:
        self._saved_state = dict(kwargs)
        self._set_attrs()
        super().__init__(bcast_object, get_rank)

    def save(self) -> None:
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def snapshot(self) -> Any:
        return dict(self._saved_state)

    def load_snapshot(self, snapshot: Any) -> None:
        self._saved_state = dict(snapshot)
        self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)


def _folder() -> str | None:
    """The job's folder on this host, where poprun keeps the instances' error files, or None."""
    error_file = settings.text(TORCHELASTIC_ERROR_FILE)
    return os.path.dirname(error_file) if error_file else None


def persist(state: State, rank: int) -> None:
    """Write ``state``'s last commit to the job's folder (atomically: a new file renamed in place)."""
    folder = _folder()
    if folder is None or not os.path.isdir(folder):
        return
    data = pickle.dumps((state.commits, state.snapshot()), protocol=pickle.HIGHEST_PROTOCOL)
    fd, temporary = tempfile.mkstemp(dir=folder, prefix=".horovod-state-")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(temporary, os.path.join(folder, STATE_FILE.format(rank=rank)))
    except BaseException:
        os.unlink(temporary)
        raise


def newest_on_this_host() -> tuple[int, Any] | None:
    """The newest commit an earlier start left in this host's job folder: (commits, snapshot)."""
    folder = _folder()
    if folder is None or not os.path.isdir(folder):
        return None
    newest: tuple[int, Any] | None = None
    for name in os.listdir(folder):
        if name.startswith("horovod-state-") and name.endswith(".pickle"):
            with open(os.path.join(folder, name), "rb") as f:
                commits, snapshot = pickle.load(f)
            if newest is None or commits > newest[0]:
                newest = (commits, snapshot)
    return newest


def resume(state: State, allgather_object: Callable[[Any], list[Any]], bcast_object: Callable[..., Any]) -> None:
    """At the start of a job's start: the newest commit any rank finds on its host becomes everyone's."""
    found = newest_on_this_host()
    counts = allgather_object(found[0] if found is not None else -1)
    best = max(counts)
    if best < 0:
        return
    root = counts.index(best)
    snapshot = bcast_object(found[1] if found is not None and counts[state._rank()] == best else None, root)
    state.load_snapshot(snapshot)
    state.commits = best


def run_fn(func: Callable[..., Any], reset: Callable[[], None],
           allgather_object: Callable[[Any], list[Any]]) -> Callable[..., Any]:
    """Horovod's elastic loop around ``func(state, ...)`` (see the module's docstring)."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        resume(state, allgather_object, state._bcast_object)
        failed_at: int | None = None
        skip_sync = False
        while True:
            if not skip_sync:
                state.sync()
            try:
                return func(state, *args, **kwargs)
            except HorovodInternalError:
                if failed_at == state.commits:
                    raise
                failed_at = state.commits
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as e:
                skip_sync = e.skip_sync
            reset()
            state.on_reset()

    return wrapper
