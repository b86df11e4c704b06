"""The ``poprun`` command line: a click command, its options, and every usage error as one line.

``parse`` turns argv into the options ``launch`` runs (``LaunchOptions``, built once, here), or the
exit status of a command line that launches nothing (help, version, a usage error).
"""

from __future__ import annotations

import os
from typing import Any

import click

from poprun_py import __version__
from poprun_py.planning.options import LaunchOptions
from poprun_py.shared.errors import PlanError
from poprun_py.supervision import log

#: PopRun's V-IPU options: accepted so PopRun scripts run, each one used is warned about and ignored.
VIPU_FLAGS = (
    "--vipu-server-host", "--vipu-server-port", "--vipu-server-timeout", "--vipu-partition",
    "--vipu-partition-attempts", "--update-partition", "--reset-partition", "--remove-partition",
    "--vipu-cluster", "--vipu-allocation", "--num-ilds",
)


#: The most instances poprun starts, and the bound of every other count (replicas, IPUs per
#: replica, hosts): 2**16, 64 times Graphcore's largest system (1024 IPUs, one instance each at
#: most) and more than a Linux host's default pid_max (32768) allows on one machine. poprun holds
#: a connection and a few hundred bytes of plan per instance, so the bound also keeps its memory
#: and a --dry-run's time small (65536 instances: ~2 s).
MAX_COUNT = 65536
#: Counts are shown by their first digits past this many (a 100000-digit value is one short line).
SHOWN_DIGITS = 20


class Count(click.IntRange):
    """Every count option's type (``--num-instances``, ``--num-replicas``, ...; an index too):
    plain decimal digits only, where ``int`` would also take ``2_0``, `` 2`` or a fullwidth 2; at least
    ``min``, at most ``max``, checked before the number is used (a value past ``max`` says
    ``beyond``, e.g. "is more than poprun can start")."""

    name = "count"

    def __init__(self, min: int, max: int = MAX_COUNT, beyond: str = "is more than poprun supports") -> None:
        super().__init__(min=min, max=max)
        self.beyond = beyond

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
        if not isinstance(text, str):  # from a config file: true, 2.5, ...
            self.fail(f"{value!r} is not a whole number", param, ctx)
        digits = text[1:] if text.startswith("-") else text
        shown = text if len(text) <= SHOWN_DIGITS else text[:SHOWN_DIGITS] + "..."
        if not (digits.isascii() and digits.isdigit()):
            self.fail(f"{shown!r} is not a whole number in plain decimal digits (0-9), e.g. 4", param, ctx)
        assert self.min is not None and self.max is not None
        # Beyond a few digits only the sign matters (and int() of 5000 digits would fail).
        big = len(digits.lstrip("0")) > len(str(self.max))
        number = (-1 if text.startswith("-") else 1) * (self.max + 1 if big else int(digits))
        if number > self.max:
            self.fail(f"{shown} {self.beyond} (at most {self.max})", param, ctx)
        if number < self.min:
            self.fail(f"{shown} is not in the range {self._describe_range()}", param, ctx)
        return number


class Port(Count):
    """``--master-port``: a TCP port, 1..65535; any other value is one line naming it and the range."""

    name = "port"

    def __init__(self) -> None:
        super().__init__(1, 65535)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter:
            text = str(value)
            shown = text if len(text) <= SHOWN_DIGITS else text[:SHOWN_DIGITS] + "..."
            self.fail(f"{shown!r} is not a TCP port: give a whole number in the range 1..65535", param, ctx)


def _text(kind: Text | FileName, value: Any, param: click.Parameter | None, ctx: click.Context | None,
          empty: bool) -> str:
    """``value`` as an option's text, or one line saying why it cannot be: not text (a config
    file's 5 or true), empty where a name is needed, or holding a NUL byte (no argument, file
    name or environment variable can carry one)."""
    if not isinstance(value, str):
        kind.fail(f"{value!r} is not text (in a config file, give it in quotes)", param, ctx)
    shown = value if len(value) <= 60 else value[:60] + "..."
    if not value and not empty:
        kind.fail("'' is empty: give a name", param, ctx)
    if "\0" in value:
        kind.fail(f"{shown!r} holds a NUL byte, which no argument or file name can carry", param, ctx)
    return value


class Text(click.types.StringParamType):
    """Every text option's type (hosts, MPI arguments, ...): text, as on a command line."""

    def __init__(self, empty: bool = True) -> None:
        self.empty = empty

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        return _text(self, value, param, ctx, self.empty)


