"""The cooperative executor: the L replicas of a step as greenlets on the calling thread.

A replica runs until it has to wait at a collective; it then switches to the next runnable
replica (or back to the scheduler loop), and the last arrival, which combines (and does any MPI
work, with its usual deadlines), marks the waiters runnable again. Only one replica runs at a
time, so a collective costs a few greenlet switches (a fraction of a microsecond each) instead
of an OS wake-up and a GIL hand-off per waiting thread: the right trade when this process has
about one core, the wrong one when it has spare cores that threads could fill with numpy work
(which releases the GIL).

A replica that returns early or calls fewer collectives is a mismatch reported at once, as
with threads (its end of step is a deposit too). Beyond that, every replica is runnable,
waiting at the rendezvous or finished, so a scheduler with nothing left to run while replicas
wait knows at once that they can never complete (:meth:`.Rendezvous.stall`); no local
deadline is needed. In exchange, steps must meet only through collectives and never block on
each other otherwise (a ``threading.Barrier`` between replicas would block the whole thread),
nor switch greenlets themselves.
"""

from __future__ import annotations

import logging
from collections import deque
from contextvars import copy_context
from functools import partial

from greenlet import GreenletExit, getcurrent, greenlet

from popdist_py.engine._execution.executor import Stall, Task
from popdist_py.engine.errors import CollectiveError

log = logging.getLogger(__name__)


class CooperativePool:
    """The cooperative executor (:class:`.executor.ReplicaExecutor`): runs ``task(i)`` for every
    replica ``i`` as a greenlet; also the rendezvous's :class:`.rendezvous.Waits`.

    Greenlets are created for each run (they cost about a microsecond and are tied to the
    thread that runs them, so a runtime may be driven from different threads in turn) and
    dropped afterwards, so the pool never keeps a run's step alive. Each starts in a copy of
    the caller's ``contextvars`` context, so settings such as ``numpy.errstate`` apply to
    every replica, and the step context that :mod:`.context` keeps there is private to it.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._ready: deque[int] = deque()
        self._greenlets: list[greenlet] = []
        self._main: greenlet | None = None

    # -- Waits (called by the rendezvous from inside replica greenlets) ----------------------------------
    def reset(self) -> None:
        self._ready.clear()

    def sleep(self, index: int, timeout: float, brief: bool = True) -> bool:
        """Let the other replicas run until one wakes this one (no deadline: see :meth:`run`)."""
        ready = self._ready
        if ready:  # straight to the next runnable replica: one switch instead of two
            self._greenlets[ready.popleft()].switch()
        else:
            main = self._main
            assert main is not None, "a replica waits outside CooperativePool.run"
            main.switch()
        return True

    def wake(self, index: int) -> None:
        self._ready.append(index)

    # -- running -------------------------------------------------------------------------------------------
    def run(self, task: Task, stall: Stall) -> None:
        """Run ``task(i)`` for every replica, round-robin; return when all have returned.

        ``task`` must not raise (it records failures itself). When no replica is runnable but
        some have not finished, ``stall()`` must wake them (returning True: the rendezvous
        fails the ones waiting in a collective that can never complete); replicas that are
        stuck anywhere else (a step that switched greenlets itself) get a CollectiveError.
        """
        if self.size == 1:
            task(0)
            return
        main = getcurrent()
        gs = [greenlet(partial(task, i), parent=main) for i in range(self.size)]
        for g in gs:  # each its own copy of the caller's context variables (numpy.errstate, ...)
            g.gr_context = copy_context()
        ready = self._ready
        ready.clear()
        ready.extend(range(self.size))
        self._main, self._greenlets = main, gs
        try:
            while True:
                while ready:
                    # a replica that waits switches to the next runnable one itself, so this
                    # returns only when a replica finishes or nobody is left to run
                    gs[ready.popleft()].switch()
                alive = [i for i, g in enumerate(gs) if not g.dead]
                if not alive:
                    return
                if stall():
                    log.debug("cooperative replicas %s: no replica could run; waiters failed", alive)
                    continue
                for i in alive:
                    if not gs[i].dead:
                        gs[i].throw(CollectiveError(
                            f"local replica {i} switched away from its greenlet outside a collective and was "
                            "never resumed (a step must not switch greenlets under the cooperative executor)"
                        ))
        finally:
            for g in gs:  # interrupted (Ctrl-C in the scheduler): unwind whatever is left
                if g and not g.dead:
                    g.throw(GreenletExit)
            ready.clear()
            self._main, self._greenlets = None, []

    def shutdown(self) -> None:
        """Nothing to stop: greenlets live only during a run."""
