"""Which tests `make mutants` runs against the mutants of each module it mutates.

mutmut runs, for each mutant, every selected test that reached the mutated function; a function
that every job reaches (reading the topology, the supervisor's loop) would be run against the
whole launcher suite. Here each module is tested by the files written for it, so a surviving
mutant costs seconds, not minutes. ``tests/conftest.py`` credits a test with a function only when
the test's file is listed for the function's module, and checks that these lists and the
modules are what ``[tool.mutmut]`` in pyproject.toml selects and mutates.
"""

from __future__ import annotations

_LAUNCH = ("tests/launcher/test_poprun_lean_launch.py", "tests/launcher/test_poprun_launch.py",
           "tests/launcher/test_poprun_failures.py")

TESTS_OF_MODULE: dict[str, tuple[str, ...]] = {
    # the canonical reduction order
    "popdist_py.engine._collectives.reduce": (
        "tests/engine/test_engine_reduce.py", "tests/engine/test_engine_segments.py",
        "tests/library/test_collectives_local.py"),
    # deadlines of every wait, failure release, agreement
    "popdist_py.deadline": (
        "tests/library/test_deadline_poll.py", "tests/library/test_collectives_local.py",
        "tests/engine/test_engine_runtime.py", "tests/integration/test_mpi_suites.py"),
    "popdist_py.engine._collectives.rendezvous": (
        "tests/engine/test_engine_rendezvous.py", "tests/engine/test_engine_runtime.py",
        "tests/engine/test_engine_executor.py"),
    "popdist_py.agreement": ("tests/library/test_collectives_local.py", "tests/integration/test_mpi_suites.py"),
    "popdist_py.failsafe": (
        "tests/library/test_failsafe.py", "tests/library/test_collectives_local.py",
        "tests/library/test_popdist_under_poprun.py"),
    # teardown and release, on both sides of the control connection
    "poprun_py.supervisor": (*_LAUNCH, "tests/launcher/test_root_cause.py"),
    "poprun_py.teardown": (*_LAUNCH, "tests/launcher/test_leftovers.py"),
    "poprun_py.shim": (*_LAUNCH, "tests/launcher/test_root_cause.py", "tests/launcher/test_shim_settings.py"),
    "poprun_py.shim_pump": (*_LAUNCH, "tests/launcher/test_root_cause.py", "tests/launcher/test_shim_settings.py"),
    "poprun_py.protocol": (
        "tests/launcher/test_protocol.py", "tests/launcher/test_shim_settings.py",
        "tests/launcher/test_poprun_lean_launch.py", "tests/launcher/test_network_and_host_errors.py"),
    # output framing
    "poprun_py.output": (
        "tests/launcher/test_output_tagging.py", "tests/launcher/test_poprun_output.py",
        "tests/launcher/test_poprun_shared_terminal.py"),
    # the environment contract
    "poprun_py.environment": ("tests/library/test_environment.py",),
    "popdist_py.env": (
        "tests/library/test_environment.py", "tests/library/test_bare_mpi.py",
        "tests/library/test_popdist_under_poprun.py"),
}