class FileName(click.Path):
    """Every file or directory option's type: click's Path, given a name that can be one."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        return str(super().convert(_text(self, value, param, ctx, empty=False), param, ctx))


class YesNo(click.ParamType[bool | str]):
    """PopRun's ``yes``/``no`` values: click's boolean words (also true/false, on/off, 1/0), shown
    as YES|NO in the help, and an error that says what is valid. ``words``: more values the option
    takes besides yes and no (each given back as itself, in lower case), e.g. ``offset``."""

    def __init__(self, *words: str) -> None:
        self.words = words
        self.name = "|".join(("yes", "no", *words))

    str_to_bool = staticmethod(click.types.BoolParamType.str_to_bool)

    def is_value(self, word: str) -> bool:
        """Whether ``word`` is one of the option's values (else, after the option alone, the program)."""
        return self.str_to_bool(word) is not None or word.strip().lower() in self.words

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> bool | str:
        if isinstance(value, str) and value.strip().lower() in self.words:
            return value.strip().lower()
        state = self.str_to_bool(value) if isinstance(value, (bool, str)) and value != "" else None
        if state is None:
            valid = ", ".join(("yes", "no", *self.words[:-1])) + f" or {self.words[-1]}" if self.words else "yes or no"
            self.fail(f"{value!r} is not {valid}", param, ctx)
        return state


#: Other launchers' options people type out of habit (mpirun/mpiexec, horovodrun, torchrun), and
#: what poprun calls them. Click reads ``-np`` as ``-n`` followed by ``p``.
FOREIGN_OPTIONS = {
    **dict.fromkeys(("-np", "-n", "--np", "--n", "-c"), "--num-instances N"),
    **dict.fromkeys(("-N", "--npernode", "-npernode", "--nproc-per-node", "--nproc_per_node", "-ppn"),
                    "--num-instances N, the total over all hosts"),
    **dict.fromkeys(("-host", "-hosts", "--hosts", "--nnodes"), "-H/--host LIST"),
    **dict.fromkeys(("-f", "-hostfile", "--hostfile", "-machinefile", "--machinefile"), "--host-file FILE"),
}


#: ``--help``'s sections, in order, by parameter name; every option is in exactly one (a test checks).
HELP_SECTIONS = {
    "Launch": ("num_instances", "num_replicas", "ipus_per_replica", "executable_cache_path", "horovod", "dry_run",
               "verbose", "version", "help"),
    "Hosts": ("host", "host_file", "host_subnet", "launcher_agent", "master_port", "numa_aware"),
    "Output": ("only_output_from_instance", "log_dir", "tee", "prefix_timestamp", "print_topology"),
    "Failures and restarts": ("max_restarts", "restart_backoff", "min_hosts", "host_cooldown",
                              "host_discovery_script", "error_file", "start_timeout"),
    "MPI": ("mpi", "mpi_global_args", "mpi_local_args", "instance_mpi_local_args"),
    "Configuration files": ("import_config", "export_config", "overwrite_config"),
    "PopRun options that do nothing here (accepted so PopRun scripts run; each one given is warned about)": (
        "offline_mode", *(flag[2:].replace("-", "_") for flag in VIPU_FLAGS)),
}


