"""Turn parsed options into a plan and one mpiexec command, then supervise the job.

Runs on every launch before mpiexec starts, so it imports only what a plain launch needs;
``--dry-run``, host lists and topology printing bring in their modules when asked for.
"""

from __future__ import annotations

import os
import sys

from poprun_py import log
from poprun_py.errors import PlanError
from poprun_py.options import VIPU_FLAGS

_LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}


class ProgramError(Exception):
    """The program cannot be started here; ``status`` is the shell's (127 not found, 126 not executable)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def launch(options: dict) -> int:
    """Run the job ``options`` describe (as click would parse them); its exit status."""
    log.configure(options["verbose"])
    for flag in VIPU_FLAGS:
        if options.get(flag[2:].replace("-", "_")) is not None:
            log.warning("%s has no effect in poprun-py (there is no V-IPU here); ignored", flag)

    from poprun_py.mpi import CommandSpec, build_command, detect_launcher, find_mpiexec, \
        parse_instance_local_args, split_args
    from poprun_py.plan import JobPlan

    hosts = _resolve_hosts(options)
    num_replicas = options["num_replicas"] or options["num_instances"]
    plan = JobPlan(options["num_instances"], num_replicas, options["ipus_per_replica"],
                   tuple(hosts), options["executable_cache_path"])
    only = options["only_output_from_instance"]
    if only is not None and only >= plan.num_instances:
        raise PlanError(f"--only-output-from-instance {only} is outside the instances 0..{plan.num_instances - 1}")
    spec = CommandSpec(
        job_env={**plan.job_env(), "PYTHONUNBUFFERED": os.environ.get("PYTHONUNBUFFERED", "1")},
        instance_envs=[plan.instance_env(i) for i in range(plan.num_instances)],
        instance_argv=[],
        global_args=split_args(options["mpi_global_args"], "--mpi-global-args"),
        local_args=split_args(options["mpi_local_args"], "--mpi-local-args"),
        instance_local_args=parse_instance_local_args(options["instance_mpi_local_args"], plan.num_instances),
        numa_aware=options["numa_aware"],
        explicit_hosts=bool(hosts),
    )
    _check_program(options["program"], hosts)
    launcher = detect_launcher(find_mpiexec(options["mpi"]), need_version=options["dry_run"] or options["verbose"] > 0)
    log.info("using %s (%s %s)", launcher.path, launcher.flavour, launcher.version)
    shim = os.path.join(os.path.dirname(os.path.abspath(__file__)), "instance.py")
    program = [options["program"], *options["args"]]
    spec.instance_argv = [[sys.executable, "-S", shim, str(i), *program] for i in range(plan.num_instances)]

    def command(control_address: str) -> list[str]:
        from poprun_py.protocol import ENV_CONTROL

        spec.job_env[ENV_CONTROL] = control_address
        return build_command(launcher, plan, spec)

    if options["print_topology"] or options["dry_run"]:
        from poprun_py.topology import render_topology

        print(render_topology(plan))
    if options["dry_run"]:
        import shlex

        print(plan.describe())
        print(f"mpi: {launcher.flavour} {launcher.version} ({launcher.path})")
        print("command: " + shlex.join(command("<poprun-address>:<port>")))
        return 0

    from poprun_py.supervisor import Supervisor

    bind_all = any(h not in _LOCAL_NAMES for h in hosts)
    supervisor = Supervisor(plan.num_instances, [i.host for i in plan.instances], command,
                            show_instance=only, bind_all=bind_all)
    return supervisor.run()


def _resolve_hosts(options: dict) -> list[str]:
    if options["host"] is not None and options["host_file"] is not None:
        raise PlanError("--host and --host-file exclude each other; give only one of them")
    if options["host"] is None and options["host_file"] is None:
        return []
    from poprun_py.hosts import expand_hosts, read_host_file

    if options["host"] is not None:
        return expand_hosts(options["host"])
    return read_host_file(options["host_file"])


def _check_program(program: str | None, hosts: list[str]) -> None:
    if not program:
        raise PlanError("missing PROGRAM: give the program to run, e.g. 'poprun --num-instances 2 python train.py'")
    if any(h not in _LOCAL_NAMES for h in hosts):
        return  # remote hosts: the instance shim reports a missing program there
    from poprun_py.paths import which

    path = which(program) if os.sep not in program else program
    if path is None or not os.path.exists(path):
        raise ProgramError(f"program {program!r} was not found" + ("" if os.sep in program else " on PATH"), 127)
    if os.path.isdir(path) or not os.access(path, os.X_OK):
        raise ProgramError(f"program {program!r} is not an executable file", 126)
