"""Suite-wide reporting (tests that could not run here say so in one loud line at the end) and
the engine tests' executor fixture."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from poprun_py.environment import ENGINE_EXECUTOR, LOCAL_WORLD_SIZE

#: Skip reasons that start with this are not quiet: the summary repeats them in red.
LOUD = "MULTI-HOST TESTS NOT RUN"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    reasons = set()
    for report in terminalreporter.stats.get("skipped", []):
        text = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if LOUD in text:
            reasons.add(text[text.index(LOUD):])
    for reason in sorted(reasons):
        terminalreporter.write_line(f"!!! {reason} !!!", red=True, bold=True)


# -- the engine's two executors ---------------------------------------------------------------------
#: Every test of a ``test_engine_*`` module runs under both executors of popdist_py.engine (chosen
#: through the environment; an explicit ``Runtime(executor=...)`` in a test still wins), unless the
#: module or test is marked ``one_executor``. Tests read the current one from the ``executor`` fixture.
ENGINE_EXECUTORS = ("threads", "cooperative")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "one_executor: an engine test that does not depend on the executor (runs once)")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    module = metafunc.module.__name__.rpartition(".")[2]
    if module.startswith("test_engine_") and metafunc.definition.get_closest_marker("one_executor") is None:
        metafunc.parametrize("executor", ENGINE_EXECUTORS, indirect=True, scope="module")


@pytest.fixture(scope="module", autouse=True)
def executor(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """The engine executor of the current ``test_engine_*`` test (module-scoped: tests are grouped
    by executor, and hypothesis may use it); None elsewhere."""
    name = getattr(request, "param", None)
    if name is None:
        yield None
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENGINE_EXECUTOR, name)
        mp.delenv(LOCAL_WORLD_SIZE, raising=False)
        yield name


@pytest.fixture(scope="session", autouse=True)
def no_start_files_left() -> Iterator[None]:
    """tests/scripts/behave.py's folders of start files, of jobs whose instances were all stopped
    before one of them could remove it: removed when the session ends."""
    yield
    for folder in Path(tempfile.gettempdir()).glob(f"behave-{os.getuid()}-*"):
        shutil.rmtree(folder, ignore_errors=True)
