"""Per-instance shim: ``mpiexec`` starts it (through ``script.py``), it starts the user's program.

It streams the program's stdout/stderr to ``poprun`` as frames (so ``poprun`` can tag whole
lines and never interleave them), reports the exact exit status or signal, and stops the
program's whole process group when ``poprun`` says so or when it is signalled itself. The
program dies with the shim (PR_SET_PDEATHSIG, set by util-linux's ``setpriv``), so a SIGKILLed
shim leaves nothing behind.

Run as ``python -S script.py INDEX``: the program and its arguments are not on mpiexec's
command line, where mpiexec would read words of its own syntax among them (``:``, ``--``,
``-n``, ...). The shim connects to poprun, says HELLO and receives them, byte for byte, in a
sealed PROGRAM message (``protocol``); a shim that cannot reach poprun starts nothing. The shim
shares the cores with the program it starts, so it is kept cheap: the program is started with
``posix_spawn`` (a vfork: forking the interpreter costs ~4 ms of copy-on-write faults, and
setting the death signal from Python needs ctypes, ~3 ms more) as soon as it has arrived, and
the shim uses only modules built into the interpreter (``_socket``, ``select``, ``_signal``),
not their pure-Python wrappers.
"""

from __future__ import annotations

import _signal
import _socket
import errno
import os
import sys
import time

from popcontract import environment, settings
from poprun_py.instance.pmi_relay import open_relay
from poprun_py.shared import sweep
from poprun_py.shared.cores import threads_per_instance
from poprun_py.shared.paths import which

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing under python -S
if TYPE_CHECKING:
    from typing import NoReturn

    from poprun_py.instance.pmi_relay import PmiRelay
    from poprun_py.wire.seal import Seal


def spawn(argv: list[bytes], *, no_stdin: bool, one_stream: bool = False,
          pmi: PmiRelay | None = None) -> tuple[int, int, int | None] | OSError:
    """Start ``argv`` in its own process group with stdout/stderr on pipes (with ``one_stream``, one
    pipe for both, as ``2>&1`` makes them: only then does the order of its writes survive), and
    stdin from /dev/null when ``no_stdin``.

    Returns ``(pid, stdout_fd, stderr_fd)`` (``stderr_fd`` None for one stream), or the OSError
    saying why it cannot start. What mpiexec gave us stays inherited, but MPICH's PMI_FD, which
    ``pmi`` takes the place of (``pmi_relay``); our own descriptors are close-on-exec.
    """
    program = os.fsdecode(argv[0])
    if which(program) is None:
        missing = os.sep not in program or not os.path.exists(program)
        code = errno.ENOENT if missing else errno.EACCES
        return OSError(code, os.strerror(code))
    setpriv = which("setpriv")
    command: list[str | bytes] = [setpriv, "--pdeathsig", "KILL", "--", *argv] if setpriv else [*argv]
    out_r, out_w = os.pipe()
    err_r, err_w = (None, out_w) if one_stream else os.pipe()
    try:
        actions: list[tuple[int | str, ...]] = [(os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2)]
        if no_stdin:
            actions.append((os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0))
        if pmi is not None:
            actions.append(pmi.spawn_action())
        pid = os.posix_spawnp(command[0], command, os.environ, setpgroup=0, file_actions=actions,
                              # Python ignores these; programs expect the defaults.
                              setsigdef=(_signal.SIGPIPE, _signal.SIGXFSZ))
    except OSError as exc:
        os.close(out_r)
        if err_r is not None:
            os.close(err_r)
        return exc
    finally:
        os.close(out_w)
        if err_w != out_w:
            os.close(err_w)
        if pmi is not None:
            pmi.spawned()
    return pid, out_r, err_r


def keep_launchers_library_from_the_program() -> None:
    """Take poprun's library for Open MPI's launcher (``loopback``) out of ``LD_PRELOAD``: the
    program's own binds are its business."""
    value = settings.text(environment.LD_PRELOAD)
    if not value:
        return
    from poprun_py.shared.loopback import without_library

    if rest := without_library(value):
        os.environ[environment.LD_PRELOAD] = rest
    else:
        del os.environ[environment.LD_PRELOAD]


