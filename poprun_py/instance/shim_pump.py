"""The shim's loop once the program runs: frames out, commands in (TERMINATE, STOP, CONT),
adopted orphans' ends collected as they come, exit status last.

poprun that reads slowly (its own output is not read: a pager, a stalled ``tee``, Ctrl-S) or not at
all (stopped: a debugger, Ctrl-Z) is back-pressure, not death: a send waits until poprun's kernel
takes it, and meanwhile the program's pipes are not read, so the program waits on them, as in a
shell pipeline; commands are still obeyed while it waits. poprun is gone when its connection ends
(its process died: its kernel closes it at once) or when its host acknowledges nothing for
the silence limit (``POPRUN_SILENCE_LIMIT``, ``_unanswered``); a stopped poprun's kernel still acknowledges.

Built on the interpreter's own C modules (``_socket``, ``select``, ``_signal``, ``time``): see
``script.py`` for why.
"""

from __future__ import annotations

import _signal
import _socket
import os
import select
import time

from popcontract import environment, settings
from poprun_py.host import oom
from poprun_py.host.link import kill_grace
from poprun_py.host.uncaught import Tail
from poprun_py.shared import root_cause, sweep
from poprun_py.shared.watch import Watch
from poprun_py.stub.pmi_relay import abort_status, hang_up
from poprun_py.wire import protocol
from poprun_py.wire.control import TCPI_PROBES, TCPI_RETRANSMITS, since_last_ack, tcp_info

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing under python -S
if TYPE_CHECKING:
    from poprun_py.stub.pmi_relay import PmiRelay
    from poprun_py.wire.seal import Seal

READ_SIZE = 65536
#: The most read of the program's stderr when poprun's TERMINATE comes (``_stop_on_request``): no
#: pipe holds more (``/proc/sys/fs/pipe-max-size``), and a program that writes on is not waited for.
STOP_READ_LIMIT = 1 << 20
#: The most read of poprun's commands at once (each is 1 + TAG_SIZE bytes).
COMMANDS_READ_SIZE = 64
#: After the program exits, how long descendants may keep its pipes open before they are killed.
DRAIN_SECONDS = 1.0
#: At most this long after its exit report, a shim waits for RELEASE: an instance that could not
#: reach poprun can never be counted as done, and must not hold the others for ever.
RELEASE_WAIT_SECONDS = 10.0
#: How long a shim that had no RELEASE waits, its PMI line closed, for its launcher to end the job.
LAUNCHER_NOTICE_SECONDS = 1.0
#: Keys of the descriptors the loop (and the wait for RELEASE) watches.
CONTROL, STDOUT, STDERR, EXITED, LAUNCHER, SIGNALLED, CHILDREN, PMI_PROGRAM, PMI_LAUNCHER = range(9)
#: How long the shim keeps ending descendants that escaped the program's process group, and how
#: long it lets each round of deaths settle before it looks again.
ESCAPED_SECONDS = 2.0
ESCAPED_PAUSE = 0.001
#: The loop's longest idle wait (a pidfd or a pipe wakes it), and its polling interval where
#: nothing can wake it (no pidfd, no pipe left, or the program killed and not yet reaped).
IDLE_WAIT = 1.0
POLL_WAIT = 0.05
#: ``Pump.kill_at`` once the SIGKILL has been sent: never again.
KILLED = float("inf")
#: The most a send waits for room before it looks again at poprun's commands and liveness.
ROOM_WAIT = 1.0
#: poprun's host counts as silent only when it has been so at looks this far apart: a window probe
#: just sent to a poprun that is stopped is unanswered for one round trip, however alive it is.
UNANSWERED_SECONDS = 1.0


def _ignore(*_: object) -> None:
    """A signal's handler during the wait for RELEASE: the wake-up descriptor does the work."""


