"""Tear a job down on this host so that no process outlives poprun.

The instances still running are told to stop (TERMINATE to their stubs); mpiexec's process group
is sent SIGTERM, then SIGKILL, if it has not ended by then; and when poprun is done, whatever is
still in mpiexec's session is killed and the files MPICH's killed processes left are removed.
"""

from __future__ import annotations

import _signal
import os
import time

from poprun_py.shared import sweep
from poprun_py.shared.errors import printable
from poprun_py.supervision import log
from poprun_py.supervision.states import signal_name
from poprun_py.wire import protocol

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing on the launch path
if TYPE_CHECKING:
    from collections.abc import Callable

    from poprun_py.supervision.process import Process
    from poprun_py.supervision.states import InstanceState

#: How long after the instances' grace (SIGTERM to SIGKILL, ``environment.KILL_GRACE``) a teardown
#: signals mpiexec's process group, then kills it: a stub that no longer answers is not waited for.
TERM_MPIEXEC_MARGIN = 0.5
KILL_MPIEXEC_MARGIN = 1.5
#: ``Teardown.started`` when a second signal asks for the escalation at once.
AT_ONCE = -float("inf")
#: How long poprun waits for mpiexec to exit after SIGKILL, and for the processes it killed in
#: mpiexec's session to be gone.
MPIEXEC_EXIT_WAIT = 5.0
EXIT_WAIT = 2.0
#: How often poprun looks whether they are gone.
EXIT_POLL = 0.01


