"""Find ``mpiexec``, tell MPICH (Hydra) from Open MPI, and build the one command that starts a job.

Every instance is its own MPMD app context (``A : B : ...``) because each gets different
``POPDIST_*`` values, as PopRun does with Open MPI's ``mpirun``. Hosts are one list for the
whole job (``-hosts h0:k,h1:k`` / ``--host h0:k,...``), filled in order; past
``MAX_COMMAND_BYTES`` the host list and the app contexts go to files instead of the command line.
Each app context runs the instance's stub with the instance's index alone: the user's program and
its arguments are never mpiexec's to read (the stub gets them from its host's supervisor, which
has them from poprun: ``poprun_py/stub``).
"""

from __future__ import annotations

import os
import sys
from typing import NamedTuple

from popcontract import compiled, environment, settings
from poprun_py.planning.agent import hydra_uses_ssh
from poprun_py.shared import loopback
from poprun_py.shared.errors import PlanError
from poprun_py.shared.paths import which

TYPE_CHECKING = False  # typing.TYPE_CHECKING (typing itself comes with click)
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Literal

    from poprun_py.planning.plan import JobPlan

    Flavour = Literal["mpich", "openmpi"]

#: poprun's control address where no real one is known yet (a dry run, the checks before the start).
CONTROL_SHOWN = "<poprun-address>:<port>"
#: Open MPI does not forward the environment by default; PopRun forwards these by name.
OPENMPI_FORWARDED = ("PATH", "LD_LIBRARY_PATH", environment.PYTHONPATH, "VIRTUAL_ENV")
#: ... and every variable with one of these prefixes.


class MpiLauncher:
    """An mpiexec and the MPI it belongs to. ``instead``: for gforker that poprun picked itself,
    the launcher it stands in for, which starts a job too large for gforker (see :func:`build_command`)."""

    __slots__ = ("flavour", "instead", "path", "version")

    def __init__(self, path: str, flavour: Flavour, version: str, instead: MpiLauncher | None = None) -> None:
        self.path = path
        self.flavour = flavour
        self.version = version
        self.instead = instead

    def __repr__(self) -> str:
        return f"MpiLauncher({self.path!r}, {self.flavour!r}, {self.version!r})"


def find_mpiexec(explicit: str | None = None) -> str:
    """``--mpi PATH`` if given, else the mpiexec next to the running Python, else the one on PATH."""
    if explicit:
        resolved = which(explicit) if os.sep not in explicit else explicit
        if not resolved or not os.path.isfile(resolved) or not os.access(resolved, os.X_OK):
            raise PlanError(f"--mpi {explicit!r} is not an executable file; give the path of mpiexec or mpirun")
        return os.path.abspath(resolved)
    beside_python = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.isfile(beside_python) and os.access(beside_python, os.X_OK):
        return beside_python
    on_path = which("mpiexec") or which("mpirun")
    if not on_path:
        raise PlanError(
            "no mpiexec found next to Python or on PATH; install the 'mpich' wheel "
            "(pip install mpich) or pass --mpi /path/to/mpiexec"
        )
    return on_path


def one_host_launcher(launcher: MpiLauncher) -> MpiLauncher:
    """What starts a job on this host alone when poprun chose the MPI itself: MPICH's gforker when
    it sits beside Hydra's mpiexec (the mpich wheel has both), else ``launcher``.

    gforker starts the instances itself and reaches them over socket pairs: nothing listens, and
    no library is preloaded into it (Hydra's mpiexec needs one: :func:`loopback_library`). A job
    whose command would not fit on gforker's command line is started by ``launcher`` instead."""
    gforker = os.path.join(os.path.dirname(launcher.path), GFORKER)
    if launcher.flavour != "mpich" or not os.access(gforker, os.X_OK):
        return launcher
    return MpiLauncher(gforker, "mpich", launcher.version, instead=launcher)


def is_gforker(launcher: MpiLauncher) -> bool:
    """By the executable's own name: a link named ``mpiexec`` may lead to it."""
    return launcher.flavour == "mpich" and os.path.basename(os.path.realpath(launcher.path)) == GFORKER


