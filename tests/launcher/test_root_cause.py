"""torchrun's error files: each host's supervisor (poprun on its own) sends back (bounded) and removes each instance's
TORCHELASTIC_ERROR_FILE; poprun shows what a failed program recorded there. Without torch: the
programs here write what torch's ``@record`` writes (tests/integration/test_torch_ddp.py uses torch itself)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from poprun_py.shared import root_cause
from poprun_py.supervision.supervisor import Supervisor
from poprun_py.wire import protocol
from tests.helpers import OMP_SET, PYTHON, poprun, wait_until
from tests.launcher.supervising import InstanceSeal

#: What torch's ErrorHandler.record_exception writes (torch 2.13).
RECORDED: dict[str, Any] = {"message": {"message": "ValueError: bad batch 7",
                        "extraInfo": {"py_callstack": "Traceback (most recent call last):\n  File \"t.py\", line 3, "
                                                      "in load_batch\n    raise ValueError('bad batch 7')\n"
                                                      "ValueError: bad batch 7\n",
                                      "timestamp": "1700000000"}}}


def test_a_record_is_sent_as_written_and_described() -> None:
    data = json.dumps(RECORDED).encode()
    assert root_cause.describe(data) == {"message": "ValueError: bad batch 7",
                                         "traceback": RECORDED["message"]["extraInfo"]["py_callstack"],
                                         "timestamp": "1700000000"}
    # torch's other layout: the message a string, the timestamp beside it.
    assert root_cause.describe(b'{"message": "killed", "timestamp": 5}') == \
        {"message": "killed", "traceback": None, "timestamp": "5"}
    assert root_cause.describe(b"not json\n") == {"message": "not json", "traceback": None, "timestamp": None}


def test_collect_is_bounded_and_keeps_the_tracebacks_end(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    assert root_cause.collect(str(path)) is None  # nothing written
    path.write_text("")
    assert root_cause.collect(str(path)) is None
    path.write_text(json.dumps(RECORDED))
    assert root_cause.collect(str(path)) == path.read_bytes()
    frames = "".join(f"  File \"deep.py\", line {i}, in level_{i}\n    go()\n" for i in range(20000))
    huge = {"message": {"message": "RecursionError: too deep", "extraInfo": {
        "py_callstack": f"Traceback (most recent call last):\n{frames}RecursionError: too deep\n",
        "timestamp": "1"}}}
    path.write_text(json.dumps(huge))
    sent = root_cause.collect(str(path))
    assert sent is not None and len(sent) <= root_cause.SEND_LIMIT < path.stat().st_size
    cause = root_cause.describe(sent)
    assert cause["message"] == "RecursionError: too deep"
    assert cause["traceback"] is not None
    assert cause["traceback"].endswith("level_19999\n    go()\nRecursionError: too deep\n")
    path.write_bytes(b"x" * (3 * root_cause.SEND_LIMIT))  # not JSON: its beginning
    assert root_cause.collect(str(path)) == b"x" * root_cause.SEND_LIMIT


def test_each_instance_has_a_file_of_its_own_in_the_jobs_folder() -> None:
    assert root_cause.error_file("/tmp/poprun-ab", 3) == "/tmp/poprun-ab/error-3.json"
    assert root_cause.error_file("/tmp/poprun-ab", 30) != root_cause.error_file("/tmp/poprun-ab", 3)


def test_summary_lines_show_the_message_then_the_tracebacks_end() -> None:
    cause = root_cause.describe(json.dumps(RECORDED).encode())
    assert root_cause.summary_lines(3, cause) == [
        "poprun: root cause (instance 3's error file): ValueError: bad batch 7",
        "poprun: its traceback:",
        "    Traceback (most recent call last):",
        '      File "t.py", line 3, in load_batch',
        "        raise ValueError('bad batch 7')",
        "    ValueError: bad batch 7",
    ]


#: A program that records its failure as torch's @record does, in instance 1 only, and exits 3.
RECORDS = f"""
import json, os, sys
if os.environ["RANK"] == "1":
    with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
        json.dump({RECORDED!r}, f)
    sys.exit(3)
