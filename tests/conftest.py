"""Suite-wide reporting (tests that could not run here say so in one loud line at the end) and
the engine tests' executor fixture."""

from __future__ import annotations

import compileall
import os
import shutil
import signal
import sysconfig
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from popcontract.environment import ENGINE_EXECUTOR, LOCAL_WORLD_SIZE
from poprun_py.host import SCRIPT as HOST_SCRIPT
from poprun_py.stub import SCRIPT as STUB_SCRIPT
from tests import leftover_files
from tests.helpers import MARKER_VARIABLE, ROOT, UNDER_MUTANTS
from tests.mutation.selection import TESTS_OF_MODULE, selects, tests_of_run

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


# -- layers and the engine's two executors -----------------------------------------------------------
#: The folders of tests/, each a layer, each test marked with its folder's name (``-m engine``).
LAYERS = ("launcher", "library", "engine", "mpi", "integration")
#: Every test marked ``engine`` (those in tests/engine/, and the engine's MPI files, marked by their
#: module) runs under both executors of popdist_py.engine (chosen through the environment; an
#: explicit ``Runtime(executor=...)`` in a test still wins), unless marked ``one_executor``. Tests
#: read the current one from the ``executor`` fixture.
ENGINE_EXECUTORS = ("threads", "cooperative")


# -- the fast tier -----------------------------------------------------------------------------------
#: ``make test-fast`` runs the tests not marked slow, none of which starts a process
#: (tests/process_guard.py), with ``--fast-tier``: each engine test under the cooperative executor
#: alone, and each hypothesis test with a fifth of its examples (at least MIN_EXAMPLES). ``make
#: test`` runs every test under both executors with all its examples.
FAST_TIER_EXECUTORS = ("cooperative",)
FAST_TIER_EXAMPLES, MIN_EXAMPLES = 5, 10


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast-tier", action="store_true",
                     help="make test-fast: each engine test under one executor, hypothesis tests with fewer examples")


def _fewer_examples(items: list[pytest.Item]) -> None:
    """A fifth of each hypothesis test's examples. Its own ``@settings(max_examples=...)`` outranks
    any profile, so the settings hypothesis reads from the test's function when it runs (a private
    attribute: tests/integration/test_fast_tier.py fails if that stops working) are replaced."""
    from hypothesis import settings

    tests = {id(test): test for item in items
             if getattr(test := getattr(item, "obj", None), "is_hypothesis_test", False)}
    for test in tests.values():
        given: settings = test._hypothesis_internal_use_settings  # type: ignore[union-attr]
        fewer = max(MIN_EXAMPLES, given.max_examples // FAST_TIER_EXAMPLES)
        test._hypothesis_internal_use_settings = settings(given, max_examples=min(fewer, given.max_examples))  # type: ignore[union-attr]


def _layer(path: Path) -> str | None:
    if not path.is_relative_to(ROOT / "tests"):  # a pytest run inside a test (tests/integration/test_fast_tier.py)
        return None
    parts = path.relative_to(ROOT / "tests").parts
    return parts[0] if len(parts) > 1 and parts[0] in LAYERS else None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "one_executor: an engine test that does not depend on the executor (runs once)")
    for layer in LAYERS:
        config.addinivalue_line("markers", f"{layer}: a test of tests/{layer}/")
    if UNDER_MUTANTS:
        _check_selection()
        _children_import_the_mutants()
    elif not config.getoption("--with-mpi", default=False):
        _watch_for_processes(config)


def _watch_for_processes(config: pytest.Config) -> None:
    """A test not marked slow starts no process (tests/process_guard.py), so ``-m "not slow"`` is
    the fast tier (``make test-fast``)."""
    from tests import process_guard

    if not config.pluginmanager.is_registered(process_guard):
        config.pluginmanager.register(process_guard)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        layer = _layer(item.path)
        if layer is not None:
            item.add_marker(layer)
    # A file of tests/mpi run under mpiexec from the copy (tests/integration/test_mpi_suites.py) is
    # run whole: the selection and its order are for mutmut's own pytest.
    if UNDER_MUTANTS and not config.getoption("--with-mpi", default=False):
        _mutmut_order(config, items)
    if config.getoption("--fast-tier"):
        _fewer_examples(items)


