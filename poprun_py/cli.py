"""The ``poprun`` command: plan the job, build one mpiexec command, supervise it.

Heavy work (detecting mpiexec, the supervisor) is imported only when a job really starts, so
``poprun`` adds little to mpiexec's own start-up time.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from typing import Any

import click

from poprun_py import __version__
from poprun_py.errors import PlanError

log = logging.getLogger("poprun")

VIPU_OPTIONS = (
    "--vipu-server-host", "--vipu-server-port", "--vipu-server-timeout", "--vipu-partition",
    "--vipu-partition-attempts", "--update-partition", "--reset-partition", "--remove-partition",
    "--vipu-cluster", "--vipu-allocation", "--num-ilds",
)


class YesNo(click.ParamType):
    name = "yes|no"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("yes", "y", "true", "1", "on"):
            return True
        if text in ("no", "n", "false", "0", "off"):
            return False
        self.fail(f"{value!r} is not yes or no", param, ctx)


YES_NO = YesNo()
POSITIVE = click.IntRange(min=1)


def _vipu_options(func: Any) -> Any:
    for flag in reversed(VIPU_OPTIONS):
        func = click.option(flag, metavar="VALUE", default=None, expose_value=True,
                            help="Accepted for PopRun compatibility; has no effect (warned).")(func)
    return func


@click.command(
    context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"],
                      "max_content_width": 100},
    epilog="Every instance gets POPDIST_* (see popdist_py), RANK, WORLD_SIZE, LOCAL_RANK and "
           "LOCAL_WORLD_SIZE. Output lines are tagged '[i] ' with their instance index. "
           "Exit status: 0 when every instance succeeds, else the first failing instance's status "
           "(128+N for signal N).",
)
@click.option("--num-instances", type=POSITIVE, default=1, show_default=True, help="Processes to start.")
@click.option("--num-replicas", type=POSITIVE, default=None,
              help="Total replicas, divided evenly among the instances.  [default: one per instance]")
@click.option("--ipus-per-replica", type=POSITIVE, default=1, show_default=True,
              help="Devices per replica (given to instances as POPDIST_NUM_IPUS_PER_REPLICA).")
@click.option("-H", "--host", "host", metavar="LIST", default=None,
              help="Hosts to run on: 'a,b' or ranges 'node[0-2,4]'. Instances are spread evenly.")
@click.option("--host-file", metavar="FILE", default=None, help="File with one host per line (not with --host).")
@click.option("--mpi-global-args", metavar="ARGS", default=None, help="Extra arguments put once on the mpiexec line.")
@click.option("--mpi-local-args", metavar="ARGS", default=None, help="Extra arguments for every instance's app context.")
@click.option("--instance-mpi-local-args", metavar="I:ARGS", multiple=True,
              help="Extra app-context arguments for instance I only (repeatable).")
@click.option("--only-output-from-instance", type=click.IntRange(min=0), default=None, metavar="I",
              help="Show only instance I's output (failures of others are still summarised).")
@click.option("--print-topology", type=YES_NO, default=False, help="Print hosts -> instances -> replicas [no].")
@click.option("--numa-aware", type=YES_NO, default=False, help="Bind instances to NUMA nodes [no].")
@click.option("--offline-mode", type=YES_NO, default=False,
              help="Run without devices [no]. Every run is offline here; accepted for compatibility.")
@click.option("--executable-cache-path", metavar="DIR", default=None,
              help="Shared cache directory, given to instances as POPDIST_EXECUTABLE_CACHE_PATH.")
@click.option("--import-config", metavar="FILE", default=None, help="Load options from a JSON file; the command line wins.")
@click.option("--export-config", metavar="FILE", default=None, help="Write the effective options as JSON.")
@click.option("--overwrite-config", is_flag=True, default=False, help="Allow --export-config to replace a file.")
@click.option("--mpi", "mpi", metavar="PATH", default=None,
              help="The mpiexec to use (MPICH or Open MPI). Default: next to this Python, then PATH.")
@click.option("--dry-run", is_flag=True, default=False, help="Print the plan and the exact mpiexec command; start nothing.")
@click.option("-v", "--verbose", count=True, help="-v: progress; -vv: debug.")
@_vipu_options
@click.version_option(__version__, "--version", prog_name="poprun (poprun-py)")
@click.argument("program", required=False, metavar="PROGRAM")
@click.argument("args", nargs=-1, type=click.UNPROCESSED, metavar="[ARGS]...")
@click.pass_context
def poprun(ctx: click.Context, **options: Any) -> int:
    """Launch PROGRAM as --num-instances processes on MPI, each driving its share of --num-replicas."""
    if options["import_config"]:
        from poprun_py.config import import_config

        import_config(ctx, options["import_config"])
        options.update(ctx.params)
    _configure_logging(options["verbose"])
    for flag in VIPU_OPTIONS:
        if options.get(flag[2:].replace("-", "_")) is not None:
            log.warning("%s has no effect in poprun-py (there is no V-IPU here); ignored", flag)
    if options["export_config"]:
        from poprun_py.config import export_config

        export_config(ctx, options["export_config"], options["overwrite_config"])
    try:
        return _launch(options)
    except PlanError as exc:
        raise click.UsageError(str(exc)) from None


def _configure_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity == 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s.%(msecs)03d %(process)d POPRUN [%(levelname).1s] %(message)s",
                                           "%H:%M:%S"))
    log.handlers[:] = [handler]
    log.setLevel(level)
    log.propagate = False


def _resolve_hosts(options: dict[str, Any]) -> list[str]:
    from poprun_py.hosts import expand_hosts, read_host_file

    if options["host"] is not None and options["host_file"] is not None:
        raise PlanError("--host and --host-file exclude each other; give only one of them")
    if options["host"] is not None:
        return expand_hosts(options["host"])
    if options["host_file"] is not None:
        return read_host_file(options["host_file"])
    return []


def _check_program(program: str | None, hosts: list[str]) -> None:
    if not program:
        raise PlanError("missing PROGRAM: give the program to run, e.g. 'poprun --num-instances 2 python train.py'")
    if any(h not in _LOCAL_NAMES for h in hosts):
        return  # remote hosts: the instance shim reports a missing program there
    path = shutil.which(program) if os.sep not in program else program
    if path is None or not os.path.exists(path):
        click.echo(f"poprun: error: program {program!r} was not found"
                   + ("" if os.sep in program else " on PATH"), err=True)
        raise SystemExit(127)
    if os.path.isdir(path) or not os.access(path, os.X_OK):
        click.echo(f"poprun: error: program {program!r} is not an executable file", err=True)
        raise SystemExit(126)


_LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}


def _launch(options: dict[str, Any]) -> int:
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

        click.echo(render_topology(plan))
    if options["dry_run"]:
        import shlex

        click.echo(plan.describe())
        click.echo(f"mpi: {launcher.flavour} {launcher.version} ({launcher.path})")
        click.echo("command: " + shlex.join(command("<poprun-address>:<port>")))
        return 0

    from poprun_py.supervisor import Supervisor

    bind_all = any(h not in _LOCAL_NAMES for h in hosts)
    supervisor = Supervisor(plan.num_instances, [i.host for i in plan.instances], command,
                            show_instance=only, bind_all=bind_all)
    return supervisor.run()


def main(argv: list[str] | None = None) -> None:
    """Entry point: usage errors are one line and exit status 2, never a traceback."""
    try:
        status = poprun.main(args=argv, prog_name="poprun", standalone_mode=False)
    except click.UsageError as exc:
        click.echo(f"poprun: error: {exc.format_message()}", err=True)
        status = 2
    except click.ClickException as exc:
        click.echo(f"poprun: error: {exc.format_message()}", err=True)
        status = exc.exit_code
    except click.exceptions.Abort:
        status = 130
    # Skip the interpreter's teardown (modules, GC): nothing is left to clean up, and every
    # launch would pay for it.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):
            pass  # the reader went away (e.g. `| head`): nothing more can be said
    os._exit(status if isinstance(status, int) else 0)
