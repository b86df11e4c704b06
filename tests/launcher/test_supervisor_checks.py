"""The supervisor's periodic checks, one step at a time on real connections of hosts' supervisors
(one instance each here): a host that has gone silent (it died or the network to it is cut) and
instances that never call in."""

from __future__ import annotations

import io
import os
import re
import signal
import socket
import time
from collections.abc import Callable, Iterator

import pytest

from poprun_py.supervision.process import Process
from poprun_py.supervision.supervisor import MAX_PENDING, Supervisor
from poprun_py.wire import protocol
from poprun_py.wire.seal import TO_POPRUN, Seal, new_secret
from tests.helpers import PYTHON, wait_until
from tests.launcher import supervising
from tests.launcher.supervising import START_TIMEOUT, InstanceSeal, call_in, call_in_sealed, link_of, poprun_log, read


@pytest.fixture
def job() -> Iterator[tuple[Supervisor, socket.socket, list[socket.socket]]]:
    """A supervisor of three instances on hosts a, b, c (other machines than poprun's), its
    listener, and the hosts' supervisors' ends of the connections that call in (closed at the end)."""
    s = supervising.supervisor(io.BytesIO(), io.BytesIO(), hosts=("a", "b", "c"))
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    ends_: list[socket.socket] = []
    yield s, server, ends_
    for sock in (server, *ends_, *(link.conn for link in s.host_links.values())):
        sock.close()


def _heard(s: Supervisor, index: int, at: float) -> None:
    """Instance ``index``'s host last heard at ``at`` (monotonic)."""
    link = link_of(s, index)
    assert link is not None
    link.last_heard = at


def test_an_instance_silent_past_the_limit_is_lost_and_ends_the_job(
        job: tuple[Supervisor, socket.socket, list[socket.socket]]) -> None:
    s, server, ends_ = job
    ends_ += [call_in(s, server, index) for index in range(3)]
    now = time.monotonic()
    quiet, silent, finished = s.instances
    _heard(s, 0, now - s.silence_limit + 10)  # quiet, within the limit
    _heard(s, 1, now - s.silence_limit - 1)
    finished.status = 0  # exited: no word is expected from it
    _heard(s, 2, now - 3600)
    with poprun_log(1) as said:
        s._check_silence()
    lines = [line.split(" POPRUN ", 1)[1] for line in said.getvalue().splitlines()]
    assert lines[:2] == ["[W] no word from b's supervisor for 21 s",
                         "[I] instance 1 on b was lost without an exit report"], lines
    assert (silent.silent, silent.lost, silent.attached) == (s.silence_limit, True, False)
    assert s.failure is not None and (s.failure.index, s.failure.status) == (1, 1)
    assert s.failure.description.startswith("lost: ")
    assert s.teardown.started is not None and quiet.stopped_by_poprun  # the others are told to stop
    assert not quiet.silent and quiet.attached
    assert not finished.silent and finished.attached


def test_time_poprun_did_not_run_is_no_ones_silence(job: tuple[Supervisor, socket.socket, list[socket.socket]]) -> None:
    """A turn of the loop that comes 30 s late (poprun was stopped, or a write of its output waited
    for its reader) moves every deadline that waits for a word by the gap: instances quiet for 15 s
    before it are not lost, and an open line did not keep another instance waiting meanwhile."""
    s, server, ends_ = job
    ends_ += [call_in(s, server, index) for index in range(3)]
    s._discount_stall()  # the loop's first turn
    s.instances[0].output.feed(1, b"unfinished")
    s.instances[1].output.feed(1, b"waits for its turn\n")
    line = s.sinks[1].line
    assert line.owner is not None and len(line.queue) == 1
    gap = 30.0
    now = time.monotonic()
    for index in range(3):
        _heard(s, index, now - gap - 15)  # quiet for 15 s before poprun stopped running
    line.active -= gap  # the line's owner last wrote, and the other began waiting, just before
    line.queue[0].waiting_since -= gap
    s.turned_at -= gap  # the loop's last turn was just before, too
    s._discount_stall()
    s.next_silence_check = 0.0
    s._check_silence()
    s.sinks[1].tick()
    assert s.failure is None and not any(state.silent for state in s.instances)
    stdout = s.sinks[1].file
    assert isinstance(stdout, io.BytesIO) and stdout.getvalue() == b"[0] unfinished"  # not cut for the other


