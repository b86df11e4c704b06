"""A small MPI job whose instances fail (or not) in chosen ways: ``failsafe_job.py MODE [--marker=X]``.

Run it with ``mpiexec -n N python failsafe_job.py MODE`` or through ``poprun``; every line it
prints starts with ``instance <i>:``. The extra ``--marker=...`` argument is ignored: tests use it
to find leftover processes. Modes:

raise        instance 1 raises while the others wait in a barrier        -> job aborts, status 1
raise_reduce instance 1 raises while the others wait in an allreduce     -> job aborts, status 1
raise_init_twice  as raise, after init() is called a second time and logging is set up to name
             each line's logger                                          -> job aborts, status 1
thread       instance 1 has an uncaught exception in a thread             -> job aborts, status 1
exit3        instance 1 calls sys.exit(3) while the others wait          -> job status 3
exit_caught  instance 1 catches its sys.exit(3), then ends normally      -> status 0
raise_exit3  instance 1 writes `raise SystemExit(3)` while the others wait -> job status 3
quit3        instance 1 prints repr(quit), then calls the builtin quit(3)  -> job status 3
held_exit3   instance 1 keeps a caught SystemExit(5), then exits with 3, dropping the first as the
             second leaves                                                 -> job status 3
interrupt    instance 1 raises KeyboardInterrupt while the others wait     -> job status 130
exit1        instance 1 calls sys.exit(1) while the others wait          -> job status 1
console      instance 1 sets sys.ps1 (as an interactive console does) and raises: its user's
             session, the job is not ended for it (the others end normally) -> status 1
raise_exit_caught  instance 1 catches its `raise SystemExit(3)`, ends normally -> status 0
ok           collectives on every instance, normal exit                  -> status 0
interactive  (under ``python -i``) instance 1 raises, the others end at once: its interpreter goes
             on to its prompt, which reads the end of stdin                -> status 0
interactive_thread  the same with the exception in a thread of instance 1   -> status 0
console_thread  instance 1 sets sys.ps1 (as an interactive console does), then has an uncaught
             exception in a thread                                         -> status 0
mismatch     shapes differ between instances; each prints its error      -> status 0
late         instance 1 never calls allreduce (uncaught timeout on the others ends the job, status 1)
stopped      instance 1 agrees to an allreduce, then stops itself (SIGSTOP) before its data exchange:
             the others' timeout in the exchange ends the job, status 1
subset       execute_on_instances({0, 2}) with collectives inside (3 instances)
subset_mismatch  instance 2 asks for {0, 1, 2}, the others for {0, 2} (3 instances): every
             instance reports the mismatch, then an allreduce over all of them still works
finalize     init(), finalize(), then a collective                       -> RuntimeError, status 1
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

import popdist_py
from popdist_py import CollectiveMismatchError


def say(*parts: object) -> None:
    """One line, written at once, so that lines of different instances do not interleave."""
    index = popdist_py.getInstanceIndex() if popdist_py.isPopdistEnvSet() else RANK
    sys.stdout.write(" ".join([f"instance {index}:", *map(str, parts)]) + "\n")
    sys.stdout.flush()


FAILS_IN_INSTANCE_1 = ("raise", "raise_reduce", "raise_init_twice", "thread", "exit3", "exit_caught", "raise_exit3",
                       "raise_exit_caught", "quit3", "held_exit3", "interrupt", "exit1")


def fails_in_instance_1(mode: str, n: int) -> None:
    """Instance 1 fails (or exits, or catches its exit) while the others wait in a collective."""
    if mode in ("exit3", "raise_exit3", "quit3", "held_exit3") and RANK == 1:
        import atexit

        atexit.register(say, "atexit handler ran")  # registered after popdist_py: runs first
        say("last words before exit 3")
    # Instance 1 fails only once every other instance has said it is entering the collective
    # (a message, not a guess at how long they take), so the others are waiting when it fails.
    if RANK != 1:
        COMM.send("entering the collective", dest=1, tag=29)
    else:
        for other in range(n):
            if other != 1:
                COMM.recv(source=other, tag=29)
        fail_as(mode)
    if mode == "raise_reduce":
        popdist_py.allreduce(np.ones(3))
    else:
        popdist_py.barrier()
    say("done")


def fail_as(mode: str) -> None:
    """Instance 1's part of :func:`fails_in_instance_1`."""
    if mode in ("raise", "raise_reduce", "raise_init_twice"):
        raise RuntimeError("boom from instance 1")
    if mode == "thread":
        worker = threading.Thread(target=lambda: 1 / 0, name="worker")
        worker.start()
        worker.join()
        time.sleep(30)
    elif mode == "exit3":
        sys.exit(3)
    elif mode == "exit1":
        sys.exit(1)
    elif mode == "raise_exit3":
        raise SystemExit(3)
    elif mode == "quit3":
        say(repr(quit))
        quit(3)
    elif mode == "held_exit3":
        held: list[SystemExit] = []
        try:
            sys.exit(5)
        except SystemExit as exc:
            held.append(exc)
        try:
            sys.exit(3)
        finally:
            held.clear()  # the first exit is freed while the second one leaves
    elif mode == "interrupt":
        raise KeyboardInterrupt
    elif mode == "exit_caught":
        try:
            sys.exit(3)
        except SystemExit as exc:
            say("caught SystemExit", exc.code)
    elif mode == "raise_exit_caught":
        try:
            raise SystemExit(3)
        except SystemExit as exc:
            say("caught SystemExit", exc.code)


