"""Which tests `make mutants` runs against the mutants of each module it mutates.

mutmut runs, for each mutant, every selected test that reached the mutated function; a function
that every job reaches (reading the topology, the supervisor's loop) would be run against the
whole launcher suite. Here each module is tested by the tests written for it, so a surviving
mutant costs seconds, not minutes. An entry is a test file, or one test of it (``file::name``,
with every parametrization of it). ``tests/conftest.py`` credits a test with a function only when
the test is listed for the function's module, runs only the tests of the modules a run mutates
(``MUTMUT_PATTERNS``), and checks that these lists and the modules are what ``[tool.mutmut]`` in
pyproject.toml selects and mutates.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

_FAILURES = "tests/launcher/test_poprun_failures.py"
#: The launcher's job tests. Of its failure tests, not: the restart from a checkpoint (poprun's
#: restart loop, in launch.py, trains MNIST twice) and the pids-cgroup limit (the same start
#: timeout as ``test_instances_that_never_start...``, seconds longer).
_LAUNCH = ("tests/launcher/test_poprun_lean_launch.py", "tests/launcher/test_poprun_launch.py", *(
    f"{_FAILURES}::{name}" for name in (
        "test_an_instance_that_leaves_early_is_named_not_the_one_left_waiting",
        "test_the_death_of_mpis_process_on_a_host_ends_the_job_at_once",
        "test_daemons_left_by_the_program_end_with_the_job",
        "test_a_stub_that_no_longer_answers_is_killed_with_mpiexecs_process_group",
        "test_daemons_end_when_poprun_is_interrupted",
        "test_a_second_signal_kills_at_once_what_the_first_asked_to_stop",
        "test_an_instance_gets_the_whole_kill_grace_to_clean_up",
        "test_a_job_that_cannot_fit_the_open_file_limit_is_refused_before_it_starts",
        "test_a_process_left_behind_is_named_by_the_first_200_bytes_of_its_command_line",
        "test_files_of_killed_mpi_processes_are_removed",
        "test_files_of_instances_that_all_left_through_os_exit_are_removed",
        "test_instances_that_never_start_end_the_job_at_the_start_timeout",
        "test_a_process_left_in_mpiexecs_session_is_killed_and_named",
        "test_instances_failing_together_each_report_their_own_status",
        "test_an_interrupted_job_is_not_restarted",
        "test_a_signal_after_an_instance_failed_leaves_that_failure_on_record",
        "test_a_storm_of_signals_ends_the_job_once_with_its_summary_and_leaves_nothing",
        "test_a_reader_that_stops_reading_is_not_an_error",
        "test_a_stray_connection_to_the_control_port_is_refused_and_the_job_goes_on",
        "test_an_instance_found_stopped_is_named_before_the_one_that_timed_out_waiting_for_it",
    )))
_COMPILED = "tests/integration/test_compiled_parts.py"

TESTS_OF_MODULE: dict[str, tuple[str, ...]] = {
    # the canonical reduction order
    "popdist_py.engine._collectives.reduce": (
        "tests/engine/test_engine_reduce.py", "tests/engine/test_engine_segments.py",
        "tests/engine/test_engine_tree_kernel.py", "tests/library/test_collectives_local.py"),
    # deadlines of every wait, failure release, agreement
    "popdist_py.deadline": (
        "tests/library/test_deadline_poll.py", "tests/library/test_collectives_local.py",
        "tests/engine/test_engine_runtime.py", "tests/integration/test_mpi_suites.py"),
    "popdist_py.engine._collectives.rendezvous": (
        "tests/engine/test_engine_rendezvous.py", "tests/engine/test_engine_runtime.py",
        "tests/engine/test_engine_executor.py"),
    # the local work of large collectives in slices: every element once, failures after every slice
    "popdist_py.engine._execution.slices": ("tests/engine/test_engine_slices.py",),
    "popdist_py.agreement": ("tests/library/test_collectives_local.py", "tests/integration/test_mpi_suites.py"),
    "popdist_py.failsafe": (
        "tests/library/test_failsafe.py", "tests/library/test_collectives_local.py",
        "tests/library/test_popdist_under_poprun.py"),
    # teardown and release, on both sides of the control connection
    "poprun_py.supervision.supervisor": (*_LAUNCH, "tests/launcher/test_supervisor_checks.py",
                                         "tests/launcher/test_root_cause.py",
                             "tests/launcher/test_poprun_output.py::test_log_dir_keeps_each_instances_raw_output",
                             "tests/launcher/test_holder.py::test_poprun_collects_the_holders_its_job_orphans",
                             "tests/launcher/test_lingering_mpiexec.py",
                             ("tests/launcher/test_error_file.py::"
                             "test_a_launch_that_fails_is_recorded_with_the_host_that_could_not_start")),
    "poprun_py.supervision.teardown": (*_LAUNCH, "tests/launcher/test_leftovers.py"),
    # what the stubs and the hosts' supervisors start with: the program's start and the holder,
    # the link to poprun and the settings a host reads
    "poprun_py.stub.program": (*_LAUNCH, "tests/launcher/test_holder.py", "tests/launcher/test_stub.py",
                               "tests/launcher/test_program_arguments.py"),
    "poprun_py.host.link": ("tests/launcher/test_host_link.py", "tests/launcher/test_host_settings.py"),
    "poprun_py.wire.protocol": (
        "tests/launcher/test_protocol.py", "tests/launcher/test_host_settings.py",
        "tests/launcher/test_poprun_lean_launch.py", "tests/launcher/test_network_and_host_errors.py",
        "tests/launcher/test_program_arguments.py", "tests/launcher/test_host_link.py"),
    # output framing
    "poprun_py.supervision.output": (
        "tests/launcher/test_output_tagging.py", "tests/launcher/test_poprun_output.py",
        "tests/launcher/test_poprun_shared_terminal.py"),
    # the environment contract
    "popcontract.environment": ("tests/library/test_environment.py",),
    "popdist_py.topology": (
        "tests/library/test_environment.py", "tests/library/test_bare_mpi.py",
        "tests/library/test_popdist_under_poprun.py"),
    # the plan: the hosts a scheduler gives, the launcher agent, the compiled parts
    "poprun_py.planning.host_sources": ("tests/launcher/test_host_sources.py", "tests/launcher/test_host_names.py"),
    "poprun_py.planning.agent": ("tests/launcher/test_launcher_agent_plan.py",),
    "popcontract.compiled": (*(f"{_COMPILED}::{name}" for name in (
        "test_this_checkouts_build_has_every_part", "test_an_unknown_part_is_refused_naming_the_parts",
        "test_a_parts_file_is_looked_for_in_its_package_wherever_that_was_imported_from",
        "test_version_says_which_part_is_missing_and_what_that_means",
        "test_a_build_that_does_not_load_is_missing_with_the_loaders_reason",
        "test_without_batch_invariant_its_products_refuse_in_one_line_at_first_use",
        "test_without_loopback_a_launcher_that_would_listen_everywhere_refuses_naming_the_part",
        "test_the_libc_subreaper_is_reached_only_where_the_part_is_missing")),
        "tests/launcher/test_poprun_cli.py::test_version_names_each_compiled_part"),
    # how a failed job is told: the first failure, the stubs' clocks, the OOM killer, strangers on the
    # control port, poprun's own output gone
    "poprun_py.supervision.first_failure": (
        "tests/launcher/test_root_cause.py", "tests/launcher/test_sigkill_and_left_early.py",
        "tests/launcher/test_foreign_text.py::test_a_programs_recorded_error_and_stderr_are_quoted_escaped_in_the_summary",
        f"{_FAILURES}::test_instances_failing_together_each_report_their_own_status",
        f"{_FAILURES}::test_an_instance_that_leaves_early_is_named_not_the_one_left_waiting"),
    "poprun_py.supervision.clocks": ("tests/launcher/test_root_cause.py",),
    "poprun_py.host.oom": ("tests/launcher/test_sigkill_and_left_early.py",),
    "poprun_py.supervision.strays": (
        "tests/launcher/test_supervisor_checks.py", "tests/launcher/test_control_port_flood.py",
        f"{_FAILURES}::test_a_stray_connection_to_the_control_port_is_refused_and_the_job_goes_on"),
    "poprun_py.supervision.own_output": (
        "tests/launcher/test_poprun_own_output.py",
        "tests/launcher/test_output_tagging.py::test_output_to_a_reader_that_has_gone_is_dropped_without_an_error",
        "tests/launcher/test_output_tagging.py::test_poprun_s_own_stream_is_a_terminal_where_its_descriptor_is_one",
        "tests/launcher/test_output_tagging.py::test_poprun_s_own_stream_knows_whether_what_it_wrote_ended_a_line",
        f"{_FAILURES}::test_a_reader_that_stops_reading_is_not_an_error"),
    # the per-instance stub (its fallback in Python), its frames and the supervisor's end of them
    "poprun_py.wire.local": ("tests/launcher/test_local_frames.py", "tests/launcher/test_stub.py"),
    "poprun_py.host.stubs": ("tests/launcher/test_local_frames.py", "tests/launcher/test_stub.py"),
    "poprun_py.stub.fallback": ("tests/launcher/test_stub.py",),
    # poprun as its own host's supervisor: one instance's stub seen from there, what each stub is told
    "poprun_py.host.instance": ("tests/launcher/test_root_cause.py", "tests/launcher/test_sigkill_and_left_early.py",
                                "tests/launcher/test_poprun_output.py", "tests/launcher/test_uncaught.py",
                                "tests/launcher/test_mpi_abort.py"),
    "poprun_py.host.programs": ("tests/launcher/test_host_programs.py", "tests/launcher/test_host_settings.py",
                                ("tests/launcher/test_network_exposure.py::"
                                 "test_the_launchers_library_stays_out_of_the_programs_environment")),
}


def selects(entries: tuple[str, ...], nodeid: str) -> bool:
    """Whether the test ``nodeid`` is one of ``entries`` (a file, or ``file::name``)."""
    return any(nodeid == entry or nodeid.startswith((f"{entry}::", f"{entry}[")) for entry in entries)


def tests_of_run(patterns: list[str]) -> tuple[str, ...]:
    """The entries for the modules a run of mutmut with these name ``patterns`` mutates (a pattern
    names a module's mutants, or those of some of its functions)."""
    return tuple(entry for module, entries in TESTS_OF_MODULE.items()
                 if any(fnmatchcase(f"{module}.x_", pattern) or pattern.startswith(f"{module}.x")
                        for pattern in patterns) for entry in entries)


#: The supervisor's methods that deal with the stubs' and hosts' connections (``make mutants-connections``);
#: the rest, the run, mpiexec and the end of the job, are ``make mutants-supervisor``'s.
SUPERVISOR_CONNECTIONS = ("_accept", "_drop_pending", "_read_hello", "_recv", "_read_stub", "_handle_frames",
                          "_release_when_all_done", "_check_silence", "_check_start", "_disconnect")


def _supervisor_methods() -> list[str]:
    """The methods of poprun_py/supervision/supervisor.py's Supervisor, read from its source."""
    import ast
    from pathlib import Path

    tree = ast.parse((Path(__file__).resolve().parents[2] / "poprun_py" / "supervision" / "supervisor.py").read_text())
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Supervisor")
    return [node.name for node in cls.body if isinstance(node, ast.FunctionDef)]


def _methods(names: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    return tuple(f"poprun_py.supervision.supervisor.xǁSupervisorǁ{name}__mutmut_*" for name in names)


#: The Makefile's mutation targets (``make mutants``, ``make mutants-NAME``): the mutants each
#: runs, as mutmut name patterns, each sized to finish within 30 minutes on two cores
#: (docs/mutation.md); every function of the mutated modules is in exactly one (a test checks).
TARGETS: dict[str, tuple[str, ...]] = {
    "library": ("popdist_py.*", "poprun_py.supervision.output.*", "popcontract.environment.*"),
    "program": ("poprun_py.stub.program.*", "poprun_py.host.link.*"),
    "teardown": ("poprun_py.supervision.teardown.*", "poprun_py.wire.protocol.*"),
    "supervisor": _methods([m for m in _supervisor_methods() if m not in SUPERVISOR_CONNECTIONS]),
    "connections": _methods(SUPERVISOR_CONNECTIONS),
    "planning": ("poprun_py.planning.host_sources.*", "poprun_py.planning.agent.*", "popcontract.compiled.*"),
    "failures": ("poprun_py.supervision.first_failure.*", "poprun_py.supervision.clocks.*",
                 "poprun_py.supervision.strays.*", "poprun_py.supervision.own_output.*", "poprun_py.host.oom.*"),
    "stub": ("poprun_py.wire.local.*", "poprun_py.host.stubs.*", "poprun_py.stub.fallback.*",
             "poprun_py.host.instance.*", "poprun_py.host.programs.*"),
}


def target_of(mutant: str) -> list[str]:
    """The targets whose patterns select ``mutant`` (a mutant's or a function's mutmut name)."""
    return [name for name, patterns in TARGETS.items() if any(fnmatchcase(mutant, p) for p in patterns)]


if __name__ == "__main__":  # the Makefile: the patterns of the target named, one per line
    import sys

    print("\n".join(TARGETS[sys.argv[1]]))