#: MPICH's launcher for one host, which opens no socket to listen on.
GFORKER = "mpiexec.gforker"
#: Where the proxies of a one-host job's Hydra call its mpiexec back.
LOOPBACK_ADDRESS = "127.0.0.1"


def loopback_library(launcher: MpiLauncher) -> str | None:
    """The library preloaded into ``launcher`` in a one-host job to keep it on loopback
    (:mod:`poprun_py.shared.loopback`); None for gforker, which listens on nothing.

    Hydra's mpiexec and Open MPI's prterun listen on every interface whatever their options say
    (both bind the wildcard address); without the library they would open a port to the network,
    so its absence is refused, before anything starts."""
    if is_gforker(launcher):
        return None
    library = loopback.library()
    if library is None:
        raise PlanError(compiled.missing_line(compiled.LOOPBACK, f"{launcher.path} would listen on every "
                                              "interface: keeping it on loopback in a one-host job"))
    return library


def _loopback_env(launcher: MpiLauncher, spec: CommandSpec) -> dict[str, str]:
    """One host: the launcher's ``LD_PRELOAD``, with the library first (its host's
    supervisor takes it out again before the program starts: what the program listens on is its own business)."""
    if spec.callback_address or not (library := loopback_library(launcher)):
        return {}
    return {environment.LD_PRELOAD: loopback.preloaded(settings.text(environment.LD_PRELOAD), library)}


#: Files that sit beside each flavour's mpiexec: telling them apart costs a stat, not a process.
_SIBLINGS: dict[Flavour, tuple[str, ...]] = {"mpich": ("hydra_pmi_proxy",), "openmpi": ("prterun", "orterun")}


def detect_launcher(path: str, need_version: bool = False) -> MpiLauncher:
    """Which MPI ``path`` belongs to: from the files beside it when that is unambiguous (every
    launch pays for this, so no process is started), else from ``path --version``."""
    if not need_version:
        real = os.path.realpath(path)
        folder = os.path.dirname(real)
        found = [flavour for flavour, names in _SIBLINGS.items()
                 if any(os.path.exists(os.path.join(folder, name)) for name in names)]
        if len(found) == 1:
            return MpiLauncher(path, found[0], "unknown")
    return _ask_version(path)


def _ask_version(path: str) -> MpiLauncher:
    import subprocess

    try:
        out = subprocess.run([path, "--version"], capture_output=True, timeout=20, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PlanError(f"could not run {path!r} --version to detect the MPI flavour: {exc}") from None
    text = (out.stdout + out.stderr).decode(errors="replace").replace("\0", "")
    if "HYDRA" in text or "MPICH" in text.upper():
        version = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if "Version:" in ln), "unknown")
        return MpiLauncher(path, "mpich", version)
    if "Open MPI" in text or "OpenRTE" in text or "prterun" in text.lower():
        first = text.strip().splitlines()[0] if text.strip() else ""
        version = first.rsplit(" ", 1)[-1] if first else "unknown"
        return MpiLauncher(path, "openmpi", version)
    first_line = text.strip().splitlines()[0] if text.strip() else "(no output)"
    raise PlanError(
        f"{path!r} is neither MPICH (Hydra) nor Open MPI (its --version says {first_line!r}); "
        "pass --mpi with an MPICH or Open MPI mpiexec"
    )