def test_silence_is_checked_once_a_second(job: tuple[Supervisor, socket.socket, list[socket.socket]]) -> None:
    s, server, ends_ = job
    ends_ += [call_in(s, server, index) for index in range(3)]
    for index in range(3):
        _heard(s, index, time.monotonic())
    s._check_silence()
    assert s.next_silence_check > time.monotonic() + 0.5
    _heard(s, 2, time.monotonic() - s.silence_limit - 1)
    s._check_silence()  # within the second: not checked
    assert not s.instances[2].silent
    s.next_silence_check = time.monotonic()  # the second is over
    s._check_silence()
    assert s.instances[2].silent and s.failure is not None and s.failure.index == 2


def test_instances_not_called_in_at_the_start_timeout_end_the_job_named_with_their_hosts(
        job: tuple[Supervisor, socket.socket, list[socket.socket]]) -> None:
    s, server, ends_ = job
    s.start_timeout = 5
    s.mpiexec_started = time.monotonic() - 4  # before the timeout
    ends_.append(call_in(s, server, 1))
    s._check_start()
    assert s.failure is None and s.teardown.started is None
    s.mpiexec_started = time.monotonic() - 6
    s._check_start()
    assert s.failure is not None and (s.failure.index, s.failure.status) == (None, 1)
    assert s.failure.description == "instance(s) 0, 2 on a, c had not started 5 s after mpiexec did (--start-timeout)"
    assert s.teardown.started is not None and s.instances[1].stopped_by_poprun


@pytest.mark.parametrize("case", ["all called in", "failed already", "stopping already"])
def test_the_start_timeout_does_not_fire_once_everyone_called_in_or_the_job_is_ending(
        case: str, job: tuple[Supervisor, socket.socket, list[socket.socket]]) -> None:
    s, server, ends_ = job
    s.start_timeout = 5
    s.mpiexec_started = time.monotonic() - 60
    if case == "all called in":
        ends_ += [call_in(s, server, index) for index in range(3)]
    elif case == "stopping already":
        s.teardown.begin()
    else:
        from poprun_py.supervision.states import Failure

        s.failure = Failure(0, 3, "exit status 3")
    before = s.failure
    s._check_start()
    assert s.failure is before


def test_of_losses_found_in_one_turn_the_connection_that_ended_first_is_the_failure(
        job: tuple[Supervisor, socket.socket, list[socket.socket]]) -> None:
    """A host dies (instance 2's supervisor with it), and the launcher then ends the others without a
    report (instance 0's host's supervisor goes too): poprun, waiting its turn on a busy machine,
    finds both connections ended in one turn, instance 0's first. The failure is the loss whose
    connection ended first (its FIN came first), not the one read first; the other is a loss of the
    teardown."""
    s, server, ends_ = job
    ends_ += [call_in(s, server, index) for index in range(3)]
    for index in (2, 0):
        link = link_of(s, index)
        assert link is not None
        link.conn.setblocking(True)  # (read below as the loop would, once each is ready)
    ends_[2].close()
    time.sleep(0.05)  # the kernel stamps each FIN's arrival to the tick (4 ms at most): 50 ms apart
    ends_[0].close()
    for index in (0, 2):  # the order one turn may read them in
        read(s, index)
    assert s.instances[0].lost and s.instances[2].lost
    assert s.failure is not None and s.failure.index == 2 and s.failure.description.startswith("lost: ")
    assert s.instances[2].ended_at is not None and s.instances[0].ended_at is not None
    assert s.instances[0].ended_at - s.instances[2].ended_at > 0.03


