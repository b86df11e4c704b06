"""Run the mpiexec command, route every instance's output, and tear the job down on failure.

One event loop (``watch.Watch``) watches: the control listener and each instance's connection,
mpiexec's own stdout/stderr, and a wake-up pipe for signals. The first instance to fail is the
root cause; every other instance is told to stop, then mpiexec's process group is signalled,
then anything left in mpiexec's session is killed, so no process outlives ``poprun``.
"""

from __future__ import annotations

import _signal
import _socket
import os
import sys
import time

from poprun_py import control, log, protocol
from poprun_py.output import InstanceOutput, OutputOptions, sinks_for
from poprun_py.plan import LOCAL_HOST
from poprun_py.process import Process
from poprun_py.watch import Watch

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing on the launch path
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import BinaryIO

#: How long after a teardown starts before mpiexec's process group is signalled, then killed.
TERM_MPIEXEC_AFTER = protocol.DEFAULT_GRACE + 0.5
KILL_MPIEXEC_AFTER = TERM_MPIEXEC_AFTER + 1.0


class InstanceState:
    """What poprun knows of one instance: its connection, output, and exit report."""

    def __init__(self, index: int, host: str, output: InstanceOutput) -> None:
        self.index = index
        self.host = host
        self.output = output
        self.connection: _socket.socket | None = None
        self.reader = protocol.FrameReader()
        self.pid: int | None = None
        self.status: int | None = None
        self.signal: int | None = None
        self.error: str | None = None
        self.stopped_by_poprun = False
        self.lost = False  # disconnected without an exit report
        self.last_heard = 0.0  # time.monotonic() of its last frame
        self.silent = False  # lost because nothing came from it for protocol.SILENCE_LIMIT seconds
        self.ended_at: float | None = None  # time.monotonic() of its exit report or its loss
        self.root_cause: bytes | None = None  # what its program wrote to TORCHELASTIC_ERROR_FILE, if it failed

    @property
    def finished(self) -> bool:
        return self.status is not None

    @property
    def done(self) -> bool:
        return self.finished or self.lost

    @property
    def failed_by_itself(self) -> bool:
        """It reported a failure of its own: a non-zero status that is not what stopping it gives
        (SIGTERM, then SIGKILL, or the shell's 128+N for them)."""
        if not self.status:
            return False
        stopped = {_signal.SIGTERM, _signal.SIGKILL}
        return self.signal not in stopped and self.status not in {128 + s for s in stopped}


class Failure:
    """The root cause of a failed job: the first instance to fail (None: poprun itself)."""

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


def describe_status(status: int, signum: int | None) -> str:
    if signum:
        return f"killed by {signal_name(signum)} (status {status})"
    return f"exit status {status}"


