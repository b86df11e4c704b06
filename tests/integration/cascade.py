"""What the tests of a real torch cascade check (tests/scripts/cascade.py): on one host
(test_torch_ddp.py) and across hosts (test_multihost.py), the rank that raised is the root cause."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from tests.helpers import ROOT

#: The job whose one failure takes the others down before it has left itself.
CASCADE = str(ROOT / "tests" / "scripts" / "cascade.py")


def _peer_lost(error: str) -> bool:
    """A failure on a connection its peer closed (gloo's words)."""
    from poprun_py.supervision.first_failure import PEER_LOST

    return any(words in error.lower() for words in PEER_LOST)


def check_cascade(result: subprocess.CompletedProcess[str], error_file: Path, instances: int, failed: int,
                  hosts: list[str], error: str = "ValueError: bad batch 7") -> None:
    """The rank that raised (``failed``, its ``error``) is the root cause, though the others, whose
    connections it closed, recorded their errors and exited before it: in the summary, first, with
    its traceback, then each other one on a line of its own; and in --error-file, whose failures'
    times run in their order."""
    assert result.returncode == 1, result.stderr  # the failure that poprun saw first: status 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("poprun: ")]
    host = hosts[failed]
    # Its own end (exit status 1), or poprun's stop as it lingered on its way out (the stop may also
    # come as it leaves by itself).
    assert re.fullmatch(rf"poprun: instance {failed} on {host} failed: (exit status 1|recorded its error at "
                        r"[0-9:.]+, then ended as poprun stopped it: (killed by SIGTERM \(status 143\)|exit status 1))",
                        lines[0]), result.stderr
    assert lines[1:3] == [f"poprun: root cause (instance {failed}'s error file): {error}",
                          "poprun: its traceback:"], result.stderr
    assert f"    {error}" in result.stderr.splitlines()
    # Each other rank failed on a closed connection, or (on a busy machine, before it had recorded
    # that) was stopped by poprun.
    for line in lines[3:]:
        if " also failed: " in line:
            rank = int(line.split()[2])
            assert rank != failed and line.startswith(f"poprun: instance {rank} on {hosts[rank]} also failed: "), \
                result.stderr
            assert "; its error: RuntimeError: " in line and _peer_lost(line), result.stderr
    written = json.loads(error_file.read_text())[-1]
    assert (written["instance"], written["host"], written["status"]) == (failed, host, 1), (written, result.stderr)
    assert written["root_cause"]["message"] == error
    assert ", in load_batch\n" in written["root_cause"]["traceback"]
    first, *others = written["failures"]
    assert (first["instance"], first["error"]) == (failed, error), written
    times = [failure["time"] for failure in written["failures"]]  # ISO 8601, all UTC: they sort as text
    assert times == sorted(times) and written["time"] == times[0], written
    assert all(_peer_lost(other["error"] or "") for other in others), (written, result.stderr)
    assert sorted([f["instance"] for f in written["failures"]] + written["stopped"]) == list(range(instances)), \
        (written, result.stderr)