class CommandSpec(NamedTuple):
    """Everything that shapes the mpiexec command apart from the plan; read-only (a start's own
    control address is a new spec: ``spec._replace(control_address=...)``).

    ``launch_env``: what every instance gets besides the plan's variables, the same for every start:
    poprun's settings passed on (``PYTHONUNBUFFERED``, the user's ``OMP_NUM_THREADS``, ...) and
    those its options give (``POPRUN_ONE_STREAM``, ``POPRUN_HOST_SUBNET``).
    ``control_address``: where poprun listens for this start's hosts' supervisors (``POPRUN_CONTROL``).
    ``callback_address``: the local address remote hosts reach this one on (None: one-host job).
    ``host_subnet``: ``--host-subnet``'s CIDR, which MPI's own traffic is kept to as well.
    ``launcher_agent``: the program that reaches the other hosts instead of ssh (``agent``).
    ``silence_limit``: ``POPRUN_SILENCE_LIMIT``, which bounds how long ssh and Open MPI's daemons
    wait for a host that does not answer (``ssh_args``, ``daemon_keepalive``).
    """

    launch_env: Mapping[str, str]
    #: Each instance runs ``stub + [index]``.
    stub: tuple[str, ...]
    silence_limit: float
    control_address: str = CONTROL_SHOWN
    global_args: tuple[str, ...] = ()
    local_args: tuple[str, ...] = ()
    instance_local_args: Mapping[int, list[str]] = {}
    numa_aware: bool = False
    explicit_hosts: bool = False
    callback_address: str | None = None
    host_subnet: str | None = None
    launcher_agent: str | None = None


def job_env(plan: JobPlan, spec: CommandSpec) -> dict[str, str]:
    """What every instance of ``plan`` gets (``-genv`` / ``-x``): the plan's variables, the launch's
    own, and where poprun listens."""
    return {**plan.job_env(), **spec.launch_env, environment.CONTROL: spec.control_address}


def instance_environment(plan: JobPlan, spec: CommandSpec, index: int) -> dict[str, str]:
    """Everything the command gives instance ``index``: the job's variables, then its own."""
    return {**job_env(plan, spec), **plan.instance_env(index)}


#: Above this many bytes of arguments, the host list and the app contexts go to files (Hydra's
#: ``-f`` and ``-configfile``, Open MPI's ``--hostfile`` and ``--app``): Linux refuses one
#: argument over 128 KiB and a whole command line near 2 MiB, and a dry run of such a line is
#: unreadable.
MAX_COMMAND_BYTES = 64 * 1024
#: The most bytes of a line of an app file Open MPI reads whole: 5.0's prterun reads each in a
#: buffer of 1024 bytes, newline and NUL included; a longer line was cut in two, and the job never started ("No
#: executable was specified") or prterun crashed.
OPENMPI_APP_LINE = 1022


def ssh_args(silence_limit: float) -> str:
    """ssh's options for reaching hosts: fail within a bound instead of hanging on a dead host or a
    password prompt. A host may take half the silence limit to answer a connection (10 s under the
    default 20 s), and one that stops answering is given up after three keep-alives a quarter of
    the limit apart (at most 5 s); ``inf`` leaves ssh's own connect timeout. Users' own
    HYDRA_LAUNCHER_EXTRA_ARGS / plm_ssh_args win."""
    connect = "" if silence_limit == float("inf") else f"-o ConnectTimeout={max(1, round(silence_limit / 2))} "
    alive = max(1, round(min(5.0, silence_limit / 4)))
    return f"{connect}-o BatchMode=yes -o ServerAliveInterval={alive} -o ServerAliveCountMax=3"