def _mutmut_order(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Only the tests of the modules this run mutates (the Makefile passes its name patterns in
    MUTMUT_PATTERNS), each ``file::name`` entry checked to name a test; the fastest first, as
    measured while mutmut collected its statistics (mutmut stops a mutant's run at its first
    failing test)."""
    from mutmut.state import state  # only `make mutants` installs mutmut

    patterns = os.environ.get("MUTMUT_PATTERNS", "").split()
    if patterns:
        wanted = tests_of_run(patterns)
        config.hook.pytest_deselected(items=[item for item in items if not selects(wanted, item.nodeid)])
        items[:] = [item for item in items if selects(wanted, item.nodeid)]
    named = {entry for entry in tests_of_run(patterns or ["*"]) if "::" in entry}
    unknown = [entry for entry in named if not any(selects((entry,), item.nodeid) for item in items)]
    if unknown and os.environ.get("MUTANT_UNDER_TEST") == "stats":  # the whole selection is collected
        raise pytest.UsageError(f"tests/mutation/selection.py names tests that do not exist: {sorted(unknown)}")
    items.sort(key=lambda item: state().duration_by_test.get(item.nodeid, 0.0))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    engine = _layer(metafunc.definition.path) == "engine" or metafunc.definition.get_closest_marker("engine")
    if engine and metafunc.definition.get_closest_marker("one_executor") is None:
        executors = FAST_TIER_EXECUTORS if metafunc.config.getoption("--fast-tier") else ENGINE_EXECUTORS
        metafunc.parametrize("executor", executors, indirect=True, scope="module")


@pytest.fixture(scope="module", autouse=True)
def executor(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """The engine executor of the current engine test (module-scoped: tests are grouped
    by executor, and hypothesis may use it); None elsewhere."""
    name = getattr(request, "param", None)
    if name is None:
        yield None
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENGINE_EXECUTOR, name)
        mp.delenv(LOCAL_WORLD_SIZE, raising=False)
        yield name


@pytest.fixture(autouse=True)
def leaves_no_job_files(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that leaves a file of MPI, poprun or the suite in /dev/shm or /tmp fails, named (``make
    test`` checks the whole run too, but could not say which test). Not under mpiexec's ranks or
    mutmut's concurrent children, where another process's files come and go meanwhile, nor in the
    fast tier: its tests start no process (tests/process_guard.py), and it is the tier run while
    other jobs run on the host, whose files would be blamed on whichever test was running."""
    if UNDER_MUTANTS or request.config.getoption("--with-mpi", default=False) \
            or request.config.getoption("--fast-tier"):
        yield
        return
    before, since = leftover_files.names(), time.time()
    yield
    left = sorted(leftover_files.names() - before)
    if left:
        described = ", ".join(leftover_files.describe(path, since) for path in left)
        pytest.fail(f"left behind by this test: {described}", pytrace=False)


@pytest.fixture(autouse=True)
def no_marker_after_the_test() -> Iterator[None]:
    """A test's job marker (helpers.job_marker) stays out of the processes later tests start."""
    yield
    os.environ.pop(MARKER_VARIABLE, None)


@pytest.fixture(scope="session", autouse=True)
def jobs_take_sigint() -> None:
    """The jobs the tests start get SIGINT's default action, as a terminal's jobs do. A suite started
    as a background job of a non-interactive shell (``make test &`` in a script) inherits SIGINT
    ignored, and so would every poprun it starts, which keeps an ignored SIGINT ignored as shells and
    Python do: each test that interrupts a job would then wait for ever (seen running two halves of
    the suite at once). A handler here becomes the default action in every program it starts."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def no_start_files_left() -> Iterator[None]:
    """tests/scripts/behave.py's folders of start files, of jobs whose instances were all stopped
    before one of them could remove it: removed when the session ends."""
    yield
    for folder in Path(tempfile.gettempdir()).glob(f"behave-{os.getuid()}-*"):
        shutil.rmtree(folder, ignore_errors=True)


# -- make mutants: code reached in child processes ---------------------------------------------------
#: In mutmut's copy of the tree every child a test starts (poprun, its instances, scripts under
#: mpiexec) must import the mutated copy too, and the functions the children reach are credited
#: to the test.
CHILD_HITS, CHILD_HITS_OWNER = "MUTMUT_CHILD_HITS", "MUTMUT_CHILD_HITS_OWNER"
#: The scripts of the Python stub (mpiexec starts one per instance) and of a remote host's supervisor
#: run as ``python -S``, where no sitecustomize is imported: in the copy each imports the recorder itself.
ENTRIES = (Path(STUB_SCRIPT), Path(HOST_SCRIPT))


def _children_import_the_mutants() -> None:
    """PYTHONPATH for every child: the copy first, then tests/mutation/sitecustomize.py (which
    records what a child reaches), then site-packages (the ``-S`` stub imports mutmut too). The
    file of children's hits belongs to mutmut's own pytest process; a pytest under mpiexec
    (tests/integration/test_mpi_suites.py) writes to it like any other child."""
    paths = [str(ROOT), str(ROOT / "tests" / "mutation"), sysconfig.get_paths()["purelib"]]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    if CHILD_HITS not in os.environ:
        # Inside the copy, which every run of `make mutants` makes afresh: nothing left in /tmp.
        hits = ROOT / "mutmut-child-hits"
        hits.write_text("")
        os.environ[CHILD_HITS] = str(hits)
        os.environ[CHILD_HITS_OWNER] = str(os.getpid())
        for path in ENTRIES:
            entry = path.read_text()
            if not entry.startswith("import sitecustomize"):
                path.write_text("import sitecustomize  # noqa: F401  (make mutants: tests/conftest.py)\n" + entry)
        # The mutated modules are many times their size (a copy of each function per mutant): a
        # process that compiles them takes most of a second, and a job starts several. Compiled
        # once here, every child reads the bytecode, even where PYTHONDONTWRITEBYTECODE is set.
        for package in ("poprun_py", "popdist_py", "popcontract"):
            compileall.compile_dir(ROOT / package, quiet=1)


def _module_of(function: str) -> str:
    """``popdist_py.deadline`` for mutmut's ``popdist_py.deadline.x_wait``."""
    return function[:function.rindex(".x")]


def _check_selection() -> None:
    """tests/mutation/selection.py names exactly the modules and test files of [tool.mutmut]."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    mutated = {path.removesuffix(".py").replace("/", ".") for path in config["only_mutate"]}
    selected = {arg for arg in config["pytest_add_cli_args_test_selection"] if arg.startswith("tests/")
                and arg.endswith(".py")}
    listed = {test.split("::")[0] for tests in TESTS_OF_MODULE.values() for test in tests}
    if mutated != set(TESTS_OF_MODULE) or selected != listed:
        raise pytest.UsageError(f"tests/mutation/selection.py and [tool.mutmut] differ: modules "
                                f"{sorted(mutated ^ set(TESTS_OF_MODULE))}, tests {sorted(selected ^ listed)}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """While mutmut collects its statistics: the functions this test reached, in this process or
    in its children, credited to it where its file is listed for their module."""
    yield
    if not (UNDER_MUTANTS and os.environ.get("MUTANT_UNDER_TEST") == "stats"
            and os.environ.get(CHILD_HITS_OWNER) == str(os.getpid())):
        return
    from mutmut.state import state  # only `make mutants` installs mutmut

    hits = Path(os.environ[CHILD_HITS])
    reached = state()._stats | set(hits.read_text().split())
    hits.write_text("")
    state()._stats.clear()
    state()._stats.update(f for f in reached if selects(TESTS_OF_MODULE.get(_module_of(f), ()), item.nodeid))
