"""What poprun knows of each instance of a running job, and of the failure that ends it."""

from __future__ import annotations

import _signal
import time
from collections.abc import Callable

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing on the launch path
if TYPE_CHECKING:
    import _socket

    from poprun_py.host.instance import StubbedInstance
    from poprun_py.supervision.host_links import HostLink
    from poprun_py.supervision.output import InstanceOutput


class InstanceState:
    """What poprun knows of one instance: its connection, output, and exit report."""

    def __init__(self, index: int, host: str, output: InstanceOutput) -> None:
        self.index = index
        self.host = host
        self.output = output
        #: On poprun's own host, where a stub runs it: its stub and the stub's connection.
        self.connection: _socket.socket | None = None
        self.stub: StubbedInstance | None = None
        #: On a remote host whose supervisor runs it: that supervisor's connection (``connection``
        #: stays None), until the instance has ended or is lost.
        self.via: HostLink | None = None
        self.pid: int | None = None
        self.status: int | None = None
        self.signal: int | None = None
        self.error: str | None = None
        self.stopped_by_poprun = False
        self.lost = False  # disconnected without an exit report
        self.stub_signalled = False  # its stub was signalled (not told by poprun) and stopped the program
        self.was_stopped = False  # its program was stopped (SIGSTOP, a debugger) when its stub came to end it
        self.oom_killed = False  # its program died of SIGKILL as the kernel's out-of-memory killer ran (oom)
        self.mpi_abort = False  # its program called MPI_Abort, and its status is the abort's (pmi_relay)
        self.launcher_lost: str | None = None  # its stub saw its host's MPI daemon die: why (protocol.LAUNCHER_LOST)
        self.silent = 0.0  # lost because nothing came from it for this many seconds (the silence limit)
        self.ended_at: float | None = None  # time.monotonic() of its exit report or its loss
        self.root_cause: bytes | None = None  # what its program wrote to TORCHELASTIC_ERROR_FILE, if it failed
        #: Its host's clock minus poprun's (ns, see ``clocks``): its host supervisor's link's.
        self.clock_offset = 0
        #: On its host's clock (ns; 0: never or not told, see protocol.TIMES): when its program
        #: ended, when its stub began to stop it, when its error file was last written.
        self.ended_ns = 0
        self.stopped_ns = 0
        self.recorded_ns = 0
        #: The exception's line of the uncaught exception's traceback its program's stderr ended
        #: with when its stub came to stop it, and when its supervisor read that line (ns, its clock;
        #: protocol.UNCAUGHT): it had failed by itself, and the stop only ended its way out.
        self.uncaught: str | None = None
        self.uncaught_ns = 0
        self.seen_at: float | None = None  # time.time() when poprun saw its end (exit report or loss)
        self.sending = False  # a message to its stub or host is half sent: nothing may be put in its middle

    def send(self, message: bytes) -> bool:
        """One of poprun's commands (protocol.TERMINATE, RELEASE, STOP, CONT) to its stub, or
        through its host's supervisor; whether it went."""
        if self.stub is not None:
            return self.connection is not None and self.stub.command(message)
        if self.via is not None:
            self.sending = True
            try:
                return self.via.command(self.index, message)
            finally:
                self.sending = False
        return False

    @property
    def attached(self) -> bool:
        """Whether poprun still hears from it: its stub's connection (on poprun's host), or its
        host's supervisor's."""
        return self.connection is not None or self.via is not None

    @property
    def finished(self) -> bool:
        return self.status is not None

    @property
    def done(self) -> bool:
        return self.finished or self.lost

    def how(self) -> str:
        """Its end as the summary tells it: its status, and what it says of it."""
        return describe_status(self.status or 0, self.signal, self.oom_killed, self.mpi_abort)

    @property
    def failed_by_itself(self) -> bool:
        """It reported a failure of its own: a non-zero status that is not what stopping it gives
        (SIGTERM, then SIGKILL, or the shell's 128+N for them), or any, when its stub's times say
        that its program ended before anything began to stop it (a SIGKILL from the kernel's
        out-of-memory killer, which its supervisor may also tell)."""
        if not self.status:
            return False
        if self.oom_killed or (self.ended_ns and (not self.stopped_ns or self.ended_ns < self.stopped_ns)):
            return True
        stopped = {_signal.SIGTERM, _signal.SIGKILL}
        return self.signal not in stopped and self.status not in {128 + s for s in stopped}


class Progress:
    """Whether ``holds`` holds for every instance, where an instance it holds for holds so for
    good (done, ended): each instance is looked at until it holds, then never again, so a job of N
    instances looks about N times in all rather than N times at each turn of poprun's loop."""

    def __init__(self, instances: list[InstanceState], holds: Callable[[InstanceState], bool]) -> None:
        self.instances = instances
        self.holds = holds
        #: The first instance it was not seen to hold for.
        self.first = 0

    def all(self) -> bool:
        while self.first < len(self.instances) and self.holds(self.instances[self.first]):
            self.first += 1
        return self.first == len(self.instances)


class Failure:
    """What made poprun stop a failed job: the first instance it saw fail (None: poprun itself).
    The root cause, the earliest failure, is chosen once every report is in (``first_failure``)."""

    def __init__(self, index: int | None, status: int, description: str) -> None:
        self.index = index
        self.status = status
        self.description = description
        self.at = time.time()


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15; the ``signal`` module (enums) is imported only when a name is needed."""
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_status(status: int, signum: int | None, oom_killed: bool = False, mpi_abort: bool = False) -> str:
    if mpi_abort:
        return f"called MPI_Abort (exit status {status})"
    if oom_killed:
        return f"killed by {signal_name(signum or _signal.SIGKILL)} (status {status}) {OOM_KILLED}"
    if signum:
        return f"killed by {signal_name(signum)} (status {status})"
    return f"exit status {status}"


#: What the summary adds to a SIGKILL that its supervisor tells came from the out-of-memory killer.
OOM_KILLED = "from the kernel's out-of-memory killer (its memory cgroup's oom_kill count rose)"
