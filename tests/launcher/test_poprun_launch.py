"""Real launches through ``poprun`` and the MPICH wheel's mpiexec: environment, output, failures."""

from __future__ import annotations

import io
import os
import re
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path

import pytest

import poprun_py
from poprun_py.supervision.supervisor import Supervisor
from poprun_py.wire import protocol
from poprun_py.wire.seal import new_secret
from tests.helpers import (
    BIN,
    OMP_SET,
    OPENMPI_MPIEXEC,
    POPRUN,
    PYTHON,
    ROOT,
    job_marker,
    poprun,
    resolved_as_unknown,
    tagged_json,
    wait_no_processes,
)
from tests.launcher.supervising import PROGRAM, START_TIMEOUT, call_in, supervisor

pytestmark = pytest.mark.slow  # every test launches through poprun and mpiexec

SCRIPTS = ROOT / "tests" / "scripts"
BEHAVE = str(SCRIPTS / "behave.py")


@pytest.mark.parametrize("instances,replicas", [(1, 1), (2, 4), (4, 8)])
def test_each_instance_gets_its_environment(instances: int, replicas: int) -> None:
    result = poprun("--num-instances", str(instances), "--num-replicas", str(replicas),
                    PYTHON, str(SCRIPTS / "print_env.py"))
    assert result.returncode == 0, result.stderr
    envs = tagged_json(result.stdout)
    assert sorted(envs) == list(range(instances))
    local = replicas // instances
    for i, env in envs.items():
        assert env["POPDIST_NUM_TOTAL_REPLICAS"] == str(replicas)
        assert env["POPDIST_NUM_LOCAL_REPLICAS"] == str(local)
        assert env["POPDIST_REPLICA_INDEX_OFFSET"] == str(i * local)
        assert env["POPDIST_NUM_IPUS_PER_REPLICA"] == "1"
        assert env["POPDIST_UNIFORM_REPLICAS_PER_INSTANCE"] == "1"
        assert env["POPDIST_LOCAL_INSTANCE_INDEX"] == str(i)
        assert env["POPDIST_NUM_INSTANCES"] == str(instances)
        assert env["POPDIST_INSTANCE_INDEX"] == str(i)
        assert (env["RANK"], env["WORLD_SIZE"]) == (str(i), str(instances))
        assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (str(i), str(instances))
        assert env["PYTHONUNBUFFERED"] == "1"


def test_replicas_default_to_one_per_instance_and_options_reach_instances(tmp_path: Path) -> None:
    result = poprun("--num-instances", "2", "--ipus-per-replica", "2", "--executable-cache-path", str(tmp_path),
                    "--mpi-local-args", "-env FOO from-local", "--instance-mpi-local-args", "1:-env BAR only-one",
                    PYTHON, str(SCRIPTS / "print_env.py"))
    assert result.returncode == 0, result.stderr
    envs = tagged_json(result.stdout)
    for i in (0, 1):
        assert envs[i]["POPDIST_NUM_TOTAL_REPLICAS"] == "2"
        assert envs[i]["POPDIST_NUM_LOCAL_REPLICAS"] == "1"
        assert envs[i]["POPDIST_NUM_IPUS_PER_REPLICA"] == "2"
        assert envs[i]["POPDIST_EXECUTABLE_CACHE_PATH"] == str(tmp_path)
        assert envs[i]["FOO"] == "from-local"
    assert envs[0]["BAR"] is None and envs[1]["BAR"] == "only-one"


def test_non_python_program_and_arguments_without_a_shell() -> None:
    result = poprun("--num-instances", "2", "/bin/echo", "a b", "$HOME", "*", "--flag")
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0] a b $HOME * --flag", "[1] a b $HOME * --flag"]


