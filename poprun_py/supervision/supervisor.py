"""Run the mpiexec command, route every instance's output, and end the job as one.

One event loop (``watch.Watch``) watches: the stubs of poprun's own host (their connections and
their programs' pipes: poprun is its host's supervisor), the control listener and each other
host's supervisor's connection, mpiexec's own stdout/stderr, and a wake-up pipe for signals. The
first instance to fail is the root cause and starts the teardown (``teardown``); once every
instance is done, all the stubs are released together; at the end, what went wrong is reported
(``report``).

poprun's own output is written as it comes, and a write waits while no one reads it (a pager left
alone, a stalled ``tee``, Ctrl-S): the loop reads nothing meanwhile, so the hosts' supervisors'
sends wait and the programs wait on their pipes, as in a shell pipeline. Time the loop did not run (such a wait,
or poprun stopped: SIGSTOP, a debugger) is no one's silence (``_discount_stall``). Ctrl-Z (SIGTSTP)
stops the whole job: every stub stops its program, then poprun stops; ``fg`` continues them all.
"""

from __future__ import annotations

import _signal
import _socket
import os
import re
import sys
import time

from popcontract import environment
from poprun_py.planning.plan import LOCAL_HOST
from poprun_py.shared import sweep
from poprun_py.shared.watch import Watch
from poprun_py.supervision import interrupts, log
from poprun_py.supervision.output import InstanceOutput, OutputOptions, sinks_for
from poprun_py.supervision.process import Process
from poprun_py.supervision.states import Failure, InstanceState, Progress, signal_name
from poprun_py.supervision.strays import Strays
from poprun_py.supervision.teardown import AT_ONCE, Teardown, remove_files_left
from poprun_py.wire import control, protocol

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing on the launch path
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import Any, BinaryIO

    from poprun_py.host import stubs
    from poprun_py.host.programs import HostPrograms
    from poprun_py.supervision.host_links import HostLink
    from poprun_py.supervision.report import Report


#: The most read from an instance's connection or mpiexec's pipe at once.
READ_SIZE = 1 << 16
#: Connections that may wait to be accepted, beyond one per instance (strays, retries).
EXTRA_BACKLOG = 8
#: The loop's longest wait: how soon it looks again at deadlines (the teardown, --start-timeout).
TICK_SECONDS = 0.1
#: After mpiexec exits, how long what its processes still send is read before poprun stops.
AFTER_MPIEXEC_SECONDS = 2.0
#: On one host, how long mpiexec may outlive the end of every instance and of every stub before
#: poprun stops it (see _stop_lingering_mpiexec).
LINGER_SECONDS = 0.5
#: Open MPI's launcher (PRRTE) sets the process group of the remote-start command it forks (ssh, an
#: agent) from both sides; when the child has run its exec first, the parent's setpgid fails
#: (EACCES) and it says so on stderr, a race without consequence that a busy host shows among the
#: job's lines. Kept for -vv (``_read_mpiexec``).
PRRTE_SETPGID_RACE = re.compile(rb"^\[[^]\n]*\] plm:ssh: Warning: setpgid\(\d+,\d+\) failed in parent with "
                                rb"errno=Permission denied\(13\)\n", re.MULTILINE)
#: How often silence is checked (see _check_silence).
SILENCE_CHECK_SECONDS = 1.0
#: A gap longer than this between two turns of the loop is time poprun did not listen (it was
#: stopped, or blocked writing output no one read): it counts as no one's silence (_discount_stall).
STALL_SECONDS = 1.0
#: Connections that have not yet said who they are, at most: beyond it the oldest is dropped, so
#: that strays cannot use up poprun's descriptors (each also gets the silence limit); a host's
#: supervisor whose HELLO has come is taken first (see _make_room).
MAX_PENDING = 64