class Supervisor:
    def __init__(self, num_instances: int, hosts: list[str], build_command: Callable[[str], list[str]],
                 show_instance: int | None = None, listen_address: str = "127.0.0.1",
                 remote_hosts: frozenset[str] = frozenset(),
                 stdout: BinaryIO | None = None, stderr: BinaryIO | None = None,
                 output: OutputOptions | None = None) -> None:
        # Shared by every instance: who owns the current line of each, one line for both when they
        # are the same file or terminal (see poprun_py.output).
        self.sinks = sinks_for(stdout or sys.stdout.buffer, stderr or sys.stderr.buffer)
        self.instances = [
            InstanceState(i, hosts[i], InstanceOutput(i, show_instance in (None, i), self.sinks, output))
            for i in range(num_instances)
        ]
        self.build_command = build_command
        self.listen_address = listen_address
        self.remote_hosts = remote_hosts
        self.watch = Watch()
        self.failure: Failure | None = None
        self.interrupted: int | None = None
        self.teardown_started: float | None = None
        self.next_silence_check = 0.0
        self.called_in = 0  # instances whose HELLO has arrived
        self.mpiexec: Process | None = None
        self.mpiexec_output: list[bytes] = []
        #: mpiexec's output until every instance has called in, held back: if a host cannot be
        #: reached it is a page of launcher noise around the one line that says why.
        self.held: list[tuple[int, bytes]] | None = []
        #: Streams on which mpiexec's own output left a line unfinished (poprun's lines start anew).
        self.mpiexec_open: set[int] = set()

    # ---------------------------------------------------------------- set-up
    def run(self) -> int:
        started = time.time()
        server, address = control.listen(self.listen_address, backlog=len(self.instances) + 8)
        wake_read, wake_write = os.pipe()
        os.set_blocking(wake_write, False)
        os.set_blocking(wake_read, False)
        previous_wakeup = _signal.set_wakeup_fd(wake_write)
        previous_handlers = {sig: _signal.signal(sig, self._on_signal)
                             for sig in (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP)}
        try:
            command = self.build_command(address)
            log.info("running command: %s", " ".join(command))
            # A terminal stays with poprun: instances reading stdin would fight over it.
            self.mpiexec = Process(command, stdin_devnull=os.isatty(0))
            log.info("waiting for mpiexec (PID %d)", self.mpiexec.pid)
            self.watch.add(server, ("listen", server))
            self.watch.add(wake_read, ("wake", None))
            self.watch.add(self.mpiexec.stdout, ("mpiexec", 1))
            self.watch.add(self.mpiexec.stderr, ("mpiexec", 2))
            if self.mpiexec.exit_fd is not None:  # wake the moment mpiexec exits instead of polling
                self.watch.add(self.mpiexec.exit_fd, ("exited", None))
            self._loop()
        finally:
            _signal.set_wakeup_fd(previous_wakeup)
            for sig, handler in previous_handlers.items():
                _signal.signal(sig, handler)
            self._kill_leftovers()
            self._remove_files_left(started)
            if self.mpiexec is not None:
                self.mpiexec.close()
            server.close()
            os.close(wake_read)
            os.close(wake_write)
        return self._finish()

    # ---------------------------------------------------------------- event loop
    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.interrupted is None:
            self.interrupted = signum
        elif self.teardown_started is not None:
            self.teardown_started = -float("inf")  # second signal: escalate at once

    def _loop(self) -> None:
        assert self.mpiexec is not None
        mpiexec_done_at: float | None = None
        while True:
            if self.interrupted is not None and self.teardown_started is None:
                log.warning("received %s: stopping every instance", signal_name(self.interrupted))
                self._teardown()
            self._escalate()
            self._check_silence()
            for sink in self.sinks.values():
                sink.tick()  # a line that another instance has waited on too long is ended
            if mpiexec_done_at is None and self.mpiexec.poll() is not None:
                mpiexec_done_at = time.monotonic()
                log.info("mpiexec exited with status %s", self.mpiexec.returncode)
            if mpiexec_done_at is not None:
                connected = any(i.connection is not None for i in self.instances)
                # mpiexec is gone: read what is still in flight, then stop.
                if (not connected and not self._mpiexec_pipes_open()) or time.monotonic() - mpiexec_done_at > 2.0:
                    return
            for fd, (kind, data) in self.watch.ready(0.1):
                if kind == "listen":
                    self._accept(data)
                elif kind == "wake":
                    try:
                        os.read(fd, 512)
                    except BlockingIOError:
                        pass
                elif kind == "pending":
                    self._read_hello(*data)
                elif kind == "instance":
                    self._read_instance(data)
                elif kind == "mpiexec":
                    self._read_mpiexec(fd, data)
                elif kind == "exited":
                    self.watch.remove(fd)
                    self.mpiexec.reap()

    def _show_held(self) -> None:
        """Pass on what mpiexec said before every instance had called in (no host failed to start)."""
        if self.held is None:
            return
        for stream, data in self.held:
            self._pass_on(stream, data)
        self.held = None

    def _pass_on(self, stream: int, data: bytes) -> None:
        """mpiexec's own output, as it came; remembers whether it left a line unfinished."""
        self.sinks[stream].write(data)
        self.sinks[stream].flush()
        if data.endswith(b"\n"):
            self.mpiexec_open.discard(stream)
        else:
            self.mpiexec_open.add(stream)

    def _say(self, text: str) -> None:
        """poprun's own lines on stderr, starting a line of their own even after mpiexec left one
        unfinished there (or on stdout, when both streams are one terminal or file)."""
        shared = self.sinks[1].line is self.sinks[2].line
        cut = 2 in self.mpiexec_open or (shared and 1 in self.mpiexec_open)
        if shared:
            self.mpiexec_open.clear()
        else:
            self.mpiexec_open.discard(2)
        self.sinks[2].write((("\n" if cut else "") + text).encode())
        self.sinks[2].flush()

    def _host_failures(self) -> dict[str, str]:
        """What the launcher's output says went wrong on which host (see ``host_errors``)."""
        if not self.mpiexec_output:
            return {}
        from poprun_py.host_errors import host_failures

        hosts = list(dict.fromkeys(state.host for state in self.instances))
        return host_failures(b"".join(self.mpiexec_output).decode(errors="replace"), hosts)

    def _mpiexec_pipes_open(self) -> bool:
        return any(kind == "mpiexec" for kind, _ in self.watch.labels())

    def _accept(self, server: _socket.socket) -> None:
        conn = control.accept(server)
        if conn is None:
            return
        self.watch.add(conn, ("pending", (conn, protocol.FrameReader())))

    def _read_hello(self, conn: _socket.socket, reader: protocol.FrameReader) -> None:
        data = self._recv(conn)
        if data is None:
            return
        if not data:
            self.watch.remove(conn)
            conn.close()
            return
        frames = reader.feed(data)
        if not frames:
            return
        kind, _, payload = frames[0]
        try:
            if kind != protocol.HELLO:
                raise protocol.ProtocolError(f"first frame is of kind {kind}, not HELLO")
            index, pid, host = protocol.read_hello(payload)
            if not 0 <= index < len(self.instances) or self.instances[index].connection:
                raise protocol.ProtocolError(f"instance {index} is not expected or already connected")
        except protocol.ProtocolError as exc:
            log.error("unexpected connection on the control port: %s", exc)
            self.watch.remove(conn)
            conn.close()
            return
        state = self.instances[index]
        state.connection, state.reader, state.pid = conn, reader, pid
        state.last_heard = time.monotonic()
        self.called_in += 1
        if self.called_in == len(self.instances):
            self._show_held()
        if state.host == LOCAL_HOST:
            state.host = host  # no host list: name the machine; otherwise keep the user's name for it
        self.watch.relabel(conn, ("instance", index))
        log.debug("instance %d connected from %s (pid %s)", index, state.host, state.pid)
        if self.teardown_started is not None:
            self._send_terminate(state)
        self._handle_frames(state, frames[1:])

    @staticmethod
    def _recv(conn: _socket.socket) -> bytes | None:
        """Bytes received; ``b""`` when the peer is gone; ``None`` when nothing is there yet."""
        try:
            return conn.recv(1 << 16)
        except BlockingIOError:
            return None
        except OSError:
            return b""

    def _read_instance(self, index: int) -> None:
        state = self.instances[index]
        assert state.connection is not None
        data = self._recv(state.connection)
        if data is None:
            return
        if not data:
            self._disconnect(state)
            return
        state.last_heard = time.monotonic()
        self._handle_frames(state, state.reader.feed(data))

    def _handle_frames(self, state: InstanceState, frames: list[tuple[int, int, bytes]]) -> None:
        for kind, stream, payload in frames:
            if kind == protocol.OUTPUT:
                state.output.feed(stream, payload)
            elif kind == protocol.ROOT_CAUSE:
                state.root_cause = payload
            elif kind == protocol.EXIT:
                state.status, state.signal, state.error = protocol.read_exit(payload)
                state.ended_at = time.monotonic()
                if state.error:
                    state.output.stderr_tail.append(state.error.encode())
                log.info("instance %d on %s: %s", state.index, state.host, describe_status(state.status, state.signal))
                if state.status != 0 and self.failure is None and not state.stopped_by_poprun \
                        and self.teardown_started is None:
                    self.failure = Failure(state.index, state.status, describe_status(state.status, state.signal))
                    self._teardown()
                self._release_when_all_done()

    def _release_when_all_done(self) -> None:
        """Once every instance is done, let all the shims exit together (see protocol.RELEASE)."""
        if not all(state.done for state in self.instances):
            return
        for state in self.instances:
            if state.connection is not None:
                try:
                    state.connection.sendall(protocol.RELEASE)
                except OSError:
                    pass  # that shim is gone already

    def _check_silence(self) -> None:
        """An instance still running that has said nothing for SILENCE_LIMIT seconds is lost: its
        host died or the network to it is cut (neither closes the connection). Checked once a second."""
        now = time.monotonic()
        if now < self.next_silence_check:
            return
        self.next_silence_check = now + 1.0
        for state in self.instances:
            if state.connection is not None and not state.finished \
                    and now - state.last_heard > protocol.SILENCE_LIMIT:
                log.warning("no word from instance %d on %s for %.0f s", state.index, state.host,
                            now - state.last_heard)
                state.silent = True
                self._disconnect(state)

    def _disconnect(self, state: InstanceState) -> None:
        assert state.connection is not None
        self.watch.remove(state.connection)
        state.connection.close()
        state.connection = None
        state.output.flush()
        if state.status is None:
            # The shim died without reporting (killed by mpiexec or a signal).
            state.lost = True
            state.ended_at = time.monotonic()
            log.info("instance %d on %s was lost without an exit report", state.index, state.host)
            if self.failure is None and self.teardown_started is None:
                self.failure = Failure(state.index, 1, f"lost: {_loss(state)}")
                self._teardown()
            self._release_when_all_done()

    def _read_mpiexec(self, fd: int, stream: int) -> None:
        data = os.read(fd, 1 << 16)
        if not data:
            self.watch.remove(fd)
            return
        self.mpiexec_output.append(data)
        if self.held is not None:
            self.held.append((stream, data))
        elif self.teardown_started is None:
            self._pass_on(stream, data)
        else:
            log.debug("mpiexec during teardown: %s", data.decode(errors="replace").rstrip())

    # ---------------------------------------------------------------- teardown
    def _send_terminate(self, state: InstanceState) -> None:
        if state.connection is None or state.finished:
            return
        state.stopped_by_poprun = True
        try:
            state.connection.sendall(protocol.TERMINATE)
        except OSError:
            pass

    def _teardown(self) -> None:
        if self.teardown_started is not None:
            return
        self.teardown_started = time.monotonic()
        log.info("stopping every instance")
        for state in self.instances:
            if not state.finished:
                state.stopped_by_poprun = True
                self._send_terminate(state)

    def _escalate(self) -> None:
        if self.teardown_started is None or self.mpiexec is None or self.mpiexec.poll() is not None:
            return
        elapsed = time.monotonic() - self.teardown_started
        if elapsed >= KILL_MPIEXEC_AFTER:
            self._signal_mpiexec(_signal.SIGKILL)
        elif elapsed >= TERM_MPIEXEC_AFTER:
            self._signal_mpiexec(_signal.SIGTERM)

    def _signal_mpiexec(self, sig: int) -> None:
        assert self.mpiexec is not None
        log.debug("sending %s to mpiexec's process group", signal_name(sig))
        try:
            os.killpg(self.mpiexec.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _kill_leftovers(self) -> None:
        """Last resort on this host: nothing started in mpiexec's session may survive poprun."""
        if self.mpiexec is None:
            return
        if self.mpiexec.poll() is None:
            self._signal_mpiexec(_signal.SIGKILL)
            if self.mpiexec.wait(timeout=5) is None:
                log.error("mpiexec (PID %d) did not exit after SIGKILL", self.mpiexec.pid)
        for pid in session_members(self.mpiexec.pid):
            command = _command_line(pid)
            if command:  # an empty command line: the process is already exiting
                log.warning("killing process %d (%s) left behind in the job's session", pid, command)
            try:
                os.kill(pid, _signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for state in self.instances:
            state.output.flush()
            if state.connection is not None:
                state.connection.close()
                state.connection = None

    def _remove_files_left(self, since: float) -> None:
        """What killed MPICH processes of this job left on this host (see poprun_py.leftovers)."""
        if self.teardown_started is None and self.interrupted is None:
            return  # a job that ended by itself cleaned up after itself
        from poprun_py import leftovers

        for place in (leftovers.HYDRA_TOPOLOGY, leftovers.SHARED_MEMORY):
            for path in leftovers.remove_unused(place, since):
                log.debug("removed %s, left by the job's killed processes", path)

    # ---------------------------------------------------------------- result
    def _finish(self) -> int:
        assert self.mpiexec is not None
        rc = self.mpiexec.returncode
        status = rc if rc is not None and rc > 0 else 1
        if self.interrupted is not None:
            self._show_held()
            self._summary(f"interrupted by {signal_name(self.interrupted)}")
            return 128 + self.interrupted
        unstarted = self._unstarted_hosts()
        if unstarted:
            # The root cause, even when the launcher then took down instances that did start.
            from poprun_py.host_errors import describe

            said = b"".join(self.mpiexec_output).decode(errors="replace").strip()
            if said:
                log.info("mpiexec said:\n%s", said)
            self.held = None
            never = [s.index for s in self.instances if s.host in unstarted and s.pid is None]
            self._error(f"instance(s) {_ranges(never)} could not be started: {describe(unstarted)}")
            return status
        if self.failure is not None:
            self._show_held()
            self._summary(None)
            return self.failure.status
        self._show_held()
        unreported = [s.index for s in self.instances if s.status is None]
        if unreported:
            said = b"".join(self.mpiexec_output).decode(errors="replace").strip()
            self._error(f"mpiexec exited with status {rc} before instance(s) "
                        f"{_ranges(unreported)} reported an exit status"
                        + (f"; mpiexec said:\n{said}" if said and self.teardown_started is not None else ""))
            return status
        return 0 if rc == 0 else status

    def _unstarted_hosts(self) -> dict[str, str]:
        """Hosts the launcher's output blames whose instances never called in: what went wrong there."""
        if self.called_in == len(self.instances):
            return {}
        never = {state.host for state in self.instances if state.pid is None}
        return {host: why for host, why in self._host_failures().items() if host in never}

    def _lost_host(self, state: InstanceState) -> str | None:
        """When every instance of a remote host was lost without a report, the host is what
        failed: say so, with what ssh said about it if anything."""
        if not state.lost or state.host not in self.remote_hosts:
            return None
        on_host = [s for s in self.instances if s.host == state.host]
        if not all(s.lost for s in on_host):
            return None
        silent = next((s for s in on_host if s.silent), None)
        why = self._host_failures().get(state.host) or \
            (_loss(silent) if silent else "its processes or the connection to it died")
        return (f"host {state.host} was lost: instance(s) {_ranges([s.index for s in on_host])} there ended "
                f"without an exit report ({why})")

    def _error(self, message: str) -> None:
        self._say(f"poprun: error: {message}\n")

    def _summary(self, reason: str | None) -> None:
        lines = []
        also: list[InstanceState] = []
        if self.failure is not None and self.failure.index is not None:
            state = self.instances[self.failure.index]
            lost_host = self._lost_host(state)
            left = self._left_early(state)
            if lost_host:
                lines.append(f"poprun: {lost_host}")
            elif left:
                lines.append(f"poprun: {left}")
            else:
                lines.append(f"poprun: instance {state.index} on {state.host} failed: {self.failure.description}")
            cause = self._root_cause(state)
            if cause is not None:
                from poprun_py.root_cause import summary_lines

                lines += summary_lines(state.index, cause)
            if state.output.stderr_tail:
                lines.append(f"poprun: last lines of instance {state.index}'s stderr:")
                lines += [f"    {line.decode(errors='replace')}" for line in state.output.stderr_tail]
            # Instances that failed by themselves too (when all fail at once), each with its own status.
            also = [s for s in self.instances if s is not state and s.failed_by_itself]
            for other in also:
                lines.append(f"poprun: instance {other.index} on {other.host} also failed: "
                             f"{describe_status(other.status or 0, other.signal)}")
        if reason:
            lines.append(f"poprun: {reason}")
        stopped = [s.index for s in self.instances if s.stopped_by_poprun and not s.lost and s not in also]
        if stopped:
            lines.append(f"poprun: stopped instance(s) {_ranges(stopped)}")
        self._say("\n".join(lines) + "\n")

    def failure_report(self) -> dict[str, object] | None:
        """The first failure, for --error-file and the restart message: which instance, where, its
        status or signal, when, one line saying why, and the last lines of its stderr."""
        if self.failure is None or self.failure.index is None:
            return None
        state = self.instances[self.failure.index]
        import datetime

        reason = (self._lost_host(state) or self._left_early(state)
                  or f"instance {state.index} on {state.host} failed: {self.failure.description}")
        return {
            "instance": state.index,
            "host": state.host,
            "status": self.failure.status,
            "signal": signal_name(state.signal) if state.signal else None,
            "time": datetime.datetime.fromtimestamp(self.failure.at, datetime.UTC).isoformat(),
            "reason": reason,
            "stderr_tail": [line.decode(errors="replace") for line in state.output.stderr_tail],
            "root_cause": self._root_cause(state),
        }

    @staticmethod
    def _root_cause(state: InstanceState) -> dict[str, str | None] | None:
        """What the instance's program recorded in its error file (torch's ``@record``), if anything."""
        if state.root_cause is None:
            return None
        from poprun_py.root_cause import describe

        return describe(state.root_cause)

    def _left_early(self, state: InstanceState) -> str | None:
        """When the launcher killed an instance (no exit report) after others had exited with status 0
        while it still ran, those left early: an MPI program that exits without MPI_Finalize (os._exit,
        a crash below Python) makes mpiexec end the rest of the job. Name them, not the victim."""
        if not state.lost or state.silent or state.ended_at is None:
            return None
        left = [s for s in self.instances
                if s.status == 0 and s.ended_at is not None and s.ended_at < state.ended_at]
        if not left:
            return None
        victims = [s.index for s in self.instances if s.lost]
        first = min(s.ended_at or 0.0 for s in left)
        return (f"instance(s) {_ranges([s.index for s in left])} on {', '.join(sorted({s.host for s in left}))} "
                f"left early: exited with status 0 while instance(s) {_ranges(victims)} still ran, and "
                f"{state.ended_at - first:.1f} s later mpiexec ended those without an exit report (an MPI "
                f"program that exits without MPI_Finalize, e.g. through os._exit, takes the job down)")

def _loss(state: InstanceState) -> str:
    """Why an instance went without an exit report, as far as poprun can tell."""
    if state.silent:
        return f"no word from it for {protocol.SILENCE_LIMIT:.0f} s: its host or the network to it is down"
    return "its launcher process died without reporting"


def _ranges(indices: list[int]) -> str:
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


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read(200).replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def session_members(session_id: int) -> list[int]:
    """PIDs whose session is ``session_id`` (Linux /proc), excluding zombies."""
    members = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:  # os.open/os.read: a buffered file object per process would cost 3x as much
            fd = os.open(f"/proc/{entry}/stat", os.O_RDONLY)
            try:
                stat = os.read(fd, 1024)
            finally:
                os.close(fd)
        except OSError:
            continue
        fields = stat.rsplit(b")", 1)[1].split()  # state ppid pgrp session ...
        if len(fields) > 3 and int(fields[3]) == session_id and fields[0] != b"Z":
            members.append(int(entry))
    return members