class Command:
    """The mpiexec command for a job.

    ``head`` comes first, then the host list, then ``tail`` (global options), then one app
    context per instance. When all of it would be longer than ``MAX_COMMAND_BYTES``, the host
    list and the app contexts go to files instead (``files``), and ``argv`` names them.
    """

    def __init__(self, head: list[str], hosts: HostList | None, tail: list[str], blocks: list[list[str]],
                 context_option: str, env: dict[str, str]) -> None:
        self.head = head
        self.hosts = hosts
        self.tail = tail
        self.blocks = blocks
        self.context_option = context_option
        #: Variables mpiexec itself needs (e.g. its ssh options), added to poprun's environment.
        self.env = env
        inline = [*head, *(hosts.inline if hosts else []), *tail, *(a for b in blocks for a in b)]
        self.uses_files = sum(len(a) + 1 for a in inline) > MAX_COMMAND_BYTES

    def files(self) -> dict[str, str]:
        """``{placeholder: content}`` of the files ``argv`` names (none for a short command)."""
        if not self.uses_files:
            return {}
        files = {"<config-file>": "".join(line + "\n" for line in self.context_lines())}
        if self.hosts:
            files["<host-file>"] = self.hosts.file_text
        return files

    def context_lines(self) -> list[str]:
        """The app contexts as the config file's lines: each token as it is, for mpiexec splits the
        lines at white space and removes no quotes (a shell-quoted ``-x 'A=a&b'`` set no variable
        under Open MPI, and gave Hydra's ``-env A 'a&b'`` its quotes)."""
        return [" ".join(block) for block in self.blocks]

    def argv(self, paths: dict[str, str] | None = None) -> list[str]:
        """The command; ``paths`` maps each placeholder of ``files`` to where it was written."""
        paths = paths or {}
        if self.uses_files:
            hosts = [self.hosts.file_option, paths.get("<host-file>", "<host-file>")] if self.hosts else []
            return [*self.head, *hosts, *self.tail, self.context_option, paths.get("<config-file>", "<config-file>")]
        argv = [*self.head, *(self.hosts.inline if self.hosts else []), *self.tail]
        for index, block in enumerate(self.blocks):
            argv += [":", *block] if index else block
        return argv


class HostList:
    """The job's hosts with their slots, inline (``-hosts a:2,b:2``) and as a machine file."""

    def __init__(self, inline: list[str], file_option: str, file_text: str) -> None:
        self.inline = inline
        self.file_option = file_option
        self.file_text = file_text


def build_command(launcher: MpiLauncher, plan: JobPlan, spec: CommandSpec) -> Command:
    """The command for ``plan``; a job too large for one command line gets config files, whose
    lines mpiexec splits at white space with no quoting.

    A job too large for gforker (:func:`_too_large_for_gforker`) goes to the launcher gforker stands
    in for when poprun picked gforker (Hydra's mpiexec, kept on loopback), and is refused when the
    user did."""
    build = _mpich_command if launcher.flavour == "mpich" else _openmpi_command
    command = build(launcher, plan, spec)
    if is_gforker(launcher) and (too_large := _too_large_for_gforker(command)):
        if launcher.instead is not None:
            return build_command(launcher.instead, plan, spec)
        raise PlanError(f"{launcher.path} cannot start this job: {too_large}; pass --mpi with Hydra's mpiexec instead")
    if not command.uses_files:
        return command
    for block in command.blocks:
        for token in block:
            # (split: white space as str.isspace knows it, in C rather than a loop per character)
            if not token or token.split() != [token] or any(quote in token for quote in "'\"\\"):
                raise PlanError(f"{token!r} cannot go in mpiexec's config file, which a job this large needs "
                                "(its lines are split at white space, without quoting); use arguments "
                                "without spaces or quotes in --mpi-local-args / --instance-mpi-local-args")
    if launcher.flavour == "openmpi":
        longest = max(len(line.encode(errors="surrogateescape")) for line in command.context_lines())
        if longest > OPENMPI_APP_LINE:
            raise PlanError(f"an instance's app context is {longest} bytes, and Open MPI reads at most "
                            f"{OPENMPI_APP_LINE} of a line of its app file, which a job this large needs; "
                            "shorten --mpi-local-args / --instance-mpi-local-args")
    return command


#: The most variables gforker passes on from its own environment: MPICH 5.0.2's refuses 193 or more
#: ("Environment is too large (max is 193)", from each instance); its -genv and -env do not count.
GFORKER_MAX_VARIABLES = 192


def _too_large_for_gforker(command: Command) -> str | None:
    """Why gforker cannot start ``command``, or None. It reads no config file: given ``-configfile``
    it starts nothing and exits 0 (MPICH 5.0.2 turns each line into no arguments at all); and it
    refuses an environment of more than GFORKER_MAX_VARIABLES (mpiexec gets poprun's, with the
    command's own variables and the job's secret)."""
    if command.uses_files:
        return (f"its command would be longer than {MAX_COMMAND_BYTES // 1024} KiB, and gforker ignores the "
                "config file that would take it")
    variables = len(os.environ.keys() | command.env.keys() | {environment.SECRET})
    if variables > GFORKER_MAX_VARIABLES:
        return (f"its environment would have {variables} variables, and gforker passes on "
                f"{GFORKER_MAX_VARIABLES} at most")
    return None