class PoprunCommand(click.Command):
    """A click command with grouped ``--help``, yes/no options that also stand alone as flags, and
    an unknown-option error that names poprun's option for another launcher's."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        records = {"help" if "--help" in p.opts else p.name: p.get_help_record(ctx) for p in self.get_params(ctx)}
        for title, names in HELP_SECTIONS.items():
            with formatter.section(title):
                formatter.write_dl([record for name in names if (record := records[name])])

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        args = _bare_yes_no(self, ctx, args)
        given = list(args)  # click's parser consumes the list it is given
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            token = _typed(exc.option_name, given)
            hint = FOREIGN_OPTIONS.get(token) or FOREIGN_OPTIONS.get(exc.option_name)
            if not hint:
                raise
            shown = token if token in FOREIGN_OPTIONS else exc.option_name
            raise click.NoSuchOption(shown, f"No such option {shown!r} (poprun's option is {hint}).",
                                     ctx=exc.ctx) from None


def _bare_yes_no(command: click.Command, ctx: click.Context, args: list[str]) -> list[str]:
    """``args`` with ``yes`` after each yes/no option given alone (``--print-topology hostname``,
    ``--tee`` last): the option's next word is its value only when it is a yes/no word. A word
    after it that is neither yes/no nor an option is the program, which must then be one found
    here (on PATH, or a path): ``--print-topology maybe prog`` is refused, naming both readings,
    rather than running ``maybe``."""
    options = {opt: p for p in command.params if isinstance(p, click.Option) for opt in (*p.opts, *p.secondary_opts)}
    out: list[str] = []
    i = 0
    while i < len(args):
        word = args[i]
        out.append(word)
        i += 1
        option = options.get(word)
        if word == "--" or (option is None and not word.startswith("-")):  # the program: the rest is its own
            return out + args[i:]
        if option is None or option.is_flag or option.count:
            continue
        if isinstance(option.type, YesNo) and (i == len(args) or not option.type.is_value(args[i])):
            if i < len(args) and not args[i].startswith("-"):
                _check_program_after(option, ctx, word, args[i])
            out.append("yes")
        elif i < len(args):  # the option's value, whatever it looks like
            out.append(args[i])
            i += 1
    return out


def _check_program_after(option: click.Option, ctx: click.Context, flag: str, word: str) -> None:
    """``word`` follows the yes/no option ``flag`` given alone: it is the program, which must be
    found here; else neither reading works, and the line says so."""
    from poprun_py.shared.paths import which

    if which(word) is not None:
        return
    shown = word if len(word) <= 60 else word[:60] + "..."
    program = "an executable file" if os.sep in word else "a program on PATH"
    raise click.BadParameter(f"{shown!r} is not yes or no, nor {program}; give '{flag} yes' or '{flag} no' "
                             "before the program", ctx=ctx, param=option)


def _typed(option: str, args: list[str]) -> str:
    """The word of ``args`` that click's unknown ``option`` came from: ``-np`` for ``-n``, and
    ``-hostfile`` for ``-o`` (click reads it as ``-h`` ``-o`` ``-s`` ...)."""
    for arg in args:
        if arg == "--":
            break
        word = arg.split("=", 1)[0]
        short = not option.startswith("--") and word.startswith("-") and not word.startswith("--")
        if word == option or (short and option[1:] in word[1:]):
            return word
    return option


def vipu_options(func: Any) -> Any:
    """Declare the V-IPU compatibility options (they take any value)."""
    for flag in reversed(VIPU_FLAGS):
        func = click.option(flag, metavar="VALUE", help="V-IPU: there are no IPUs here.")(func)
    return func


def _show_version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    """``poprun X``, then a line per compiled part: present, or missing and what that means
    (asked only here: a launch imports only the parts it uses); then what runs each instance on
    poprun's own host (``POPRUN_STUB``)."""
    if not value or ctx.resilient_parsing:
        return
    from popcontract import compiled
    from poprun_py.planning import per_instance

    try:
        runs = per_instance.describe(per_instance.mode())
    except PlanError as exc:
        runs = f"none: {exc}"
    click.echo("\n".join([f"poprun {__version__}", *compiled.report(),
                          f"each instance on this host runs under: {runs}"]))
    ctx.exit()


def import_config(ctx: click.Context, param: click.Parameter, path: str | None) -> None:
    """Eager: the file's options become click's defaults before any other option is read."""
    if path is not None:
        from poprun_py.cli import config  # json and pathlib, only when a file is given

        config.load(ctx, path)


@click.command(
    cls=PoprunCommand,
    context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"],
                      "max_content_width": 100},
    epilog="Every instance gets POPDIST_* (see popdist_py) and torchrun's variables (RANK, WORLD_SIZE, "
           "LOCAL_RANK, MASTER_ADDR, MASTER_PORT, ...). A yes/no option given alone means yes. Output lines "
           "are tagged '[i] ' with their instance index. "
           "Exit status: 0 when every instance succeeds, else the first failing instance's status "
           "(128+N for signal N; 1 when an MPI instance left early, without MPI_Finalize).",
)
@click.option("--num-instances", type=Count(1, beyond="is more than poprun can start"), default=1, show_default=True,
              metavar="N",
              help="Processes to start.")
@click.option("--num-replicas", type=Count(1), metavar="N",
              help="Total replicas, divided evenly among the instances (default: one per instance).")
@click.option("--ipus-per-replica", type=Count(1), default=1, show_default=True, metavar="N",
              help="Devices per replica (given to instances as POPDIST_NUM_IPUS_PER_REPLICA).")