def console() -> None:
    if RANK == 1:
        sys.ps1 = ">>> "
        raise RuntimeError("boom at the console")
    say("done")


def console_thread() -> None:
    if RANK == 1:
        sys.ps1 = ">>> "
        worker = threading.Thread(target=lambda: 1 / 0, name="worker")
        worker.start()
        worker.join()
    say("done")


def interactive(in_thread: bool) -> None:
    # The prompt that follows reads stdin, which the launcher may hold open: /dev/null instead.
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if RANK == 1:
        def boom() -> None:
            raise RuntimeError("boom in an interactive session")

        if not in_thread:
            boom()
        worker = threading.Thread(target=boom, name="worker")
        worker.start()
        worker.join()
    say("done")


def ok(n: int) -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3) + RANK
    total = popdist_py.allreduce(x)
    expected = sum(np.arange(6, dtype=np.float32).reshape(2, 3) + r for r in range(n))
    assert np.array_equal(total, expected), (total, expected)
    gathered = popdist_py.allgather(np.array([RANK, RANK * 10]))
    assert gathered.tolist() == [[r, r * 10] for r in range(n)], gathered
    b = popdist_py.broadcast(np.full(2, RANK, dtype=np.int64), root=n - 1)
    assert b.tolist() == [n - 1, n - 1], b
    mean = popdist_py.allreduce(np.array([RANK], dtype=np.int32), op="mean")
    assert mean.dtype == np.int32 and mean[0] == sum(range(n)) // n
    popdist_py.synchronize()
    say("ok", total.sum(), gathered[:, 0].tolist())


def mismatch() -> None:
    shape = (3, 4) if RANK == 0 else (4,)
    try:
        popdist_py.allreduce(np.zeros(shape, dtype=np.float32))
    except CollectiveMismatchError as exc:
        say("error:", exc)
    popdist_py.barrier()


def late() -> None:
    if RANK == 1:
        # Never arrives, whatever the scheduling: instance 0's uncaught timeout ends the job
        # while this instance waits. Should that not happen within 30 s, it fails the job
        # (status 2) rather than arrive late and let the allreduce succeed.
        time.sleep(30)
        say("was not stopped by the others' timeout")
        sys.exit(2)
    popdist_py.allreduce(np.ones(3))
    say("done")


def stopped() -> None:
    if RANK == 1:
        # The allreduce's agreement, as popdist_py.allreduce makes it, then a stop before its data.
        from popdist_py.host_collectives import REDUCE_FIELDS, agree
        from popdist_py.instances import current_scope

        agree(current_scope(), "allreduce", ("sum", (3,), "float64"), REDUCE_FIELDS, None)
        os.kill(os.getpid(), signal.SIGSTOP)
        say("was not stopped by the others' timeout")
        sys.exit(2)
    popdist_py.allreduce(np.ones(3))
    say("done")


def subset() -> None:
    def on_subset(offset: int) -> list[object]:
        total = popdist_py.allreduce(np.array([float(RANK + offset)]))
        popdist_py.synchronize()
        gathered = popdist_py.allgather(np.array([RANK]))
        inner = popdist_py.execute_on_instances({2}, lambda: popdist_py.allreduce(np.array([7.0]))[0])
        return [float(total[0]), gathered[:, 0].tolist(), inner]

    result = popdist_py.execute_on_instances({0, 2}, on_subset, offset=1)
    say("subset result", result)
    again = popdist_py.execute_on_instances({0, 2}, on_subset, 0)  # reuses the communicator
    say("again", again)
    popdist_py.barrier()


def subset_mismatch() -> None:
    wanted = {0, 1, 2} if RANK == 2 else {0, 2}
    try:
        popdist_py.execute_on_instances(wanted, popdist_py.barrier)
    except popdist_py.CollectiveError as exc:
        say(f"error: {type(exc).__name__}: {exc}")
    else:
        say("no error")
    say("world usable afterwards", popdist_py.allreduce(np.ones(1))[0])


def finalize() -> None:
    popdist_py.finalize()
    say("finalized")
    popdist_py.barrier()


def main(mode: str) -> None:
    popdist_py.init()
    if mode == "raise_init_twice":
        import logging

        popdist_py.init()  # installs nothing twice
        logging.basicConfig(format="%(name)s %(levelname)s: %(message)s")
    n = COMM.Get_size()
    others: dict[str, Callable[[], None]] = {
        "console": console, "console_thread": console_thread, "interactive": lambda: interactive(False),
        "interactive_thread": lambda: interactive(True), "ok": lambda: ok(n), "mismatch": mismatch, "late": late,
        "stopped": stopped, "subset": subset, "subset_mismatch": subset_mismatch, "finalize": finalize}
    if mode in FAILS_IN_INSTANCE_1:
        fails_in_instance_1(mode, n)
    elif mode in others:
        others[mode]()
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    from popdist_py.world import world

    COMM = world()
    RANK = COMM.Get_rank()
    main(sys.argv[1])
