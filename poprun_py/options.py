"""``poprun``'s options, defined once: the click command (``command.py``) and the launch fast
path (``fast_args.py``) are both built from this table, so they cannot drift apart.

Click-free on purpose: a plain launch never imports click (see ``fast_args.py``).
"""

from __future__ import annotations

# Kinds of option value. The fast path converts them with the functions below; the click
# command uses the click types that accept exactly the same text.
POSITIVE = "positive"  # integer >= 1
INDEX = "index"  # integer >= 0
YES_NO = "yes|no"
TEXT = "text"
TEXTS = "texts"  # repeatable text, collected in order
FLAG = "flag"
COUNT = "count"  # repeatable flag, counted


class Option:
    """One command-line option: its flags, where its value goes, its kind, default and help."""

    __slots__ = ("default", "dest", "fast", "flags", "help", "kind", "metavar", "show_default")

    def __init__(self, flags: tuple[str, ...], kind: str, help: str, default: object = None,
                 metavar: str | None = None, show_default: bool = False, fast: bool = True) -> None:
        self.flags = flags
        self.dest = flags[-1].lstrip("-").replace("-", "_")
        self.kind = kind
        self.default = () if kind == TEXTS else 0 if kind == COUNT else False if kind == FLAG else default
        self.metavar = metavar
        self.help = help
        self.show_default = show_default
        #: False: the fast path leaves this option to click (it needs click's context, or warns).
        self.fast = fast


VIPU_FLAGS = (
    "--vipu-server-host", "--vipu-server-port", "--vipu-server-timeout", "--vipu-partition",
    "--vipu-partition-attempts", "--update-partition", "--reset-partition", "--remove-partition",
    "--vipu-cluster", "--vipu-allocation", "--num-ilds",
)

OPTIONS: tuple[Option, ...] = (
    Option(("--num-instances",), POSITIVE, "Processes to start.", default=1, show_default=True),
    Option(("--num-replicas",), POSITIVE,
           "Total replicas, divided evenly among the instances.  [default: one per instance]"),
    Option(("--ipus-per-replica",), POSITIVE,
           "Devices per replica (given to instances as POPDIST_NUM_IPUS_PER_REPLICA).", default=1,
           show_default=True),
    Option(("-H", "--host"), TEXT,
           "Hosts to run on: 'a,b' or ranges 'node[0-2,4]'. Instances are spread evenly.", metavar="LIST"),
    Option(("--host-file",), TEXT, "File with one host per line (not with --host).", metavar="FILE"),
    Option(("--host-subnet",), TEXT,
           "Network for traffic between hosts: poprun's control channel, MPI's daemons and MPI itself "
           "use the interface whose address is in it. Default: the route towards the first remote host.",
           metavar="CIDR"),
    Option(("--mpi-global-args",), TEXT, "Extra arguments put once on the mpiexec line.", metavar="ARGS"),
    Option(("--mpi-local-args",), TEXT, "Extra arguments for every instance's app context.", metavar="ARGS"),
    Option(("--instance-mpi-local-args",), TEXTS,
           "Extra app-context arguments for instance I only (repeatable).", metavar="I:ARGS"),
    Option(("--only-output-from-instance",), INDEX,
           "Show only instance I's output (failures of others are still summarised).", metavar="I"),
    Option(("--print-topology",), YES_NO, "Print hosts -> instances -> replicas [no].", default=False),
    Option(("--numa-aware",), YES_NO, "Bind instances to NUMA nodes [no].", default=False),
    Option(("--offline-mode",), YES_NO,
           "Run without devices [no]. Every run is offline here; accepted for compatibility.", default=False),
    Option(("--executable-cache-path",), TEXT,
           "Shared cache directory, given to instances as POPDIST_EXECUTABLE_CACHE_PATH.", metavar="DIR"),
    Option(("--import-config",), TEXT, "Load options from a JSON file; the command line wins.",
           metavar="FILE", fast=False),
    Option(("--export-config",), TEXT, "Write the effective options as JSON.", metavar="FILE", fast=False),
    Option(("--overwrite-config",), FLAG, "Allow --export-config to replace a file."),
    Option(("--mpi",), TEXT, "The mpiexec to use (MPICH or Open MPI). Default: next to this Python, then PATH.",
           metavar="PATH"),
    Option(("--dry-run",), FLAG, "Print the plan and the exact mpiexec command; start nothing."),
    Option(("-v", "--verbose"), COUNT, "-v: progress; -vv: debug."),
    *(Option((flag,), TEXT, "Accepted for PopRun compatibility; has no effect (warned).", metavar="VALUE",
             fast=False) for flag in VIPU_FLAGS),
)

BY_FLAG: dict[str, Option] = {flag: option for option in OPTIONS for flag in option.flags}


def to_int(text: str, minimum: int) -> int:
    """``text`` as an integer >= ``minimum`` (ValueError otherwise), as click's IntRange reads it."""
    value = int(text)
    if value < minimum:
        raise ValueError(f"{value} is below {minimum}")
    return value


def yes_no(value: object) -> bool:
    """PopRun's yes/no option values (also true/false, on/off, 1/0); ValueError otherwise."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("yes", "y", "true", "1", "on"):
        return True
    if text in ("no", "n", "false", "0", "off"):
        return False
    raise ValueError(f"{value!r} is not yes or no")


def convert(option: Option, text: str) -> object:
    """The value of ``option`` given as ``text`` on the command line; ValueError if invalid."""
    if option.kind == POSITIVE:
        return to_int(text, 1)
    if option.kind == INDEX:
        return to_int(text, 0)
    if option.kind == YES_NO:
        return yes_no(text)
    return text