class Pump:
    def __init__(self, index: int, connection: tuple[_socket.socket, Seal, int], silence_limit: float,
                 error_file: str | None = None, pmi: PmiRelay | None = None) -> None:
        self.index = index
        #: ``POPRUN_SILENCE_LIMIT``: how long poprun's host may leave frames unacknowledged, and how
        #: often the shim says something (``protocol.heartbeat_seconds``).
        self.silence_limit = silence_limit
        self.heartbeat = protocol.heartbeat_seconds(silence_limit)
        #: The program's PMI line through the shim (``pmi_relay``), and the code of the MPI_Abort
        #: it asked for there (None: it did not).
        self.pmi = pmi
        self.aborted: int | None = None
        #: poprun's connection, what seals its frames, and what checks its commands (None once one
        #: failed its check: nothing more is read from poprun).
        self.control, self.seal = connection[0], connection[1]
        self.commands: protocol.CommandReader | None = protocol.CommandReader(self.seal)
        # Sent data that waits is back-pressure (poprun reads slowly, or is stopped), which
        # TCP_USER_TIMEOUT would take for a dead peer once the window has stayed shut that long:
        # from now on poprun's liveness is judged here (``_unanswered``).
        if hasattr(_socket, "TCP_USER_TIMEOUT"):
            self.control.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_USER_TIMEOUT, 0)
        self.control.setblocking(False)
        #: Sealed frames not yet handed to the kernel, the first one under way while ``sending``.
        self.outbox: list[bytes] = []
        self.sending = False
        #: poprun is gone (its connection ended, or its host stopped answering): nothing more is sent.
        self.gone = False
        #: When poprun's host was first seen leaving data unacknowledged for the silence limit.
        self.unanswered_since: float | None = None
        #: The program's TORCHELASTIC_ERROR_FILE: sent to poprun when it fails (see root_cause.py).
        self.error_file = error_file
        self.grace = kill_grace()
        self.pid: int | None = None
        self.kill_at: float | None = None
        #: On this host's wall clock (ns; 0: not yet), for poprun's choice of the first failure
        #: (protocol.TIMES): when the program ended, and when the shim began to stop it.
        self.ended_ns = 0
        self.stopped_ns = 0
        self.last_sent = time.monotonic()
        self.started = time.time()
        #: Why the shim stopped its program by itself (its launcher died), for the exit report.
        self.reason: str | None = None
        #: The shim itself was signalled (not told by poprun) and stopped its program.
        self.signalled = False
        #: When the shim came to stop its program, the program was stopped (SIGSTOP, a debugger).
        self.was_stopped = False
        #: The OOM kills counted in its memory cgroup as the program started (None: none can be read).
        self.oom_kills = oom.kills()
        #: The end of the program's stderr (of its one stream), that stream's key and its pipe
        #: (None once closed); poprun's TERMINATE has come; and, when that end was an uncaught
        #: exception's traceback then, when its last line was read and the exception's line
        #: (``protocol.UNCAUGHT``).
        self.tail = Tail()
        self.tail_stream = STDERR
        self.tail_fd: int | None = None
        self.terminated = False
        self.uncaught: tuple[int, bytes] | None = None
        #: Until when (monotonic) the stop waits for a traceback that the program was printing
        #: when TERMINATE came to be printed whole (``_stop_on_request``); None: no such wait.
        self.finishing_until: float | None = None
        # The loop's state (_pump): the program's pipes still open, its status once it has exited,
        # until when its pipes may stay open after that, and the pidfds watched.
        self.open_streams = 2
        self.returncode: int | None = None
        self.drain_until: float | None = None
        self.exit_fd: int | None = None
        #: The wake-up descriptor's ends while the loop runs (a SIGCHLD wakes it: ``_wake_on_children``).
        self.children: tuple[int, int] | None = None
        self.launcher = 0
        self.launcher_fd: int | None = None

    def send(self, data: bytes) -> None:
        """``data``, sealed, handed whole to the kernel, however long poprun takes to read (see the
        module's docstring); dropped once poprun is gone, so that the program is still stopped cleanly.
        A frame sent while another waits for room (by a command obeyed meanwhile) goes after it:
        frames never interleave, and go in the order they were sealed in."""
        if self.gone:
            return
        self.outbox.append(self.seal.seal(data))
        if self.sending:
            return
        self.sending = True
        try:
            while self.outbox and not self.gone:
                self._send_whole(memoryview(self.outbox[0]))
                del self.outbox[:1]
        finally:
            self.sending = False
        self.outbox.clear()  # (what poprun, gone, never gets)
        self.last_sent = time.monotonic()

    def _send_whole(self, pending: memoryview) -> None:
        while pending and not self.gone:
            try:
                pending = pending[self.control.send(pending):]
            except BlockingIOError:
                self._wait_for_room()
            except OSError:
                self._lose_poprun()

    def _wait_for_room(self) -> None:
        """Wait until poprun's connection takes more (at most ROOM_WAIT s), obeying its commands,
        stopping the program on time, and noticing poprun's end, meanwhile."""
        poll = select.poll()
        # (poprun's commands no longer read after one failed its check: left unread, not polled)
        poll.register(self.control, select.POLLOUT | (select.POLLIN if self.commands is not None else 0))
        events = 0
        for _, happened in poll.poll(ROOM_WAIT * 1000):
            events |= happened
        now = time.monotonic()
        self._kill_when_due(now)
        if events & (select.POLLIN | select.POLLERR | select.POLLHUP):
            self._hear_poprun()
        elif self._unanswered(now):
            self._lose_poprun()

    def _hear_poprun(self) -> bool:
        """Read and obey poprun's commands; False once nothing more can come from it (the
        connection ended, or a command failed its check), and then the program is stopped."""
        if self.commands is None:
            return False
        try:
            message = self.control.recv(COMMANDS_READ_SIZE)
        except BlockingIOError:
            return True
        except OSError:
            message = b""
        if not message:
            self._lose_poprun()
            return False
        for command in self._commands(message):
            if command == protocol.TERMINATE:
                self._stop_on_request()
            elif command == protocol.STOP and self.returncode is None and self.kill_at is None:
                self._signal_group(_signal.SIGSTOP)
            elif command == protocol.CONT:
                self._signal_group(_signal.SIGCONT)
        return self.commands is not None

    def _lose_poprun(self) -> None:
        """poprun is gone: stop the program; nothing more is sent."""
        self.gone = True
        self.stop_program()

    def _unanswered(self, now: float) -> bool:
        """Whether poprun's host has acknowledged nothing for the silence limit while the shim
        waits for it to (a retransmission, or a window probe: linux/tcp.h's tcpi_retransmits,
        tcpi_probes), at two looks UNANSWERED_SECONDS apart: the host died or the network to it is
        cut. A poprun that is stopped or reads slowly still has its kernel acknowledge."""
        info = tcp_info(self.control)
        if info is None:
            return False
        waiting = info[TCPI_RETRANSMITS] or info[TCPI_PROBES]
        since_ack = since_last_ack(info)
        if not waiting or since_ack < self.silence_limit:
            self.unanswered_since = None
            return False
        if self.unanswered_since is None:
            self.unanswered_since = now
        return now - self.unanswered_since >= UNANSWERED_SECONDS

    def output(self, stream: int, data: bytes) -> None:
        self.send(protocol.frame(protocol.OUTPUT, data, stream))

    def spawn_failed(self, program: str, error: OSError) -> int:
        status = 127 if error.errno == 2 else 126
        reason = "not found" if status == 127 else f"cannot be executed ({error.strerror})"
        self.send(protocol.exit_report(status, None, f"program {program!r} {reason} on host {_socket.gethostname()}"))
        return status

    def _stop_on_request(self) -> None:
        """poprun's TERMINATE: what the program wrote to its stderr before it, still in the pipe,
        is read and passed on first (to the last byte there now: all of it was written before the
        stop), so that the shim knows how that stderr ended. An uncaught exception's traceback
        there says the program had failed by itself and was on its way out (atexit hooks,
        threads, the interpreter's shutdown): the SIGTERM that ends it then is no stop of a
        program that was running, and its exit report says so (``protocol.UNCAUGHT``). What it
        writes after the stop (a SIGTERM handler's traceback) is no part of that."""
        if self.pid is None or self.kill_at is not None or self.terminated:
            return
        self.terminated = True
        self._read_to_the_end()
        if self.tail.printing():  # it had failed and was printing why: stopped once it has said it
            self.finishing_until = time.monotonic() + self.grace
            return
        self._stop_after_request()

    def _stop_after_request(self) -> None:
        """The stop poprun asked for: an uncaught exception's traceback as the end of the program's
        stderr then is said (``protocol.UNCAUGHT``), and the program is stopped. A traceback that
        was being printed when the request came is waited for until it is whole, or until the
        program has ended by itself, or for the grace at most; anything else the program writes
        meanwhile ends the wait."""
        self.finishing_until = None
        line = self.tail.exception()
        if line is not None:
            self.uncaught = (self.tail.read_ns, line)
        self.stop_program()

    def _read_to_the_end(self) -> None:
        """Pass on what the program's stderr pipe holds now, at most STOP_READ_LIMIT bytes."""
        read = 0
        while self.tail_fd is not None and read < STOP_READ_LIMIT:
            try:
                data = os.read(self.tail_fd, READ_SIZE)
            except BlockingIOError:
                return
            if not data:  # its end: the loop closes it
                return
            read += len(data)
            self._received(self.tail_stream, data)

    def _received(self, stream: int, data: bytes) -> None:
        """Output read from the program: passed on; stderr's (the one stream's) end kept."""
        if stream == self.tail_stream:
            self.tail.add(data, time.time_ns())
            if self.finishing_until is not None and not self.tail.printing():
                self._stop_after_request()
        self.output(stream, data)

    def stop_program(self, *_: object) -> None:
        """SIGTERM the program's process group now, SIGKILL it after the grace period. A program
        found stopped is continued after the SIGTERM, so that it can act on it, and the exit
        report says it was stopped."""
        if self.pid is None or self.kill_at is not None:
            return
        self.kill_at = time.monotonic() + self.grace
        self.stopped_ns = time.time_ns()
        self.was_stopped = self.returncode is None and sweep.is_stopped(self.pid)
        self._signal_group(_signal.SIGTERM)
        self._signal_group(_signal.SIGCONT)

    def _on_signal(self, *_: object) -> None:
        """The shim was signalled (mpiexec ending the job, or someone by hand): stop the program."""
        if self.pid is not None and self.kill_at is None:
            self.signalled = True
        self.stop_program()

    def _signal_group(self, sig: int) -> None:
        assert self.pid is not None
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def run(self, pid: int, stdout_fd: int, stderr_fd: int | None) -> int:
        """Pump the program's output (``stderr_fd`` None: both its streams are one pipe, on
        ``stdout_fd``) until it has exited; report its status; wait for RELEASE; its status."""
        self.pid = pid
        for sig in (_signal.SIGTERM, _signal.SIGINT, _signal.SIGHUP):
            _signal.signal(sig, self._on_signal)
        status, signum = self._pump(stdout_fd, stderr_fd)
        cause, recorded = root_cause.take(self.error_file, status != 0, folders=2)  # (shim.prepare_error_file's)
        for frame in protocol.before_exit(cause, self.uncaught, self.ended_ns, self.stopped_ns, recorded):
            self.send(frame)
        flags = (protocol.EXIT_SHIM_SIGNALLED if self.signalled else 0) | \
            (protocol.EXIT_WAS_STOPPED if self.was_stopped else 0) | \
            (protocol.EXIT_OOM_KILLED if self._oom_killed(signum) else 0) | \
            (protocol.EXIT_MPI_ABORT if self.aborted is not None else 0)
        wake = self._signals_end_the_wait()  # before the report: poprun may stop the job on it
        self.send(protocol.exit_report(status, signum, self.reason, flags))
        self._await_release(wake)
        return status

    def _oom_killed(self, signum: int | None) -> bool:
        """The program died of a SIGKILL the shim did not send, and the OOM kills counted in its
        memory cgroup rose meanwhile: the kernel's out-of-memory killer ended it (see ``oom``)."""
        if signum != _signal.SIGKILL or self.kill_at == KILLED or self.oom_kills is None:
            return False
        after = oom.kills()
        return after is not None and after > self.oom_kills

    def _signals_end_the_wait(self) -> int:
        """From now on a signal only ends the wait for RELEASE (mpiexec ending the processes of a
        job whose instances left without MPI_Finalize): its handler does nothing, and the wake-up
        descriptor it writes to, returned, is watched by the wait. Nothing is raised, so a signal
        at any moment, during the wait or after it, leaves the shim's status its program's."""
        wake_read, wake_write = os.pipe()
        os.set_blocking(wake_write, False)
        _signal.set_wakeup_fd(wake_write)
        for sig in (_signal.SIGTERM, _signal.SIGINT, _signal.SIGHUP):
            _signal.signal(sig, _ignore)
        return wake_read

    def _await_release(self, wake: int) -> None:
        """Wait, idle, for poprun's RELEASE (see ``protocol.RELEASE``), poprun's end, a signal
        (``wake`` readable), or RELEASE_WAIT_SECONDS."""
        watch = Watch()
        watch.add(self.control, CONTROL)
        watch.add(wake, SIGNALLED)
        deadline = time.monotonic() + RELEASE_WAIT_SECONDS
        try:
            while (left := deadline - time.monotonic()) > 0:
                ready = [key for _, key in watch.ready(left)]
                if SIGNALLED in ready:
                    return
                if CONTROL in ready:
                    try:
                        message = self.control.recv(COMMANDS_READ_SIZE)
                    except BlockingIOError:
                        continue
                    if not message or protocol.RELEASE in self._commands(message):
                        return
        except OSError:
            return
        self._hang_up_on_the_launcher(wake)

    def _hang_up_on_the_launcher(self, wake: int) -> None:
        """No RELEASE came: other instances still run. Close this shim's copy of MPICH's PMI line
        (``PMI_FD``) before exiting, and give the launcher up to LAUNCHER_NOTICE_SECONDS to act on
        it. Hydra's proxy, seeing the line end and the process exit at the same moment, at times
        took a program that left without MPI_Finalize (``os._exit``) for one that finished, and the
        job's other instances then waited for ever; seeing the line end first, it ends the job
        (which signals this shim: ``wake``). After MPI_Finalize the line's end is no news to it."""
        if not hang_up():
            return
        watch = Watch()
        watch.add(wake, SIGNALLED)
        watch.ready(LAUNCHER_NOTICE_SECONDS)

    def _pump(self, stdout_fd: int, stderr_fd: int | None) -> tuple[int, int | None]:
        """Pass the program's output on and poprun's TERMINATE in until the program has exited and
        its pipes are drained; then end what it left. Its status, and the signal that killed it."""
        assert self.pid is not None
        watch = self._watch(stdout_fd, stderr_fd)
        while True:
            now = time.monotonic()
            self._kill_when_due(now)
            if not self.gone and self._unanswered(now):
                watch.remove(self.control)
                self._lose_poprun()
            if self.returncode is None:
                waited, wait_status = os.waitpid(self.pid, os.WNOHANG)
                if waited:
                    self._exited(wait_status, now)
            if self.drain_until is not None and (self.open_streams == 0 or now >= self.drain_until):
                break
            if now - self.last_sent >= self.heartbeat:
                self.send(protocol.HEARTBEAT_FRAME)
            for fd, key in watch.ready(self._timeout(now)):
                self._ready(watch, fd, key)
        for watched in (self.exit_fd, self.launcher_fd):
            if watched is not None:
                os.close(watched)
        if self.pmi is not None:
            self.pmi.close()
        self._stop_waking_on_children()
        self._end_descendants()
        self._collect(now)  # what it just killed: on a remote host no poprun above would collect them
        assert self.returncode is not None
        if self.aborted is not None:
            return abort_status(self.aborted), None
        if self.returncode < 0:
            return 128 - self.returncode, -self.returncode
        return self.returncode, None

    def _kill_when_due(self, now: float) -> None:
        """SIGTERM the program once the wait for its traceback has run out; SIGKILL its group once
        its grace after SIGTERM has."""
        if self.finishing_until is not None and (now >= self.finishing_until or self.returncode is not None):
            self._stop_after_request()
        if self.kill_at is not None and now >= self.kill_at:
            self._signal_group(_signal.SIGKILL)
            self.kill_at = KILLED

    def _watch(self, stdout_fd: int, stderr_fd: int | None) -> Watch:
        """The program's pipes, poprun's connection, the program's exit, its launcher's death, and
        the ends of the shim's children (the program, adopted orphans)."""
        assert self.pid is not None
        watch = Watch()
        watch.add(stdout_fd, STDOUT)
        if stderr_fd is None:
            self.open_streams = 1
            self.tail_stream = STDOUT
        else:
            watch.add(stderr_fd, STDERR)
        self.tail_fd = stdout_fd if stderr_fd is None else stderr_fd
        # Non-blocking: what TERMINATE's reading (``_stop_on_request``) empties may still be in the
        # loop's list of descriptors ready to read.
        for fd in (stdout_fd, stderr_fd):
            if fd is not None:
                os.set_blocking(fd, False)
        self.children = self._wake_on_children()
        watch.add(self.children[0], CHILDREN)
        watch.add(self.control, CONTROL)
        try:  # wake the moment the program exits instead of polling (Linux >= 5.3)
            self.exit_fd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            self.exit_fd = None
        if self.exit_fd is not None:
            watch.add(self.exit_fd, EXITED)
        # The process that started this shim (MPICH's hydra_pmi_proxy, Open MPI's prted): when it
        # dies the MPI job on this host is broken, so stop the program at once and say why,
        # instead of letting MPI fail much later in a collective or in MPI_Finalize.
        self.launcher = os.getppid()
        try:
            self.launcher_fd = os.pidfd_open(self.launcher) if self.launcher > 1 else None
        except (AttributeError, OSError):
            self.launcher_fd = None
        if self.launcher_fd is not None:
            watch.add(self.launcher_fd, LAUNCHER)
        if self.pmi is not None:
            watch.add(self.pmi.shim_end, PMI_PROGRAM)
            watch.add(self.pmi.launcher, PMI_LAUNCHER)
        return watch

    def _wake_on_children(self) -> tuple[int, int]:
        """Have each SIGCHLD wake the loop, through the wake-up descriptor (returned: its ends), to
        collect the ends of the orphans the shim adopts as their subreaper (``shim.main``): a long
        job that starts helpers (data loaders, shells, ``subprocess`` in a loop) would otherwise
        leave a zombie per orphan until it ends, creeping towards ``pids.max``. Its other signals'
        handlers act as they did; they only wake the loop as well."""
        wake_read, wake_write = os.pipe()
        os.set_blocking(wake_read, False)
        os.set_blocking(wake_write, False)
        _signal.set_wakeup_fd(wake_write)
        _signal.signal(_signal.SIGCHLD, _ignore)
        return wake_read, wake_write

    def _stop_waking_on_children(self) -> None:
        """Undo ``_wake_on_children``: SIGCHLD back to its default, no wake-up descriptor."""
        if self.children is None:
            return
        _signal.signal(_signal.SIGCHLD, _signal.SIG_DFL)
        _signal.set_wakeup_fd(-1)
        for fd in self.children:
            os.close(fd)
        self.children = None

    def _collect(self, now: float) -> None:
        """Collect the end of every child of the shim that has ended: the program's status is kept
        (exactly as a wait for it alone would have read it), an adopted orphan's is dropped."""
        while True:
            try:
                pid, wait_status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:  # no child left
                return
            if pid == 0:
                return
            if pid == self.pid and self.returncode is None:
                self._exited(wait_status, now)

    def _exited(self, wait_status: int, now: float) -> None:
        """The program has exited: its status; its pipes may stay open DRAIN_SECONDS longer."""
        self.returncode = os.waitstatus_to_exitcode(wait_status)
        if self.aborted is None:  # (an abort's time is when it was asked)
            self.ended_ns = time.time_ns()
        self.drain_until = now + DRAIN_SECONDS

    def _timeout(self, now: float) -> float:
        """How long the next wait may last: until the kill or the end of the drain, else a second
        (polling every 50 ms when neither a pidfd nor a pipe can wake it)."""
        if self.kill_at is not None:
            return max(0.0, self.kill_at - now) if self.kill_at != KILLED else POLL_WAIT
        if self.finishing_until is not None:
            return max(0.0, self.finishing_until - now)
        if self.drain_until is not None:
            return max(0.0, self.drain_until - now)
        return min(IDLE_WAIT, self.heartbeat) if self.exit_fd is not None or self.open_streams else POLL_WAIT

    def _ready(self, watch: Watch, fd: int, key: int) -> None:
        """One descriptor that woke the loop."""
        assert self.pid is not None
        if key == CHILDREN:
            while True:  # empty the wake-up pipe: one byte per signal
                try:
                    if len(os.read(fd, READ_SIZE)) < READ_SIZE:
                        break
                except BlockingIOError:
                    break
            self._collect(time.monotonic())
        elif key == EXITED:
            watch.remove(fd)
            if self.returncode is None:  # exited: a blocking wait returns at once
                self._exited(os.waitpid(self.pid, 0)[1], time.monotonic())
        elif key == LAUNCHER:
            watch.remove(fd)
            if self.returncode is None:
                self.reason = (f"the MPI launcher's process that started instance {self.index} on "
                               f"{_socket.gethostname()} (PID {self.launcher}) died; the instance was stopped")
                self.send(protocol.frame(protocol.LAUNCHER_LOST, self.reason.encode()))
                self.stop_program()
        elif key == CONTROL:
            if not self._hear_poprun():
                watch.remove(fd)
        elif key == PMI_PROGRAM:
            self._hear_program_on_pmi(watch)
        elif key == PMI_LAUNCHER:
            assert self.pmi is not None
            if not self.pmi.from_launcher():
                watch.remove(fd)
        else:
            try:
                data = os.read(fd, READ_SIZE)
            except BlockingIOError:  # emptied since the loop found it ready (``_stop_on_request``)
                return
            if data:
                self._received(key, data)
            else:
                watch.remove(fd)
                os.close(fd)
                self.open_streams -= 1
                if fd == self.tail_fd:
                    self.tail_fd = None

    def _hear_program_on_pmi(self, watch: Watch) -> None:
        """What the program sent on its PMI line: passed on, but an MPI_Abort, which ends it here
        (see ``pmi_relay``): SIGKILL, as the launchers end an aborted job, and its exit status is
        then the abort's. When it asked is its failure's time."""
        assert self.pmi is not None
        code = self.pmi.from_program()
        if not self.pmi.program_open:
            watch.remove(self.pmi.shim_end)
        if code is None or self.aborted is not None or self.returncode is not None or self.kill_at is not None:
            return  # (an abort asked once poprun's stop had begun is the stop's: it ends as that goes)
        self.aborted = code
        self.ended_ns = time.time_ns()
        self._signal_group(_signal.SIGKILL)
        self.kill_at = KILLED

    def _commands(self, data: bytes) -> list[bytes]:
        """poprun's commands in ``data``; one that fails its check counts as TERMINATE (the
        connection has been tampered with, and poprun can no longer be heard: ``commands`` is
        then None, and nothing more is read)."""
        if self.commands is None:
            return [protocol.TERMINATE]
        try:
            return self.commands.feed(data)
        except protocol.ProtocolError as exc:
            os.write(2, f"poprun instance {self.index}: {exc} on poprun's connection; stopping\n".encode())
            self.commands = None
            return [protocol.TERMINATE]

    def _end_descendants(self) -> None:
        """Descendants that outlived the program (or held its pipes) must not outlive the job:
        its process group, and daemons that left the group (setsid)."""
        self._signal_group(_signal.SIGKILL)
        end_escaped(self.index)
        if self.kill_at is not None:  # stopped: MPICH's segments of its killed processes stay behind
            from poprun_py.shared import leftovers

            leftovers.remove_unused(leftovers.SHARED_MEMORY, self.started)


def end_escaped(index: int) -> None:
    """SIGKILL the program's descendants that left its process group (a daemon started with
    fork, setsid, fork): they still hold mpiexec's pipes, so the job would never end. They are
    found as the shim's descendants (it adopts them as their subreaper, see shim.main), and, only
    where no subreaper can be had, by the environment they inherited: this job's control address
    and this instance's index. (With the subreaper, whatever inherited them from the program is
    below the shim; the search by environment reads every process on the host, in every shim of
    the job.) Repeats until none is left (each death can let more be found), for at most
    ESCAPED_SECONDS."""
    me = os.getpid()
    control = settings.text(environment.CONTROL)
    # Without a job address there is nothing to tell this job's marked processes by.
    marks = (f"{environment.CONTROL}={control}".encode(), f"{environment.INSTANCE_INDEX}={index}".encode()) \
        if control and not sweep.adopts_orphans() else ()
    deadline = time.monotonic() + ESCAPED_SECONDS
    while time.monotonic() < deadline:
        found = sweep.leftovers(me, marks)
        if not found:
            return
        for pid in found:
            sweep.kill_leftover(pid, me, marks)
        time.sleep(ESCAPED_PAUSE)
