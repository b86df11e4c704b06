"""The fast tier starts no process: a test not marked ``slow`` that starts one fails, naming what.

``make test-fast`` runs ``-m "not slow"`` as the tier to run after every edit; a process (poprun,
mpiexec, a Python child, a fork) costs a tenth of a second to seconds each, and a hundred of them
had made the tier twice its figure. Rather than trust each test's author to mark it, every test
outside the ``slow`` mark runs watched, in every run (``make test`` too): starting a process through
Python (``subprocess``, ``os.fork``/``forkpty``/``posix_spawn``/``system``/``exec*``/``spawn*``,
``multiprocessing``, ``pty``) raises in the test and fails it, even where the test catches the
error. Mark such a test ``slow``. A library's C code that forks on its own is not seen.

Registered by tests/conftest.py (not under mpiexec's ranks or mutmut); ``-p tests.process_guard``
registers it in any other run.
"""

from __future__ import annotations

import _posixsubprocess
import sys
from collections.abc import Callable, Generator
from typing import Any

import pytest

#: The audit events (docs of the ``sys`` module's audit table) that start a process.
EVENTS = frozenset({"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.system",
                    "os.exec", "os.spawn"})
#: What each watched test started, while it runs; None while a ``slow`` test (or no test) runs.
_watched: list[str] | None = None
REFUSED = "started a process without being marked slow (the fast tier starts none: tests/process_guard.py)"
_STARTED = pytest.StashKey[list[str]]()
_installed = False


def _refuse(what: str) -> None:
    if _watched is not None:
        _watched.append(what)
        pytest.fail(f"{REFUSED}: {what}")


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _watched is not None and event in EVENTS:
        _refuse(f"{event} {args[:2]!r}"[:300])


def _guarded(fork_exec: Callable[..., int]) -> Callable[..., int]:
    """multiprocessing's spawn and forkserver start their children through ``fork_exec`` directly,
    which raises no audit event."""

    def fork_exec_unless_watched(*args: Any) -> int:
        _refuse(f"_posixsubprocess.fork_exec {args[0]!r}"[:300])
        return fork_exec(*args)

    return fork_exec_unless_watched


def _install() -> None:
    """Once per process: an audit hook cannot be removed, so it reads the module's state."""
    global _installed
    if not _installed:
        sys.addaudithook(_audit)
        _posixsubprocess.fork_exec = _guarded(_posixsubprocess.fork_exec)
        _installed = True


def pytest_configure(config: pytest.Config) -> None:
    _install()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    """From the first fixture's setup to the last one's teardown: a module fixture that starts a
    process makes its first and last tests start one."""
    global _watched
    outer, _watched = _watched, None
    if item.get_closest_marker("slow") is None:
        _watched = item.stash[_STARTED] = []
    try:
        return (yield)
    finally:
        _watched = outer


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A test that caught the failure raised where it started a process fails all the same (once:
    a phase that failed already has said so)."""
    report = yield
    started = item.stash.get(_STARTED, None)
    if started:
        if report.passed:
            report.outcome = "failed"
            report.longrepr = f"{REFUSED}: {started[0]}"
        started.clear()
    return report