def pin_network(subnet: str) -> None:
    """``--host-subnet``: keep the program's MPI traffic on this host's interface in ``subnet``.

    Interface names differ between hosts, so each shim finds its own: UCX (MPICH's ch4:ucx) and
    libfabric's tcp provider (ch4:ofi) take a device name. Open MPI takes the subnet itself
    (poprun passes btl_tcp_if_include). A variable the user set is left alone.
    """
    from poprun_py.shared.errors import PlanError
    from poprun_py.shared.network import address_in_subnet

    try:
        _, interface = address_in_subnet(subnet)
    except PlanError as exc:
        os.write(2, f"poprun: warning: on host {os.uname().nodename}: {exc}\n".encode())
        return
    os.environ.setdefault(environment.UCX_NET_DEVICES, interface)
    os.environ.setdefault(environment.FI_TCP_IFACE, interface)


def divide_cores() -> None:
    """torchrun's OMP_NUM_THREADS, per host: when the user has not set it and this host runs several
    instances, each gets the host's usable cores divided by them (at least 1), so that their
    OpenMP and BLAS threads do not fight over the cores (torchrun sets 1). poprun says so once."""
    if settings.given(environment.OMP_NUM_THREADS) is not None:
        return
    try:
        per_host = settings.integer(environment.LOCAL_WORLD_SIZE, 1)
    except settings.PopdistEnvError as exc:  # poprun sets a count: a shim started some other way goes on
        os.write(2, f"poprun: warning: on host {os.uname().nodename}: {exc}; {environment.OMP_NUM_THREADS} is "
                    "left unset\n".encode())
        return
    if per_host > 1:
        os.environ[environment.OMP_NUM_THREADS] = str(threads_per_instance(per_host))




def prepare_error_file(index: int) -> str | None:
    """The program's TORCHELASTIC_ERROR_FILE, moved into a folder of this shim's own
    (``root_cause.own_folder``) and its directories made here (on a remote host they do not exist
    yet); None, and the variable unset with a warning, when that cannot be done."""
    given = settings.text(environment.TORCHELASTIC_ERROR_FILE)
    if not given:
        return None
    from poprun_py.shared.root_cause import own_folder, prepare

    path = own_folder(given, index)
    problem = prepare(path)
    if problem is None:
        os.environ[environment.TORCHELASTIC_ERROR_FILE] = path
        return path
    os.write(2, f"poprun: warning: on host {os.uname().nodename}: no {environment.TORCHELASTIC_ERROR_FILE} "
                f"for the program: {problem}\n".encode())
    del os.environ[environment.TORCHELASTIC_ERROR_FILE]
    return None


def silence_limit() -> float:
    """``POPRUN_SILENCE_LIMIT``, or the default with a warning when it is no number of seconds
    (poprun refuses such a value: a shim started by hand)."""
    from poprun_py.wire import protocol

    try:
        return protocol.silence_limit()
    except settings.PopdistEnvError as exc:
        os.write(2, f"poprun: warning: {exc}; using {protocol.DEFAULT_SILENCE_LIMIT:g}\n".encode())
        return protocol.DEFAULT_SILENCE_LIMIT


def connect_to_poprun(index: int, secret: str | None, limit: float,
                      who: str = "") -> tuple[_socket.socket, Seal, int] | None:
    """The control connection, its seal, and when poprun's nonce arrived (this host's wall clock,
    ns: half of the measure of the clocks' offset, see ``protocol.CLOCK``); None, said on stderr,
    when poprun cannot be reached within the silence limit (``limit``), or its address or the
    secret is missing."""
    from poprun_py.wire.control import connect

    address = settings.text(environment.CONTROL)
    missing = " or ".join(name for name, value in ((environment.CONTROL, address), (environment.SECRET, secret))
                          if not value)
    problem = f"no {missing} in its environment (was it dropped by mpiexec's options?)"
    if address and secret:
        try:
            control = connect(address, give_up_after=limit)
            try:
                nonce = read_nonce(control, limit)
                arrived = time.time_ns()
            except OSError:
                control.close()
                raise
            from poprun_py.wire.seal import TO_POPRUN, Seal

            return control, Seal(secret, nonce, TO_POPRUN), arrived
        except OSError as exc:
            problem = str(exc)
    # Only poprun has the program: nothing is started. mpiexec passes this line and the status on.
    where = f" at {address}" if address else ""
    os.write(2, f"{who or f'poprun instance {index}'}: cannot reach poprun{where} ({problem}); "
                "the program was not started\n".encode())
    return None


