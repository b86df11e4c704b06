"""How poprun reports failures that involve several instances: each its own status, and the
instance that left early named instead of the one mpiexec then killed."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from popcontract import environment
from poprun_py.supervision import teardown
from poprun_py.supervision.report import LEFT_EARLY_STATUS
from poprun_py.wire import protocol
from poprun_py.wire.seal import TO_POPRUN, Seal, new_secret
from tests.helpers import (
    BIN,
    OMP_SET,
    OPENMPI_LIBMPI,
    OPENMPI_MPIEXEC,
    POPRUN,
    PYTHON,
    ROOT,
    SUBPROCESS_TIMEOUT,
    job_marker,
    live_command_line,
    poprun,
    processes_matching,
    run,
    stub_of,
    wait_no_processes,
    wait_until,
)

pytestmark = pytest.mark.slow
SCRIPTS = ROOT / "tests" / "scripts"
# One --error-file record of a start that ended badly, whatever ended it.
RECORD_KEYS = {"restart", "hosts", "instances", "lost_hosts", "instance", "host", "status", "signal", "time",
               "reason", "stderr_tail", "root_cause", "failures", "stopped"}


def test_instances_failing_together_each_report_their_own_status(tmp_path: Path) -> None:
    result = poprun("--num-instances", "3", PYTHON, str(SCRIPTS / "fail_together.py"), str(tmp_path))
    first = re.search(r"^poprun: instance (\d) on \S+ failed: exit status (\d)$", result.stderr, re.MULTILINE)
    assert first, result.stderr
    index = int(first.group(1))
    assert int(first.group(2)) == 3 + index and result.returncode == 3 + index
    others = sorted({0, 1, 2} - {index})
    for other in others:
        assert f"poprun: instance {other} on " in result.stderr
        assert re.search(rf"^poprun: instance {other} on \S+ also failed: exit status {3 + other}$",
                         result.stderr, re.MULTILINE), result.stderr
    assert "stopped instance" not in result.stderr


def _fail_while_another_exits(tmp_path: Path, mode: str, one_stream: bool) -> tuple[subprocess.CompletedProcess[str],
                                                                                    dict[str, object]]:
    """tests/scripts/fail_while_another_exits.py's job, its output one stream (poprun's stdout and
    stderr one pipe) or two; poprun's result (stderr: all of its output) and its --error-file record."""
    error_file = tmp_path / "error.json"
    command = [*POPRUN, "--error-file", str(error_file), "--log-dir", str(tmp_path / "logs"), "--num-instances", "2",
               PYTHON, str(SCRIPTS / "fail_while_another_exits.py"), str(tmp_path / "logs"), mode]
    result = subprocess.run(command, stdout=subprocess.DEVNULL if not one_stream else subprocess.PIPE,
                            stderr=subprocess.STDOUT if one_stream else subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, **OMP_SET}, timeout=SUBPROCESS_TIMEOUT)
    if one_stream:
        result.stderr = result.stdout
    (record,) = json.loads(error_file.read_text())
    return result, record


@pytest.mark.parametrize("one_stream", [False, True])
def test_an_instance_stopped_on_its_way_out_after_its_traceback_failed_too(tmp_path: Path, one_stream: bool) -> None:
    """Issue 49: instance 1's uncaught exception is printed, and it lingers in an atexit hook; only
    then (poprun has its traceback) does instance 0 fail, and poprun's stop ends instance 1. Both
    failed, instance 1 first; poprun exits with instance 0's status, the failure that made it stop."""
    result, record = _fail_while_another_exits(tmp_path, "traceback", one_stream)
    assert re.search(r"^poprun: instance 1 on \S+ failed: printed an uncaught exception at \d\d:\d\d:\d\d\.\d{3}, "
                     r"then ended as poprun stopped it: killed by SIGTERM \(status 143\)$", result.stderr, re.M), \
        result.stderr
    assert re.search(r"^poprun: instance 0 on \S+ also failed: exit status 3$", result.stderr, re.M), result.stderr
    assert "stopped instance" not in result.stderr and result.returncode == 3, result.stderr
    assert (record["instance"], record["status"], record["stopped"]) == (1, 3, []), record
    failures = record["failures"]
    assert isinstance(failures, list)
    assert [(f["instance"], f["status"], f["error"]) for f in failures] == \
        [(1, 143, "ValueError: failed as well"), (0, 3, None)], record


@pytest.mark.parametrize("mode", ["running", "raises-on-stop"])
def test_an_instance_that_had_not_failed_when_it_was_stopped_is_stopped(tmp_path: Path, mode: str) -> None:
    """Instance 1 runs when instance 0 fails: stopped, not failed, even when its SIGTERM handler
    raises and Python prints that traceback (after the stop) before SIGTERM ends it."""
    result, record = _fail_while_another_exits(tmp_path, mode, one_stream=False)
    assert re.search(r"^poprun: instance 0 on \S+ failed: exit status 3$", result.stderr, re.M), result.stderr
    assert re.search(r"^poprun: stopped instance\(s\) 1 \(1 of 2\)$", result.stderr, re.M), result.stderr
    assert "also failed" not in result.stderr and "uncaught" not in result.stderr, result.stderr
    assert result.returncode == 3 and (record["instance"], record["stopped"]) == (0, [1]), record
    if mode == "raises-on-stop":  # printed, once stopped
        assert re.search(r"^\[1\] RuntimeError: raised on the stop$", result.stderr, re.M), result.stderr


