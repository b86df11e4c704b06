"""What poprun says when a job ends badly: the summary on stderr, and the failure report behind
``--error-file`` and the restart message. Imported only when there is something to report."""

from __future__ import annotations

import datetime
import time
from functools import cached_property

from poprun_py.shared.errors import printable
from poprun_py.supervision.states import Failure, InstanceState, describe_status, signal_name

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from poprun_py.supervision.first_failure import Failed

#: poprun's exit status when instances left early (see ``Report._left_early``): the status of the
#: instances mpiexec then ended (143 for its SIGTERM) would read as poprun's own SIGTERM.
LEFT_EARLY_STATUS = 1


class Report:
    """Reads the end of one run: who failed first, how, and what else went wrong."""

    def __init__(self, instances: list[InstanceState], failure: Failure | None, remote_hosts: frozenset[str],
                 host_failures: Callable[[], dict[str, str]]) -> None:
        self.instances = instances
        self.failure = failure
        self.remote_hosts = remote_hosts
        #: What the launcher's output says went wrong on which host (read only when needed).
        self.host_failures = host_failures

    @cached_property
    def _by_host(self) -> dict[str, list[InstanceState]]:
        """Each host's instances, in the order of the hosts' first instances (read once: a job may
        have thousands of hosts, and a failure is looked at host by host)."""
        grouped: dict[str, list[InstanceState]] = {}
        for state in self.instances:
            grouped.setdefault(state.host, []).append(state)
        return grouped

    @cached_property
    def _blamed(self) -> dict[str, str]:
        """What the launcher's output says went wrong on which host, read once."""
        return self.host_failures()

    @cached_property
    def failures(self) -> list[Failed]:
        """Every instance that failed, the first first (see ``first_failure``)."""
        from poprun_py.supervision.first_failure import failures

        return failures(self.instances)

    @cached_property
    def cause(self) -> InstanceState | None:
        """The root cause: the instance that failed first. A host lost (its instances ended without a
        report, or its MPI daemon died) stays the cause when poprun saw it first: when it went is
        not known, only when poprun noticed. None when the job failed for poprun's own reason."""
        if self.failure is None or self.failure.index is None:
            return None
        first = self.instances[self.failure.index]
        if first.lost or first.launcher_lost or not self.failures or not self.failures[0].first_hand:
            return first
        return self.failures[0].state

    @property
    def status(self) -> int:
        """poprun's exit status: the root cause's own when it failed by itself, else that of the
        failure that made poprun stop the job."""
        assert self.failure is not None
        cause = self.cause
        if cause is not None and self._left_before(cause):
            return LEFT_EARLY_STATUS
        if cause is not None and cause.index != self.failure.index and cause.failed_by_itself:
            assert cause.status is not None
            return cause.status
        return self.failure.status

    def summary(self, reason: str | None) -> str:
        """The lines on stderr: the root cause, what its program recorded, the last lines of its
        stderr (of its output, when its two streams are one), every other instance that failed (one
        line each), why poprun stopped, and whom it stopped."""
        lines = []
        others: list[Failed] = []
        state = self.cause
        if state is not None:
            lines.append(f"poprun: {self._reason(state)}")
            cause = root_cause(state)
            for victim in self._ended_after_left(state):
                lines.append(f"poprun: instance {victim.index} on {victim.host} was ended by mpiexec: "
                             f"{describe_status(victim.status or 0, victim.signal)}")
            if cause is not None:
                from poprun_py.shared.root_cause import summary_lines

                lines += summary_lines(state.index, cause)
            if state.output.stderr_tail:
                stream = "output" if state.output.one_stream else "stderr"
                lines.append(f"poprun: last lines of instance {state.index}'s {stream}:")
                lines += [f"    {printable(line.decode(errors='replace'))}" for line in state.output.stderr_tail]
            others = [failed for failed in self.failures if failed.state is not state]
            for other in others:
                error = f"; its error: {other.error}" if other.error is not None else ""
                lines.append(f"poprun: instance {other.state.index} on {other.state.host} also failed: "
                             f"{other.how()}{error}")
        if self.failure is not None and self.failure.index is None:  # poprun's own reason
            lines.append(f"poprun: {self.failure.description}")
        if reason:
            lines.append(f"poprun: {reason}")
        stopped = self.stopped()
        if stopped:
            lines.append(f"poprun: stopped instance(s) {ranges(stopped)} ({len(stopped)} of {len(self.instances)})")
        return "\n".join(lines) + "\n"

    def stopped(self) -> list[int]:
        """The instances poprun stopped that did not fail by themselves, nor are the root cause."""
        failed = {failed.state.index for failed in self.failures}
        if self.cause is not None:
            failed.add(self.cause.index)
        return [s.index for s in self.instances if s.stopped_by_poprun and not s.lost and s.index not in failed]

    def failure_report(self) -> dict[str, object] | None:
        """The root cause, for --error-file and the restart message: which instance, where, the
        job's status, its signal, when it failed, one line saying why, the last lines of its stderr
        (``stderr_tail``: of its output, when its two streams are one) and what it recorded; then
        every instance that failed (``failures``, the first first) and those poprun stopped
        (``stopped``)."""
        if self.failure is None:
            return None
        if self.failure.index is None:
            return own_failure(self.failure.description, self.failure.status, self.failure.at)
        state = self.cause
        assert state is not None
        # One that left early or was stopped is the cause, as the summary says, not the instance
        # it took down.
        cause = next(iter(self._left_before(state) or self._stopped_besides(state)), state)
        first = next((failed for failed in self.failures if failed.state is state), None)
        from poprun_py.supervision.first_failure import iso

        return {
            "instance": cause.index,
            "host": cause.host,
            "status": self.status,
            "signal": signal_name(cause.signal) if cause.signal else None,
            "time": iso(first.reported_at if first is not None else self.failure.at),
            "reason": self._reason(state),
            "stderr_tail": [line.decode(errors="replace") for line in cause.output.stderr_tail],
            "root_cause": root_cause(cause),
            "failures": [failed.report() for failed in self.failures],
            "stopped": self.stopped(),
        }

    def _reason(self, state: InstanceState) -> str:
        """One line on why the job failed, given its root cause."""
        assert self.failure is not None
        failed = f"instance {state.index} on {state.host} failed: {self._how(state)}"
        lost = self._failed_hosts(state)
        return ((self._host_line(lost[0]) if lost else None) or self._left_early(state)
                or self._stopped(state, failed) or failed)

    def _how(self, state: InstanceState) -> str:
        """How the root cause failed: as poprun saw it when that made it stop the job; else as
        ``first_failure`` tells."""
        assert self.failure is not None
        if state.index == self.failure.index:
            return self.failure.description
        return next(failed.how() for failed in self.failures if failed.state is state)

    def _failed_hosts(self, state: InstanceState) -> list[str]:
        """The remote hosts whose loss the failure of ``state`` comes from, each with every instance
        lost without a report: those the launcher's output blames (ssh: "Connection to node1 closed
        by remote host"; the launcher then ends the others, which are lost too, as victims); else
        ``state``'s own host; else, when the launcher ended ``state`` (Open MPI's daemons do once
        they lose a host) and no instance left early, another host whose instances were all lost
        (a silent one first). None when ``state`` failed by itself, or its host's MPI daemon died
        (its stub says so) and its stub then reported the stop: a stub that said so and was then
        lost went down with its host, having seen the daemon end a moment before."""
        if state.failed_by_itself or (state.launcher_lost and not state.lost):
            return []
        blamed = [h for h in self._blamed if self._host_lost(h) is not None]
        if blamed:
            return blamed
        if state.lost and self._host_lost(state.host) is not None:
            return [state.host]
        if not _ended_by_launcher(state) or self._left_before(state):
            return []
        others = [h for h in self._by_host if h != state.host and self._host_lost(h) is not None]
        others.sort(key=lambda h: not any(s.silent for s in self._by_host[h]))
        return others[:1]

    def _host_line(self, host: str) -> str:
        on_host = [s.index for s in self._by_host[host]]
        return (f"host {host} was lost: instance(s) {ranges(on_host)} there ended without an exit report "
                f"({self._host_lost(host)})")

    def _host_lost(self, host: str) -> str | None:
        """Why the remote ``host`` is lost, when every instance there was lost without a report."""
        if host not in self.remote_hosts:
            return None
        on_host = self._by_host.get(host, [])
        if not on_host or not all(s.lost for s in on_host):
            return None
        silent = next((s for s in on_host if s.silent), None)
        died = loss(silent) if silent else "its processes or the connection to it died"
        return self._blamed.get(host) or died

    def lost_hosts(self) -> dict[str, str]:
        """The remote hosts this run lost, each with why: those the failure comes from (see
        ``_failed_hosts``); the failure's host when its MPI daemon died; or those where no instance
        had started by --start-timeout when instances elsewhere had."""
        lost: dict[str, str] = {}
        cause = self.cause
        if cause is not None:
            if cause.launcher_lost and cause.host in self.remote_hosts:
                lost[cause.host] = cause.launcher_lost
            for host in self._failed_hosts(cause):
                lost[host] = self._host_lost(host) or ""
        timed_out = self.failure is not None and self.failure.index is None  # poprun's one reason: the start
        if timed_out and any(s.pid is not None for s in self.instances):
            for host, on_host in self._by_host.items():
                if host in self.remote_hosts and all(s.pid is None for s in on_host):
                    lost[host] = "its instances had not started by --start-timeout"
        return lost

    def _left_early(self, state: InstanceState) -> str | None:
        """When the launcher ended an instance (Hydra kills it: no exit report; gforker signals its
        stub) after others had exited with status 0 while it still ran, those left early: an MPI
        program that exits without MPI_Finalize (os._exit, a crash below Python) makes mpiexec end
        the rest of the job. Name them, not the victim."""
        left = self._left_before(state)
        if not left:
            return None
        assert state.ended_at is not None
        victims = [s.index for s in self.instances if _ended_by_launcher(s)]
        first = min(s.ended_at or 0.0 for s in left)
        return (f"instance(s) {ranges([s.index for s in left])} on {', '.join(sorted({s.host for s in left}))} "
                f"left early: exited with status 0 while instance(s) {ranges(victims)} still ran, and "
                f"{state.ended_at - first:.1f} s later mpiexec ended those (an MPI program that exits "
                f"without MPI_Finalize, e.g. through os._exit, takes the job down)")

    def _ended_after_left(self, state: InstanceState) -> list[InstanceState]:
        """When instances left early before ``state`` was ended, those mpiexec then ended that
        reported a status (Hydra's kill leaves none): each with its own."""
        if not self._left_before(state):
            return []
        return [s for s in self.instances if _ended_by_launcher(s) and s.status is not None]

    def _stopped(self, state: InstanceState, failed: str) -> str | None:
        """When others were found stopped (SIGSTOP, SIGTSTP, a debugger) as poprun ended the job,
        they come first: an instance that waits on a stopped one gives up at its timeout, and is
        the one that fails."""
        stopped = self._stopped_besides(state)
        if not stopped:
            return None
        return (f"instance(s) {ranges([s.index for s in stopped])} on {', '.join(sorted({s.host for s in stopped}))} "
                f"had been stopped (SIGSTOP, SIGTSTP or a debugger) when {failed}; an instance that waits for a "
                "stopped one fails at its timeout")

    def _stopped_besides(self, state: InstanceState) -> list[InstanceState]:
        """The instances other than ``state`` whose program was found stopped when it was ended."""
        return [s for s in self.instances if s is not state and s.was_stopped]

    def _left_before(self, state: InstanceState) -> list[InstanceState]:
        """The instances that exited with status 0 before the launcher ended ``state``, in order."""
        if not _ended_by_launcher(state) or state.silent or state.ended_at is None:
            return []
        return [s for s in self.instances if s.status == 0 and s.ended_at is not None and s.ended_at < state.ended_at]


