"""How poprun reports failures that involve several instances: each its own status, and the
instance that left early named instead of the one mpiexec then killed."""

from __future__ import annotations

import re

import pytest

from tests.helpers import PYTHON, ROOT, poprun

pytestmark = pytest.mark.slow
SCRIPTS = ROOT / "tests" / "scripts"


def test_instances_failing_together_each_report_their_own_status(tmp_path) -> None:
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


def test_an_instance_that_leaves_early_is_named_not_the_one_left_waiting() -> None:
    result = poprun("--num-instances", "2", PYTHON, str(SCRIPTS / "leave_early.py"), timeout=90)
    assert result.returncode != 0
    assert re.search(r"^poprun: instance\(s\) 0 on \S+ left early: exited with status 0 while instance\(s\) 1 "
                     r"still ran, .* without MPI_Finalize", result.stderr, re.MULTILINE), result.stderr
    assert "instance 1 on" not in result.stderr.splitlines()[0]
