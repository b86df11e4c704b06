"""The lean launch path: a plain launch imports nothing heavy besides click, and the stubs'
RELEASE and death-signal guarantees hold on real processes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from popcontract import environment
from poprun_py.stub.fallback import RELEASE_WAIT_SECONDS
from tests.helpers import BIN, PYTHON, ROOT, STUB_MODES, job_marker, poprun, run, wait_no_processes

pytestmark = pytest.mark.slow  # every test starts poprun or a Python process

#: Modules the Python stub and a host's supervisor never import: each would cost every instance
#: (every host) a millisecond or more before its
#: program starts (click ~30 ms, socket ~6 ms, OpenSSL's hashes ~5 ms and 4 MB resident: the seal
#: of a quiet connection uses the interpreter's own SHA-256).
HEAVY = ("click", "logging", "subprocess", "dataclasses", "typing", "re", "json", "shutil", "inspect",
         "ctypes", "argparse", "pathlib", "socket", "selectors", "signal", "enum", "collections",
         "encodings.idna", "hmac", "hashlib", "_hashlib")
#: Of those, the ones click does not bring in: poprun itself avoids them on a plain launch too.
HEAVY_BESIDES_CLICK = ("logging", "subprocess", "dataclasses", "json", "shutil", "ctypes", "argparse", "pathlib",
                       "socket", "selectors", "signal", "encodings.idna", "hmac", "hashlib", "_hashlib")


def imported(import_log: str) -> set[str]:
    """Module names from untagged ``-X importtime`` lines (poprun's and the Python stubs' own)."""
    names = set()
    for line in import_log.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


@pytest.mark.parametrize(("stub", "per_instance"), [
    (stub, module) for stub, module in [("compiled", "poprun_py.host.instance"), ("python", "poprun_py.stub.fallback")]
    if stub in STUB_MODES])
def test_plain_launch_imports_nothing_heavy_besides_click(stub: str, per_instance: str) -> None:
    # The instances' own import logs come back tagged "[i] ", so the untagged lines are poprun's
    # and, but for the compiled stub, the two Python stubs' (test_the_python_stub_and_a_hosts_supervisor_use_only_
    # builtin_modules checks them alone). poprun itself is its host's supervisor.
    result = run([str(BIN / "poprun"), "--num-instances", "2", PYTHON, "-c", "pass"],
                 env={"PYTHONPROFILEIMPORTTIME": "1", environment.STUB: stub})
    assert result.returncode == 0, result.stderr
    modules = imported(result.stderr)
    assert {"click", "poprun_py.supervision.supervisor", per_instance} <= modules
    assert modules.isdisjoint(HEAVY_BESIDES_CLICK), sorted(modules & set(HEAVY_BESIDES_CLICK))


def test_the_python_stub_and_a_hosts_supervisor_use_only_builtin_modules() -> None:
    # As mpiexec starts the Python stub and the first stub a remote host's supervisor: python -S.
    code = "import poprun_py.stub.fallback, poprun_py.host.supervisor, poprun_py.host.link"
    result = run([PYTHON, "-S", "-X", "importtime", "-c", code], cwd=ROOT)
    assert result.returncode == 0, result.stderr
    modules = imported(result.stderr)
    assert {"poprun_py.stub.fallback", "poprun_py.host.supervisor", "poprun_py.host.link"} <= modules
    assert modules.isdisjoint(HEAVY), sorted(modules & set(HEAVY))


def test_a_connection_loads_openssls_hash_only_once_it_has_hashed_more_than_loading_costs() -> None:
    # Under python -S, as a host's supervisor: a quiet connection's frames leave OpenSSL unloaded; past
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


def test_stubs_wait_for_release_so_all_exit_together(tmp_path: Path) -> None:
    # Instance 0 ends at once; instance 1 looks for instance 0's stub once instance 0's program is
    # gone (its pid, written to a file, no longer in /proc or a zombie), and keeps looking for a
    # while. The stub is still there (idle), so MPICH's proxy has no exited child to busy-wait on.
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
             "pid, stub = open(pid_file).read().split()\n"
             "while state(pid) not in (None, 'Z') and time.monotonic() < give_up: time.sleep(0.01)\n"
             "alive = []\n"
             "watch_until = time.monotonic() + 0.5\n"
             "while time.monotonic() < watch_until: alive.append(state(stub) not in (None, 'Z')); time.sleep(0.02)\n"
             "print('program 0 gone' if state(pid) in (None, 'Z') else 'program 0 still running')\n"
             "print('stub 0 alive' if all(alive) else 'stub 0 gone')\n")
    result = poprun("--num-instances", "2", PYTHON, "-c", probe, marker, str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[1] program 0 gone", "[1] stub 0 alive"]
    assert wait_no_processes(marker) == []


def test_successful_job_is_released_at_once() -> None:
    # Once every instance is done poprun sends RELEASE and the stubs exit together: a 2-instance
    # `true` takes well under a second (mpiexec's start-up included), several on a loaded 2-core
    # host. Without RELEASE each stub falls back to waiting RELEASE_WAIT_SECONDS (10 s): half of
    # that separates released from fell back.
    bound = RELEASE_WAIT_SECONDS / 2
    start = time.monotonic()
    result = poprun("--num-instances", "2", "true")
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stderr
    assert elapsed < bound, f"a 2-instance `true` took {elapsed:.1f} s: the stubs were not released"


PDEATHSIG = ("import ctypes; v = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(v)); "
             "import os; print(v.value, os.getpgid(0) == os.getpid())")  # PR_GET_PDEATHSIG


@pytest.mark.parametrize("stub", STUB_MODES)
def test_program_dies_with_its_stub_and_leads_its_own_process_group(stub: str) -> None:
    result = poprun("--num-instances", "2", PYTHON, "-c", PDEATHSIG, env={environment.STUB: stub})
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0] 9 True", "[1] 9 True"]  # SIGKILL


@pytest.mark.parametrize(("stub", "death_signal"), [
    (stub, signum) for stub, signum in [("compiled", 9), ("python", 0)] if stub in STUB_MODES])
def test_without_setpriv_the_program_still_runs(tmp_path: Path, stub: str, death_signal: int) -> None:
    # No setpriv on PATH: the Python stub starts the program directly (no death signal,
    # the session sweep is what remains) rather than failing; the compiled stub sets it itself.
    result = poprun("--num-instances", "2", PYTHON, "-c", PDEATHSIG,
                    env={"PATH": str(tmp_path), environment.STUB: stub})
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [f"[0] {death_signal} True", f"[1] {death_signal} True"]
