"""Other programs' words in poprun's own lines (a launcher agent's, a failed program's recorded error
and stderr, a discovery script's) come with their control characters escaped as ``repr`` writes
them: an ESC, BEL or NUL there would work on the terminal (clear it, retitle it) or cut the line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers import OMP_SET, OPENMPI_MPIEXEC, PYTHON, poprun

pytestmark = pytest.mark.slow  # every test starts poprun

#: Words with what a terminal acts on: a title, a screen clear, a colour, a NUL, a carriage return.
SAID = "\x1b]0;pwned\x07\x1b[2J down\x00 \r\x1b[31mred"
SHOWN = "\\x1b]0;pwned\\x07\\x1b[2J down\\x00 \\r\\x1b[31mred"
#: SAID as printf's format writes it (a NUL cannot be in a script's text).
PRINTF = SAID.replace("\x00", "\\000")
#: A character that is not printable, other than the newline.
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")


def _script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_what_an_agent_said_is_quoted_escaped(tmp_path: Path, mpi: str) -> None:
    """RFC 6761's .invalid never resolves (poprun asks the machine's resolver once); the agent never
    reaches it, and says so with control characters in its line."""
    agent = _script(tmp_path, "agent", f"printf '%s: {PRINTF}\\n' \"$1\" >&2\nexit 255\n")
    args = ["--mpi", str(OPENMPI_MPIEXEC)] if mpi == "openmpi" else []
    result = poprun(*args, "--launcher-agent", agent, "-H", "ghost.invalid", "/bin/true", env=OMP_SET)
    assert (result.returncode, result.stderr) == (255, (
        f"poprun: error: instance(s) 0 could not be started: host ghost.invalid: agent: ghost.invalid: {SHOWN}\n"))


#: Both instances record an error (torch's @record layout) and write to stderr, with control
#: characters: instance 0 first, then it waits to be stopped; instance 1 once instance 0's record is
#: there (its error file's sibling), then it exits 3. Instance 0's is dated a day later, so instance 1
#: is the root cause, and instance 0 failed too, with its error.
RECORDS = f"""
import json, os, signal, sys, time
rank, said, path = os.environ["RANK"], {SAID!r}, os.environ["TORCHELASTIC_ERROR_FILE"]
record = {{"message": {{"message": f"ValueError: {{rank}} {{said}}", "extraInfo": {{
    "py_callstack": f"Traceback (most recent call last):\\nValueError: {{said}}\\n",
    "timestamp": str(int(time.time()) + (86400 if rank == "0" else 0))}}}}}}
print(said, file=sys.stderr, flush=True)
if rank == "1":
    while not os.path.exists(os.path.join(os.path.dirname(path), "error-0.json")):
        time.sleep(0.01)
with open(path + ".new", "w") as f:
    json.dump(record, f)
os.rename(path + ".new", path)
if rank == "0":
    signal.pause()
sys.exit(3)
"""


def test_a_programs_recorded_error_and_stderr_are_quoted_escaped_in_the_summary(tmp_path: Path) -> None:
    error_file = tmp_path / "failure.json"
    result = poprun("--num-instances", "2", "--error-file", str(error_file), PYTHON, "-c", RECORDS, env=OMP_SET)
    assert result.returncode == 3, result.stderr
    lines = result.stderr.splitlines()
    start = next(at for at, line in enumerate(lines) if line.startswith("poprun: instance 1 on "))
    summary = lines[start:]
    assert [line for line in summary if CONTROL.search(line)] == [], summary
    assert summary[1:5] == [f"poprun: root cause (instance 1's error file): ValueError: 1 {SHOWN}",
                            "poprun: its traceback:", "    Traceback (most recent call last):",
                            f"    ValueError: {SHOWN}"], summary
    # The last lines of its stderr, a line as a terminal would show it (after its last carriage return).
    assert "    \\x1b[31mred" in summary, summary
    also = [line for line in summary if line.startswith("poprun: instance 0 on ")]
    assert len(also) == 1 and also[0].endswith(f"; its error: ValueError: 0 {SHOWN}"), summary
    # The program's own output is its own, passed on as it came; the record keeps it too.
    assert f"[1] {SAID.partition(chr(13))[0]}" in "\n".join(lines[:start])
    assert json.loads(error_file.read_text())[-1]["root_cause"]["message"] == f"ValueError: 1 {SAID}"


def test_what_a_failing_discovery_script_said_is_quoted_escaped(tmp_path: Path) -> None:
    script = _script(tmp_path, "discover", f"printf '{PRINTF}\\n' >&2\nexit 3\n")
    result = poprun("--host-discovery-script", script, "--num-instances", "2", "--dry-run", "/bin/true")
    assert (result.returncode, result.stderr) == (2, (
        f"poprun: error: --host-discovery-script {script} exited with status 3 ({SHOWN})\n"))