def own_failure(reason: str, status: int, at: float | None = None,
                stopped: list[int] | None = None) -> dict[str, object]:
    """The failure report of a run that ended for poprun's own reason, no instance's (a host that
    could not start, --start-timeout, mpiexec's failure, a signal): the same keys, no instance."""
    when = datetime.datetime.fromtimestamp(time.time() if at is None else at, datetime.UTC)
    return {"instance": None, "host": None, "status": status, "signal": None, "time": when.isoformat(),
            "reason": reason, "stderr_tail": [], "root_cause": None, "failures": [], "stopped": stopped or []}


def _ended_by_launcher(state: InstanceState) -> bool:
    return state.lost or (state.stub_signalled and not state.stopped_by_poprun)


def root_cause(state: InstanceState) -> dict[str, str | None] | None:
    """What the instance's program recorded in its error file (torch's ``@record``), if anything."""
    if state.root_cause is None:
        return None
    from poprun_py.shared.root_cause import describe

    return describe(state.root_cause)


def loss(state: InstanceState) -> str:
    """Why an instance went without an exit report, as far as poprun can tell."""
    if state.silent:
        return f"no word from it for {state.silent:g} s: its host or the network to it is down"
    return "its launcher process died without reporting"


def ranges(indices: list[int]) -> str:
    """``0-3, 7`` for [0, 1, 2, 3, 7]: a job of thousands of instances still fits one line."""
    parts: list[str] = []
    start = previous = indices[0]
    for index in [*indices[1:], None]:
        if index is not None and index == previous + 1:
            previous = index
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if index is not None:
            start = previous = index
    return ", ".join(parts)