@click.option("-H", "--host", type=Text(), metavar="LIST",
              help="Hosts to run on: 'a,b' or ranges 'node[0-2,4]'. Instances are spread evenly. "
                   "Default: the scheduler's hosts, the first set of SLURM_JOB_NODELIST, PBS_NODEFILE, "
                   "LSB_DJOB_HOSTFILE or LSB_MCPU_HOSTS, PE_HOSTFILE, OMPI_MCA_orte_default_hostfile or "
                   "HYDRA_HOST_FILE (their slots bound each host's instances), else this machine.")
@click.option("--host-file", type=FileName(exists=True, dir_okay=False, readable=True), metavar="FILE",
              help="File with one host per line, as 'host', 'host slots=N' or 'host:N' (N bounds the host's "
                   "instances); not with --host.")
@click.option("--host-subnet", type=Text(), metavar="CIDR",
              help="Network for traffic between hosts: poprun's control channel, MPI's daemons and MPI itself "
                   "use the interface whose address is in it. Default: the route towards the first remote host.")
@click.option("--launcher-agent", type=Text(empty=False), metavar="PROGRAM",
              help="Reach the other hosts with PROGRAM instead of ssh: mpiexec runs 'PROGRAM HOST COMMAND...' "
                   "(a kubectl exec wrapper, blaunch, a 'qrsh -inherit' wrapper). Default: the agent "
                   "PRTE_MCA_plm_ssh_agent, OMPI_MCA_plm_rsh_agent or HYDRA_LAUNCHER_EXEC names, else ssh.")
@click.option("--mpi-global-args", type=Text(), metavar="ARGS", help="Extra arguments put once on the mpiexec line.")
@click.option("--mpi-local-args", type=Text(), metavar="ARGS", help="Extra arguments for every instance's app context.")
@click.option("--instance-mpi-local-args", multiple=True, type=Text(), metavar="I:ARGS",
              help="Extra app-context arguments for instance I only (repeatable).")
@click.option("--only-output-from-instance", type=Count(0, MAX_COUNT - 1, "is past the last instance poprun can start"),
              metavar="I",
              help="Show only instance I's output (failures of others are still summarised).")
@click.option("--log-dir", type=FileName(file_okay=False), metavar="DIR",
              help="Also write each instance's raw output to DIR/instance-<i>/stdout.log and stderr.log, "
                   "or to output.log when poprun's stdout and stderr are one file or terminal (there an "
                   "instance's streams are one, in the order it wrote them) "
                   "(DIR is created if its parent exists; a restarted job appends).")
@click.option("--tee", type=YesNo(), default="yes", show_default=True,
              help="With --log-dir, still show the output here; no: only in the files.")
@click.option("--prefix-timestamp", type=YesNo("offset"), default="no", show_default=True,
              help="Start every output line with the local time poprun received its first byte: "
                   "'[i] 2026-11-23 01:02:03.456 text'; offset: with the local time's UTC offset, which "
                   "tells the hour repeated at a daylight saving change: '[i] 2026-11-23 01:02:03.456+01:00 text'.")
@click.option("--print-topology", type=YesNo(), default="no", show_default=True,
              help="Print hosts -> instances -> replicas.")
@click.option("--numa-aware", type=YesNo(), default="no", show_default=True, help="Bind instances to NUMA nodes.")
@click.option("--offline-mode", type=YesNo(), default="no", show_default=True,
              help="Run without devices: every run is.")
@click.option("--executable-cache-path", type=Text(empty=False), metavar="DIR",
              help="Shared cache directory, given to instances as POPDIST_EXECUTABLE_CACHE_PATH.")
@click.option("--horovod", is_flag=True,
              help="Let the program's `import horovod` find Horovod's PyTorch API in popdist_py.horovod "
                   "(an installed Horovod still wins).")
@click.option("--import-config", type=FileName(exists=True, dir_okay=False, readable=True), metavar="FILE",
              is_eager=True, expose_value=False, callback=import_config,
              help="Take options from a JSON file (keys: long option names); the command line wins.")
@click.option("--export-config", type=FileName(dir_okay=False), metavar="FILE",
              help="Write the effective options as JSON.")
@click.option("--overwrite-config", is_flag=True, help="Allow --export-config to replace a file.")
@click.option("--mpi", type=Text(empty=False), metavar="PATH",
              help="The mpiexec to use (MPICH or Open MPI). Default: next to this Python, then PATH; "
                   "for a one-host job MPICH's mpiexec.gforker beside it, which opens no port beyond loopback.")