def test_a_frame_that_fails_its_check_drops_the_connection_and_the_instance_is_lost(
        job: tuple[Supervisor, socket.socket, list[socket.socket]]) -> None:
    """Only a host's supervisor of this run can seal a frame: one that fails its check means the
    connection was tampered with, and what comes on it can no longer be believed."""
    s, server, ends_ = job
    ends_ += [call_in(s, server, index) for index in range(3)]
    ends_[1].sendall(protocol.frame(protocol.EXIT, bytes(9)) + bytes(protocol.TAG_SIZE))  # no real tag
    state = s.instances[1]
    deadline = time.monotonic() + 10  # until the bytes are through loopback
    with poprun_log() as said:
        while state.attached and time.monotonic() < deadline:
            read(s, 1)
    assert said.getvalue().endswith(" POPRUN [E] the supervisor of host b: dropped its connection: a frame failed "
                                    "its authentication check\n"), said.getvalue()
    assert not state.attached and state.lost and state.status is None  # the report was not believed
    assert s.failure is not None and s.failure.index == 1 and s.failure.description.startswith("lost: ")
    assert s.teardown.started is not None
    assert ends_[1].recv(1) == b""  # closed by poprun


def _stray(s: Supervisor, server: socket.socket) -> socket.socket:
    """A connection that takes poprun's nonce and then says nothing."""
    stray = socket.create_connection(server.getsockname(), timeout=10)
    s._accept(server)
    assert len(stray.recv(protocol.NONCE_SIZE, socket.MSG_WAITALL)) == protocol.NONCE_SIZE
    return stray


def test_a_connection_that_never_says_who_it_is_is_dropped_at_the_silence_limit(
        job: tuple[Supervisor, socket.socket, list[socket.socket]]) -> None:
    s, server, ends_ = job
    ends_ += [_stray(s, server), _stray(s, server)]
    old, new = s.pending  # in the order they came
    s.pending[old] = (time.monotonic() - s.silence_limit - 1, *s.pending[old][1:])
    with poprun_log() as said:
        s._check_silence()
    assert list(s.pending) == [new] and ends_[0].recv(1) == b""
    port = ends_[0].getsockname()[1]
    assert said.getvalue().endswith(f" POPRUN [E] unexpected connection on the control port from 127.0.0.1:{port}: "
                                    "it said nothing for 20 s\n"), said.getvalue()


