"""The ``poprun`` command line: a click command, its options, and every usage error as one line.

``parse`` turns argv into the options dictionary ``launch`` runs, or the exit status of a
command line that launches nothing (help, version, a usage error).
"""

from __future__ import annotations

from typing import Any

import click

from poprun_py import __version__, log

#: PopRun's V-IPU options: accepted so PopRun scripts run, each one used is warned about and ignored.
VIPU_FLAGS = (
    "--vipu-server-host", "--vipu-server-port", "--vipu-server-timeout", "--vipu-partition",
    "--vipu-partition-attempts", "--update-partition", "--reset-partition", "--remove-partition",
    "--vipu-cluster", "--vipu-allocation", "--num-ilds",
)


class YesNo(click.types.BoolParamType):
    """PopRun's ``yes``/``no`` values: click's boolean words (also true/false, on/off, 1/0), shown
    as YES|NO in the help, and an error that says what is valid."""

    name = "yes|no"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> bool:
        state = self.str_to_bool(value) if isinstance(value, (bool, str)) and value != "" else None
        if state is None:
            self.fail(f"{value!r} is not yes or no", param, ctx)
        return state


def vipu_options(func: Any) -> Any:
    """Declare the V-IPU compatibility options (they take any value)."""
    for flag in reversed(VIPU_FLAGS):
        func = click.option(flag, metavar="VALUE",
                            help="Accepted for PopRun compatibility; has no effect (warned).")(func)
    return func


def import_config(ctx: click.Context, param: click.Parameter, path: str | None) -> None:
    """Eager: the file's options become click's defaults before any other option is read."""
    if path is not None:
        from poprun_py import config  # json and pathlib, only when a file is given

        config.load(ctx, path)


@click.command(
    context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"],
                      "max_content_width": 100},
    epilog="Every instance gets POPDIST_* (see popdist_py), RANK, WORLD_SIZE, LOCAL_RANK and "
           "LOCAL_WORLD_SIZE. Output lines are tagged '[i] ' with their instance index. "
           "Exit status: 0 when every instance succeeds, else the first failing instance's status "
           "(128+N for signal N).",
)
@click.option("--num-instances", type=click.IntRange(min=1), default=1, show_default=True, metavar="N",
              help="Processes to start.")
@click.option("--num-replicas", type=click.IntRange(min=1), metavar="N",
              help="Total replicas, divided evenly among the instances (default: one per instance).")
@click.option("--ipus-per-replica", type=click.IntRange(min=1), default=1, show_default=True, metavar="N",
              help="Devices per replica (given to instances as POPDIST_NUM_IPUS_PER_REPLICA).")
@click.option("-H", "--host", metavar="LIST",
              help="Hosts to run on: 'a,b' or ranges 'node[0-2,4]'. Instances are spread evenly. "
                   "Default: the Slurm allocation's nodes (SLURM_JOB_NODELIST), else this machine.")
@click.option("--host-file", type=click.Path(exists=True, dir_okay=False, readable=True), metavar="FILE",
              help="File with one host per line (not with --host).")
@click.option("--host-subnet", metavar="CIDR",
              help="Network for traffic between hosts: poprun's control channel, MPI's daemons and MPI itself "
                   "use the interface whose address is in it. Default: the route towards the first remote host.")
@click.option("--mpi-global-args", metavar="ARGS", help="Extra arguments put once on the mpiexec line.")
@click.option("--mpi-local-args", metavar="ARGS", help="Extra arguments for every instance's app context.")
@click.option("--instance-mpi-local-args", multiple=True, metavar="I:ARGS",
              help="Extra app-context arguments for instance I only (repeatable).")
@click.option("--only-output-from-instance", type=click.IntRange(min=0), metavar="I",
              help="Show only instance I's output (failures of others are still summarised).")
@click.option("--print-topology", type=YesNo(), default="no", show_default=True,
              help="Print hosts -> instances -> replicas.")
@click.option("--numa-aware", type=YesNo(), default="no", show_default=True, help="Bind instances to NUMA nodes.")
@click.option("--offline-mode", type=YesNo(), default="no", show_default=True,
              help="Run without devices. Every run is offline here; accepted for compatibility.")
@click.option("--executable-cache-path", metavar="DIR",
              help="Shared cache directory, given to instances as POPDIST_EXECUTABLE_CACHE_PATH.")
@click.option("--import-config", type=click.Path(exists=True, dir_okay=False, readable=True), metavar="FILE",
              is_eager=True, expose_value=False, callback=import_config,
              help="Take options from a JSON file (keys: long option names); the command line wins.")
@click.option("--export-config", type=click.Path(dir_okay=False), metavar="FILE",
              help="Write the effective options as JSON.")
@click.option("--overwrite-config", is_flag=True, help="Allow --export-config to replace a file.")
@click.option("--mpi", metavar="PATH",
              help="The mpiexec to use (MPICH or Open MPI). Default: next to this Python, then PATH.")
@click.option("--dry-run", is_flag=True, help="Print the plan and the exact mpiexec command; start nothing.")
@click.option("-v", "--verbose", count=True, help="-v: progress; -vv: debug.")
@vipu_options
@click.version_option(__version__, "--version", prog_name="poprun (poprun-py)")
@click.argument("program", required=False, metavar="PROGRAM")
@click.argument("args", nargs=-1, type=click.UNPROCESSED, metavar="[ARGS]...")
@click.pass_context
def poprun(ctx: click.Context, **options: Any) -> dict[str, Any]:
    """Launch PROGRAM as --num-instances processes on MPI, each driving its share of --num-replicas."""
    if options["export_config"]:
        from poprun_py.config import export

        export(ctx, options["export_config"], options["overwrite_config"])
    for flag in VIPU_FLAGS:
        if options.pop(flag[2:].replace("-", "_")) is not None:
            log.warning("%s has no effect in poprun-py (there is no V-IPU here); ignored", flag)
    return options


def parse(argv: list[str]) -> dict[str, Any] | int:
    """The options for ``argv``, or an exit status when there is nothing to launch (help,
    version, or a usage error, already printed as one line)."""
    try:
        result = poprun.main(args=argv, prog_name="poprun", standalone_mode=False)
    except click.ClickException as exc:
        message = exc.format_message()
        if isinstance(exc, click.BadParameter):
            from poprun_py.config import blame

            message = blame(exc) or message
        click.echo(f"poprun: error: {message}", err=True)
        return exc.exit_code
    except click.exceptions.Abort:
        return 130
    return result if isinstance(result, dict) else int(result or 0)