@click.option("--max-restarts", type=Count(0, beyond="is more restarts than poprun makes"), default=0,
              show_default=True, metavar="N",
              help="When an instance fails, stop the job and start it again, up to N times; instances get "
                   "POPDIST_RESTART_COUNT (and TORCHELASTIC_RESTART_COUNT) to resume from a checkpoint.")
@click.option("--restart-backoff", type=Count(0, 3600, "is more than an hour"), default=1, show_default=True,
              metavar="SECONDS",
              help="Wait this long before the first restart, twice as long before each next one (at most 60 s).")
@click.option("--min-hosts", type=Count(1), default=1, show_default=True, metavar="N",
              help="A restart leaves out the hosts that were lost or could not start, and spreads the same "
                   "replicas over the hosts left; with fewer than N left, poprun stops instead.")
@click.option("--host-cooldown", type=Count(0, 86400, "is more than a day"), default=60, show_default=True,
              metavar="SECONDS",
              help="How long a failed host is left out; twice as long after each further failure of it.")
@click.option("--host-discovery-script", type=FileName(dir_okay=False), metavar="PATH",
              help="A program that prints the hosts available now, one 'host' or 'host:slots' per line "
                   "(Horovod's contract): asked at every restart (and for the first start without "
                   "-H/--host-file), so a repaired or new host joins, up to the job's first number of hosts; "
                   "slots bounds the instances a restart puts there.")
@click.option("--error-file", type=FileName(dir_okay=False), metavar="FILE",
              help="When a start of the job fails, write every start so far to FILE as a JSON list, the last "
                   "one last: restart, hosts, instances, lost hosts; the root cause (the instance that failed "
                   "first): its instance, host, status, signal, time, reason, the last lines of its stderr and "
                   "what it recorded; every instance that failed, the first first; and those poprun stopped.")
@click.option("--start-timeout", type=Count(1, 86400, "is more than a day"), default=120, show_default=True,
              metavar="SECONDS",
              help="Stop the job when an instance has not started this long after mpiexec did (a host that "
                   "never runs the launcher's processes, a process limit), saying which.")
@click.option("--master-port", type=Port(), metavar="PORT",
              help="MASTER_PORT, where instance 0 serves torch.distributed's store (env://). Default: a port "
                   "free on MASTER_ADDR when instance 0 runs on this machine, else 29500 (torchrun's).")
@click.option("--dry-run", is_flag=True, help="Print the plan, the exact mpiexec command and the program the instances "
              "are given; start nothing.")
@click.option("-v", "--verbose", count=True, help="-v: progress; -vv: debug.")
@vipu_options
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_show_version,
              help="Show the version, and which compiled parts this install has (missing: what that means), and exit.")
@click.argument("program", required=False, metavar="PROGRAM")
@click.argument("args", nargs=-1, type=click.UNPROCESSED, metavar="[ARGS]...")
@click.pass_context
def poprun(ctx: click.Context, /, **options: Any) -> dict[str, Any]:
    """Launch PROGRAM as --num-instances processes on MPI, each driving its share of --num-replicas."""
    if options["export_config"]:
        from poprun_py.cli.config import export

        export(ctx, options["export_config"], options["overwrite_config"])
    for flag in VIPU_FLAGS:
        if options.pop(flag[2:].replace("-", "_")) is not None:
            log.warning("%s has no effect in poprun-py (there is no V-IPU here); ignored", flag)
    return options


def parse(argv: list[str]) -> LaunchOptions | int:
    """The options for ``argv``, or an exit status when there is nothing to launch (help,
    version, or a usage error, already printed as one line: 2 for one the options' own checks find)."""
    try:
        result = poprun.main(args=argv, prog_name="poprun", standalone_mode=False)
    except click.ClickException as exc:
        message = exc.format_message()
        if isinstance(exc, click.BadParameter):
            from poprun_py.cli.config import blame

            message = blame(exc) or message
        click.echo(f"poprun: error: {message}", err=True)
        return exc.exit_code
    except click.exceptions.Abort:
        return 130
    if not isinstance(result, dict):
        return int(result or 0)
    try:
        return LaunchOptions.from_command_line(result)
    except PlanError as exc:
        click.echo(f"poprun: error: {exc}", err=True)
        return 2
