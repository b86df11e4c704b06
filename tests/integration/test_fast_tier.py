"""The fast tier (``make test-fast``: every test not marked slow, with ``--fast-tier``) starts no
process: a test that starts one without the mark fails, however it starts it and even where it
catches the failure (tests/process_guard.py). Its shortcuts (tests/conftest.py): one executor for
the engine's tests, fewer examples for hypothesis's. Each case runs in a pytest of its own, in
this process."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import conftest, process_guard

pytest_plugins = ["pytester"]

#: How a test may start a process (each would touch its file in the child: the file tells whether
#: one started).
STARTS = {
    "popen": "subprocess.run(['touch', str(made)], check=True)",
    "swallowed": "try:\n        subprocess.run(['touch', str(made)])\n    except BaseException:\n        pass",
    "system": "os.system(f'touch {made}')",
    "fork": ("pid = os.fork()\n    if pid == 0:\n        made.touch()\n        os._exit(0)\n"
             "    os.waitpid(pid, 0)"),
    "spawn": ("process = multiprocessing.get_context('spawn').Process(target=made.touch)\n"
              "    process.start()\n    process.join()"),
    "posix_spawn": "os.waitpid(os.posix_spawnp('touch', ['touch', str(made)], dict(os.environ)), 0)",
}


def _inner(pytester: pytest.Pytester, folder: Path, starts: dict[str, str], *,
           mark: str = "") -> dict[str, pytest.TestReport]:
    """A pytest run, in this process, of one test per way in ``starts``, and of a test whose module
    fixture starts a process: each marked ``mark``. Each test's first report that did not pass,
    else its call's."""
    pytester.makeini("[pytest]\nmarkers =\n    slow: starts processes\n")
    tests = "".join(f"\n\n{mark}\ndef test_{how}():\n    made = FOLDER / {how!r}\n    {body}\n"
                    for how, body in starts.items())
    pytester.makepyfile(test_inner=f"""
import multiprocessing, os, pathlib, subprocess
import pytest

FOLDER = pathlib.Path({str(folder)!r})

@pytest.fixture(scope="module")
def server():
    subprocess.run(["touch", str(FOLDER / "fixture")])

{mark}
def test_fixture(server):
    pass
{tests}""")
    recorded = pytester.inline_run("-p", "tests.process_guard", "-p", "no:cacheprovider",
                                   "-W", "ignore::pytest.PytestAssertRewriteWarning")
    reports: dict[str, pytest.TestReport] = {}
    for report in recorded.getreports("pytest_runtest_logreport"):
        name = report.nodeid.split("::")[-1].removeprefix("test_")
        if report.when == "call" or not report.passed:
            reports.setdefault(name, report)
    return reports


def test_the_suite_runs_every_test_watched(request: pytest.FixtureRequest) -> None:
    """tests/conftest.py registers the guard (not under mpiexec's ranks or mutmut)."""
    assert request.config.pluginmanager.is_registered(process_guard)


def test_a_test_not_marked_slow_that_starts_a_process_fails_and_starts_none(pytester: pytest.Pytester,
                                                                           tmp_path: Path) -> None:
    reports = _inner(pytester, tmp_path, STARTS)
    assert sorted(reports) == sorted([*STARTS, "fixture"])
    for how, report in reports.items():
        assert report.failed and f"{process_guard.REFUSED}: " in report.longreprtext, (how, report.longreprtext)
    assert reports["fixture"].when == "setup"
    assert list(tmp_path.iterdir()) == []  # each refused before its process started


@pytest.mark.slow  # its inner tests start processes, as slow tests may
def test_a_test_marked_slow_may_start_processes(pytester: pytest.Pytester, tmp_path: Path) -> None:
    """(Not through multiprocessing here: its resource tracker would stay until the session ends.)"""
    starts = {how: STARTS[how] for how in ("popen", "fork", "posix_spawn")}
    reports = _inner(pytester, tmp_path, starts, mark="@pytest.mark.slow")
    assert [how for how, report in reports.items() if not report.passed] == []
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([*starts, "fixture"])


def _tier(pytester: pytest.Pytester, tmp_path: Path, *options: str) -> dict[str, pytest.TestReport]:
    """An engine test and a hypothesis test asking for 100 examples (each writes a line to a file
    of tmp_path), run with the suite's conftest and ``options``: their call reports."""
    pytester.makepyfile(test_inner=f"""
import pathlib
import pytest
from hypothesis import given, settings, strategies as st

RAN = pathlib.Path({str(tmp_path)!r})

@pytest.mark.engine
def test_engine(executor):
    with open(RAN / "executors", "a") as ran:
        ran.write(executor + "\\n")

@settings(max_examples=100, database=None)
@given(st.integers())
def test_examples(n):
    with open(RAN / "examples", "a") as ran:
        ran.write(f"{{n}}\\n")
""")
    recorded = pytester.inline_run("-p", "tests.conftest", "-p", "no:cacheprovider", *options,
                                   "-W", "ignore::pytest.PytestAssertRewriteWarning")
    return {report.nodeid.split("::")[-1]: report for report in recorded.getreports("pytest_runtest_logreport")
            if report.when == "call"}


@pytest.mark.parametrize(("options", "executors", "examples"), [
    ((), ["threads", "cooperative"], 100),
    (("--fast-tier",), ["cooperative"], conftest.MIN_EXAMPLES * 2),
], ids=["full", "fast"])
def test_the_fast_tier_runs_engine_tests_under_one_executor_and_hypothesis_tests_with_a_fifth_of_their_examples(
        pytester: pytest.Pytester, tmp_path: Path, options: tuple[str, ...], executors: list[str],
        examples: int) -> None:
    reports = _tier(pytester, tmp_path, *options)
    assert all(report.passed for report in reports.values()), reports
    assert (tmp_path / "executors").read_text().split() == executors
    assert len((tmp_path / "examples").read_text().split()) == examples