class Supervisor:
    """``build_command``: the mpiexec command for poprun's control address, and what mpiexec needs in
    its environment besides poprun's. ``secret``: this run's (``seal``), which mpiexec gets in its
    environment (never on a command line) and the hosts' supervisors from it. ``program``: the
    program and its arguments, which each host's supervisor gets in answer to its HELLO.
    ``log_failures_said``: what the job has said of logs that could not be written (see
    ``InstanceOutput``), shared by its starts."""

    def __init__(self, num_instances: int, hosts: list[str],
                 build_command: Callable[[str], tuple[list[str], Mapping[str, str]]],
                 secret: str, program: list[bytes], *, listen_address: str, start_timeout: float,
                 show_instance: int | None = None,
                 remote_hosts: frozenset[str] = frozenset(),
                 stdout: BinaryIO | None = None, stderr: BinaryIO | None = None,
                 output: OutputOptions | None = None, log_failures_said: set[str] | None = None,
                 grace: float = protocol.DEFAULT_GRACE, remote_launcher: str = "ssh",
                 silence_limit: float = protocol.DEFAULT_SILENCE_LIMIT,
                 host_programs: HostPrograms | None = None, stub_socket: str | None = None) -> None:
        # Shared by every instance: who owns the current line of each, one line for both when they
        # are the same file or terminal (see poprun_py.supervision.output).
        self.sinks = sinks_for(stdout or sys.stdout.buffer, stderr or sys.stderr.buffer)
        said = set() if log_failures_said is None else log_failures_said  # one for every instance
        self.instances = [
            InstanceState(i, hosts[i], InstanceOutput(i, show_instance in (None, i), self.sinks, output, said))
            for i in range(num_instances)
        ]
        self.build_command = build_command
        self.secret = secret
        self.program = protocol.encode_program(program)
        self.argv = program
        #: Where this host's instances run under stubs (one host): what each stub is told, what
        #: mpiexec was given (``_start_and_watch``), and the stubs not yet said HELLO.
        self.host_programs = host_programs
        self.launch_env: dict[str, str] = {}
        self.grace = grace
        self.stub_pending: dict[_socket.socket, stubs.Reader] = {}
        #: The remote hosts' supervisors that have said HOST_HELLO, by their connection.
        self.host_links: dict[_socket.socket, HostLink] = {}
        #: Where this host's stubs find poprun (None: a private folder of its own is made).
        self.stub_socket = stub_socket
        self.listen_address = listen_address
        self.remote_hosts = remote_hosts
        #: What reaches the remote hosts (ssh, or the launcher agent's name), as messages name it.
        self.remote_launcher = remote_launcher
        self.watch = Watch()
        self.failure: Failure | None = None
        self.interrupted: int | None = None
        self.teardown = Teardown(self.instances, grace, through_agent=remote_launcher != "ssh",
                                 mark=f"{environment.SECRET}={secret}".encode())
        self.next_silence_check = 0.0
        self.next_stub_tick = 0.0
        #: Every instance done (_release_when_all_done); every one ended and no longer heard from
        #: (the loop's end of what agents left); and, on one host, every stub gone too
        #: (_stop_lingering_mpiexec).
        self.all_done = Progress(self.instances, lambda s: s.done)
        self.all_ended = Progress(self.instances, lambda s: s.status is not None and not s.attached)
        self.all_gone = Progress(self.instances, lambda s: s.status is not None and s.connection is None
                                 and s.pid is not None and sweep.has_ended(s.pid))
        #: ``POPRUN_SILENCE_LIMIT``: how long an instance on another host may say nothing.
        self.silence_limit = silence_limit
        #: Connections accepted that have not yet said HELLO: when each was accepted (monotonic), from
        #: where, and when its nonce was sent (wall clock, ns: see ``clocks``).
        self.pending: dict[_socket.socket, tuple[float, str, int]] = {}
        #: Connections refused on the control port, said in a bounded number of lines.
        self.strays = Strays()
        #: --start-timeout: how long after mpiexec's start every instance must have called in.
        self.start_timeout = start_timeout
        self.mpiexec_started = 0.0
        self.called_in = 0  # instances whose HELLO has arrived
        #: one host: when every instance and stub was first seen ended while mpiexec ran on
        self.all_ended_at: float | None = None
        #: poprun stopped an mpiexec that had nothing left to do (its status is not the job's)
        self.mpiexec_stopped = False
        self.mpiexec: Process | None = None
        self.mpiexec_output: list[bytes] = []
        #: mpiexec's output until every instance has called in, held back: if a host cannot be
        #: reached it is a page of launcher noise around the one line that says why.
        self.held: list[tuple[int, bytes]] | None = []
        #: Streams on which mpiexec's own output left a line unfinished (poprun's lines start anew).
        self.mpiexec_open: set[int] = set()
        #: poprun's own line on why the job failed, when no instance's failure says it.
        self.ended_because: str | None = None
        self.status: int | None = None
        #: time.monotonic() of the loop's last turn, and when mpiexec was seen to have exited.
        self.turned_at = 0.0
        #: The turn before this one began (monotonic), and the turn in which the failure was an
        #: instance lost (a turn's count), for ``_disconnect``.
        self.previous_turn_at = 0.0
        self.turns = 0
        self.lost_in_turn = -1
        self.mpiexec_done_at: float | None = None
        #: Ctrl-Z came while a message to a stub was half sent: the loop stops the job (_on_stop).
        self.stop_due = False
        #: A signal asked poprun to stop the job, which the loop has not said yet (_on_signal).
        self.interrupt_unsaid = False

    # ---------------------------------------------------------------- set-up
    def run(self) -> int:
        started = time.time()
        server, address = control.listen(self.listen_address, backlog=len(self.instances) + EXTRA_BACKLOG)
        wake_read, wake_write = os.pipe()
        os.set_blocking(wake_write, False)
        os.set_blocking(wake_read, False)
        previous_wakeup = _signal.set_wakeup_fd(wake_write)
        previous_handlers = {sig: _signal.signal(sig, self._on_signal)
                             for sig in interrupts.heeded()}
        if _signal.getsignal(_signal.SIGTSTP) != _signal.SIG_IGN:  # (as for the stopping signals)
            previous_handlers[_signal.SIGTSTP] = _signal.signal(_signal.SIGTSTP, self._on_stop)
        try:
            self._start_and_watch(server, address, wake_read, wake_write, previous_wakeup, started)
            # Signals are still only recorded: a storm of them cannot cut the summary short.
            self.status = self._finish()
            return self.status
        finally:
            for sig, handler in previous_handlers.items():
                _signal.signal(sig, handler)

    def _start_and_watch(self, server: _socket.socket, address: str, wake_read: int, wake_write: int,
                         previous_wakeup: int, started: float) -> None:
        """Start mpiexec and run the loop until the job is over; then clean up after it."""
        stub_server: _socket.socket | None = None
        stub_path = ""
        try:
            # What the job orphans on this host (the stubs' holders under gforker, daemons the
            # stubs adopted and ended) comes to poprun, whose teardown collects their ends.
            sweep.adopt_orphans()
            command, env = self.build_command(address)
            self.launch_env = {**os.environ, **env, environment.SECRET: self.secret}
            if self.host_programs is not None:
                from poprun_py.host import stubs

                stub_server, stub_path = self._listen_for_stubs()
                stub_server.setblocking(False)
                self.launch_env[environment.STUB_SOCKET] = stub_path
                self.watch.add(stub_server, ("stub-listen", stub_server))
            log.info("running command: %s", " ".join(command))
            # A terminal stays with poprun: instances reading stdin would fight over it.
            self.mpiexec = self.teardown.mpiexec = Process(command, stdin_devnull=os.isatty(0), env=self.launch_env)
            self.mpiexec_started = time.monotonic()
            log.info("waiting for mpiexec (PID %d)", self.mpiexec.pid)
            self.watch.add(server, ("listen", server))
            self.watch.add(wake_read, ("wake", None))
            self.watch.add(self.mpiexec.stdout, ("mpiexec", 1))
            self.watch.add(self.mpiexec.stderr, ("mpiexec", 2))
            if self.mpiexec.exit_fd is not None:  # wake the moment mpiexec exits instead of polling
                self.watch.add(self.mpiexec.exit_fd, ("exited", None))
            self._loop()
        finally:
            self.strays.finish()
            _signal.set_wakeup_fd(previous_wakeup)  # before its pipe is closed
            self.teardown.kill_leftovers()
            # Even a job that ended by itself: instances that left through os._exit never unlinked
            # their segments (when none is left, this costs two directory listings).
            remove_files_left(started, self.mpiexec.pid if self.mpiexec is not None else None)
            sweep.reap_adopted()  # mpiexec is collected by now (its loop, or kill_leftovers)
            if self.mpiexec is not None:
                self.mpiexec.close()
            for conn in self.pending:
                conn.close()
            for conn, reader in self.stub_pending.items():
                reader.close()
                conn.close()
            for conn in self.host_links:
                conn.close()
            for state in self.instances:
                if state.stub is not None:
                    state.stub.close_pipes()
            if stub_server is not None:
                from poprun_py.host import stubs

                stub_server.close()
                stubs.remove(stub_path)
            server.close()
            os.close(wake_read)
            os.close(wake_write)

    # ---------------------------------------------------------------- event loop
    def _on_signal(self, signum: int, _frame: object) -> None:
        """The first SIGINT, SIGTERM or SIGHUP stops every instance at once, from the handler, so
        that it acts even while a write of poprun's output waits for its reader (unless a message to
        a stub is half sent: then the loop does it); the loop says so at its next turn."""
        if self.interrupted is None:
            self.interrupted = signum
            self.interrupt_unsaid = self.teardown.started is None
            if self.interrupt_unsaid and not self._half_sent():
                self.teardown.begin(quiet=True)
        elif self.teardown.started is not None:
            self.teardown.started = AT_ONCE  # second signal: escalate at once

    def _on_stop(self, _signum: int = _signal.SIGTSTP, _frame: object = None) -> None:
        """Ctrl-Z: stop the whole job, as a shell stops every process of a job: each stub stops its
        program (protocol.STOP), then poprun stops itself with SIGTSTP's own action, so that its shell
        sees the job stopped; once continued (``fg``, ``bg``), the stubs continue their programs.
        Done in the handler, so that it acts even while a write of poprun's output waits for its
        reader; a message to a stub half sent (the program, to a stub slow to take it) is never
        cut into: the loop does it once that message has gone."""
        if self._half_sent():
            self.stop_due = True
            return
        self.stop_due = False
        # Nothing is logged here: the loop may be inside a write to stderr, which this would re-enter.
        self._tell_running(protocol.STOP)
        _signal.signal(_signal.SIGTSTP, _signal.SIG_DFL)
        try:
            _signal.raise_signal(_signal.SIGTSTP)  # returns once continued (SIGCONT)
        finally:
            _signal.signal(_signal.SIGTSTP, self._on_stop)
        self._tell_running(protocol.CONT)

    def _half_sent(self) -> bool:
        """Whether a message to a stub or a host's supervisor is half sent (nothing may cut into it)."""
        return any(state.sending for state in self.instances) or any(link.sending for link in self.host_links.values())

    def _tell_running(self, command: bytes) -> None:
        """``command`` to every stub whose program runs (one already told to end is left to end)."""
        for state in self.instances:
            if state.attached and not state.finished and not state.stopped_by_poprun:
                state.send(command)

    def _discount_stall(self) -> None:
        """Time the loop did not run (STALL_SECONDS or more between two turns: poprun was stopped,
        or a write of its output waited for its reader) is no one's silence: every deadline that
        waits for a word from elsewhere moves on by it. Meanwhile poprun read nothing, so nothing
        could have been heard, and the stubs' kernels' acknowledgements showed them poprun alive."""
        now = time.monotonic()
        gap = now - self.turned_at if self.turned_at else 0.0
        self.turned_at = now
        if gap < STALL_SECONDS:
            return
        log.debug("poprun did not run for %.1f s: not counted as anyone's silence", gap)
        for link in self.host_links.values():
            link.last_heard += gap
        for line in {id(sink.line): sink.line for sink in self.sinks.values()}.values():
            line.discount(gap)  # nor did anyone keep a line to itself meanwhile
        self.pending = {conn: (accepted + gap, peer, sent) for conn, (accepted, peer, sent) in self.pending.items()}
        self.mpiexec_started += gap
        if self.mpiexec_done_at is not None:
            self.mpiexec_done_at += gap

    def _begin_turn(self) -> None:
        """What each turn of the loop first acts on: its own stall, and signals to poprun."""
        self.turns += 1
        self.previous_turn_at = self.turned_at
        self._discount_stall()
        if self.stop_due:
            self._on_stop()
        if self.interrupted is not None and self.interrupt_unsaid:
            self.interrupt_unsaid = False
            log.warning("received %s: stopping every instance", signal_name(self.interrupted))
            self.teardown.begin()
            self.teardown.say_begun()

    def _loop(self) -> None:
        assert self.mpiexec is not None
        while True:
            self._begin_turn()
            self.teardown.escalate()
            self._check_silence()
            self._check_start()
            self._stop_lingering_mpiexec()
            if self.all_ended.all():
                self.teardown.end_what_agents_left()
            for sink in self.sinks.values():
                sink.tick()  # a line that another instance has waited on too long is ended
            self._tick_stubs()
            if self.mpiexec_done_at is None and self.mpiexec.poll() is not None:
                self.mpiexec_done_at = time.monotonic()
                log.info("mpiexec exited with status %s", self.mpiexec.returncode)
            if self.mpiexec_done_at is not None:
                connected = any(i.attached for i in self.instances)
                # mpiexec is gone: read what is still in flight, then stop.
                drained = not connected and not self._mpiexec_pipes_open()
                if drained or time.monotonic() - self.mpiexec_done_at > AFTER_MPIEXEC_SECONDS:
                    if not drained:
                        self._say_what_was_left_open()
                    # mpiexec is gone, and with it whatever could still have carried their words:
                    # instances that never reported are lost (a host cut off before the silence
                    # limit, whose daemon Open MPI gave up on first).
                    for state in self.instances:
                        if state.attached and state.status is None:
                            self._disconnect(state)
                    return
            for fd, (kind, data) in self.watch.ready(TICK_SECONDS):
                self._ready(fd, kind, data)

    def _ready(self, fd: int, kind: str, data: Any) -> None:
        """One descriptor the loop found ready, by its label."""
        assert self.mpiexec is not None
        if kind == "listen":
            self._accept(data)
        elif kind == "wake":
            try:
                os.read(fd, READ_SIZE)  # the signals that woke it
            except BlockingIOError:
                pass
        elif kind == "pending":
            self._read_hello(*data)
        elif kind == "instance":
            self._read_stub(self.instances[data])
        elif kind == "pipe":
            self._read_pipe(*data)
        elif kind == "host":
            self._read_host(data)
        elif kind == "stub-listen":
            self._accept_stub(data)
        elif kind == "stub-hello":
            self._read_stub_hello(data)
        elif kind == "mpiexec":
            self._read_mpiexec(fd, data)
        elif kind == "exited":
            self.watch.remove(fd)
            self.mpiexec.reap()

    def _stop_lingering_mpiexec(self) -> None:
        """One host: once every instance has reported its end and every stub has ended, mpiexec
        has nothing left to do; one still running LINGER_SECONDS later is stopped. MPICH's gforker
        misses a child's end that comes while it handles another's failure, and then waits out its
        2 s limit with a core spinning (4 of 4 failed one-host jobs tried on 2026-11-27)."""
        assert self.mpiexec is not None
        if self.remote_hosts or self.mpiexec_stopped or self.mpiexec.returncode is not None:
            return
        if not self.all_gone.all():
            return
        now = time.monotonic()
        if self.all_ended_at is None:
            self.all_ended_at = now
        elif now - self.all_ended_at >= LINGER_SECONDS:
            log.info("mpiexec outlived the end of every instance by %g s: stopping it", LINGER_SECONDS)
            self.mpiexec_stopped = True
            self.teardown.stop_mpiexec()

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
        from poprun_py.supervision.host_errors import host_failures, launcher_text

        hosts = list(dict.fromkeys(state.host for state in self.instances))
        started = {state.host for state in self.instances if state.pid is not None}
        unstarted = [h for h in hosts if h in self.remote_hosts and h not in started]
        return host_failures(launcher_text(self.mpiexec_output), hosts, unstarted, self.remote_launcher)

    def _say_what_was_left_open(self) -> None:
        """-v: what was still open when poprun stopped waiting after mpiexec's exit."""
        streams = sorted({1: "stdout", 2: "stderr"}[stream] for stream in self._open_mpiexec_streams())
        connected = [state.index for state in self.instances if state.attached]
        held = [f"its {' and '.join(streams)} still open (held by a process it started)"] if streams else []
        if connected:
            from poprun_py.supervision.report import ranges

            held.append(f"instance(s) {ranges(connected)} still connected")
        log.info("stopped waiting %g s after mpiexec exited: %s", AFTER_MPIEXEC_SECONDS, "; ".join(held))

    def _mpiexec_pipes_open(self) -> bool:
        return bool(self._open_mpiexec_streams())

    def _open_mpiexec_streams(self) -> list[int]:
        """mpiexec's streams (1, 2) whose pipes are still open."""
        return [stream for kind, stream in self.watch.labels() if kind == "mpiexec"]

    def _accept(self, server: _socket.socket) -> None:
        """A new connection: its nonce first (see ``seal``); nothing it sends is believed unchecked."""
        accepted = control.accept(server)
        if accepted is None:
            return
        conn, peer = accepted
        from poprun_py.wire.seal import TO_HOST, Seal, new_nonce

        nonce = new_nonce()
        try:
            conn.sendall(nonce)  # a new socket's buffer takes 16 bytes at once
        except OSError:
            conn.close()
            return
        sent = time.time_ns()
        if len(self.pending) >= MAX_PENDING:
            self._make_room()
        self.pending[conn] = (time.monotonic(), peer, sent)
        reader = protocol.FrameReader(Seal(self.secret, nonce, TO_HOST), hello_first=True)
        self.watch.add(conn, ("pending", (conn, reader)))

    def _make_room(self) -> None:
        """Room for one more connection that has not said who it is. First every waiting one is
        read (a host's supervisor whose HELLO has come becomes its host's, a stranger that sent
        bytes is refused), so that strays coming after one in mid-handshake do not push it out; then
        the oldest left is dropped."""
        for kind, data in self.watch.labels():
            if kind == "pending":
                self._read_hello(*data)
        if len(self.pending) >= MAX_PENDING:
            oldest = min(self.pending, key=lambda pending: self.pending[pending][0])
            self._drop_pending(oldest, f"more than {MAX_PENDING} connections had not said who they were")

    def _drop_pending(self, conn: _socket.socket, why: str | None) -> None:
        """Close a connection that has not become an instance's, saying why (None: it closed)."""
        _, peer, _ = self.pending.pop(conn)
        if why is not None:
            self.strays.refused(peer, why)
        self.watch.remove(conn)
        conn.close()

    def _read_hello(self, conn: _socket.socket, reader: protocol.FrameReader) -> None:
        if conn not in self.pending:  # dropped, or taken as an instance's, earlier in this round
            return
        data = self._recv(conn)
        received = time.time_ns()
        if data is None:
            return
        if not data:
            self._drop_pending(conn, None)
            return
        try:
            frames = reader.feed(data)
        except protocol.ProtocolError as exc:  # not sealed with this run's secret: a stranger
            self._drop_pending(conn, str(exc))
            return
        if not frames:
            return
        try:  # sealed with this run's secret: a HELLO that cannot be believed ends the job
            if not self.remote_hosts:
                raise protocol.ProtocolError("every instance of this job runs on poprun's host, and no other "
                                             "host's supervisor is expected")
            pid, host = protocol.read_host_hello(frames[0][2])
        except protocol.ProtocolError as exc:
            peer = self.pending[conn][1]
            self._drop_pending(conn, None)
            self._cannot_read(None, f"a connection from {peer} sealed with this run's secret sent a HELLO "
                                    f"poprun cannot read: {exc}")
            return
        self._host_hello(conn, reader, pid, host, frames[1:], received)

    # ---------------------------------------------------------------- remote hosts' supervisors
    def _host_hello(self, conn: _socket.socket, reader: protocol.FrameReader, pid: int, host: str,
                    frames: list[tuple[int, int, bytes]], received: int) -> None:
        """A remote host's supervisor called in: it gets the program, then its instances' frames."""
        from poprun_py.supervision.host_links import HostLink

        link = HostLink(conn, reader, host, pid, self.pending.pop(conn)[2])
        self.host_links[conn] = link
        self.watch.relabel(conn, ("host", link))
        log.debug("the supervisor of host %s connected (pid %s)", host, pid)
        if not link.send(self.program, within=self.silence_limit):
            log.error("host %s: could not send its supervisor the program", host)
            self._lose_host(link)
            return
        self._host_frames(link, frames, received)

    def _read_host(self, link: HostLink) -> None:
        data = self._recv(link.conn)
        received = time.time_ns()
        if data is None:
            return
        if not data:
            self._lose_host(link)
            return
        link.last_heard = time.monotonic()
        try:
            frames = link.reader.feed(data)
        except protocol.ProtocolError as exc:
            log.error("the supervisor of host %s: dropped its connection: %s", link.host, exc)
            self._lose_host(link)
            return
        self._host_frames(link, frames, received)

    def _host_frames(self, link: HostLink, frames: list[tuple[int, int, bytes]], received: int) -> None:
        """A host supervisor's frames: its clock, its heartbeat, and its instances' frames."""
        from poprun_py.supervision.clocks import offset_ns

        for kind, _stream, payload in frames:
            if link.conn not in self.host_links:  # (lost meanwhile)
                return
            try:
                if kind == protocol.CLOCK:  # (right after its HELLO: its instances take it as they call in)
                    arrived, replied = protocol.read_clock(payload)
                    link.clock_offset = offset_ns(link.nonce_sent, arrived, replied, received)
                    for index in link.instances:
                        self.instances[index].clock_offset = link.clock_offset
                elif kind == protocol.INSTANCE:
                    self._instance_frame(link, *protocol.read_instance(payload))
                elif kind != protocol.HEARTBEAT:
                    raise protocol.ProtocolError(f"a frame of kind {kind} from a host's supervisor")
            except protocol.ProtocolError as exc:
                self._cannot_read(None, f"the supervisor of host {link.host} sent a frame poprun cannot read: {exc}")
                self._lose_host(link)
                return

    def _instance_frame(self, link: HostLink, index: int, kind: int, stream: int, payload: bytes) -> None:
        if not 0 <= index < len(self.instances):
            raise protocol.ProtocolError(f"instance {index} is not of this job")
        state = self.instances[index]
        if kind == protocol.STUB_HELLO:
            if state.attached or state.pid is not None:
                raise protocol.ProtocolError(f"instance {index} is already connected")
            state.pid = protocol.read_stub_hello(payload)
            state.via, state.clock_offset = link, link.clock_offset
            link.instances.add(index)
            self.called_in += 1
            if self.called_in == len(self.instances):
                self._show_held()
            log.debug("instance %d connected from %s (pid %s)", index, state.host, state.pid)
            if self.teardown.started is not None:
                self.teardown.terminate(state)
        elif state.via is not link:
            return  # (an instance already counted lost: what still comes of it is not believed)
        elif kind == protocol.STUB_LOST:
            self._disconnect(state)
        else:
            self._handle_frames(state, [(kind, stream, payload)])

    def _lose_host(self, link: HostLink) -> None:
        """A host's supervisor is gone (its connection ended, or its host fell silent): each of its
        instances that has not reported its end is lost."""
        info = control.tcp_info(link.conn)
        self.host_links.pop(link.conn, None)
        self.watch.remove(link.conn)
        link.conn.close()
        for index in sorted(link.instances):
            state = self.instances[index]
            if state.via is link:
                self._disconnect(state, info)

    @staticmethod
    def _recv(conn: _socket.socket) -> bytes | None:
        """Bytes received; ``b""`` when the peer is gone; ``None`` when nothing is there yet."""
        try:
            return conn.recv(READ_SIZE)
        except BlockingIOError:
            return None
        except OSError:
            return b""

    def _handle_frames(self, state: InstanceState, frames: list[tuple[int, int, bytes]]) -> None:
        """What an instance's stub (through its host's supervisor, or poprun's own) tells of it."""
        for kind, stream, payload in frames:
            problem = protocol.unreadable(kind, stream, payload)
            if problem is not None:  # sealed, so from its stub: a stub poprun cannot work with
                self._cannot_read(state.index, f"its stub sent a frame poprun cannot read: {problem}")
            elif kind == protocol.OUTPUT:
                state.output.feed(stream, payload)
            elif kind == protocol.ROOT_CAUSE:
                state.root_cause = payload
            elif kind == protocol.UNCAUGHT:
                state.uncaught_ns, state.uncaught = protocol.read_uncaught(payload)
            elif kind == protocol.TIMES:
                state.ended_ns, state.stopped_ns, state.recorded_ns = protocol.read_times(payload)
            elif kind == protocol.LAUNCHER_LOST:
                state.launcher_lost = payload.decode(errors="replace")
                fails = self.failure is None and self.teardown.started is None
                if fails:
                    self.failure = Failure(state.index, 1, state.launcher_lost)
                log.info("instance %d on %s: %s", state.index, state.host, state.launcher_lost)
                if fails and self.teardown.started is None:  # (unless a signal's handler began it)
                    self.teardown.begin()
            elif kind == protocol.EXIT:
                state.status, state.signal, state.error, flags = protocol.read_exit(payload)
                state.stub_signalled = bool(flags & protocol.EXIT_STUB_SIGNALLED)
                state.was_stopped = bool(flags & protocol.EXIT_WAS_STOPPED)
                state.oom_killed = bool(flags & protocol.EXIT_OOM_KILLED)
                state.mpi_abort = bool(flags & protocol.EXIT_MPI_ABORT)
                state.ended_at = time.monotonic()
                state.seen_at = time.time()
                if state.error:
                    state.output.stderr_tail.append(state.error.encode())
                how = state.how()
                if self.failure is not None and self.failure.index == state.index and state.launcher_lost:
                    self.failure.status = state.status  # what its stub's stop gave, as for any failure
                fails = state.status != 0 and self.failure is None and not state.stopped_by_poprun \
                    and self.teardown.started is None
                if fails:
                    self.failure = Failure(state.index, state.status, how)
                # Said once recorded: a signal that follows what poprun said (its handler begins the
                # teardown at once) finds the failure on record.
                log.info("instance %d on %s: %s", state.index, state.host, how)
                if fails and self.teardown.started is None:
                    self.teardown.begin()
                self._release_when_all_done()

    def _cannot_read(self, index: int | None, why: str) -> None:
        """A frame sealed with this run's secret that cannot be read (a stub of another version, a
        bug): the job cannot be supervised as it should, and ends, saying so in one line."""
        if self.failure is None and self.teardown.started is None:
            self.failure = Failure(index, 1, why)
            self.teardown.begin()
        else:  # the job is ending already: one more line would only repeat it
            log.info("%s%s", "" if index is None else f"instance {index}: ", why)

    def _release_when_all_done(self) -> None:
        """Once every instance is done, let all the stubs exit together (see protocol.RELEASE)."""
        if not self.all_done.all():
            return
        for state in self.instances:
            if state.attached:
                state.send(protocol.RELEASE)

    def _check_silence(self) -> None:
        """An instance on another host still running that has said nothing for the silence limit
        is lost: its host died or the network to it is cut (neither closes the connection). On this
        host neither can happen, and a stub that ends closes its connection: one silent here is only
        waiting for a core (a thousand instances on two cores wait that long to start), not lost.
        Silence is a host's (its supervisor's connection). A connection that has not said who it is
        by then is dropped. Checked once a second."""
        now = time.monotonic()
        if now < self.next_silence_check:
            return
        self.next_silence_check = now + SILENCE_CHECK_SECONDS
        self.strays.tick()
        for conn, (accepted, _, _) in list(self.pending.items()):
            if now - accepted > self.silence_limit:
                self._drop_pending(conn, f"it said nothing for {self.silence_limit:g} s")
        for link in list(self.host_links.values()):
            running = [self.instances[i] for i in link.instances
                       if self.instances[i].via is link and not self.instances[i].finished]
            if running and now - link.last_heard > self.silence_limit:
                log.warning("no word from %s's supervisor for %.0f s", link.host, now - link.last_heard)
                for state in running:
                    state.silent = self.silence_limit
                self._lose_host(link)

    def _check_start(self) -> None:
        """Instances that have not called in --start-timeout seconds after mpiexec started will not:
        its processes cannot start there (a process limit, a host that takes ssh but never runs
        them), and mpiexec may wait for ever without a word. Stop the job, saying which."""
        if self.called_in == len(self.instances) or self.failure is not None or self.teardown.started is not None \
                or time.monotonic() - self.mpiexec_started < self.start_timeout:
            return
        from poprun_py.supervision.report import ranges

        missing = [s.index for s in self.instances if s.pid is None]
        hosts = ", ".join(dict.fromkeys(self.instances[i].host for i in missing))
        self.failure = Failure(None, 1, f"instance(s) {ranges(missing)} on {hosts} had not started "
                                        f"{self.start_timeout:g} s after mpiexec did (--start-timeout)")
        self.teardown.begin()

    def _disconnect(self, state: InstanceState, info: bytes | None = None) -> None:
        """poprun no longer hears from ``state``: its connection ended (its stub's, or its
        host supervisor's: ``info``, that connection's TCP_INFO), or its stub left. Lost, unless it
        reported its end."""
        assert state.attached
        if state.stub is not None:  # what its program wrote before is passed on first
            for fd in state.stub.pipes:
                self.watch.remove(fd)
            state.stub.lost()
        if state.connection is not None:
            info = control.tcp_info(state.connection) if state.stub is None else None
            self.watch.remove(state.connection)
            state.connection.close()
            state.connection = None
        state.via = None
        state.output.flush()
        if state.status is None:
            # The stub died without reporting (killed by mpiexec or a signal).
            state.lost = True
            now = time.monotonic()
            # When its connection ended: its last segment (the FIN) came that long ago, within this
            # turn's wait, which may have found several ended (a host's death, then the launcher's
            # end of the others: on a busy machine poprun may have waited its turn meanwhile).
            ago = min(control.since_last_ack(info), now - self.previous_turn_at) if info is not None else 0.0
            state.ended_at = now - max(0.0, ago)
            state.seen_at = time.time()
            log.info("instance %d on %s was lost without an exit report", state.index, state.host)
            log.debug("its connection's last segment came %.3f s ago; this turn began %.3f s after the last",
                      control.since_last_ack(info) if info is not None else -1.0, now - self.previous_turn_at)
            if self._first_loss(state):
                from poprun_py.supervision.report import loss

                self.failure = Failure(state.index, 1, f"lost: {loss(state)}")
                self.teardown.begin()
                self.lost_in_turn = self.turns
            self._release_when_all_done()

    def _first_loss(self, state: InstanceState) -> bool:
        """Whether the loss of ``state`` is the job's failure: the first thing to fail, or a loss
        found in the same turn as the loss that was, whose connection ended before that one's."""
        if self.failure is None:
            return self.teardown.started is None
        if self.lost_in_turn != self.turns or self.failure.index is None:
            return False
        first = self.instances[self.failure.index]
        return first.ended_at is not None and state.ended_at is not None and state.ended_at < first.ended_at

    # ---------------------------------------------------------------- stubs (one host)
    def _listen_for_stubs(self) -> tuple[_socket.socket, str]:
        """The stubs' socket on this host: at ``stub_socket``, in its folder made here (private),
        or in a private folder of its own."""
        from poprun_py.host import stubs

        if self.stub_socket is None:
            return stubs.listen()
        folder = os.path.dirname(self.stub_socket)
        for place in (os.path.dirname(folder), folder):
            try:
                os.mkdir(place, 0o700)
            except FileExistsError:
                pass
        from poprun_py.shared.paths import private_folder

        if not private_folder(folder) or not private_folder(os.path.dirname(folder)):
            raise OSError(f"{folder} is not a private folder of this user")
        return stubs.bind(self.stub_socket), self.stub_socket

    def _accept_stub(self, server: _socket.socket) -> None:
        """A stub's connection (``host.stubs``: its user checked); its HELLO comes next."""
        from poprun_py.host import stubs

        try:
            accepted = stubs.accept(server)
        except OSError:
            return
        if accepted is None:
            return
        conn, _ = accepted
        conn.setblocking(False)
        self.stub_pending[conn] = stubs.Reader()
        self.watch.add(conn, ("stub-hello", conn))

    def _read_stub_hello(self, conn: _socket.socket) -> None:
        """A stub's HELLO: it becomes its instance's, and gets its program."""
        from poprun_py.host import stubs
        from poprun_py.host.instance import StubbedInstance
        from poprun_py.wire import local

        reader = self.stub_pending.get(conn)
        if reader is None:
            return
        try:
            frames = reader.frames(conn)
            if frames == []:
                return  # (the rest of its HELLO is still to come)
            del self.stub_pending[conn]
            self.watch.remove(conn)
            if frames is None:
                conn.close()
                return
            index = stubs.hello_index(frames)
            if not 0 <= index < len(self.instances) or self.instances[index].attached:
                raise local.LocalProtocolError(f"instance {index} is not expected or already connected")
        except (OSError, local.LocalProtocolError) as exc:
            self.stub_pending.pop(conn, None)
            self.watch.remove(conn)
            reader.close()
            conn.close()
            self._cannot_read(None, f"a stub on this host sent a HELLO poprun cannot read: {exc}")
            return
        state = self.instances[index]
        assert self.host_programs is not None
        env, error_file = self.host_programs.environment(index, self.launch_env)
        state.stub = StubbedInstance(index, conn, reader, lambda data: self._from_stub(state, data), grace=self.grace,
                                     error_file=error_file, program=self.argv[0], tidy=False)
        state.connection, state.pid = conn, stubs.peer(conn).pid
        self.called_in += 1
        if self.called_in == len(self.instances):
            self._show_held()
        if state.host == LOCAL_HOST:
            state.host = _socket.gethostname()
        self.watch.add(conn, ("instance", index))
        log.debug("instance %d connected from %s (pid %s)", index, state.host, state.pid)
        if not state.stub.start(self.argv, env, self.host_programs.flags(index)):
            log.error("instance %d on %s: could not send it the program", index, state.host)
            self._disconnect(state)
            return
        if self.teardown.started is not None:
            self.teardown.terminate(state)

    def _read_stub(self, state: InstanceState) -> None:
        """One frame from an instance's stub; its end, when its connection ended."""
        from poprun_py.wire import local

        assert state.stub is not None and state.connection is not None
        try:
            frames = state.stub.reader.frames(state.stub.conn)
            for frame in frames or []:
                for fd in state.stub.frame(frame):
                    self.watch.add(fd, ("pipe", (state.index, fd)))
        except (OSError, local.LocalProtocolError) as exc:
            log.error("instance %d on %s: dropped its stub's connection: %s", state.index, state.host, exc)
            frames = None
        if frames is None:
            self._disconnect(state)

    def _read_pipe(self, index: int, fd: int) -> None:
        stub = self.instances[index].stub
        if stub is None or fd not in stub.pipes:  # closed earlier in this turn (its number since reused)
            return
        if not stub.read(fd):
            self.watch.remove(fd)  # (before it is closed)
            stub.pipe_ended(fd)

    def _tick_stubs(self) -> None:
        """The stubbed instances' deadlines (a traceback waited for, a drain), looked at every
        TICK_SECONDS: the events that end them early (a pipe's end, a line) are acted on as they come."""
        now = time.monotonic()
        if now < self.next_stub_tick:
            return
        self.next_stub_tick = now + TICK_SECONDS
        for state in self.instances:
            if state.stub is not None and state.stub.waiting:
                state.stub.tick(now)

    def _from_stub(self, state: InstanceState, data: bytes) -> None:
        """A frame poprun gets of an instance run by a stub, as its stub would have sent it."""
        kind, stream, _ = protocol.HEADER.unpack_from(data)
        self._handle_frames(state, [(kind, stream, data[protocol.HEADER.size:])])

    def _read_mpiexec(self, fd: int, stream: int) -> None:
        data = os.read(fd, READ_SIZE)
        if not data:
            self.watch.remove(fd)
            return
        self.mpiexec_output.append(data)
        for race in PRRTE_SETPGID_RACE.findall(data):
            log.debug("mpiexec: %s", race.decode(errors="replace").rstrip())
        data = PRRTE_SETPGID_RACE.sub(b"", data)
        if not data:
            return
        if self.held is not None:
            self.held.append((stream, data))
        elif self.teardown.started is None:
            self._pass_on(stream, data)
        else:
            log.debug("mpiexec during teardown: %s", data.decode(errors="replace").rstrip())

    # ---------------------------------------------------------------- result
    def _finish(self) -> int:
        assert self.mpiexec is not None
        # an mpiexec poprun stopped had ended every instance: their statuses are the job's
        rc = 0 if self.mpiexec_stopped else self.mpiexec.returncode
        status = rc if rc is not None and rc > 0 else 1
        if self.interrupted is not None:
            self._show_held()
            self._summary(f"interrupted by {signal_name(self.interrupted)}")
            return 128 + self.interrupted
        unstarted = self._unstarted_hosts()
        if unstarted:
            # The root cause, even when the launcher then took down instances that did start.
            from poprun_py.supervision.host_errors import describe, launcher_text
            from poprun_py.supervision.report import ranges

            said = launcher_text(self.mpiexec_output).strip()
            if said:
                log.info("mpiexec said:\n%s", said)
            self.held = None
            never = [s.index for s in self.instances if s.host in unstarted and s.pid is None]
            self._error(f"instance(s) {ranges(never)} could not be started: {describe(unstarted)}")
            return status
        if self.failure is not None:
            self._show_held()
            report = self._report()
            self._say(report.summary(None))
            return report.status
        self._show_held()
        # Nothing failed and nothing stopped the job: whatever mpiexec said has been passed on.
        unreported = [s.index for s in self.instances if s.status is None]
        if unreported:
            from poprun_py.supervision.report import ranges

            self._error(f"mpiexec exited with status {rc} before instance(s) "
                        f"{ranges(unreported)} reported an exit status")
            return status
        if rc != 0:
            self._error(f"mpiexec exited with status {rc} after every instance had exited with status 0")
        return 0 if rc == 0 else status

    def _unstarted_hosts(self) -> dict[str, str]:
        """Hosts the launcher's output blames whose instances never called in: what went wrong there."""
        if self.called_in == len(self.instances):
            return {}
        never = {state.host for state in self.instances if state.pid is None}
        return {host: why for host, why in self._host_failures().items() if host in never}

    def _error(self, message: str) -> None:
        self.ended_because = message
        self._say(f"poprun: error: {message}\n")

    def _report(self) -> Report:
        from poprun_py.supervision.report import Report

        return Report(self.instances, self.failure, self.remote_hosts, self._host_failures)

    def _summary(self, reason: str | None) -> None:
        self._say(self._report().summary(reason))

    def failure_report(self) -> dict[str, object] | None:
        """The first failure, for --error-file and the restart message (see ``report``); poprun's
        own reason when no instance failed (a host that could not start, mpiexec's failure, a signal
        to poprun before any instance failed). None only when the run succeeded."""
        from poprun_py.supervision.report import own_failure

        if self.ended_because is not None:  # said instead of an instance's failure (see _finish)
            return own_failure(self.ended_because, self.status or 1)
        report = self._report().failure_report()
        if report is None and self.interrupted is not None:
            return own_failure(f"interrupted by {signal_name(self.interrupted)}", 128 + self.interrupted,
                               stopped=self._report().stopped())
        return report

    def lost_hosts(self) -> dict[str, str]:
        """The hosts this run lost, each with why: those the launcher could not start the instances
        on (then the others' losses are the launcher ending the job), else remote hosts whose every
        instance was lost or never called in (see ``report``)."""
        return self._unstarted_hosts() or self._report().lost_hosts()

