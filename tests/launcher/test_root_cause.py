"""torchrun's error files: the shim prepares, sends back (bounded) and removes each instance's
TORCHELASTIC_ERROR_FILE; poprun shows what a failed program recorded there. Without torch: the
programs here write what torch's ``@record`` writes (tests/integration/test_torch_ddp.py uses torch itself)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from poprun_py import root_cause
from tests.helpers import OMP_SET, PYTHON, poprun

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


def test_prepare_and_remove(tmp_path: Path) -> None:
    job = tmp_path / "poprun-abc"
    mine, other = str(job / "0" / "error.json"), str(job / "1" / "error.json")
    assert root_cause.prepare(mine) is None and root_cause.prepare(other) is None
    assert (job / "0").stat().st_mode & 0o777 == 0o700
    Path(mine).write_text("stale")  # left by an earlier start of the job
    assert root_cause.prepare(mine) is None and not Path(mine).exists()
    Path(mine).write_text("{}")
    root_cause.remove(mine)
    assert not (job / "0").exists() and job.exists()  # instance 1's is still there
    root_cause.remove(other)
    assert not job.exists()
    job.mkdir(mode=0o755)  # someone else's, or open to others: not used
    assert root_cause.prepare(mine) == f"{job} is not a private directory of this user"


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
                           "print(os.path.dirname(os.path.dirname(os.environ['TORCHELASTIC_ERROR_FILE'])))")
    ok = poprun("--num-instances", "2", PYTHON, "-c", writes_and_succeeds, env=OMP_SET)
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr
    job_dirs = {line.split(" ", 1)[1] for line in ok.stdout.splitlines()}
    assert len(job_dirs) == 1 and not any(os.path.exists(d) for d in job_dirs)
    fails = poprun("--num-instances", "2", PYTHON, "-c", "import os, sys; sys.exit(int(os.environ['RANK']))",
                   env=OMP_SET)
    assert fails.returncode == 1 and "root cause" not in fails.stderr, fails.stderr  # no record: no root cause


@pytest.mark.slow
def test_a_shim_where_the_jobs_directory_does_not_exist_makes_it_and_sends_the_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a remote host: nothing of the job's directory exists there; the shim makes it, sends the
    failed program's record before its exit report, and removes it again."""
    from poprun_py import protocol
    from tests.launcher.shim import run_shim

    job = tmp_path / "poprun-remote"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(job / "5" / "error.json"))
    monkeypatch.setenv("RANK", "1")
    result, frames = run_shim(PYTHON, "-c", RECORDS)
    assert result.returncode == 3, result.stderr
    assert [kind for kind, _, _ in frames if kind != protocol.OUTPUT] == \
        [protocol.HELLO, protocol.ROOT_CAUSE, protocol.EXIT]
    assert json.loads(frames[-2][2]) == RECORDED
    assert not job.exists()