@pytest.mark.parametrize("mpi", ["gforker", "hydra"])
def test_an_instance_that_leaves_early_is_named_not_the_one_left_waiting(mpi: str, tmp_path: Path) -> None:
    """Instance 0 leaves through os._exit(0) without MPI_Finalize while instance 1 waits in a
    collective; MPICH ends the job some seconds later (one job per launcher: that wait is
    MPICH's own). poprun names instance 0, not the one left waiting, and exits with
    LEFT_EARLY_STATUS, not the 143 of a poprun that received SIGTERM."""
    # gforker (poprun's choice for one host) signals the stubs it ends, which stop their programs
    # with SIGTERM and report; Hydra (the same MPICH, named with --mpi) kills them without a report.
    args = ["--mpi", str(BIN / "mpiexec")] if mpi == "hydra" else []
    error_file = tmp_path / "error.json"
    result = poprun("-v", *args, "--error-file", str(error_file), "--num-instances", "2", PYTHON,
                    str(SCRIPTS / "leave_early.py"), timeout=90)
    report = json.loads(error_file.read_text())[-1]  # the same instance as the summary
    assert report["instance"] == 0 and "left early" in report["reason"], report
    assert report["status"] == LEFT_EARLY_STATUS, report
    # poprun's own status for instances that left early, not the victim's (gforker's SIGTERM: 143)
    assert result.returncode == LEFT_EARLY_STATUS != 143, result.stderr
    if mpi == "hydra":
        assert re.search(r" POPRUN \[I\] instance 1 on \S+ was lost without an exit report$", result.stderr, re.M)
    else:
        assert re.search(r"^poprun: instance 1 on \S+ was ended by mpiexec: killed by SIGTERM \(status 143\)$",
                         result.stderr, re.M), result.stderr
    assert re.search(r"^poprun: instance\(s\) 0 on \S+ left early: exited with status 0 while instance\(s\) 1 "
                     r"still ran, and \d+\.\d s later mpiexec ended those \(an MPI program that exits without "
                     r"MPI_Finalize, e\.g\. through os\._exit, takes the job down\)$", result.stderr,
                     re.M), result.stderr
    assert "instance 1 on" not in result.stderr.split("left early")[0].splitlines()[-1]


@pytest.mark.parametrize("mpi", ["gforker", "hydra", "openmpi"])
def test_the_death_of_mpis_process_on_a_host_ends_the_job_at_once(mpi: str) -> None:
    """Killing the process that started an instance (MPICH's gforker mpiexec or hydra_pmi_proxy,
    Open MPI's prted) ends the job at once, saying so, instead of when MPI later fails."""
    marker = job_marker()
    args, env = {"gforker": ([], {}), "hydra": (["--mpi", str(BIN / "mpiexec")], {}),
                 "openmpi": (["--mpi", str(OPENMPI_MPIEXEC)], {"MPI4PY_LIBMPI": str(OPENMPI_LIBMPI)})}[mpi]
    proc = subprocess.Popen([*POPRUN, *args, "--num-instances", "2", PYTHON, str(SCRIPTS / "behave.py"), marker],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env}, cwd=ROOT)
    try:
        assert proc.stdout is not None
        started = 0
        while started < 2:  # ordered by the instances' own messages
            line = proc.stdout.readline()
            assert line, proc.communicate(timeout=30)
            started += "started" in line
        stub = stub_of(marker, 0)
        launcher = int(Path(f"/proc/{stub}/stat").read_text().rsplit(")", 1)[1].split()[1])
        start = time.monotonic()
        os.kill(launcher, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=30)
        took = time.monotonic() - start
    finally:
        proc.kill()
    # Measured from the kill: ended at once (well under a second) vs noticed only when the stubs'
    # silence limit (protocol.DEFAULT_SILENCE_LIMIT, 20 s) runs out or the instances' 120 s sleep ends;
    # half the silence limit separates the two even on a loaded 2-core host.
    # The stub saw its launcher die and stopped the program (SIGTERM: status 143).
    assert proc.returncode == 143 and took < protocol.DEFAULT_SILENCE_LIMIT / 2, (took, stderr)
    # Both instances of this host were started by that process; either may report it first.
    assert re.search(rf"^poprun: instance [01] on {socket.gethostname()} failed: .*\n.*\n    the MPI launcher's "
                     rf"process that started instance [01] on {socket.gethostname()} \(PID {launcher}\) died; the "
                     r"instance was stopped$", stderr, re.MULTILINE), stderr
    assert wait_no_processes(marker) == []
    # A killed prterun leaves its session directory (named by its PID: it is mpiexec itself here).
    assert not Path(f"/tmp/ompi.{launcher}").exists()