#: The shim's status when it starts no program: it could not reach poprun, or get the program from it.
NOT_STARTED = 1


def receive_program(index: int, control: _socket.socket, seal: Seal, nonce_arrived: int,
                    hello: bytes = b"", who: str = "") -> list[bytes] | None:
    """Say HELLO and this host's clock (``protocol.CLOCK``: when poprun's nonce arrived, and now),
    then read poprun's answer: the program and its arguments (``protocol.PROGRAM``),
    no longer than this host could pass to a program. None, said on stderr, when poprun's
    connection ends, its host stops acknowledging, or the program fails its check.

    A poprun that is alive may be slow to answer (its output waits for a reader that paused, or it
    is stopped): as long as its kernel acknowledges (keep-alive probes, bounded by the
    connection's TCP_USER_TIMEOUT: ``control.connect``), the shim waits."""
    from poprun_py.wire import protocol

    try:
        control.sendall(seal.seal(hello or protocol.hello(index, os.getpid(), _socket.gethostname()))
                        + seal.seal(protocol.clock(nonce_arrived, time.time_ns())))
        control.setsockopt(_socket.SOL_SOCKET, _socket.SO_KEEPALIVE, 1)
        for option, seconds in (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 2)):
            if hasattr(_socket, option):
                control.setsockopt(_socket.IPPROTO_TCP, getattr(_socket, option), seconds)
        head = _read_exactly(control, len(protocol.PROGRAM) + protocol.PROGRAM_LENGTH.size)
        (length,) = protocol.PROGRAM_LENGTH.unpack_from(head, len(protocol.PROGRAM))
        limit = os.sysconf("SC_ARG_MAX")
        if not head.startswith(protocol.PROGRAM) or length > limit:
            raise protocol.ProtocolError(f"its first message is not a program of at most {limit} bytes")
        body = _read_exactly(control, length + protocol.TAG_SIZE)
        if not seal.check(head + body[:length], body[length:]):
            raise protocol.ProtocolError("the program failed its authentication check")
        control.setsockopt(_socket.SOL_SOCKET, _socket.SO_KEEPALIVE, 0)
        return protocol.decode_program(body[:length])
    except (OSError, protocol.ProtocolError) as exc:
        why = str(exc) if not isinstance(exc, TimeoutError) else "poprun's host stopped acknowledging"
    os.write(2, f"{who or f'poprun instance {index}'}: did not receive the program from poprun ({why}); "
                "the program was not started\n".encode())
    return None


#: The most one read of poprun's messages takes.
READ_SIZE = 1 << 20


def _read_exactly(control: _socket.socket, size: int, closed: str = "poprun closed the connection") -> bytes:
    """``size`` bytes from ``control``, never more; OSError(``closed``) if the connection ends first."""
    chunks, left = [], size
    while left:
        chunk = control.recv(min(left, READ_SIZE))
        if not chunk:
            raise OSError(closed)
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_nonce(control: _socket.socket, timeout: float) -> bytes:
    """The nonce poprun sends first on a connection (OSError if it does not come whole)."""
    from poprun_py.wire.protocol import NONCE_SIZE

    control.settimeout(timeout)
    nonce = _read_exactly(control, NONCE_SIZE, "it closed the connection before it said anything")
    control.settimeout(None)
    return nonce


#: The most a holder (:func:`hold_until_reaped`) waits for the shim to be reaped.
HOLD_LIMIT = 1.0
#: How often a holder looks where Linux does not wake it when the shim is reaped.
HOLD_POLL = 0.002