def test_long_lines_never_interleave_and_filtering_keeps_one_instance() -> None:
    count, width = 60, 150_000
    result = poprun("--num-instances", "3", PYTHON, str(SCRIPTS / "long_lines.py"), str(count), str(width),
                    timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    per_instance = {0: 0, 1: 0, 2: 0}
    for line in lines:
        match = re.fullmatch(rf"\[(\d)\] (?:\d+:([a-h])\2{{{width - 1}}}|no newline at the end)", line)
        assert match, f"corrupted line (first 80 chars): {line[:80]!r}"
        index = int(match.group(1))
        if match.group(2):
            assert match.group(2) == "abc"[index]
        per_instance[index] += 1
    expected = count + len(range(0, count, 3)) + 1
    assert per_instance == {0: expected, 1: expected, 2: expected}

    only = poprun("--num-instances", "3", "--only-output-from-instance", "1",
                  PYTHON, str(SCRIPTS / "long_lines.py"), "5", "10")
    assert only.returncode == 0, only.stderr
    assert only.stdout.splitlines() and all(line.startswith("[1] ") for line in only.stdout.splitlines())


def test_stderr_is_tagged_on_stderr() -> None:
    result = poprun("--num-instances", "2", PYTHON, "-c",
                    "import os, sys; print('out', os.environ['RANK']); "
                    "print('err', os.environ['RANK'], file=sys.stderr)", env=OMP_SET)
    assert result.returncode == 0
    assert sorted(result.stdout.splitlines()) == ["[0] out 0", "[1] out 1"]
    assert sorted(result.stderr.splitlines()) == ["[0] err 0", "[1] err 1"]


@pytest.mark.parametrize("action,status,word", [("exit=3", 3, "exit status 3"),
                                                 ("signal=SIGKILL", 137, "killed by SIGKILL (status 137)"),
                                                 ("signal=SIGSEGV", 139, "killed by SIGSEGV (status 139)")])
def test_failing_instance_stops_the_others(action: str, status: int, word: str) -> None:
    marker = job_marker()
    start = time.monotonic()
    result = poprun("-v", "--num-instances", "4", PYTHON, BEHAVE, marker, f"2:stderr=about to fail,{action}")
    elapsed = time.monotonic() - start
    assert result.returncode == status, result.stderr
    assert elapsed < 8, f"teardown took {elapsed:.1f}s"
    # The summary's own line, not only -v's report of the exit.
    assert re.search(rf"^poprun: instance 2 on \S+ failed: {re.escape(word)}$", result.stderr, re.M), result.stderr
    # -v: the command (one host: MPICH's gforker), mpiexec's PID, then each exit report as it arrives.
    assert re.search(r"^\S+ \d+ POPRUN \[I\] running command: \S+/mpiexec\.gforker -genv POPDIST_NUM_TOTAL_REPLICAS 4 ",
                     result.stderr, re.M), result.stderr
    assert re.search(r" POPRUN \[I\] waiting for mpiexec \(PID \d+\)$", result.stderr, re.M), result.stderr
    assert re.search(rf" POPRUN \[I\] instance 2 on \S+: {re.escape(word)}$", result.stderr, re.M), result.stderr
    assert "    about to fail" in result.stderr  # the tail of its stderr is in the summary
    assert "stopped instance(s) 0-1, 3" in result.stderr
    assert wait_no_processes(marker) == []


def test_a_terminal_on_stdin_stays_with_poprun_and_the_instances_read_nothing() -> None:
    # Instances reading stdin would fight over a terminal (and wait on it): mpiexec gets /dev/null.
    terminal, side = os.openpty()
    try:
        # Instance 0: mpiexec passes its own stdin to the first instance only.
        result = subprocess.run([*POPRUN, "--num-instances", "1", PYTHON, "-c",
                                 "import sys; print(repr(sys.stdin.read()))"], stdin=side, capture_output=True,
                                text=True, timeout=30, cwd=ROOT)
    finally:
        os.close(terminal)
        os.close(side)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[0] ''\n"


@pytest.mark.parametrize("mpi", ["gforker", "hydra"])
def test_instances_after_the_first_read_an_empty_stdin(mpi: str) -> None:
    # mpiexec passes its stdin to instance 0 only; Hydra gives the others a pipe that never ends.
    args = ["--mpi", str(BIN / "mpiexec")] if mpi == "hydra" else []
    result = subprocess.run([*POPRUN, *args, "--num-instances", "3", PYTHON, "-c",
                             "import sys; print(repr(sys.stdin.read()))"], input="for instance 0\n",
                            capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0] 'for instance 0\\n'", "[1] ''", "[2] ''"]


def test_failure_summary_survives_output_filter() -> None:
    marker = job_marker()
    result = poprun("--num-instances", "2", "--only-output-from-instance", "0",
                    PYTHON, BEHAVE, marker, "1:stderr=the real cause,exit=5")
    assert result.returncode == 5
    assert "[1]" not in result.stdout and "[1] the real cause" not in result.stderr
    assert "instance 1 on" in result.stderr and "    the real cause" in result.stderr
    assert wait_no_processes(marker) == []


def test_all_instances_succeed_with_different_durations() -> None:
    result = poprun("--num-instances", "3", PYTHON, BEHAVE, "m", "0:sleep=0.5", "1:ok", "2:sleep=0.2")
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == sorted(
        f"[{i}] instance {i} {w}" for i in range(3) for w in ("started", "done"))


def _cpu_seconds(pid: int) -> float:
    """The CPU time (user and system) process ``pid`` has used so far; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize("sig,status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_to_poprun_stops_every_instance(sig: signal.Signals, status: int) -> None:
    marker = job_marker()
    proc = subprocess.Popen([*POPRUN, "--num-instances", "2", PYTHON, BEHAVE, marker, "0:ignore-term,sleep=120"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None
        seen = {proc.stdout.readline().strip(), proc.stdout.readline().strip()}
        assert seen == {"[0] instance 0 started", "[1] instance 1 started"}
        start, cpu_at_start = time.monotonic(), _cpu_seconds(proc.pid)
        proc.send_signal(sig)
        cpu = cpu_at_start
        while proc.poll() is None and time.monotonic() - start < 30:  # its CPU time, until it exits
            cpu = _cpu_seconds(proc.pid) or cpu
            time.sleep(0.05)
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == status
    # While it waits, poprun sleeps in its event loop: it does not spin on the signal's wake-up.
    assert cpu - cpu_at_start < 0.3 * elapsed, (cpu - cpu_at_start, elapsed)
    # Instance 0 ignores SIGTERM: it is SIGKILLed after the grace (DEFAULT_GRACE, 3 s), so stopping
    # takes a little over 3 s; never killed, it would sleep its 120 s (the wait gives up at 30 s).
    # The grace plus 10 s of slack for a loaded 2-core host separates the two.
    assert elapsed < protocol.DEFAULT_GRACE + 10, f"stopping took {elapsed:.1f}s (instance 0 needs SIGKILL)"
    assert proc.stderr is not None
    err = proc.stderr.read()
    assert re.search(rf" POPRUN \[W\] received {sig.name}: stopping every instance$", err, re.M), err
    assert f"interrupted by {sig.name}" in err
    assert wait_no_processes(marker) == []


def test_what_mpiexec_says_after_it_exits_is_passed_on_and_waited_for_without_spinning(tmp_path: Path) -> None:
    """A launcher wrapper exits with mpiexec's status while a process of its still holds its stderr:
    that process's words, said once the wrapper is gone, reach poprun's stderr, and poprun waits for
    the pipe to close (here a fifth of a second, well inside the 2 s it waits at most, so that a
    loaded host still fits: at half a second a mutation run's load once made poprun end the writer)
    asleep, not polling in a loop. The writer learns that the wrapper is gone from a FIFO that only
    the wrapper holds open for writing: its exit is the end of file the writer reads. The writer is
    the shell: ``sleep`` closes its stdio before it exits (coreutils does), so poprun, seeing the pipe
    close, could find it still alive and rightly kill it."""
    wrapper = tmp_path / "mpiexec"
    exited = tmp_path / "exited"
    os.mkfifo(exited)
    wrapper.write_text(f'#!/bin/sh\n[ "$1" = --version ] && exec {BIN / "mpiexec"} --version\n'
                       f'{BIN / "mpiexec"} "$@"; status=$?\n'
                       f"(read _ < {exited}; echo 'mpiexec: last words' >&2; sleep 0.2 >/dev/null 2>&1; :) &\n"
                       f"exec 4> {exited}\n"
                       "exit $status\n")
    wrapper.chmod(0o755)
    proc = subprocess.Popen([*POPRUN, "--mpi", str(wrapper), "--num-instances", "2", PYTHON, "-c", "print('bye')"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, **OMP_SET})
    try:
        assert proc.stdout is not None
        assert sorted([proc.stdout.readline(), proc.stdout.readline()]) == ["[0] bye\n", "[1] bye\n"]
        start, cpu_at_start = time.monotonic(), _cpu_seconds(proc.pid)
        cpu = cpu_at_start
        while proc.poll() is None and time.monotonic() - start < 30:  # its CPU time, until it exits
            cpu = _cpu_seconds(proc.pid) or cpu
            time.sleep(0.05)
        elapsed = time.monotonic() - start
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert err.endswith("mpiexec: last words\n"), err
    assert cpu - cpu_at_start < 0.3 * elapsed, (cpu - cpu_at_start, elapsed)


@pytest.mark.parametrize("held", [False, True])
def test_mpiexecs_output_is_waited_for_only_while_a_process_holds_it(tmp_path: Path, held: bool) -> None:
    """Once mpiexec has exited and its pipes have closed, poprun ends then; a process of the
    launcher's that holds its output is waited for at most 2 s, and -v says what was left open."""
    mpiexec = BIN / "mpiexec"
    if held:
        mpiexec = tmp_path / "mpiexec"
        mpiexec.write_text(f'#!/bin/sh\n[ "$1" = --version ] && exec {BIN / "mpiexec"} --version\n'
                           f'{BIN / "mpiexec"} "$@"; status=$?\n(sleep 30) &\nexit $status\n')
        mpiexec.chmod(0o755)
    result = poprun("-v", "--mpi", str(mpiexec), "--num-instances", "2", PYTHON, "-c", "pass", env=OMP_SET)
    assert result.returncode == 0, result.stderr
    said = ("POPRUN [I] stopped waiting 2 s after mpiexec exited: its stderr and stdout still open (held by a "
            "process it started)\n")
    assert (said in result.stderr) == held, result.stderr
    assert ("stopped waiting" in result.stderr) == held, result.stderr


def test_poprun_s_account_of_a_failed_job_at_vv() -> None:
    """-vv's lines of a job whose instance 1 fails: each step once, in order where there is one."""
    result = poprun("-vv", "--mpi", str(BIN / "mpiexec"), "--num-instances", "2", PYTHON, "-c",
                    "import os, sys, time; sys.exit(3) if os.environ['RANK'] == '1' else time.sleep(60)", env=OMP_SET)
    assert result.returncode == 3, result.stderr
    lines = [line.split(" POPRUN ", 1)[1] for line in result.stderr.splitlines() if " POPRUN " in line]
    host = socket.gethostname()
    assert re.fullmatch(rf"\[I\] using {re.escape(str(BIN / 'mpiexec'))} \(mpich [\d.]+\)", lines[0])
    assert lines[1].startswith(f"[I] running command: {BIN / 'mpiexec'} ")
    assert re.fullmatch(r"\[I\] waiting for mpiexec \(PID \d+\)", lines[2])
    # Instance 0 may call in before or after instance 1 has failed; the rest is in this order.
    rest = [re.sub(r"pid \d+", "pid N", line) for line in lines[3:]]
    connected = [f"[D] instance {index} connected from {host} (pid N)" for index in (0, 1)]
    assert sorted(line for line in rest if line in connected) == connected, lines
    assert rest.index(connected[1]) < rest.index(f"[I] instance 1 on {host}: exit status 3")
    assert [line for line in rest if line not in connected] == [
        f"[I] instance 1 on {host}: exit status 3", "[I] stopping every instance",
        f"[I] instance 0 on {host}: killed by SIGTERM (status 143)", "[I] mpiexec exited with status 143"], lines


def test_program_that_does_not_exist() -> None:
    result = poprun("--num-instances", "2", "no-such-program-xyz")
    assert result.returncode == 127
    assert result.stderr.strip() == "poprun: error: program 'no-such-program-xyz' was not found on PATH"


def test_print_topology_then_runs() -> None:
    result = poprun("--num-instances", "2", "--num-replicas", "4", "--print-topology", "yes", "/bin/true")
    assert result.returncode == 0, result.stderr
    # The whole box, written out: no -H, so the one host is localhost; two instances of two replicas.
    assert [line for line in result.stdout.splitlines() if line.startswith(("|", "+"))] == [
        "+-------------------------------+",
        "|        poprun topology        |",
        "+-------------------------------+",
        "| hosts     |     localhost     |",
        "| instances |    0    |    1    |",
        "| replicas  | 0  | 1  | 2  | 3  |",
        "+-------------------------------+",
    ], result.stdout


def test_print_topology_alone_then_the_program_and_long_host_names_fit() -> None:
    """``--print-topology hostname``: the bare flag, then the program; every cell holds its text."""
    result = poprun("--print-topology", "hostname")
    assert result.returncode == 0, result.stderr
    assert re.search(r"^\| hosts     \| +localhost +\|$", result.stdout, re.MULTILINE), result.stdout
    dry = poprun("--dry-run", "--print-topology", "--num-instances", "2", "-H", "a-rather-long-host-name,b", "true")
    box = [line for line in dry.stdout.splitlines() if line.startswith(("|", "+"))]
    assert "a-rather-long-host-name" in box[3] and len({len(line) for line in box}) == 1, dry.stdout


def test_python_dash_m_entry_point_and_console_script_agree() -> None:
    console = subprocess.run([str(BIN / "poprun"), "--version"],
                             capture_output=True, text=True, timeout=30)
    module = poprun("--version")
    assert console.returncode == module.returncode == 0
    assert console.stdout == module.stdout and module.stdout.startswith(f"poprun {poprun_py.__version__}\n")


def test_mpiexec_failing_before_instances_start_is_reported() -> None:
    result = poprun("--mpi-global-args", "-bogus-flag", "/bin/true")
    assert result.returncode == 255
    assert "bogus-flag" in result.stderr  # mpiexec's own explanation is passed through
    # mpiexec's last line was whole: poprun's line follows it, with no blank line between.
    last = "poprun: error: mpiexec exited with status 255 before instance(s) 0 reported an exit status\n"
    assert result.stderr.endswith(f"\n{last}") and not result.stderr.endswith(f"\n\n{last}"), result.stderr


def test_what_mpiexec_writes_on_stdout_is_passed_on_there() -> None:
    # -info: Hydra prints its build details on stdout and starts nothing.
    result = poprun("--mpi-global-args", "-info", "/bin/true")
    assert result.returncode == 1
    assert result.stdout.startswith("HYDRA build details:\n") and "Version:" in result.stdout, result.stdout
    assert result.stderr == "poprun: error: mpiexec exited with status 0 before instance(s) 0 reported an exit status\n"


def test_mpiexec_failing_after_every_instance_succeeded_fails_the_job_saying_so(tmp_path: Path) -> None:
    wrapper = tmp_path / "mpiexec"  # a launcher wrapper whose last step fails
    wrapper.write_text(f'#!/bin/sh\n[ "$1" = --version ] && exec {BIN / "mpiexec"} --version\n'
                       f'{BIN / "mpiexec"} "$@" && exit 3\n')
    wrapper.chmod(0o755)
    result = poprun("--mpi", str(wrapper), "--num-instances", "2", "/bin/true", env=OMP_SET)
    said = "poprun: error: mpiexec exited with status 3 after every instance had exited with status 0\n"
    assert (result.returncode, result.stderr) == (3, said)


@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_unknown_host_is_one_line_naming_it(mpi: str) -> None:
    # RFC 6761's .invalid never resolves (a name with '!', which the C library refused without asking a DNS
    # server, is refused by poprun itself now; this asks the machine's resolver once).
    args = ["--mpi", str(OPENMPI_MPIEXEC)] if mpi == "openmpi" else []
    result = poprun(*args, "--num-instances", "2", "-H", "ghost.invalid", "/bin/true", env=OMP_SET)
    assert result.returncode == 255
    assert resolved_as_unknown(result.stderr) == ("poprun: error: instance(s) 0-1 could not be started: host "
                                                  "ghost.invalid: ssh: Could not resolve hostname ghost.invalid: "
                                                  "Name or service not known\n")


def test_an_ssh_message_that_names_no_host_is_put_down_to_the_remote_host_that_never_started(tmp_path: Path) -> None:
    """A hung sshd's time-out names no host: it is the remote host whose instances never started
    (not this machine's, which never started either: the wrapper starts nothing)."""
    wrapper = tmp_path / "mpiexec"
    wrapper.write_text(f'#!/bin/sh\n[ "$1" = --version ] && exec {BIN / "mpiexec"} --version\n'
                       "echo 'Connection timed out during banner exchange' >&2\nexit 255\n")
    wrapper.chmod(0o755)
    result = poprun("--mpi", str(wrapper), "--num-instances", "2", "-H", "localhost,ghost.invalid", "/bin/true",
                    env=OMP_SET)
    said = ("poprun: error: instance(s) 1 could not be started: host ghost.invalid: ssh: Connection timed out during "
            "banner exchange\n")
    assert (result.returncode, result.stderr) == (255, said)


def test_open_mpis_setpgid_race_warning_is_kept_for_vv(tmp_path: Path) -> None:
    """PRRTE's warning that its setpgid lost a race with its child's exec (harmless; a busy host
    shows it) is not passed on with mpiexec's words, which are (a wrapper's line around it)."""
    race = "[vm:06254] plm:ssh: Warning: setpgid(6258,6258) failed in parent with errno=Permission denied(13)"
    wrapper = tmp_path / "mpiexec"
    wrapper.write_text(f'#!/bin/sh\n[ "$1" = --version ] && exec {BIN / "mpiexec"} --version\n'
                       f"printf 'before\\n{race}\\nafter\\n' >&2\nexec {BIN / 'mpiexec'} \"$@\"\n")
    wrapper.chmod(0o755)
    quiet = poprun("--mpi", str(wrapper), "--num-instances", "2", "/bin/true", env=OMP_SET)
    assert (quiet.returncode, quiet.stderr) == (0, "before\nafter\n")
    told = poprun("-vv", "--mpi", str(wrapper), "--num-instances", "2", "/bin/true", env=OMP_SET)
    assert told.returncode == 0 and f" POPRUN [D] mpiexec: {race}\n" in told.stderr, told.stderr


def test_what_mpiexec_said_about_a_host_that_could_not_start_is_shown_at_v(tmp_path: Path) -> None:
    """-v keeps what the launcher said (here a wrapper's line that is not UTF-8, then Hydra's, in
    several reads), as it was, before the one line naming the host."""
    wrapper, copy = tmp_path / "mpiexec", tmp_path / "said"  # the wrapper keeps a copy of its stderr
    wrapper.write_text(f'#!/bin/bash\n[ "$1" = --version ] && exec {BIN / "mpiexec"} --version\n'
                       f'exec 2> >(tee {copy} >&2)\n'
                       f"printf '\\377 the wrapper starts\\n' >&2\nexec {BIN / 'mpiexec'} \"$@\"\n")
    wrapper.chmod(0o755)
    result = poprun("-v", "--mpi", str(wrapper), "--num-instances", "2", "-H", "ghost.invalid", "/bin/true",
                    env=OMP_SET)
    assert result.returncode == 255, result.stderr
    said = resolved_as_unknown(result.stderr.split(" POPRUN [I] mpiexec said:\n", 1)[1])
    assert said.startswith("\ufffd the wrapper starts\n"), result.stderr
    assert "ssh: Could not resolve hostname ghost.invalid" in said, result.stderr
    last = ("poprun: error: instance(s) 0-1 could not be started: host ghost.invalid: "
            "ssh: Could not resolve hostname ghost.invalid: Name or service not known\n")
    wrote = resolved_as_unknown(copy.read_text(errors="replace"))
    assert said == wrote.strip() + "\n" + last, result.stderr  # newlines read as text


def test_what_mpiexec_says_during_the_teardown_is_kept_for_vv_not_passed_on(tmp_path: Path) -> None:
    """Once poprun is stopping a failed job, the launcher's words (here a wrapper's, after mpiexec
    has ended, not UTF-8) are noise around the summary: -vv shows them, as they were, in one line."""
    wrapper = tmp_path / "mpiexec"
    wrapper.write_text(f'#!/bin/sh\n[ "$1" = --version ] && exec {BIN / "mpiexec"} --version\n'
                       f'{BIN / "mpiexec"} "$@"; status=$?\n'
                       "printf '  \\377 mpiexec ended  \\n' >&2\nexit $status\n")
    wrapper.chmod(0o755)
    result = poprun("-vv", "--mpi", str(wrapper), "--num-instances", "2", PYTHON, "-c",
                    "import os, sys, time; sys.exit(3) if os.environ['RANK'] == '1' else time.sleep(60)", env=OMP_SET)
    assert result.returncode == 3, result.stderr
    said = [line.split(" POPRUN ", 1)[1] for line in result.stderr.splitlines() if "mpiexec ended" in line]
    assert said == ["[D] mpiexec during teardown:   \ufffd mpiexec ended"], result.stderr


def test_poprun_s_own_line_starts_a_line_after_mpiexec_left_one_open_on_stderr() -> None:
    out, err = io.BytesIO(), io.BytesIO()
    s = supervisor(out, err)
    s._pass_on(2, b"mpiexec: half a line")
    s._say("poprun: error: what happened\n")
    s._say("poprun: and more\n")  # the line was ended once: no blank line now
    assert err.getvalue() == b"mpiexec: half a line\npoprun: error: what happened\npoprun: and more\n"


def test_mpiexec_s_whole_lines_need_no_cut_and_its_open_stdout_is_another_file() -> None:
    out, err = io.BytesIO(), io.BytesIO()
    s = supervisor(out, err)
    s._pass_on(2, b"mpiexec: a")
    s._pass_on(2, b" whole line\n")  # ended by mpiexec itself
    s._pass_on(1, b"on stdout, unfinished")  # another file: poprun's stderr line is not cut for it
    s._say("poprun: error: what happened\n")
    assert err.getvalue() == b"mpiexec: a whole line\npoprun: error: what happened\n"
    assert out.getvalue() == b"on stdout, unfinished"


def test_one_file_for_both_streams_cuts_mpiexec_s_open_stdout_line_once() -> None:
    both = io.BytesIO()
    s = supervisor(both, both)
    s._pass_on(1, b"on stdout, unfinished")
    s._say("poprun: error: what happened\n")
    s._say("poprun: and more\n")
    assert both.getvalue() == b"on stdout, unfinished\npoprun: error: what happened\npoprun: and more\n"


def test_what_mpiexec_says_is_held_until_every_instance_has_called_in_then_passed_on_as_it_comes() -> None:
    # If a host cannot be reached, what mpiexec said is launcher noise around the one line poprun
    # gives instead; once every instance has called in, it is shown, and from then on as it comes.
    out, err = io.BytesIO(), io.BytesIO()
    s = Supervisor(3, ["node"] * 3, lambda address: ([], {}), new_secret(), PROGRAM, listen_address="127.0.0.1",
                   start_timeout=START_TIMEOUT, stdout=out, stderr=err, remote_hosts=frozenset({"node"}))
    read, write = os.pipe()
    ends = []
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    try:
        os.write(write, b"mpiexec: early words\n")
        s._read_mpiexec(read, 2)
        for index in (2, 0):
            ends.append(call_in(s, server, index))
            assert err.getvalue() == b""
        ends.append(call_in(s, server, 1))
        assert err.getvalue() == b"mpiexec: early words\n"
        os.write(write, b"mpiexec: later words\n")
        s._read_mpiexec(read, 2)
        assert err.getvalue() == b"mpiexec: early words\nmpiexec: later words\n"
        assert out.getvalue() == b""
    finally:
        for sock in (server, *ends, *(link.conn for link in s.host_links.values())):
            sock.close()
        os.close(read)
        os.close(write)


def test_a_connection_reset_by_its_peer_reads_as_gone_and_an_idle_one_as_nothing_yet() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server, \
            socket.create_connection(server.getsockname(), timeout=10) as peer:
        conn, _ = server.accept()
        with conn:
            conn.setblocking(False)
            assert Supervisor._recv(conn) is None
            peer.sendall(b"abc")
            deadline = time.monotonic() + 10  # the bytes are in flight on loopback
            while (data := Supervisor._recv(conn)) is None and time.monotonic() < deadline:
                time.sleep(0.001)
            assert data == b"abc"
            # SO_LINGER on, with a zero timeout: close sends a reset, not a FIN.
            peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            peer.close()
            deadline = time.monotonic() + 10
            while (data := Supervisor._recv(conn)) is None and time.monotonic() < deadline:
                time.sleep(0.001)
    assert data == b""
