"""Horovod's ``test/parallel/test_torch.py`` under ``poprun --horovod``: every instance runs pytest over
it, as horovodrun runs it, and each test's outcome is read from what the instances wrote.

Each instance writes a junit file and a verbose log of its own. The junit file is the record; the
log stands in where an instance wrote none (pytest-timeout's thread method ends the process at a
hung test, poprun stops the others when one fails, the job's timeout stops all): there every test
the instance ended has its outcome, the one it was in when it stopped is hung (or failed, where it
ended with no timeout), and tests it never reached are not run. Counts are instance 0's; a test
whose outcome differs between instances is listed with each instance's.
"""

from __future__ import annotations

import re
import shlex
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from bench import horovod_jobs
from bench.horovod_source import SUITE

#: What pytest-timeout reads: each test's bound, and its thread method (a hung MPI call never returns
#: to Python, so the signal method would not interrupt it).
TEST_TIMEOUT_S = 120
PYTEST_OPTIONS = ("-v", "--color=no", "--timeout", str(TEST_TIMEOUT_S), "-o", "timeout_method=thread",
                  "-p", "no:cacheprovider")
OUTCOMES = ("passed", "failed", "skipped", "hung", "not_run")
VERBOSE = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "failed", "SKIPPED": "skipped",
           "XFAIL": "skipped"}
_LINE = re.compile(r"^\S+\.py::(\S+)(?: (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b)?", re.M)
_TIMEOUT = "+ Timeout +"
_FRAME = re.compile(r'^  File "([^"]+)", line (\d+), in (\S+)', re.M)

Result = tuple[dict[str, str], dict[str, str]]


def command(instances: int, out: Path) -> list[str]:
    """Each instance: pytest over SUITE, unbuffered, its junit file and log in ``out`` named by its MPI rank."""
    each = shlex.quote(str(out)) + "/rank-$PMI_RANK"
    pytest = " ".join(["exec", shlex.quote(sys.executable), "-u", "-m", "pytest", *PYTEST_OPTIONS, SUITE,
                       f"--junitxml={each}.xml", f">{each}.log", "2>&1"])
    return horovod_jobs.poprun(instances, "sh", "-c", pytest)


def _first_line(text: str | None) -> str:
    return next((line.strip() for line in (text or "").splitlines() if line.strip()), "")


def read_junit(path: Path) -> Result:
    """Each test's outcome in a junit file, and the first line of each reason a test did not pass."""
    outcomes: dict[str, str] = {}
    reasons: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                message = _first_line(child.get("message")) or _first_line(child.text)
                if child.tag == "skipped":
                    outcome = "skipped"
                elif message.startswith("Failed: Timeout"):
                    outcome = "hung"
                else:
                    outcome = "failed"
                    message = message if child.tag == "failure" else f"error in setup or teardown: {message}"
                reasons[name] = message
        outcomes[name] = outcome
    return outcomes, reasons


def read_log(path: Path, timed_out: bool) -> Result:
    """Each test's outcome in an instance's verbose log (where it wrote no junit file): the test it
    was in when it ended is hung where its timeout or the job's struck, else failed."""
    text = path.read_text(errors="replace") if path.exists() else ""
    outcomes: dict[str, str] = {}
    reasons: dict[str, str] = {}
    unfinished = None
    for match in _LINE.finditer(text):
        name, verdict = match.group(1), match.group(2)
        if verdict:
            outcomes[name] = VERBOSE[verdict]
            if outcomes[name] == "failed":
                reasons[name] = "not recorded: the instance wrote no junit file"
            unfinished = None
        else:
            unfinished = name
    if unfinished is not None:
        if _TIMEOUT in text:
            outcomes[unfinished] = "hung"
            reasons[unfinished] = f"no end within pytest-timeout's {TEST_TIMEOUT_S} s{_stuck_at(text)}"
        elif timed_out:
            outcomes[unfinished], reasons[unfinished] = "hung", "still running when the job's timeout struck"
        else:
            last = _first_line("\n".join(reversed(text.splitlines())))
            outcomes[unfinished], reasons[unfinished] = "failed", f"the instance ended during it: {last}"
    return outcomes, reasons


def _stuck_at(text: str) -> str:
    """Where pytest-timeout's stack dump shows the main thread: its innermost frame, else ""."""
    _, _, dump = text.partition(_TIMEOUT)
    _, found, stack = dump.partition("Stack of MainThread")
    frames = _FRAME.findall(stack.split("~~~~~~~~~~ Stack of", 1)[0].split(_TIMEOUT, 1)[0]) if found else []
    if not frames:
        return ""
    path, line, function = frames[-1]
    return f"; the main thread in {function} ({path.replace(f'{horovod_jobs.REPO}/', '')}:{line})"


def _rank(out: Path, rank: int, timed_out: bool) -> tuple[Result, str]:
    junit = out / f"rank-{rank}.xml"
    if junit.exists():
        try:
            return read_junit(junit), "junit"
        except ET.ParseError:
            pass
    return read_log(out / f"rank-{rank}.log", timed_out), "log"


def collate(out: Path, instances: int, timed_out: bool) -> dict[str, Any]:
    """Instance 0's outcomes and reasons, its counts, and the tests whose outcome differs between instances."""
    ranks = [_rank(out, rank, timed_out) for rank in range(instances)]
    (outcomes, reasons), _ = ranks[0]
    every = sorted({name for (result, _), _ in ranks for name in result})
    outcomes = {name: outcomes.get(name, "not_run") for name in every}
    counts = {outcome: sum(1 for o in outcomes.values() if o == outcome) for outcome in OUTCOMES}
    differs = {}
    for name in every:
        seen = {str(rank): result[0].get(name, "not_run") for rank, (result, _) in enumerate(ranks)}
        if len(set(seen.values())) > 1:
            differs[name] = seen
    found = re.search(r"collected (\d+) items?", (out / "rank-0.log").read_text(errors="replace")
                      if (out / "rank-0.log").exists() else "")
    collected = int(found.group(1)) if found else None
    # tests no instance reached are not named anywhere, but counted
    counts["not_run"] += max(0, (collected or 0) - len(every))
    return {"read_from": [how for _, how in ranks], "collected": collected, "counts": counts, "outcomes": outcomes,
            "reasons": {name: reasons[name] for name in every if name in reasons}, "differs": differs}


def run(instances: int, folder: Path, work: Path, timeout_s: float) -> dict[str, Any]:
    """Run the suite at ``instances`` instances in ``folder`` (Horovod's files); what it found."""
    out = work / f"tests-{instances}"
    out.mkdir()
    argv = command(instances, out)
    ended = horovod_jobs.run(argv, folder, work / f"tests-{instances}.log", timeout_s)
    return {"command": horovod_jobs.shown(argv, work), "exit_status": ended.status,
            "timed_out": ended.status is None, "wall_s": ended.wall_s,
            **collate(out, instances, ended.status is None)}