def leave(status: int) -> NoReturn:
    """End the shim with ``status``; under MPICH's gforker, behind a holder (:func:`hold_until_reaped`).

    gforker reads its children's stdout, stderr and PMI descriptors until all are closed, then
    waits for the children it has not reaped yet; that wait counts them once and, if any was
    left, spins a core until its 2 s limit runs out. A process's descriptors close before its
    parent learns that it exited, so a shim's own exit left gforker one unreaped child in about
    one one-host job in five (measured on 2026-11-27: 4 of 20 jobs ended 1.5-2 s late). With the
    holder, the last descriptor closes once gforker has reaped the shim."""
    if _parent_is_gforker():
        hold_until_reaped()
    os._exit(status)


def _parent_is_gforker() -> bool:
    try:
        return os.path.basename(os.readlink(f"/proc/{os.getppid()}/exe")) == "mpiexec.gforker"
    except OSError:
        return False


def hold_until_reaped() -> None:
    """Fork a holder that keeps this process's stdin, stdout, stderr and MPICH's ``PMI_FD`` open
    until this process has exited and been reaped (or :data:`HOLD_LIMIT` has passed), and closes
    every other descriptor at once; the caller goes on (to exit). The holder sleeps on a pidfd of
    this process, which Linux wakes with EPOLLHUP once it is reaped (6.9 on); where it is not woken,
    it looks every :data:`HOLD_POLL`."""
    me = os.getpid()
    born = sweep.start_time(me)
    try:
        if os.fork():
            return
    except OSError:  # no holder: gforker may wait its 2 s, nothing worse
        return
    try:
        from poprun_py.instance.pmi_relay import pmi_line

        keep = max(2, pmi_line() or 2)
        os.closerange(3, keep)
        os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
        _wait_reaped(me, born, time.monotonic() + HOLD_LIMIT)
    finally:
        os._exit(0)


def _wait_reaped(pid: int, born: bytes | None, deadline: float) -> None:
    """Until process ``pid`` (started at ``born``) has been reaped, or ``deadline``."""
    import select

    try:
        watch = select.epoll()
        watch.register(os.pidfd_open(pid), select.EPOLLIN | select.EPOLLHUP | select.EPOLLET)
    except OSError:  # gone already, or no pidfd: the look alone
        watch = None
    while (left := deadline - time.monotonic()) > 0:
        if watch is None:
            time.sleep(min(left, HOLD_POLL))
        else:
            woken = watch.poll(min(left, HOLD_POLL))
            if any(events & select.EPOLLHUP for _, events in woken):
                return  # reaped
            if woken:
                continue  # it exited; its reaping wakes this again
        if sweep.start_time(pid) != born:
            return


def main() -> int:
    index = int(sys.argv[1])
    secret = settings.text(environment.SECRET)
    one_stream = settings.text(environment.ONE_STREAM) == "1"
    for name in (environment.SECRET, environment.ONE_STREAM):  # the program gets neither
        os.environ.pop(name, None)
    keep_launchers_library_from_the_program()
    if subnet := settings.text(environment.HOST_SUBNET):
        pin_network(subnet)
    divide_cores()
    error_file = prepare_error_file(index)
    sweep.adopt_orphans()
    limit = silence_limit()
    connection = connect_to_poprun(index, secret, limit)
    argv = receive_program(index, *connection) if connection is not None else None
    if connection is None or argv is None:
        if connection is not None:
            connection[0].close()
        _remove_error_file(error_file)
        return NOT_STARTED
    # The program starts first; the loop is imported while it does. mpiexec passes its stdin to
    # instance 0 only; Hydra gives the others a pipe that never ends, where a read would wait for ever.
    pmi = open_relay()
    spawned = spawn(argv, no_stdin=index > 0, one_stream=one_stream, pmi=pmi)

    from poprun_py.instance.shim_pump import Pump

    pump = Pump(index, connection, limit, error_file, pmi)
    if isinstance(spawned, OSError):
        if pmi is not None:
            pmi.close()
        _remove_error_file(error_file)
        return pump.spawn_failed(os.fsdecode(argv[0]), spawned)
    return pump.run(*spawned)


def _remove_error_file(error_file: str | None) -> None:
    """The error file prepared for a program that was not started, with its folder and, when no
    other shim's is left there, the job's."""
    if error_file:
        from poprun_py.shared.root_cause import remove

        remove(error_file, folders=2)