def _mpich_command(launcher: MpiLauncher, plan: JobPlan, spec: CommandSpec) -> Command:
    # One host list for the job: Hydra fills each host's slots in order, so instance i lands on
    # host i // k exactly as the plan says; the app contexts carry only what differs.
    hosts = None
    if spec.explicit_hosts:
        k = plan.instances_per_host
        hosts = HostList(["-hosts", ",".join(f"{h}:{k}" for h in plan.host_names)], "-f",
                         "".join(f"{h}:{k}\n" for h in plan.host_names))
    tail, env = [], _loopback_env(launcher, spec)
    if spec.callback_address:
        tail += ["-localhost", spec.callback_address]  # where the remote proxies call back
        if spec.launcher_agent:
            # Hydra's rsh launcher runs 'AGENT HOST COMMAND...', as ssh's would with '-x' first.
            tail += ["-launcher", "rsh", "-launcher-exec", spec.launcher_agent]
        elif settings.given(environment.HYDRA_SSH_ARGS) is None and hydra_uses_ssh(spec.global_args):
            env[environment.HYDRA_SSH_ARGS] = ssh_args(spec.silence_limit)
    elif environment.LD_PRELOAD in env and "-localhost" not in spec.global_args:
        # Hydra on one host: its mpiexec listens on loopback, so that is where a proxy that calls
        # back over TCP must go, whatever this host's name resolves to (Hydra takes one -localhost).
        tail += ["-localhost", LOOPBACK_ADDRESS]
    if spec.numa_aware:
        tail += ["-bind-to", "numa"]
    for name, value in job_env(plan, spec).items():
        tail += ["-genv", name, value]
    blocks = []
    for inst in plan.instances:
        block = ["-n", "1"]
        for name, value in plan.instance_env(inst.index).items():
            block += ["-env", name, value]
        blocks.append([*block, *spec.local_args, *spec.instance_local_args.get(inst.index, []),
                       *spec.stub, str(inst.index)])
    return Command([launcher.path, *spec.global_args], hosts, tail, blocks, "-configfile", env)


#: Open MPI's daemons on other hosts notice within about 8 s that their launcher can no longer be
#: reached (TCP keep-alives on its connection; by default 8 minutes) and end: a host cut off from
#: the job keeps none of them while it stays cut off. Well before the stubs there stop their
#: programs (the silence limit): the daemon then reports those exits to its launcher, and the
#: kernel sends no keep-alive while data waits unacknowledged, so a daemon that had not given up by
#: then would wait for TCP's retransmissions to give up (15 minutes). Idle time and interval are
#: ``daemon_keepalive`` seconds each, ``DAEMON_PROBES`` probes: 8 s under the default 20 s limit.
DAEMON_PROBES = 3


def daemon_keepalive(silence_limit: float) -> int:
    """Seconds of idle time, and between probes, for Open MPI's daemons' keep-alives under a silence
    limit (``POPRUN_SILENCE_LIMIT``) of ``silence_limit`` seconds: 2 from 20 s up, 1 below, so
    that a daemon gives up on an unreachable launcher well before the limit (4 s, 8 s)."""
    return 2 if silence_limit >= 20 else 1


