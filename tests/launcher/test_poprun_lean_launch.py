"""The lean launch path: a plain launch imports nothing heavy besides click, and the shim's
RELEASE and death-signal guarantees hold on real processes."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from popcontract import environment
from poprun_py.instance import SCRIPT, shim_pump
from poprun_py.wire import protocol
from tests.helpers import BIN, PYTHON, STUB_MODES, job_marker, poprun, run, wait_no_processes
from tests.launcher.shim import run_shim

pytestmark = pytest.mark.slow  # every test starts poprun or a shim

#: Modules the shim never imports: each would cost every instance a millisecond or more before its
#: program starts (click ~30 ms, socket ~6 ms, OpenSSL's hashes ~5 ms and 4 MB resident: the seal
#: of a quiet connection uses the interpreter's own SHA-256).
HEAVY = ("click", "logging", "subprocess", "dataclasses", "typing", "re", "json", "shutil", "inspect",
         "ctypes", "argparse", "pathlib", "socket", "selectors", "signal", "enum", "collections",
         "encodings.idna", "hmac", "hashlib", "_hashlib")
#: Of those, the ones click does not bring in: poprun itself avoids them on a plain launch too.
HEAVY_BESIDES_CLICK = ("logging", "subprocess", "dataclasses", "json", "shutil", "ctypes", "argparse", "pathlib",
                       "socket", "selectors", "signal", "encodings.idna", "hmac", "hashlib", "_hashlib")


def imported(import_log: str) -> set[str]:
    """Module names from untagged ``-X importtime`` lines (poprun's and the shims' own)."""
    names = set()
    for line in import_log.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


@pytest.mark.parametrize(("stub", "per_instance"), [
    (stub, module) for stub, module in [("compiled", "poprun_py.host.instance"), ("python", "poprun_py.stub.fallback"),
                                        ("shim", "poprun_py.instance.shim_pump")] if stub in STUB_MODES])
def test_plain_launch_imports_nothing_heavy_besides_click(stub: str, per_instance: str) -> None:
    # The instances' own import logs come back tagged "[i] ", so the untagged lines are poprun's
    # and, but for the compiled stub, the two Python stubs' or shims' (test_shim_uses_only_builtin_modules
    # checks a shim alone). With stubs, poprun itself is their host's supervisor.
    result = run([str(BIN / "poprun"), "--num-instances", "2", PYTHON, "-c", "pass"],
                 env={"PYTHONPROFILEIMPORTTIME": "1", environment.STUB: stub})
    assert result.returncode == 0, result.stderr
    modules = imported(result.stderr)
    assert {"click", "poprun_py.supervision.supervisor", per_instance} <= modules
    assert modules.isdisjoint(HEAVY_BESIDES_CLICK), sorted(modules & set(HEAVY_BESIDES_CLICK))


def test_shim_uses_only_builtin_modules() -> None:
    result, frames = run_shim("/bin/true", python_flags=("-X", "importtime"))
    assert result.returncode == 0, result.stderr
    assert [kind for kind, _, _ in frames] == [protocol.HELLO, protocol.CLOCK, protocol.TIMES, protocol.EXIT]
    assert protocol.read_exit(frames[-1][2]) == (0, None, None, 0)
    modules = imported(result.stderr)
    assert "poprun_py.instance.shim_pump" in modules
    assert modules.isdisjoint(HEAVY), sorted(modules & set(HEAVY))


def test_a_connection_loads_openssls_hash_only_once_it_has_hashed_more_than_loading_costs() -> None:
    # Under python -S, as the shim: a quiet connection's frames leave OpenSSL unloaded; past
    # FAST_AFTER_BYTES (a chatty program's output) the seal moves to it, for its speed.
    code = ("import sys\n"
            "from poprun_py.wire.seal import FAST_AFTER_BYTES, TO_POPRUN, Seal, new_nonce, new_secret\n"
            "seal = Seal(new_secret(), new_nonce(), TO_POPRUN)\n"
            "for _ in range(100): seal.seal(b'x' * (FAST_AFTER_BYTES // 100))\n"
            "print('_hashlib' in sys.modules)\n"
            "seal.seal(b'x' * 100)\n"
            "print('_hashlib' in sys.modules)\n")
    result = run([PYTHON, "-S", "-c", code])  # from the repository root, on sys.path as the script puts it
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True"]


def test_shims_wait_for_release_so_all_exit_together(tmp_path: Path) -> None:
    # Instance 0 ends at once; instance 1 looks for instance 0's shim once instance 0's program is
    # gone (its pid, written to a file, no longer in /proc or a zombie), and keeps looking for a
    # while. The shim is still there (idle), so MPICH's proxy has no exited child to busy-wait on.
    marker = job_marker()
    probe = ("import os, sys, time\n"
             "pid_file = os.path.join(sys.argv[2], 'pid0')\n"
             "if os.environ['RANK'] == '0':\n"
             "    open(pid_file + '.tmp', 'w').write(f'{os.getpid()} {os.getppid()}')\n"
             "    os.rename(pid_file + '.tmp', pid_file)\n"
             "    sys.exit(0)\n"
             "def state(pid):\n"
             "    try: return open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[0]\n"
             "    except OSError: return None\n"
             "give_up = time.monotonic() + 30\n"
             "while not os.path.exists(pid_file) and time.monotonic() < give_up: time.sleep(0.01)\n"
             "pid, shim = open(pid_file).read().split()\n"
             "while state(pid) not in (None, 'Z') and time.monotonic() < give_up: time.sleep(0.01)\n"
             "alive = []\n"
             "watch_until = time.monotonic() + 0.5\n"
             "while time.monotonic() < watch_until: alive.append(state(shim) not in (None, 'Z')); time.sleep(0.02)\n"
             "print('program 0 gone' if state(pid) in (None, 'Z') else 'program 0 still running')\n"
             "print('shim 0 alive' if all(alive) else 'shim 0 gone')\n")
    result = poprun("--num-instances", "2", PYTHON, "-c", probe, marker, str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[1] program 0 gone", "[1] shim 0 alive"]
    assert wait_no_processes(marker) == []


def test_successful_job_is_released_at_once() -> None:
    # Once every instance is done poprun sends RELEASE and the shims exit together: a 2-instance
    # `true` takes well under a second (mpiexec's start-up included), several on a loaded 2-core
    # host. Without RELEASE each shim falls back to waiting shim_pump.RELEASE_WAIT_SECONDS (10 s):
    # half of that separates released from fell back.
    bound = shim_pump.RELEASE_WAIT_SECONDS / 2
    start = time.monotonic()
    result = poprun("--num-instances", "2", "true")
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stderr
    assert elapsed < bound, f"a 2-instance `true` took {elapsed:.1f} s: the shims were not released"


PDEATHSIG = ("import ctypes; v = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(v)); "
             "import os; print(v.value, os.getpgid(0) == os.getpid())")  # PR_GET_PDEATHSIG


@pytest.mark.parametrize("stub", STUB_MODES)
def test_program_dies_with_its_shim_and_leads_its_own_process_group(stub: str) -> None:
    result = poprun("--num-instances", "2", PYTHON, "-c", PDEATHSIG, env={environment.STUB: stub})
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0] 9 True", "[1] 9 True"]  # SIGKILL


@pytest.mark.parametrize(("stub", "death_signal"), [
    (stub, signum) for stub, signum in [("compiled", 9), ("python", 0), ("shim", 0)] if stub in STUB_MODES])
def test_without_setpriv_the_program_still_runs(tmp_path: Path, stub: str, death_signal: int) -> None:
    # No setpriv on PATH: the Python stub and the shim start the program directly (no death signal,
    # the session sweep is what remains) rather than failing; the compiled stub sets it itself.
    result = poprun("--num-instances", "2", PYTHON, "-c", PDEATHSIG,
                    env={"PATH": str(tmp_path), environment.STUB: stub})
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [f"[0] {death_signal} True", f"[1] {death_signal} True"]


def test_missing_program_on_a_host_is_reported_by_the_shim() -> None:
    # As on a remote host where the program is missing: poprun hears why, with the shell's status.
    result, frames = run_shim("no-such-program-xyz")
    assert result.returncode == 127
    status, signum, error, _ = protocol.read_exit(frames[-1][2])
    assert (status, signum) == (127, None)
    assert error is not None and error.startswith("program 'no-such-program-xyz' not found on host ")


def test_a_program_that_cannot_be_executed_is_reported_by_the_shim(tmp_path: Path) -> None:
    program = tmp_path / "not-executable"
    program.write_text("#!/bin/sh\n")
    result, frames = run_shim(str(program))
    assert result.returncode == 126
    status, signum, error, _ = protocol.read_exit(frames[-1][2])
    assert (status, signum) == (126, None)
    assert error == f"program {str(program)!r} cannot be executed (Permission denied) on host {socket.gethostname()}"


def test_shim_that_cannot_reach_poprun_starts_nothing() -> None:
    # Only poprun has the program: a shim that cannot reach it says so and starts nothing.
    result = run([PYTHON, "-S", SCRIPT, "0"], env={environment.CONTROL: "127.0.0.1:1"})
    assert result.returncode == 1 and result.stdout == ""
    assert "cannot reach poprun" in result.stderr and "the program was not started" in result.stderr