def test_beyond_the_most_connections_waiting_to_say_who_they_are_the_oldest_is_dropped(
        job: tuple[Supervisor, socket.socket, list[socket.socket]]) -> None:
    s, server, ends_ = job
    ends_ += [_stray(s, server) for _ in range(MAX_PENDING)]
    # The oldest is one in the middle (not the first to come, nor the lowest port).
    oldest = list(s.pending)[MAX_PENDING // 2]
    s.pending[oldest] = (time.monotonic() - 10, *s.pending[oldest][1:])
    dropped = ends_[MAX_PENDING // 2]
    with poprun_log() as said:
        ends_.append(_stray(s, server))
    assert len(s.pending) == MAX_PENDING and oldest not in s.pending and dropped.recv(1) == b""
    port = dropped.getsockname()[1]
    assert said.getvalue().endswith(f" POPRUN [E] unexpected connection on the control port from 127.0.0.1:{port}: "
                                    f"more than {MAX_PENDING} connections had not said who they were\n")
    ends_.append(call_in(s, server, 0))  # an instance still calls in
    assert s.instances[0].attached and len(s.pending) == MAX_PENDING - 1


def test_frames_that_come_with_the_hello_are_each_handled(
        job: tuple[Supervisor, socket.socket, list[socket.socket]]) -> None:
    s, server, ends_ = job
    output = s.instances[0].output
    ends_.append(call_in(s, server, 0, then=(protocol.frame(protocol.OUTPUT, b"one\n", 1),
                                             protocol.frame(protocol.OUTPUT, b"two\n", 1),
                                             protocol.exit_report(0, None, None))))
    assert s.instances[0].status == 0
    output.flush()
    stdout = s.sinks[1].file
    assert isinstance(stdout, io.BytesIO) and stdout.getvalue() == b"[0] one\n[0] two\n"


def _commands(end: socket.socket, seal: InstanceSeal) -> list[bytes]:
    """poprun's commands that have reached ``end`` (nothing waited for: poprun sends on loopback
    within its call, so they are there), each for the instance it serves."""
    end.setblocking(False)
    try:
        data = end.recv(4096)
    except BlockingIOError:
        data = b""
    finally:
        end.setblocking(True)
    commands = protocol.CommandReader(seal.host_seal).feed(data)
    assert all(protocol.INSTANCE_FIELDS.unpack_from(command, 1)[0] == seal.index for command in commands)
    return [command[:1] for command in commands]


def test_the_stubs_are_released_together_once_every_instance_is_done(
        job: tuple[Supervisor, socket.socket, list[socket.socket]]) -> None:
    s, server, ends_ = job
    ends = [call_in_sealed(s, server, index) for index in range(3)]
    ends_ += [end for end, _ in ends]
    for index, (end, seal) in enumerate(ends):
        end.sendall(seal.seal(protocol.exit_report(0, None, None)))
        deadline = time.monotonic() + 10  # until the bytes are through loopback
        while s.instances[index].status is None and time.monotonic() < deadline:
            read(s, index)
        assert s.instances[index].status == 0
        if index < 2:  # some instance still runs: nobody is released yet
            assert [_commands(other, other_seal) for other, other_seal in ends] == [[], [], []]
    assert [_commands(end, seal) for end, seal in ends] == [[protocol.RELEASE]] * 3


def _read_until(s: Supervisor, index: int, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10  # until the bytes are through loopback
    while not done() and time.monotonic() < deadline:
        read(s, index)
    assert done()


def _reported(s: Supervisor, index: int) -> Callable[[], bool]:
    return lambda: s.instances[index].status is not None


def test_a_stub_whose_mpi_daemon_died_is_the_failure_from_its_first_word(
        job: tuple[Supervisor, socket.socket, list[socket.socket]]) -> None:
    """The launcher ends the other hosts' instances as soon as a host's daemon dies; the ends_
    there say so at once (LAUNCHER_LOST), and what poprun hears first is the failure: here b's,
    though c's failure report comes before b's own."""
    s, server, ends_ = job
    ends = [call_in_sealed(s, server, index) for index in range(3)]
    ends_ += [end for end, _ in ends]
    why = b"the MPI launcher's process that started instance 1 on b (PID 7) died \xff"
    with poprun_log(1) as said:
        ends[1][0].sendall(ends[1][1].seal(protocol.frame(protocol.LAUNCHER_LOST, why)))
        _read_until(s, 1, lambda: s.failure is not None)
    assert s.failure is not None and s.failure.index == 1 and s.teardown.started is not None
    assert s.instances[1].launcher_lost == why.decode(errors="replace")
    lines = [line.split(" POPRUN ", 1)[1] for line in said.getvalue().splitlines()]
    assert lines == [f"[I] instance 1 on b: {why.decode(errors='replace')}", "[I] stopping every instance"]
    # c, ended by the launcher, reports first; then b's stub, having stopped its program.
    ends[2][0].sendall(ends[2][1].seal(protocol.exit_report(143, 15, None)))
    _read_until(s, 2, lambda: s.instances[2].status is not None)
    assert (s.failure.index, s.failure.status) == (1, 1)
    ends[1][0].sendall(ends[1][1].seal(protocol.exit_report(143, 15, None)))
    _read_until(s, 1, lambda: s.instances[1].status is not None)
    assert (s.failure.index, s.failure.status) == (1, 143)  # b's status, as for any failure


def test_a_daemon_lost_after_the_failure_does_not_replace_it(
        job: tuple[Supervisor, socket.socket, list[socket.socket]]) -> None:
    s, server, ends_ = job
    ends = [call_in_sealed(s, server, index) for index in range(3)]
    ends_ += [end for end, _ in ends]
    ends[0][0].sendall(ends[0][1].seal(protocol.exit_report(3, None, None)))
    _read_until(s, 0, lambda: s.failure is not None)
    ends[1][0].sendall(ends[1][1].seal(protocol.frame(protocol.LAUNCHER_LOST, b"its daemon died")))
    _read_until(s, 1, lambda: s.instances[1].launcher_lost is not None)
    ends[1][0].sendall(ends[1][1].seal(protocol.exit_report(143, 15, None)))
    _read_until(s, 1, lambda: s.instances[1].status is not None)
    assert s.failure is not None and (s.failure.index, s.failure.status) == (0, 3)


def test_a_daemon_lost_while_poprun_stops_the_job_is_no_failure(
        job: tuple[Supervisor, socket.socket, list[socket.socket]]) -> None:
    """Stopping a job (on a signal) ends the daemons too: the ends_' word of it is no failure."""
    s, server, ends_ = job
    ends = [call_in_sealed(s, server, index) for index in range(3)]
    ends_ += [end for end, _ in ends]
    s.teardown.begin()  # what a SIGTERM to poprun starts, with no failure
    ends[1][0].sendall(ends[1][1].seal(protocol.frame(protocol.LAUNCHER_LOST, b"its daemon died")))
    _read_until(s, 1, lambda: s.instances[1].launcher_lost is not None)
    assert s.failure is None


def test_a_stub_that_saw_its_daemon_die_and_was_then_lost_went_down_with_its_host(
        job: tuple[Supervisor, socket.socket, list[socket.socket]]) -> None:
    """A host dies; its stub, killed a moment after its MPI daemon, may yet say the daemon died
    (LAUNCHER_LOST). With no exit report after it, the host is lost, not its daemon alone."""
    s, server, ends_ = job
    s.remote_hosts = frozenset({"b", "c"})
    ends = [call_in_sealed(s, server, index) for index in range(3)]
    ends_ += [end for end, _ in ends]
    ends[1][0].sendall(ends[1][1].seal(protocol.frame(protocol.LAUNCHER_LOST, b"its daemon died")))
    ends[1][0].close()
    _read_until(s, 1, lambda: s.instances[1].lost)
    for index in (0, 2):
        ends[index][0].sendall(ends[index][1].seal(protocol.exit_report(143, 15, None)))
        _read_until(s, index, _reported(s, index))
    assert s.failure is not None and s.failure.index == 1
    summary = s._report().summary(None)
    assert ("poprun: host b was lost: instance(s) 1 there ended without an exit report "
            "(its processes or the connection to it died)\n") in summary, summary
    assert s.lost_hosts() == {"b": "its processes or the connection to it died"}


def test_a_stub_that_saw_its_daemon_die_and_reported_the_stop_names_the_daemon(
        job: tuple[Supervisor, socket.socket, list[socket.socket]]) -> None:
    s, server, ends_ = job
    s.remote_hosts = frozenset({"b", "c"})
    ends = [call_in_sealed(s, server, index) for index in range(3)]
    ends_ += [end for end, _ in ends]
    ends[1][0].sendall(ends[1][1].seal(protocol.frame(protocol.LAUNCHER_LOST, b"its daemon died")))
    for index in (1, 0, 2):
        ends[index][0].sendall(ends[index][1].seal(protocol.exit_report(143, 15, None)))
        _read_until(s, index, _reported(s, index))
    summary = s._report().summary(None)
    assert "poprun: instance 1 on b failed: its daemon died\n" in summary, summary
    assert s.lost_hosts() == {"b": "its daemon died"}


@pytest.mark.slow  # starts a process to play mpiexec
@pytest.mark.parametrize("held", [False, True])
def test_an_instance_still_connected_without_a_report_once_mpiexec_is_gone_is_lost_with_its_host(
        job: tuple[Supervisor, socket.socket, list[socket.socket]], held: bool) -> None:
    """A host cut off before the silence limit: the launcher gives up on its daemon and ends, while
    that host's supervisor's connection still looks open. Once mpiexec is gone and its output read, no
    word can come from it: the instance is lost and its host named. (Here a process the launcher
    started may also hold its output: -v names what held poprun's wait.)"""
    s, server, ends_ = job
    s.remote_hosts = frozenset({"b", "c"})
    ends = [call_in_sealed(s, server, index) for index in range(3)]
    ends_ += [end for end, _ in ends]
    for index in (0, 2):  # their work done; b's report can no longer come
        ends[index][0].sendall(ends[index][1].seal(protocol.exit_report(0, None, None)))
        _read_until(s, index, _reported(s, index))
    launcher = ("import subprocess; subprocess.Popen(['sleep', '60']); " if held else "") + "raise SystemExit(1)"
    s.mpiexec = s.teardown.mpiexec = Process([PYTHON, "-c", launcher])
    try:
        s.watch.add(s.mpiexec.stdout, ("mpiexec", 1))
        s.watch.add(s.mpiexec.stderr, ("mpiexec", 2))
        with poprun_log(1) as said:
            s._loop()
    finally:
        if held:
            os.killpg(s.mpiexec.pid, signal.SIGKILL)  # the sleep, in the launcher's session
        s.mpiexec.close()
    output = "its stderr and stdout still open (held by a process it started); " if held else ""
    assert f"POPRUN [I] stopped waiting 2 s after mpiexec exited: {output}instance(s) 0-2 still connected\n" \
        in said.getvalue(), said.getvalue()
    assert s.instances[1].lost and not s.instances[1].attached
    assert s.failure is not None and s.failure.index == 1
    summary = s._report().summary(None)
    assert ("poprun: host b was lost: instance(s) 1 there ended without an exit report "
            "(its processes or the connection to it died)\n") in summary, summary


# ------------------------------------------------------------------ strangers and unreadable frames
@pytest.mark.parametrize("frame, problem", [
    (protocol.frame(protocol.EXIT, b"\0\0"), "EXIT payload of 2 bytes is shorter than its 9-byte header"),
    (protocol.frame(99, b"?"), "a frame of kind 99, which is no instance's"),
    (protocol.frame(protocol.INSTANCE, b"?"), f"a frame of kind {protocol.INSTANCE}, which is no instance's"),
    (protocol.frame(protocol.OUTPUT, b"text\n", 3), "output on stream 3, not 1 (stdout) or 2 (stderr)"),
], ids=["short EXIT", "unknown kind", "INSTANCE inside INSTANCE", "bad stream"])
def test_a_sealed_frame_that_cannot_be_read_ends_the_job_in_one_line_naming_the_instance(
        frame: bytes, problem: str, job: tuple[Supervisor, socket.socket, list[socket.socket]]) -> None:
    """Sealed with this run's secret, so from the instance's own host's supervisor (another
    version, a bug): the job cannot be supervised as it should, and ends; no traceback. The frames
    after it are still read."""
    s, server, ends_ = job
    ends = [call_in_sealed(s, server, index) for index in range(3)]
    ends_ += [end for end, _ in ends]
    end, seal = ends[1]
    end.sendall(seal.seal(frame) + seal.seal(protocol.exit_report(0, None, None)))
    with poprun_log() as said:
        _read_until(s, 1, _reported(s, 1))
    assert said.getvalue() == ""
    assert s.failure is not None and (s.failure.index, s.failure.status) == (1, 1)
    assert s.failure.description == f"its stub sent a frame poprun cannot read: {problem}"
    assert s.teardown.started is not None and s.instances[0].stopped_by_poprun
    assert s._report().summary(None).startswith(f"poprun: instance 1 on b failed: its stub sent a frame poprun "
                                                f"cannot read: {problem}\n")


@pytest.mark.parametrize("hello, problem, remote", [
    (protocol.frame(protocol.HOST_HELLO, b"\0\0\0"),
     "HOST_HELLO payload of 3 bytes is shorter than its 8-byte header", ("a", "b", "c")),
    (protocol.host_hello(1007, "node"),
     "every instance of this job runs on poprun's host, and no other host's supervisor is expected", ()),
], ids=["short HELLO", "no other host"])
def test_a_sealed_hello_that_cannot_be_read_ends_the_job_in_one_line(
        hello: bytes, problem: str, remote: tuple[str, ...],
        job: tuple[Supervisor, socket.socket, list[socket.socket]]) -> None:
    s, server, ends_ = job
    s.remote_hosts = frozenset(remote)
    end = socket.create_connection(server.getsockname(), timeout=10)
    ends_.append(end)
    s._accept(server)
    seal = Seal(s.secret, end.recv(protocol.NONCE_SIZE, socket.MSG_WAITALL), TO_POPRUN)
    end.sendall(seal.seal(hello))
    [(conn, reader)] = [data for kind, data in s.watch.labels() if kind == "pending"]
    deadline = time.monotonic() + 10  # until the bytes are through loopback
    with poprun_log() as said:
        while conn in s.pending and time.monotonic() < deadline:
            s._read_hello(conn, reader)
    assert said.getvalue() == "" and end.recv(1) == b""  # closed, and said only once, below
    peer = "{}:{}".format(*end.getsockname())
    assert s.failure is not None and (s.failure.index, s.failure.status) == (None, 1)
    assert s.failure.description == (f"a connection from {peer} sealed with this run's secret sent a HELLO poprun "
                                     f"cannot read: {problem}")
    assert s.teardown.started is not None
    assert s._report().summary(None) == f"poprun: {s.failure.description}\n"


def _bad_bytes(s: Supervisor, server: socket.socket, data: bytes) -> socket.socket:
    """A stranger: it takes poprun's nonce and sends ``data``; the connection is read until poprun
    drops it."""
    stray = _stray(s, server)
    stray.sendall(data)
    [(conn, reader)] = [data for kind, data in s.watch.labels() if kind == "pending" and data[0] in s.pending
                        and s.pending[data[0]][1] == "{}:{}".format(*stray.getsockname())]
    deadline = time.monotonic() + 10  # until the bytes are through loopback
    while conn in s.pending and time.monotonic() < deadline:
        s._read_hello(conn, reader)
    assert conn not in s.pending
    return stray


def test_a_first_frame_that_is_no_hello_is_refused_from_its_header_without_waiting_for_the_rest(
        job: tuple[Supervisor, socket.socket, list[socket.socket]]) -> None:
    # The header claims 1000 bytes of output: refused from its 6 bytes, not waited on for 20 s.
    s, server, ends_ = job
    with poprun_log() as said:
        ends_.append(_bad_bytes(s, server, protocol.HEADER.pack(protocol.OUTPUT, 1, 1000)))
        ends_.append(_bad_bytes(s, server, protocol.HEADER.pack(protocol.HOST_HELLO, 0, 100000)))
        s.strays.finish()
    lines = said.getvalue().splitlines()
    assert lines[0].endswith(f": its first frame is of kind 2, not HOST_HELLO ({protocol.HOST_HELLO})"), lines
    assert lines[1].endswith(f": a HELLO of 100000 bytes is longer than the {protocol.MAX_HELLO} a HELLO may have)")
    assert ends_[0].recv(1) == b"" and ends_[1].recv(1) == b""


def test_refused_connections_are_said_once_then_counted_in_one_line_every_few_seconds(
        job: tuple[Supervisor, socket.socket, list[socket.socket]]) -> None:
    from poprun_py.supervision.strays import REPORT_SECONDS

    s, server, ends_ = job
    garbage = bytes(range(64))  # 64 bytes no host's supervisor sends: kind 0
    with poprun_log() as said:
        ends_ += [_bad_bytes(s, server, garbage) for _ in range(30)]
        s.next_silence_check = 0.0
        s._check_silence()  # within REPORT_SECONDS of the first line: nothing more said
        assert len(said.getvalue().splitlines()) == 1
        assert s.strays.said_at is not None
        s.strays.said_at -= REPORT_SECONDS + 0.3  # the seconds have passed, and a little more
        s.next_silence_check = 0.0
        s._check_silence()
        ends_ += [_bad_bytes(s, server, garbage) for _ in range(5)]
        s.strays.finish()  # the job's end says what is left
        s.strays.said_at -= REPORT_SECONDS  # quiet since: the next is said in full again
        ends_.append(_bad_bytes(s, server, garbage))
    lines = [line.split(" POPRUN ", 1)[1] for line in said.getvalue().splitlines()]
    first = ends_[0].getsockname()[1]
    last = ends_[29].getsockname()[1]
    assert lines[0] == (f"[E] unexpected connection on the control port from 127.0.0.1:{first}: its first frame is "
                        f"of kind 0, not HOST_HELLO ({protocol.HOST_HELLO})")
    assert re.fullmatch(r"\[E\] refused 29 more connection\(s\) on the control port in the last 5\.[3-6] s \(the last "
                        rf"from 127\.0\.0\.1:{last}: its first frame is of kind 0, not HOST_HELLO "
                        rf"\({protocol.HOST_HELLO}\)\)", lines[1]), lines
    assert lines[2].startswith("[E] refused 5 more connection(s) on the control port in the last "), lines
    assert lines[3] == (f"[E] unexpected connection on the control port from 127.0.0.1:{ends_[-1].getsockname()[1]}: "
                        f"its first frame is of kind 0, not HOST_HELLO ({protocol.HOST_HELLO})")
    assert len(lines) == 4


def test_a_host_in_mid_handshake_is_not_pushed_out_by_strays_that_come_after_it(
        job: tuple[Supervisor, socket.socket, list[socket.socket]]) -> None:
    """Its HELLO has come but is not read yet when MAX_PENDING silent strays come after it: room is
    made by reading the waiting connections first, so the host's supervisor becomes its host's and
    a stray is dropped instead."""
    s, server, ends_ = job
    end = socket.create_connection(server.getsockname(), timeout=10)
    ends_.append(end)
    s._accept(server)
    seal = Seal(s.secret, end.recv(protocol.NONCE_SIZE, socket.MSG_WAITALL), TO_POPRUN)
    end.sendall(seal.seal(protocol.host_hello(1000, "a")))
    [(conn, _)] = [data for kind, data in s.watch.labels() if kind == "pending"]
    wait_until(lambda: conn.recv(1, socket.MSG_PEEK) != b"", "the HELLO to reach poprun", within=10)
    with poprun_log():
        ends_ += [_stray(s, server) for _ in range(MAX_PENDING)]
    assert conn in s.host_links and conn not in s.pending
    assert len(s.pending) == MAX_PENDING


def test_a_connection_dropped_earlier_in_the_same_round_is_not_read_again(
        job: tuple[Supervisor, socket.socket, list[socket.socket]]) -> None:
    """A round of the loop handles what poll found ready at its start: a connection dropped since
    to make room for a new one (or that became an instance's) may still be in it, and is passed
    over (it once ended poprun with a KeyError)."""
    s, server, ends_ = job
    ends_ += [_stray(s, server) for _ in range(MAX_PENDING)]
    oldest = min(s.pending, key=lambda conn: s.pending[conn][0])
    [label] = [data for kind, data in s.watch.labels() if kind == "pending" and data[0] is oldest]
    with poprun_log():
        ends_.append(_stray(s, server))  # the oldest is dropped to make room
    assert oldest not in s.pending
    s._read_hello(*label)  # as the rest of the round would
    assert len(s.pending) == MAX_PENDING


def test_a_host_that_takes_none_of_its_program_is_dropped() -> None:
    """poprun waits at most the silence limit for a host's supervisor to take the program it
    answers a HELLO with (more than a socket's buffers hold); one that reads none of it is dropped,
    said in one line, and its instances never call in (the start timeout, or mpiexec's end, says
    so)."""
    s = Supervisor(1, ["a"], lambda address: ([], {}), new_secret(), [b"x" * (32 << 20)], listen_address="127.0.0.1",
                   start_timeout=START_TIMEOUT, stdout=io.BytesIO(), stderr=io.BytesIO(), silence_limit=0.3,
                   remote_hosts=frozenset({"a"}))
    with socket.create_server(("127.0.0.1", 0)) as server, socket.socket() as end:
        server.setblocking(False)
        end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        end.settimeout(10)
        end.connect(server.getsockname())
        s._accept(server)
        seal = Seal(s.secret, end.recv(protocol.NONCE_SIZE, socket.MSG_WAITALL), TO_POPRUN)
        end.sendall(seal.seal(protocol.host_hello(1000, "a")))
        [(conn, reader)] = [data for kind, data in s.watch.labels() if kind == "pending"]
        with poprun_log(1) as said:
            deadline = time.monotonic() + 10
            while conn in s.pending and time.monotonic() < deadline:  # until its HELLO is through loopback
                s._read_hello(conn, reader)
    assert conn not in s.pending and conn not in s.host_links and not s.instances[0].attached
    assert "[E] host a: could not send its supervisor the program" in said.getvalue()