def _openmpi_command(launcher: MpiLauncher, plan: JobPlan, spec: CommandSpec) -> Command:
    head = [launcher.path, *spec.global_args]
    head += ["--bind-to", "numa", "--map-by", "numa"] if spec.numa_aware else ["--bind-to", "none"]
    hosts, tail = None, []
    if spec.explicit_hosts:
        # Each host offers exactly the plan's slots and they are filled in order, so instance i
        # lands on host i // k. (Adding --oversubscribe here makes Open MPI ignore the order.)
        k = plan.instances_per_host
        hosts = HostList(["--host", ",".join(f"{h}:{k}" for h in plan.host_names)], "--hostfile",
                         "".join(f"{h} slots={k}\n" for h in plan.host_names))
        if not spec.numa_aware:
            tail += ["--map-by", "slot"]
    else:
        # One host: instances are placed by poprun's plan, not by Open MPI's slot count (2 cores
        # would refuse 4 instances).
        tail.append("--oversubscribe")
    if hasattr(os, "geteuid") and os.geteuid() == 0 and "--allow-run-as-root" not in spec.global_args:
        tail.append("--allow-run-as-root")
    if spec.host_subnet:
        tail += ["--mca", "btl_tcp_if_include", spec.host_subnet, "--prtemca", "oob_tcp_if_include",
                 spec.host_subnet]
    if spec.callback_address:
        step = daemon_keepalive(spec.silence_limit)
        keepalive = (("oob_tcp_keepalive_time", step), ("oob_tcp_keepalive_intvl", step),
                     ("oob_tcp_keepalive_probes", DAEMON_PROBES))
        tail += [arg for name, value in keepalive for arg in ("--prtemca", name, str(value))]
        if spec.launcher_agent:
            # Every daemon is started from here, through the agent: with a tree, daemons would start
            # others from their hosts, where the agent may not be (kubectl in the launcher's pod alone).
            tail += ["--prtemca", "plm_ssh_agent", spec.launcher_agent, "--prtemca", "plm_ssh_no_tree_spawn", "1"]
    env = _loopback_env(launcher, spec)
    if spec.callback_address and not spec.launcher_agent and settings.given(environment.PRTE_SSH_ARGS) is None:
        env[environment.PRTE_SSH_ARGS] = ssh_args(spec.silence_limit)
    # Open MPI forwards no environment unless told: the job's values, then the caller's by name.
    common = job_env(plan, spec)
    for name, value in common.items():
        tail += ["-x", f"{name}={value}"]
    for name in forwarded_names(common):
        tail += ["-x", name]
    blocks = []
    for inst in plan.instances:
        block = ["-np", "1"]
        for name, value in plan.instance_env(inst.index).items():
            block += ["-x", f"{name}={value}"]
        blocks.append([*block, *spec.local_args, *spec.instance_local_args.get(inst.index, []),
                       *spec.stub, str(inst.index)])
    return Command(head, hosts, tail, blocks, "--app", env)


def forwarded_names(already: dict[str, str]) -> list[str]:
    """What Open MPI must forward by name from mpiexec's environment: PopRun's list plus every
    POPDIST_*, POPRUN_* and MPI4PY_* variable of poprun's (mpi4py must load the same MPI on every
    host), and the job's secret, which poprun puts in mpiexec's environment alone."""
    names = [name for name in OPENMPI_FORWARDED if name in os.environ]
    names += sorted(name for name in {*os.environ, environment.SECRET}
                    if name.startswith(environment.FORWARDED_PREFIXES) and name not in already and name not in names)
    return names


def split_args(text: str | None, option: str) -> list[str]:
    """shlex-split an option's value; unbalanced quotes are a usage error naming the option."""
    if not text:
        return []
    import shlex

    try:
        return shlex.split(text)
    except ValueError as exc:
        raise PlanError(f"{option} {text!r} cannot be split into arguments: {exc}") from None


def parse_instance_local_args(values: tuple[str, ...] | list[str], num_instances: int) -> dict[int, list[str]]:
    """``I:ARGS`` entries (repeatable; repeats for one instance are joined in order)."""
    result: dict[int, list[str]] = {}
    for value in values:
        index_text, sep, args = value.partition(":")
        if not sep or not index_text.strip().isdigit():
            raise PlanError(
                f"--instance-mpi-local-args {value!r} is not of the form I:ARGS with I an instance index, "
                f"e.g. '1:-env FOO bar'"
            )
        index = int(index_text)
        if index >= num_instances:
            raise PlanError(
                f"--instance-mpi-local-args {value!r} names instance {index}, but instances are "
                f"0..{num_instances - 1}"
            )
        result.setdefault(index, []).extend(split_args(args, "--instance-mpi-local-args"))
    return result