@pytest.mark.parametrize("mode,status,bare", [("ok", 0, False), ("fail", 3, False), ("ok", 0, True),
                                              ("fail", 3, True)])
def test_daemons_left_by_the_program_end_with_the_job(mode: str, status: int, bare: bool) -> None:
    """A daemon (setsid, out of the program's process group) holds mpiexec's pipes: without care
    the job never ends after success, and the daemon survives a failure. ``bare``: it runs a new
    program with an empty environment, so nothing it inherited says whose it is."""
    marker = job_marker()
    result = poprun("--num-instances", "2", PYTHON, str(SCRIPTS / "leave_daemon.py"), marker, mode,
                    *(["bare"] if bare else []))
    assert result.returncode == status, result.stderr
    assert wait_no_processes(marker) == []


def test_a_stub_that_no_longer_answers_is_killed_with_mpiexecs_process_group(tmp_path: Path) -> None:
    # Instance 0's stub is frozen (SIGSTOP), so it cannot stop its program when instance 1 fails:
    # poprun sends mpiexec's process group SIGTERM, then SIGKILL (teardown.TERM/KILL_MPIEXEC_MARGIN after the grace),
    # and sweeps what is left in its session. Without that the job would sleep out instance 0's 120 s.
    marker = job_marker()
    go = tmp_path / "go"
    proc = subprocess.Popen([*POPRUN, "-vv", "--num-instances", "2", PYTHON, str(SCRIPTS / "behave.py"), marker,
                             f"1:waitfile={go},exit=3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT)
    frozen = None
    try:
        assert proc.stdout is not None
        seen = {proc.stdout.readline().strip(), proc.stdout.readline().strip()}
        assert seen == {"[0] instance 0 started", "[1] instance 1 started"}, proc.communicate(timeout=30)
        frozen = stub_of(marker, 0)
        os.kill(frozen, signal.SIGSTOP)
        go.touch()
        start = time.monotonic()
        _, stderr = proc.communicate(timeout=30)
        elapsed = time.monotonic() - start
    finally:
        proc.kill()
        for pid in [int(line.split(":")[0]) for line in processes_matching(marker)]:
            os.kill(pid, signal.SIGKILL)  # when the escalation failed: nothing stays behind, frozen or not
        if frozen is not None and "instance/script.py" in (live_command_line(frozen) or ""):
            os.kill(frozen, signal.SIGKILL)
    assert proc.returncode == 3, stderr
    assert "poprun: instance 1 on" in stderr and "failed: exit status 3" in stderr, stderr
    # The default grace and KILL_MPIEXEC_MARGIN (4.5 s) plus 10 s of slack for a loaded 2-core host, against 120 s.
    assert elapsed < protocol.DEFAULT_GRACE + teardown.KILL_MPIEXEC_MARGIN + 10, f"the job took {elapsed:.1f} s to end"
    # mpiexec's group is asked first (it may end its processes itself), then killed if still there.
    escalation = re.findall(r" POPRUN \[D\] sending (\w+) to mpiexec's process group$", stderr, re.M)
    assert escalation in (["SIGTERM"], ["SIGTERM", "SIGKILL"]), stderr
    assert wait_no_processes(marker) == []
    wait_until(lambda: live_command_line(frozen) is None, "the frozen stub outlived the job", within=5)


def test_a_process_left_behind_is_named_by_the_first_200_bytes_of_its_command_line() -> None:
    """How poprun's last-resort sweep names what it kills (a real process's /proc entry): a whole
    command line may be long, and its bytes need not be UTF-8."""
    code = "import time; print('running', flush=True); time.sleep(30)"
    process = subprocess.Popen([PYTHON, "-c", code, b"\xff" + b"x" * 300], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == b"running\n", process.communicate(timeout=30)
        head = f"{PYTHON} -c {code} \ufffd"
        assert teardown.command_line(process.pid) == head + "x" * (200 - len(head.encode()) + 2)
    finally:
        process.kill()
        process.wait()
    assert teardown.command_line(process.pid) == ""  # gone: nothing to name


def test_daemons_end_when_poprun_is_interrupted() -> None:
    marker = job_marker()
    proc = subprocess.Popen([*POPRUN, "--num-instances", "2", PYTHON, str(SCRIPTS / "leave_daemon.py"), marker,
                             "wait"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None
        started = 0
        while started < 2:  # each instance has left its daemon when it says it started
            line = proc.stdout.readline()
            assert line, proc.communicate(timeout=30)
            started += "started" in line
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert wait_no_processes(marker) == []


def test_a_second_signal_kills_at_once_what_the_first_asked_to_stop() -> None:
    """After a first Ctrl-C poprun waits for the instances to stop (here one ignores SIGTERM for a
    60 s grace, so mpiexec's process group would get SIGTERM first, then SIGKILL); a second one
    kills mpiexec's process group at once. Told apart by what poprun says it sends (-vv), not by time."""
    marker = job_marker()
    proc = subprocess.Popen([*POPRUN, "-vv", "--num-instances", "2", PYTHON, str(SCRIPTS / "behave.py"), marker,
                             "0:ignore-term,sleep=120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, environment.KILL_GRACE: "60"})
    try:
        assert proc.stdout is not None and proc.stderr is not None
        seen = {proc.stdout.readline().strip(), proc.stdout.readline().strip()}
        assert seen == {"[0] instance 0 started", "[1] instance 1 started"}, proc.communicate(timeout=30)
        proc.send_signal(signal.SIGINT)
        said: list[str] = []
        while not said or " [I] stopping every instance" not in said[-1]:  # the teardown has begun
            said.append(proc.stderr.readline())
            assert said[-1], "".join(said)
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=30)
    finally:
        proc.kill()
    said.append(rest)
    assert proc.returncode == 130, "".join(said)
    assert re.search(r" POPRUN \[D\] sending SIGKILL to mpiexec's process group$", rest, re.MULTILINE), "".join(said)
    assert "SIGTERM to mpiexec" not in rest, "".join(said)
    # The interrupt is the reason; instance 0, killed without an exit report, is not a failure.
    # (Instance 1 may or may not have reported its SIGTERM before the SIGKILL.)
    summary = [line for line in rest.splitlines() if line.startswith("poprun: ")]
    assert summary[0] == "poprun: interrupted by SIGINT" and "lost" not in rest.split(summary[0])[1], "".join(said)
    assert wait_no_processes(marker) == []


def test_an_instance_gets_the_whole_kill_grace_to_clean_up() -> None:
    """POPRUN_KILL_GRACE longer than the default: poprun's own escalation (mpiexec's process group
    SIGTERMed, then SIGKILLed) waits for it too, so a program that takes 5 s to clean up after
    SIGTERM (more than the default 3 s grace) ends by itself, with status 0."""
    marker = job_marker()
    proc = subprocess.Popen([*POPRUN, "--num-instances", "2", PYTHON, str(SCRIPTS / "behave.py"), marker,
                             "0:term-cleanup=5,sleep=120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env={**os.environ, environment.KILL_GRACE: "30"})
    try:
        assert proc.stdout is not None
        seen = {proc.stdout.readline().strip(), proc.stdout.readline().strip()}
        assert seen == {"[0] instance 0 started", "[1] instance 1 started"}, proc.communicate(timeout=30)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert "[0] instance 0 cleaned up\n" in out, (out, err)
    assert "SIGKILL" not in err and "lost" not in err, err
    assert proc.returncode == 130, err
    # both, by poprun
    assert err.endswith("poprun: interrupted by SIGINT\npoprun: stopped instance(s) 0-1 (2 of 2)\n"), err
    assert wait_no_processes(marker) == []


def test_a_reader_that_stops_reading_is_not_an_error() -> None:
    """``poprun --dry-run ... | head -0``: the closed pipe ends poprun quietly, as SIGPIPE would.
    (The reader is gone before poprun starts: a reader that read a line first raced poprun, which
    may write all of its few KiB before the reader closes.)"""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.Popen([*POPRUN, "--dry-run", "--num-instances", "2000", "/bin/true"],
                                stdout=write_end, stderr=subprocess.PIPE, cwd=ROOT)
    finally:
        os.close(write_end)
    try:
        assert proc.stderr is not None
        stderr = proc.stderr.read()
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 141 and stderr == b"", stderr


def _mpich_files() -> set[str]:
    shared = {f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if n.startswith("mpich_shm_")}
    return shared | {f"/tmp/{n}" for n in os.listdir("/tmp") if n.startswith("hydra_hwloc_xmlfile_")}


@pytest.mark.parametrize("mpi", ["gforker", "hydra"])
def test_a_storm_of_signals_ends_the_job_once_with_its_summary_and_leaves_nothing(mpi: str) -> None:
    """20 SIGTERMs 3 ms apart once the instances run MPI: the first stops the job, the second
    kills it at once; every later one is recorded, not fatal, so poprun still says why it ended,
    cleans up and exits 128 + 15."""
    marker = job_marker()
    args = ["--mpi", str(BIN / "mpiexec")] if mpi == "hydra" else []
    before = _mpich_files()
    proc = subprocess.Popen([*POPRUN, *args, "--num-instances", "2", PYTHON, "-c",
                             "import time, popdist_py; popdist_py.init(); print('up', flush=True); time.sleep(60)",
                             marker], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None
        assert sorted([proc.stdout.readline(), proc.stdout.readline()]) == ["[0] up\n", "[1] up\n"]
        for _ in range(20):  # the storm itself; nothing waits on its timing
            os.kill(proc.pid, signal.SIGTERM)
            time.sleep(0.003)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "poprun: interrupted by SIGTERM" in err.splitlines(), err
    assert wait_no_processes(marker) == []
    assert _mpich_files() - before == set(), err


def test_signals_that_go_on_until_poprun_exits_cut_no_cleanup_short(tmp_path: Path) -> None:
    """SIGTERM every half millisecond from the moment the instances run (one of them failing) until
    poprun is gone, a job's directory of error files made slow to remove (400 files in it): poprun
    still removes that directory, and --error-file is whole if written, with no temporary file
    left beside it."""
    fill = ("import os, time; d = os.path.dirname(os.environ['TORCHELASTIC_ERROR_FILE']); "
            "[open(os.path.join(d, f'{os.getpid()}-{i}'), 'w').close() for i in range(200)]; "
            "open(os.path.join(d, 'ready-' + os.environ['RANK']), 'w').close(); print(d, flush=True)\n"
            "while os.environ['RANK'] == '1' and not os.path.exists(os.path.join(d, 'ready-0')): time.sleep(0.01)\n"
            "time.sleep(60 if os.environ['RANK'] == '0' else 0); raise SystemExit(3)")
    report = tmp_path / "report.json"
    proc = subprocess.Popen([*POPRUN, "--error-file", str(report), "--num-instances", "2", PYTHON, "-c", fill],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, **OMP_SET})
    try:
        assert proc.stdout is not None
        directories = {proc.stdout.readline().split("] ", 1)[-1].strip() for _ in range(2)}
        assert len(directories) == 1 and all(d.startswith("/tmp/poprun-") for d in directories), directories
        while proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                break
            time.sleep(0.0005)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert not os.path.exists(directories.pop()), err
    assert set(os.listdir(tmp_path)) <= {"report.json"}, os.listdir(tmp_path)
    if report.exists():  # every start that ended badly; which came first, the failure or a signal, is a race
        written = json.loads(report.read_text())[-1]
        assert set(written) == RECORD_KEYS, written
        assert (written["instance"], written["status"]) in {(1, 3), (None, 128 + signal.SIGTERM)}, written
        if written["instance"] is None:
            assert written["reason"] == "interrupted by SIGTERM", written


def test_an_instance_found_stopped_is_named_before_the_one_that_timed_out_waiting_for_it(tmp_path: Path) -> None:
    """Instance 1 stops itself (SIGSTOP) after a barrier; instance 0's allreduce times out and
    fails. The summary and --error-file name the stopped instance first, and poprun ends it with
    SIGTERM at once (continued after the SIGTERM), not with SIGKILL after the grace."""
    script = ("import os, signal, numpy as np, popdist_py\npopdist_py.init()\npopdist_py.barrier()\n"
              "if popdist_py.getInstanceIndex() == 1:\n    os.kill(os.getpid(), signal.SIGSTOP)\n"
              "popdist_py.allreduce(np.ones(3))\n")
    report = tmp_path / "report.json"
    result = poprun("--error-file", str(report), "--num-instances", "2", PYTHON, "-c", script,
                    env={**OMP_SET, environment.COLLECTIVE_TIMEOUT: "1", environment.KILL_GRACE: "30"})
    assert result.returncode == 1, result.stderr
    summary = [line for line in result.stderr.splitlines() if line.startswith("poprun: ")]
    host = socket.gethostname()
    assert summary[0] == (f"poprun: instance(s) 1 on {host} had been stopped (SIGSTOP, SIGTSTP or a debugger) "
                          f"when instance 0 on {host} failed: exit status 1; an instance that waits for a "
                          "stopped one fails at its timeout"), result.stderr
    written = json.loads(report.read_text())[-1]
    assert (written["instance"], written["signal"]) == (1, "SIGTERM"), written


def test_instances_that_never_start_end_the_job_at_the_start_timeout(tmp_path: Path) -> None:
    """An mpiexec that never starts the instances (here Hydra behind a wrapper that stalls first,
    as a host that takes ssh but never runs the launcher's processes does) is not waited on for
    ever: at --start-timeout poprun names the instances and stops the job."""
    wrapper = tmp_path / "mpiexec"
    wrapper.write_text(f'#!/bin/sh\n[ "$1" = --version ] && exec {BIN / "mpiexec"} --version\n'
                       f'sleep 60\nexec {BIN / "mpiexec"} "$@"\n')
    wrapper.chmod(0o755)
    result = poprun("--start-timeout", "1", "--mpi", str(wrapper), "--num-instances", "2", "/bin/true", env=OMP_SET)
    assert result.returncode == 1, result.stderr
    assert result.stderr == ("poprun: instance(s) 0-1 on localhost had not started 1 s after mpiexec did "
                             "(--start-timeout)\n")


def test_a_process_left_in_mpiexecs_session_is_killed_and_named(tmp_path: Path) -> None:
    """Whatever mpiexec's session still holds after the job (here a job of a launcher wrapper's
    shell, in a process group of its own, so that signalling mpiexec's group misses it) is killed
    by the sweep, and named."""
    marker = job_marker()
    wrapper = tmp_path / "mpiexec"
    wrapper.write_text(f'#!/bin/sh\n[ "$1" = --version ] && exec {BIN / "mpiexec"} --version\n'
                       f"set -m\nsh -c 'sleep 300' {marker} &\nexec {BIN / 'mpiexec'} \"$@\"\n")
    wrapper.chmod(0o755)
    result = poprun("--mpi", str(wrapper), "--num-instances", "2", "/bin/true", env=OMP_SET)
    assert result.returncode == 0, result.stderr
    assert re.search(rf" POPRUN \[W\] killed process \d+ \(sh -c sleep 300 {marker}\) left behind in the "
                     r"job's session$", result.stderr, re.M), result.stderr
    assert wait_no_processes(marker) == []
    # Of a job that failed, what is left is no news beside its failure: killed, and said at -vv.
    failed = poprun("-vv", "--mpi", str(wrapper), "--num-instances", "2", "/bin/false", env=OMP_SET)
    assert failed.returncode == 1, failed.stderr
    assert re.search(rf" POPRUN \[D\] killed process \d+ \(sh -c sleep 300 {marker}\) left behind in the "
                     r"job's session$", failed.stderr, re.M), failed.stderr
    assert wait_no_processes(marker) == []


PIDS = Path("/sys/fs/cgroup/pids")


@pytest.mark.skipif(os.geteuid() != 0 or not os.access(PIDS, os.W_OK), reason="needs root and the pids cgroup")
def test_a_process_limit_that_stops_mpiexec_starting_instances_ends_the_job() -> None:
    """Hydra that cannot fork its proxy (3 processes allowed: poprun, mpiexec, one more) waits
    without a word: --start-timeout ends it."""
    group = PIDS / f"poprun-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "pids.max").write_text("3")
        result = run(["/bin/sh", "-c", f'echo $$ > {group / "cgroup.procs"} && exec "$@"', "sh", *POPRUN,
                      "--start-timeout", "2", "--mpi", str(BIN / "mpiexec"), "--num-instances", "2", "/bin/true"],
                     env=OMP_SET)
    finally:
        # A process killed a moment ago leaves the group once its parent (or, orphaned, the init of
        # its PID namespace) has collected it.
        wait_until(lambda: not (group / "cgroup.procs").read_text().strip(), "the group emptied")
        group.rmdir()
    assert result.returncode == 1, result.stderr
    assert result.stderr.endswith("poprun: instance(s) 0-1 on localhost had not started 2 s after mpiexec did "
                                  "(--start-timeout)\n"), result.stderr


def test_files_of_instances_that_all_left_through_os_exit_are_removed() -> None:
    """Every instance initialises MPI, then leaves with os._exit(0), never unlinking MPICH's
    segments: the job succeeded, and poprun removes what it left all the same."""
    before = _mpich_files()
    result = poprun("--num-instances", "3", PYTHON, "-c",
                    "import os, popdist_py; popdist_py.init(); popdist_py.barrier(); os._exit(0)")
    assert result.returncode == 0, result.stderr
    assert _mpich_files() - before == set(), result.stderr


def test_files_of_killed_mpi_processes_are_removed() -> None:
    """MPICH's shared-memory segments (megabytes each) and Hydra's topology file stay behind when
    their processes are killed in a teardown; poprun removes the ones its job left."""
    before = _mpich_files()
    result = poprun("--num-instances", "3", PYTHON, str(SCRIPTS / "fail_in_mpi.py"))
    assert result.returncode == 3, result.stderr
    assert _mpich_files() - before == set(), result.stderr


def test_a_restarted_job_resumes_from_its_checkpoint_and_ends_as_if_it_never_failed(tmp_path: Path) -> None:
    """--max-restarts: instance 1 dies mid-epoch; the job restarts with POPDIST_RESTART_COUNT=1,
    resumes from the last checkpoint, and ends with the weights of a run that never failed."""
    job = ["--num-instances", "2", "--num-replicas", "4"]
    train = ["--epochs", "3", "--rts"]
    clean = poprun(*job, PYTHON, str(ROOT / "examples" / "mnist_rts.py"), *train,
                   "--checkpoint", str(tmp_path / "clean.npz"), timeout=120)
    assert clean.returncode == 0, clean.stderr
    report = tmp_path / "error.json"
    crashed = poprun("--max-restarts", "1", "--error-file", str(report), *job,
                     PYTHON, str(SCRIPTS / "mnist_fail_once.py"), *train,
                     "--checkpoint", str(tmp_path / "crashed.npz"), timeout=120)
    assert crashed.returncode == 0, crashed.stderr
    assert "poprun: restarting the job (1 of 1 restart(s)) in 1 s: instance 1 on " in crashed.stderr
    assert "killed by SIGKILL" in crashed.stderr and "resumed from" in crashed.stderr
    final = re.compile(r"^\[\d\] final: .*$", re.MULTILINE)
    assert sorted(final.findall(crashed.stdout)) == sorted(final.findall(clean.stdout)) != []
    failure, restarted = json.loads(report.read_text())  # every start, the last one last
    assert (failure["instance"], failure["signal"], failure["status"], failure["restart"]) == (1, "SIGKILL", 137, 0)
    assert (failure["hosts"], failure["instances"], failure["lost_hosts"]) == (["localhost"], 2, {})
    assert restarted == {"restart": 1, "hosts": ["localhost"], "instances": 2, "status": 0, "reason": None,
                         "lost_hosts": {}}


def test_an_interrupted_job_is_not_restarted(tmp_path: Path) -> None:
    """SIGINT before any instance fails: no restart, and --error-file records the start as every
    other failed start is recorded, with no instance and the signal as the reason."""
    marker = job_marker()
    report = tmp_path / "error.json"
    proc = subprocess.Popen([*POPRUN, "--max-restarts", "3", "--error-file", str(report), "--num-instances", "2",
                             PYTHON, str(SCRIPTS / "behave.py"), marker],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None
        started = 0
        while started < 2:
            line = proc.stdout.readline()
            assert line, proc.communicate(timeout=30)
            started += "started" in line
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "restarting" not in stderr, stderr
    assert wait_no_processes(marker) == []
    (written,) = json.loads(report.read_text())
    assert set(written) == RECORD_KEYS, written
    assert (written["restart"], written["instance"], written["host"], written["status"], written["reason"]) == (
        0, None, None, 130, "interrupted by SIGINT"), written
    assert (written["failures"], written["stopped"]) == ([], [0, 1]), written  # the summary's "stopped" line


def test_a_signal_after_an_instance_failed_leaves_that_failure_on_record(tmp_path: Path) -> None:
    """Instance 1 fails; poprun is interrupted while instance 0 (which ignores SIGTERM) is being
    stopped: poprun exits as interrupted, and --error-file still names the failure that came first."""
    script = ("import os, signal, time\nif os.environ['RANK'] == '1':\n    raise SystemExit(3)\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)\n")
    report = tmp_path / "error.json"
    proc = subprocess.Popen([*POPRUN, "-v", "--error-file", str(report), "--num-instances", "2", PYTHON, "-c", script],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, **OMP_SET, environment.KILL_GRACE: "2"})
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # poprun has the failure once it says so
            if re.search(r"instance 1 on \S+: exit status 3$", line):
                break
        else:
            pytest.fail(f"poprun never said that instance 1 failed: {proc.communicate(timeout=30)}")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    (written,) = json.loads(report.read_text())
    assert set(written) == RECORD_KEYS, written
    assert (written["instance"], written["status"]) == (1, 3), written
    assert str(written["reason"]).startswith("instance 1 on "), written


def test_a_job_that_cannot_fit_the_open_file_limit_is_refused_before_it_starts() -> None:
    """mpiexec's proxy holds about 4 descriptors per instance it starts: 1000 instances on a host
    whose hard limit is 2048 would fail minutes in with 'Too many open files'."""
    import resource

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, 2048))

    result = subprocess.run([*POPRUN, "--num-instances", "1000", "/bin/true"], capture_output=True, text=True,
                            timeout=60, cwd=ROOT, preexec_fn=low_limit)
    assert result.returncode == 2
    assert result.stderr == ("poprun: error: 1000 instances on one host need about 4064 open files in mpiexec's "
                             "process there, more than this system allows (2048, ulimit -Hn); start fewer "
                             "instances per host, or raise the limit\n")


def test_a_stray_connection_to_the_control_port_is_refused_and_the_job_goes_on(tmp_path: Path) -> None:
    """Whatever connects to poprun's control port is named on poprun's stderr (each at -vv) and
    dropped, and the job carries on: a client without this run's secret (whatever it sends), and
    even one with it whose first frame is not a HELLO. The secret reaches the stub in its
    environment only: it is on no command line, and the program does not get it."""
    go = tmp_path / "go"
    program = ("import os, sys, time\nprint(os.environ['POPRUN_CONTROL'], os.getppid(), "
               "os.environ.get('POPRUN_SECRET'), flush=True)\n"
               "while not os.path.exists(sys.argv[1]): time.sleep(0.01)\nprint('done', flush=True)\n")
    proc = subprocess.Popen([*POPRUN, "-vv", "--num-instances", "1", PYTHON, "-c", program, str(go)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None
        # "[0] 127.0.0.1:PORT PID None": the program's environment has no secret.
        control, stub, programs_secret = proc.stdout.readline().removeprefix("[0] ").split()
        assert programs_secret == "None"
        environ = dict(entry.split("=", 1) for entry in
                       Path(f"/proc/{stub}/environ").read_text().split("\0") if "=" in entry)
        secret = environ[environment.SECRET]
        assert re.fullmatch("[0-9a-f]{64}", secret)
        on_command_lines = [pid for pid in os.listdir("/proc") if pid.isdigit() and
                            secret.encode() in _read(f"/proc/{pid}/cmdline")]
        assert on_command_lines == []
        host, port = control.rsplit(":", 1)
        unsealed = protocol.host_hello(1, "intruder")
        strays: list[tuple[str | None, bytes]] = [
            (None, protocol.HEADER.pack(protocol.HOST_HELLO, 1, 1 << 30)),  # too long to be held
            (new_secret(), protocol.host_hello(1, "intruder")),  # another secret
            (None, unsealed + bytes(protocol.TAG_SIZE)),  # no tag
            (secret, protocol.frame(protocol.OUTPUT, b"x", stream=1))]
        stray_ports = []
        for key, first in strays:
            with socket.create_connection((host, int(port)), timeout=10) as stray:
                stray_ports.append(str(stray.getsockname()[1]))
                nonce = stray.recv(protocol.NONCE_SIZE, socket.MSG_WAITALL)
                assert len(nonce) == protocol.NONCE_SIZE
                stray.sendall(Seal(key, nonce, TO_POPRUN).seal(first) if key else first)
                assert stray.recv(1) == b""  # dropped by poprun
        go.touch()
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert out.endswith("[0] done\n"), out
    assert secret not in err  # not even at -vv
    # The instance itself, as it called in: its index, its host and its stub's PID.
    assert re.search(rf" POPRUN \[D\] instance 0 connected from {socket.gethostname()} \(pid {stub}\)$", err,
                     re.MULTILINE), err
    assert re.search(rf" POPRUN \[I\] instance 0 on {socket.gethostname()}: exit status 0$", err, re.MULTILINE), err
    refused = re.findall(r" POPRUN \[[ED]\] unexpected connection on the control port from 127\.0\.0\.1:(\d+): (.*)$",
                         err, re.MULTILINE)
    assert [port for port, _ in refused] == stray_ports  # each named by its own address
    assert [why for _, why in refused] == [
        f"a HELLO of {1 << 30} bytes is longer than the {protocol.MAX_HELLO} a HELLO may have",
        "a frame failed its authentication check", "a frame failed its authentication check",
        f"its first frame is of kind 2, not HOST_HELLO ({protocol.HOST_HELLO})"], err


def test_a_hello_sealed_with_the_secret_for_no_expected_host_ends_the_job_in_one_line(tmp_path: Path) -> None:
    """Only a process that holds this run's secret can seal it (see docs/design.md): a host's
    supervisor that a one-host job does not have is one poprun cannot work with, so the job ends at
    once, said in one line."""
    program = ("import os, sys, time\nprint(os.environ['POPRUN_CONTROL'], os.getppid(), flush=True)\n"
               "time.sleep(60)\n")
    proc = subprocess.Popen([*POPRUN, "--num-instances", "1", PYTHON, "-c", program],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None
        control, stub = proc.stdout.readline().removeprefix("[0] ").split()
        secret = dict(entry.split("=", 1) for entry in Path(f"/proc/{stub}/environ").read_text().split("\0")
                      if "=" in entry)[environment.SECRET]
        host, port = control.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as stray:
            peer = "{}:{}".format(*stray.getsockname())
            nonce = stray.recv(protocol.NONCE_SIZE, socket.MSG_WAITALL)
            stray.sendall(Seal(secret, nonce, TO_POPRUN).seal(protocol.host_hello(1, "intruder")))
            assert stray.recv(1) == b""  # dropped by poprun
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert err.splitlines()[0] == (f"poprun: a connection from {peer} sealed with this run's secret sent a HELLO "
                                   "poprun cannot read: every instance of this job runs on poprun's host, and no "
                                   "other host's supervisor is expected"), err
    assert "Traceback" not in err and out == ""


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError:
        return b""


@pytest.mark.parametrize("ignored", [True, False], ids=["nohup", "heeded"])
def test_a_hangup_poprun_was_started_ignoring_is_ignored_by_the_whole_job(ignored: bool, tmp_path: Path) -> None:
    """``nohup poprun ...``: the terminal's hangup (SIGHUP to its process group) leaves the job
    running to its end, as it would any program started so; heeded, it stops the job (129)."""
    go = tmp_path / "go"
    program = ("import os, time\nprint('up', flush=True)\n"
               f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\nprint('done', flush=True)")

    def start() -> None:
        if ignored:
            signal.signal(signal.SIGHUP, signal.SIG_IGN)

    proc = subprocess.Popen([*POPRUN, "--num-instances", "2", PYTHON, "-c", program], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, **OMP_SET},
                            preexec_fn=start, start_new_session=True)
    try:
        assert proc.stdout is not None
        assert sorted([proc.stdout.readline(), proc.stdout.readline()]) == ["[0] up\n", "[1] up\n"]
        os.killpg(proc.pid, signal.SIGHUP)  # as a terminal that went away: its whole foreground group
        if not ignored:
            proc.wait(timeout=SUBPROCESS_TIMEOUT)  # ended by the hangup, before the programs may finish
        go.touch()
        out, err = proc.communicate(timeout=SUBPROCESS_TIMEOUT)
    finally:
        proc.kill()
    if ignored:
        assert (proc.returncode, sorted(out.splitlines()), err) == (0, ["[0] done", "[1] done"], ""), err
    else:
        assert proc.returncode == 128 + signal.SIGHUP and "poprun: interrupted by SIGHUP" in err.splitlines(), err