"""


@pytest.mark.slow
def test_a_failed_programs_record_is_in_the_summary_and_the_error_file(tmp_path: Path) -> None:
    error_file = tmp_path / "failure.json"
    result = poprun("--num-instances", "2", "--error-file", str(error_file), PYTHON, "-c", RECORDS, env=OMP_SET)
    assert result.returncode == 3, result.stderr
    lines = result.stderr.splitlines()
    at = lines.index("poprun: root cause (instance 1's error file): ValueError: bad batch 7")
    assert lines[at - 1].startswith("poprun: instance 1 on ") and lines[at - 1].endswith(" failed: exit status 3")
    assert lines[at + 1:at + 6] == ["poprun: its traceback:", "    Traceback (most recent call last):",
                                    '      File "t.py", line 3, in load_batch',
                                    "        raise ValueError('bad batch 7')", "    ValueError: bad batch 7"]
    report = json.loads(error_file.read_text())[-1]
    assert report["instance"] == 1 and report["root_cause"] == {
        "message": "ValueError: bad batch 7", "traceback": RECORDED["message"]["extraInfo"]["py_callstack"],
        "timestamp": "1700000000"}


@pytest.mark.slow
def test_a_record_of_a_program_that_exits_0_is_not_a_failure_and_none_is_invented() -> None:
    writes_and_succeeds = ("import os; open(os.environ['TORCHELASTIC_ERROR_FILE'], 'w').write('{}'); "
                           "print(os.path.dirname(os.environ['TORCHELASTIC_ERROR_FILE']))")
    ok = poprun("--num-instances", "2", PYTHON, "-c", writes_and_succeeds, env=OMP_SET)
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr
    job_dirs = {line.split(" ", 1)[1] for line in ok.stdout.splitlines()}
    assert len(job_dirs) == 1 and not any(os.path.exists(d) for d in job_dirs)
    fails = poprun("--num-instances", "2", PYTHON, "-c", "import os, sys; sys.exit(int(os.environ['RANK']))",
                   env=OMP_SET)
    assert fails.returncode == 1 and "root cause" not in fails.stderr, fails.stderr  # no record: no root cause


# ---------------------------------------------------------------- the first failure, not the first exit
def test_a_stubs_clock_is_measured_and_one_that_agrees_within_the_measure_is_taken_as_poprun_s() -> None:
    from poprun_py.supervision.clocks import offset_ns

    # One host: the same clock, 1 ms on the wire each way and 5 ms in the stub: no offset.
    assert offset_ns(sent=1_000_000_000, arrived=1_001_000_000, replied=1_006_000_000, received=1_007_000_000) == 0
    # Asymmetric delays on one clock (0.1 ms there, 9 ms back) still measure no offset.
    assert offset_ns(sent=0, arrived=100_000, replied=200_000, received=9_200_000) == 0
    # A host whose clock is 1 h ahead, 1 ms each way: its offset, to within the measure.
    hour = 3600 * 10**9
    assert offset_ns(sent=0, arrived=hour + 1_000_000, replied=hour + 2_000_000, received=3_000_000) == hour
    # The error is the wire's half of the round trip, not the stub's time: a stub that took 100 ms
    # to answer, on a host 50 ms ahead, 1 ms each way.
    assert offset_ns(sent=0, arrived=51_000_000, replied=151_000_000, received=102_000_000) == 50_000_000
    # An offset exactly the measure's error is within it.
    assert offset_ns(sent=0, arrived=2_000_000, replied=2_000_000, received=2_000_000) == 0


def _recorded(message: str, second: int, traceback: str | None) -> bytes:
    info = {"timestamp": str(second)} if traceback is None else {"py_callstack": traceback, "timestamp": str(second)}
    return json.dumps({"message": {"message": message, "extraInfo": info}}).encode()


SECOND = 10**9
HOUR = 3600 * SECOND


@pytest.mark.parametrize("reports,first", [
    # Instance 0's host is an hour ahead: its error file, written 0.5 s before instance 1's, says
    # an hour later; its clock's offset, measured over its connection, puts it first.
    ([(1, 0, 0, 500_000_000), (0, HOUR, 0, 0)], 0),
    # Both recorded in the same second: when each file was written tells which came first.
    ([(0, 0, 0, 700_000_000), (1, 0, 0, 200_000_000)], 1),
    # Instance 1's file was written again 10 s after the second it records: that second counts.
    ([(0, 0, 0, 200_000_000), (1, 0, -SECOND, 10 * SECOND)], 1),
    # Instance 0's file was written exactly a second after the second it records: that second counts.
    ([(1, 0, 0, 500_000_000), (0, 0, 0, SECOND)], 0),
], ids=["an-hour-ahead", "one-second", "rewritten", "a-second-later"])
def test_the_first_record_in_poprun_s_time_is_the_root_cause(reports: list[tuple[int, int, int, int]],
                                                              first: int) -> None:
    """Two instances on hosts ``a`` and ``b`` report errors they recorded (``reports``: instance,
    its clock's skew, the second torch recorded and when the file was written, both from a whole
    second on poprun's clock 10 s ago, in ns), the first reported first; the root cause is
    ``first``, whatever order they came in."""
    errors: dict[int, tuple[str, str | None]] = {i: (f"ValueError: {i}", f"ValueError: {i}\n") for i in (0, 1)}
    _assert_root_cause(reports, errors, first, [reports[-1][1] != 0, False])


#: A peer's error out of the collectives: its innermost frame in torch.distributed.
IN_COLLECTIVES = ('Traceback (most recent call last):\n  File "train.py", line 20, in main\n    step()\n'
                  '  File "train.py", line 9, in step\n    dist.all_reduce(t)\n'
                  '  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2050, in '
                  'all_reduce\n    work.wait()\nRuntimeError: Connection closed by peer [10.0.0.2]:5678\n')
#: The same words from a connection of the program's own (a data loader's), called from torch.distributed.
IN_OWN_CODE = ('Traceback (most recent call last):\n  File "/venv/lib/python3.11/site-packages/torch/distributed/'
               'elastic/multiprocessing/errors/__init__.py", line 355, in wrapper\n    return f(*args)\n'
               '  File "loader.py", line 4, in load\n    sock.recv(1)\nRuntimeError: Connection closed by peer\n')


@pytest.mark.parametrize("traceback,first", [(IN_COLLECTIVES, 1), (None, 1), (IN_OWN_CODE, 0)],
                         ids=["collectives", "words-alone", "own-code"])
def test_an_error_that_says_a_peer_went_away_counts_a_second_later_when_it_came_from_the_collectives(
        traceback: str | None, first: int) -> None:
    """Instance 0 records "Connection closed by peer" half a second before instance 1 records an
    error of its own: out of the collectives (or without a traceback, by its words alone), 0's is a
    consequence of 1's, which is the root cause; from the program's own code, 0 failed first."""
    errors = {0: ("RuntimeError: Connection closed by peer", traceback), 1: ("ValueError: 1", "ValueError: 1\n")}
    _assert_root_cause([(0, 0, 0, 200_000_000), (1, 0, 0, 700_000_000)], errors, first, [False, False])


def test_a_status_of_its_own_after_poprun_began_to_stop_it_is_never_the_first_failure() -> None:
    """Instance 0 ignored its stub's stop and then exited 3 (a status of its own, after the stop);
    instance 1 failed by itself before that: 1 is the first failure, 0 only also failed."""
    with _two_instances() as (s, call_in, base):
        for index, ended, stopped, status in ((0, 600_000_000, 500_000_000, 3), (1, 700_000_000, 0, 1)):
            stub, seal = call_in(index)
            stub.sendall(b"".join(seal.seal(frame) for frame in (
                protocol.clock(time.time_ns(), time.time_ns()),
                protocol.times(base + ended, base + stopped if stopped else 0, 0),
                protocol.exit_report(status, None, None))))
            wait_until(lambda i=index: _read(s, i), "its exit report")  # type: ignore[misc]
        record = s._report().failure_report()
        assert record is not None
        assert [(f["instance"], f["status"]) for f in record["failures"]] == [(1, 1), (0, 3)]  # type: ignore[attr-defined]


@contextmanager
def _two_instances() -> Iterator[tuple[Supervisor, Callable[[int], tuple[socket.socket, InstanceSeal]], int]]:
    """A supervisor of instances 0 and 1 on hosts ``a`` and ``b``; how an instance calls in (its
    host supervisor's end, once its nonce has arrived, and its seal); a whole second ten seconds
    ago (ns). Every connection is closed at the end."""
    import io

    from tests.launcher.supervising import call_in_sealed, supervisor

    s = supervisor(io.BytesIO(), io.BytesIO(), hosts=("a", "b"))
    ends: list[socket.socket] = []
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)

        def call_in(index: int) -> tuple[socket.socket, InstanceSeal]:
            end, seal = call_in_sealed(s, server, index)
            ends.append(end)
            return end, seal

        try:
            yield s, call_in, (time.time_ns() // SECOND - 10) * SECOND
        finally:
            for sock in (*ends, *(link.conn for link in s.host_links.values())):
                sock.close()


def _assert_root_cause(reports: list[tuple[int, int, int, int]], errors: dict[int, tuple[str, str | None]],
                       first: int, skewed: list[bool]) -> None:
    """Instances 0 and 1 on hosts ``a`` and ``b`` report ``errors`` (message, traceback) as
    ``reports`` say (see above); the root cause is ``first``, and the clocks of ``skewed`` are
    measured as ahead or behind."""
    with _two_instances() as (s, call_in, base):
        for index, skew, second, written in reports:
            stub, seal = call_in(index)
            message, traceback = errors[index]
            stub.sendall(b"".join(seal.seal(frame) for frame in (
                protocol.clock(time.time_ns() + skew, time.time_ns() + skew),
                protocol.frame(protocol.ROOT_CAUSE, _recorded(message, (base + skew + second) // SECOND,
                                                              traceback)),
                protocol.times(base + skew + written + SECOND, 0, base + skew + written),
                protocol.exit_report(1, None, None))))
            wait_until(lambda i=index: _read(s, i), "its exit report")  # type: ignore[misc]
        assert [state.clock_offset != 0 for state in s.instances] == skewed
        assert s.failure is not None and s.failure.index == reports[0][0]  # the first report
        report = s._report()
        assert report.summary(None).splitlines()[:2] == [
            f"poprun: instance {first} on {'ab'[first]} failed: exit status 1",
            f"poprun: root cause (instance {first}'s error file): {errors[first][0]}"]
        record = report.failure_report()
        assert record is not None and record["instance"] == first
        assert [{key: f[key] for key in ("instance", "host", "status", "signal", "error")}
                for f in record["failures"]] == [  # type: ignore[attr-defined]
            {"instance": i, "host": "ab"[i], "status": 1, "signal": None, "error": errors[i][0]}
            for i in (first, 1 - first)]
        # ISO 8601 in UTC, in the order they failed: the root cause's no later than the other's
        times = [f["time"] for f in record["failures"]]  # type: ignore[attr-defined]
        assert times == sorted(times) and all(t.endswith("+00:00") for t in times), times


def _read(s: Supervisor, index: int) -> bool:
    """Whether instance ``index``'s exit report is in, once what it sent so far has been read."""
    from tests.launcher.supervising import read

    read(s, index)
    return s.instances[index].finished


#: Where the tests below mark what their instances did (tests/scripts/fail_apart.py).
FAIL_APART = str(Path(__file__).resolve().parent.parent / "scripts" / "fail_apart.py")


def _fail_apart(tmp_path: Path, first: int, second: int, gap: float, mode: str) -> tuple[
        subprocess.CompletedProcess[str], list[str], dict[str, Any]]:
    error_file = tmp_path / "failure.json"
    markers = tmp_path / "markers"
    markers.mkdir()
    result = poprun("--num-instances", "3", "--error-file", str(error_file), PYTHON, FAIL_APART, str(markers),
                    str(first), str(second), str(gap), mode, env=OMP_SET)
    lines = [line for line in result.stderr.splitlines() if line.startswith("poprun: ")]
    return result, lines, json.loads(error_file.read_text())[-1]


@pytest.mark.slow
@pytest.mark.parametrize("first,second", [(1, 2), (2, 1)])
def test_of_two_real_failures_a_second_apart_the_earlier_is_the_root_cause(tmp_path: Path, first: int,
                                                                          second: int) -> None:
    """``first`` records its error and lingers; a second later ``second`` records its own and exits
    first. poprun then stops ``first``, whose record still came first: it is the root cause."""
    result, lines, written = _fail_apart(tmp_path, first, second, 1.0, "record")
    assert result.returncode == 3, result.stderr  # the root cause was stopped: the first failure seen gives it
    host = socket.gethostname()
    assert re.fullmatch(rf"poprun: instance {first} on {host} failed: recorded its error at \d\d:\d\d:\d\d\.\d{{3}}, "
                        r"then ended as poprun stopped it: killed by SIGTERM \(status 143\)", lines[0]), result.stderr
    assert lines[1] == f"poprun: root cause (instance {first}'s error file): ValueError: first failure"
    also = f"poprun: instance {second} on {host} also failed: exit status 3; its error: RuntimeError: second failure"
    assert lines[-2:] == [also, "poprun: stopped instance(s) 0 (1 of 3)"], result.stderr
    assert (written["instance"], written["status"], written["signal"]) == (first, 3, "SIGTERM")
    assert written["root_cause"]["message"] == "ValueError: first failure"
    failures = written["failures"]
    assert [(f["instance"], f["status"], f["error"]) for f in failures] == [
        (first, 143, "ValueError: first failure"), (second, 3, "RuntimeError: second failure")]
    apart = (datetime.fromisoformat(failures[1]["time"]) - datetime.fromisoformat(failures[0]["time"])).total_seconds()
    assert 1.0 <= apart < 5, failures
    assert written["time"] == failures[0]["time"] and written["stopped"] == [0]


@pytest.mark.slow
def test_a_failure_recorded_first_comes_before_a_later_one_without_an_error_file(tmp_path: Path) -> None:
    result, lines, written = _fail_apart(tmp_path, 1, 2, 1.0, "no-record")
    assert result.returncode == 3, result.stderr
    assert lines[1] == "poprun: root cause (instance 1's error file): ValueError: first failure", result.stderr
    assert lines[-2:] == [f"poprun: instance 2 on {socket.gethostname()} also failed: exit status 3",
                          "poprun: stopped instance(s) 0 (1 of 3)"], result.stderr
    assert [(f["instance"], f["error"]) for f in written["failures"]] == [(1, "ValueError: first failure"), (2, None)]


@pytest.mark.slow
def test_a_failure_without_an_error_file_that_ended_first_comes_before_a_later_recorded_one(tmp_path: Path) -> None:
    """Instance 1 exits 4 with no error file, and its exit report comes a second late (a child of
    its holds its output open); instance 2 records its error after instance 1 has ended, and its
    report comes first. Instance 1 ended first: it is the root cause, and poprun exits with its status."""
    result, lines, written = _fail_apart(tmp_path, 1, 2, 0.3, "end")
    assert result.returncode == 4, result.stderr
    host = socket.gethostname()
    assert lines[0] == f"poprun: instance 1 on {host} failed: exit status 4", result.stderr
    assert f"poprun: instance 2 on {host} also failed: exit status 3; its error: RuntimeError: second failure" \
        in lines, result.stderr
    assert (written["instance"], written["status"], written["root_cause"]) == (1, 4, None)
    assert [(f["instance"], f["error"]) for f in written["failures"]] == [(1, None),
                                                                          (2, "RuntimeError: second failure")]


@pytest.mark.slow  # starts unshare
def test_the_error_files_folder_honours_tmpdir_when_tmp_is_read_only(tmp_path: Path) -> None:
    """/tmp read-only (a bind of itself, remounted so, in a mount namespace of the job's own) and
    TMPDIR a writable folder: the job's folder of error files goes there, as tempfile.gettempdir
    would choose, with no warning at any of its two starts; what the failing program records comes
    back; the folder is removed at the end."""
    if os.geteuid() != 0 or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs root and a mount namespace (unshare -m) to make /tmp read-only")
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    record = json.dumps(RECORDED)
    program = ("import os, sys; path = os.environ['TORCHELASTIC_ERROR_FILE']; print(path); "
               f"open(path, 'w').write({record!r}); sys.exit(3)")
    script = ('mount --bind /tmp /tmp && mount -o remount,bind,ro /tmp && mount -t tmpfs tmpfs "$TMPDIR" && '
              '"$@"; status=$?; echo "left: $(ls -A "$TMPDIR")"; exit $status')
    result = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", PYTHON, "-m", "poprun_py", "--max-restarts", "1",
         "--restart-backoff", "0", PYTHON, "-c", program],
        capture_output=True, text=True, timeout=60, env={**os.environ, **OMP_SET, "TMPDIR": str(tmpdir)})
    assert result.returncode == 3, result.stderr
    paths = [line.removeprefix("[0] ") for line in result.stdout.splitlines() if line.startswith("[0] ")]
    assert len(paths) == 2 and all(p.startswith(f"{tmpdir}/poprun-") for p in paths), result.stdout
    assert "warning" not in result.stderr and "Read-only" not in result.stderr, result.stderr
    assert "poprun: root cause (instance 0's error file): ValueError: bad batch 7" in result.stderr, result.stderr
    assert result.stdout.splitlines()[-1] == "left: ", result.stdout