class Teardown:
    """The teardown of one run of mpiexec: when it started, and each step of it."""

    def __init__(self, instances: list[InstanceState], grace: float = protocol.DEFAULT_GRACE,
                 through_agent: bool = False, mark: bytes = b"") -> None:
        """``grace``: the instances' own, so that a program given longer to end is not cut short;
        ``through_agent``: the remote hosts are reached by a launcher agent, not ssh (see
        ``kill_leftovers``); ``mark``: the ``NAME=value`` entry of this start's own in mpiexec's
        environment, which whatever it starts here inherits (found by it where poprun cannot be
        the subreaper of what the agents leave)."""
        self.instances = instances
        self.through_agent = through_agent
        self.mark = mark
        self.term_after = grace + TERM_MPIEXEC_MARGIN
        self.kill_after = grace + KILL_MPIEXEC_MARGIN
        self.mpiexec: Process | None = None
        #: time.monotonic() when it started (None: not started; AT_ONCE: escalate at once).
        self.started: float | None = None
        #: The last signal the escalation sent mpiexec's process group (each is sent once).
        self.signalled: int | None = None
        #: Begun by a signal's handler, which says nothing: ``say_begun`` says it later.
        self.unsaid = False

    def begin(self, quiet: bool = False) -> None:
        """Tell every instance still running to stop (once). ``quiet``: from a signal's handler,
        which must not write to stderr (the loop may be inside such a write): say it later."""
        if self.started is not None:
            return
        self.started = time.monotonic()
        self.unsaid = quiet
        if not quiet:
            log.info("stopping every instance")
        for state in self.instances:  # one that has not called in yet is told when it does
            self.terminate(state)

    def say_begun(self) -> None:
        """Say that the teardown began, if a signal's handler began it (see ``begin``)."""
        if self.unsaid:
            self.unsaid = False
            log.info("stopping every instance")

    def terminate(self, state: InstanceState) -> None:
        """Tell one instance to stop, if it is connected and still running."""
        if not state.attached or state.finished:
            return
        state.stopped_by_poprun = True
        state.send(protocol.TERMINATE)

    def escalate(self) -> None:
        """Signal mpiexec's process group once the instances have had their time to stop."""
        if self.started is None or self.mpiexec is None or self.mpiexec.poll() is not None:
            return
        elapsed = time.monotonic() - self.started
        sig = _signal.SIGKILL if elapsed >= self.kill_after else _signal.SIGTERM if elapsed >= self.term_after else None
        if sig is not None and sig != self.signalled:
            self.signalled = sig
            self._signal_mpiexec(sig)

    def stop_mpiexec(self) -> None:
        """SIGKILL mpiexec's process group: what is left of it has nothing to do (every instance ended)."""
        self._signal_mpiexec(_signal.SIGKILL)

    def _signal_mpiexec(self, sig: int) -> None:
        assert self.mpiexec is not None
        log.debug("sending %s to mpiexec's process group", signal_name(sig))
        try:
            os.killpg(self.mpiexec.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill_leftovers(self) -> None:
        """Last resort on this host: nothing started in mpiexec's session may survive poprun."""
        if self.mpiexec is None:
            return
        if self.mpiexec.poll() is None:
            self._signal_mpiexec(_signal.SIGKILL)
            if self.mpiexec.wait(timeout=MPIEXEC_EXIT_WAIT) is None:
                log.error("mpiexec (PID %d) did not exit after SIGKILL", self.mpiexec.pid)
        killed = False
        # Of a job whose every instance ended well by itself, what is left is news (a daemon its
        # program started); of one that failed, or was stopped, what had not finished starting or
        # stopping yet is not (an agent, an MPI daemon still reaching a host when another could not
        # be reached; an instance still exiting), and is said at -vv.
        ended_well = self.started is None and all(state.status == 0 for state in self.instances)
        say = log.warning if ended_well else log.debug
        for pid in session_members(self.mpiexec.pid):
            command = command_line(pid)
            if sweep.kill_in_session(pid, self.mpiexec.pid):
                killed = True
                if command:  # an empty command line: the process was already exiting
                    say("killed process %d (%s) left behind in the job's session", pid, command)
        # What started the remote hosts' side (a launcher agent such as kubectl, as ssh) is put in a
        # session of its own by Hydra and prterun, and comes to poprun once mpiexec has gone (it is
        # their subreaper). An agent may hold mpiexec's listening socket, inherited, on which a
        # proxy there that started after mpiexec ended would wait for ever: it ends with the job,
        # and so does whatever it started here (a helper in the background), until none is left
        # (an agent's end gives its orphans to poprun). ssh closes what it inherits, so no such
        # wait can hang on it: ssh clients are left to end with their remote side, as before
        # agents came.
        deadline = time.monotonic() + EXIT_WAIT
        while self.through_agent and time.monotonic() < deadline and self._end_left_here("mpiexec left", 0):
            time.sleep(EXIT_POLL)
        # Until the killed are gone they still map MPICH's segments, which would then look in use
        # to remove_files_left and stay behind. (Nothing killed, nothing to wait for: every job's
        # end would read /proc once more.)
        deadline = time.monotonic() + EXIT_WAIT
        while killed and session_members(self.mpiexec.pid) and time.monotonic() < deadline:
            time.sleep(EXIT_POLL)
        for state in self.instances:
            state.output.flush()
            if state.connection is not None:
                state.connection.close()
                state.connection = None

    def end_what_agents_left(self) -> None:
        """Through an agent, once every instance has ended while mpiexec still runs: a process an
        agent started here that outlived it (a helper in the background) came to poprun, their
        subreaper; it may hold mpiexec's pipes, which Hydra would wait on for ever. Ended, and
        said; mpiexec and what runs below it (the agents still running) are spared."""
        if self.through_agent and self.mpiexec is not None and self.mpiexec.returncode is None:
            self._end_left_here("the launcher agent left running here", self.mpiexec.pid, log.warning)

    def _end_left_here(self, who: str, spare: int, say: Callable[..., None] = log.debug) -> bool:
        """SIGKILL ``sweep.leftovers`` below poprun (with this start's mark where poprun adopts no
        orphans), but ``spare`` and its descendants; each said, with its command line, as left by
        ``who``. Whether any was found."""
        me, marks = os.getpid(), (self.mark,) if self.mark and not sweep.adopts_orphans() else ()
        found = sweep.leftovers(me, marks, spare)
        for pid in found:
            command = command_line(pid)
            if sweep.kill_leftover(pid, me, marks, spare):
                say("killed process %d (%s), which %s", pid, command, who)
        return bool(found)


def remove_files_left(since: float, launcher_pid: int | None = None) -> None:
    """What killed MPI processes of this job left on this host (see poprun_py.shared.leftovers): MPICH's
    files, and the session directory of Open MPI's launcher once it has exited."""
    from poprun_py.shared import leftovers

    removed = [path for place in (leftovers.HYDRA_TOPOLOGY, leftovers.SHARED_MEMORY)
               for path in leftovers.remove_unused(place, since)]
    if launcher_pid is not None and (session := leftovers.remove_openmpi_session(launcher_pid, since)):
        removed.append(session)
    for path in removed:
        log.debug("removed %s, left by the job's killed processes", path)


def command_line(pid: int) -> str:
    """How a process the sweep kills is named: the first 200 bytes of its command line, as text
    (any bytes that are not UTF-8 replaced); "" once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return printable(handle.read(200).replace(b"\0", b" ").decode(errors="replace").strip())
    except OSError:
        return ""


def session_members(session_id: int) -> list[int]:
    """PIDs whose session is ``session_id`` (Linux /proc), excluding zombies."""
    return [pid for pid in sweep.pids() if sweep.in_session(pid, session_id)]
