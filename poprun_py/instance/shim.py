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

import os
import sys

from popcontract import environment, settings
from poprun_py.host.link import connect_to_poprun, receive_program, silence_limit
from poprun_py.shared import sweep
from poprun_py.shared.cores import threads_per_instance
from poprun_py.stub.pmi_relay import open_relay
from poprun_py.stub.program import NOT_STARTED, spawn


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
