"""Turn the launch options into a plan and one mpiexec command, then supervise the job.

Runs on every launch before mpiexec starts, so it imports only what a plain launch needs;
``--dry-run``, host lists and topology printing bring in their modules when asked for.
"""

from __future__ import annotations

import os
import sys
import time
from types import MappingProxyType
from typing import NamedTuple

from popcontract import environment, settings
from poprun_py.shared import paths
from poprun_py.shared.errors import PlanError
from poprun_py.supervision import interrupts, log, own_output

TYPE_CHECKING = False  # typing.TYPE_CHECKING (typing itself comes with click)
if TYPE_CHECKING:
    from collections.abc import Callable

    from poprun_py.host.programs import HostPrograms
    from poprun_py.planning.agent import Agent
    from poprun_py.planning.mpi import Command, CommandSpec, MpiLauncher
    from poprun_py.planning.options import Hosts, LaunchOptions
    from poprun_py.planning.plan import JobPlan
    from poprun_py.supervision.error_file import ErrorFile
    from poprun_py.supervision.output import OutputOptions
    from poprun_py.supervision.restarts import Restarts


class ProgramError(Exception):
    """The program cannot be started here; ``status`` is the shell's (127 not found, 126 not executable)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def launch(options: LaunchOptions) -> int:
    """Run the job ``options`` describe; its exit status."""
    if not options.dry_run:  # the job is what poprun is for now, not its own output
        own_output.job_runs()
    log.configure(options.verbose)
    grace, silence = _kill_grace(), _silence_limit()
    from poprun_py.planning.mpi import detect_launcher, find_mpiexec
    from poprun_py.planning.plan import JobPlan

    hosts, slots, source = _resolve_hosts(options.hosts, options.failures.host_discovery_script)
    from poprun_py.planning.agent import find_agent

    # The variables that name an agent are read where there are hosts to reach; the option always.
    agent = find_agent(options.hosts.launcher_agent) if hosts or options.hosts.launcher_agent else None
    if agent is not None:
        log.info("reaching other hosts with %s (%s) instead of ssh", agent.path, agent.given_by)
    # The layout alone, checked before any name is resolved; the plan adds torchrun's contract.
    shape = JobPlan(options.num_instances, options.replicas, options.ipus_per_replica, tuple(hosts),
                    options.executable_cache_path, python_path=_python_path(options.horovod))
    _check_slots(shape, slots, source)
    if options.output.log_dir is not None or not options.output.tee:
        from poprun_py.supervision.output import check_log_options

        check_log_options(options.output.log_dir, options.output.tee, create=not options.dry_run)
    # A dry run asks no resolver: the address remote hosts call back on is shown as a placeholder.
    remote = _remote_hosts(hosts, resolve=not options.dry_run)
    callback = _callback_address(hosts, remote, options.hosts.host_subnet, resolve=not options.dry_run)
    # The job's id is the same for every start; a dry run prints the same each time.
    run_id = "<run-id>" if options.dry_run else os.urandom(8).hex()
    master_addr, master_port = _torchrun_contract(hosts, remote, callback, options)
    plan = shape.replace(run_id=run_id, max_restarts=options.failures.max_restarts,
                         error_dir=f"{paths.temporary_folder()}/poprun-{run_id}", master_addr=master_addr,
                         master_port=master_port())
    start = Start(plan, tuple(remote), callback, master_port, command_spec(options, plan, callback, agent), agent)
    _check_program(options.program, bool(remote))
    launcher = detect_launcher(find_mpiexec(options.mpi.mpi), need_version=options.dry_run or options.verbose > 0)
    if not options.mpi.speaks_to_an_mpiexec() and not hosts:
        from poprun_py.planning.mpi import one_host_launcher

        launcher = one_host_launcher(launcher)  # opens no port beyond loopback
    log.info("using %s (%s %s)%s", launcher.path, launcher.flavour, launcher.version,
             f", or {launcher.instead.path} for a command too long for it" if launcher.instead else "")
    if callback is None:
        # One host, before anything starts: a launcher that needs poprun's loopback library is
        # refused without it, and so is a command that gforker cannot take and Hydra may not.
        from poprun_py.planning.mpi import build_command

        build_command(launcher, plan, start.spec)
    errors = _error_file(options.failures.error_file)

    if options.print_topology or options.dry_run:
        from poprun_py.planning.plan_table import render_plan_table

        print(render_plan_table(plan))
    if options.dry_run:
        from poprun_py.planning.mpi import build_command

        if errors is not None:
            errors.close()
        _print_dry_run(plan, launcher, build_command(launcher, plan, start.spec), program_argv(options))
        return 0
    _check_open_files(plan.instances_per_host, plan.num_instances, options.output.log_dir is not None)
    _say_threads_per_instance(plan, remote)
    return _run(options, start, launcher, (grace, silence), errors, slots)


def _error_file(path: str | None) -> ErrorFile | None:
    """--error-file, checked before anything starts (PlanError when it could not take the record);
    held open until poprun exits where it is not a regular file (a FIFO's reader waits for it)."""
    if path is None:
        return None
    from poprun_py.supervision.error_file import ErrorFile

    return ErrorFile(path)


def program_argv(options: LaunchOptions) -> list[bytes]:
    """The program and its arguments exactly as poprun was given them: the bytes of its own command
    line (Python read them as text, any bytes that are not UTF-8 as surrogate escapes)."""
    return [os.fsencode(word) for word in (options.program or "", *options.args)]


def _kill_grace() -> float:
    """$POPRUN_KILL_GRACE, which every host's supervisor reads too: one line here rather than a warning from each."""
    from poprun_py.wire import protocol

    grace = protocol.kill_grace()
    if grace is None:
        raise PlanError(protocol.bad_grace(settings.passed(environment.KILL_GRACE, "")))
    return grace


def _silence_limit() -> float:
    """$POPRUN_SILENCE_LIMIT, which every host's supervisor reads too: one line here rather than a warning from
    each."""
    from poprun_py.wire import protocol

    try:
        return protocol.silence_limit()
    except settings.PopdistEnvError as exc:
        raise PlanError(str(exc)) from None


def command_spec(options: LaunchOptions, plan: JobPlan, callback: str | None, agent: Agent | None) -> CommandSpec:
    """What the mpiexec command is built from besides the plan: what every instance gets from poprun's
    environment and options, the stub, the user's MPI arguments and what reaches the hosts (``agent``,
    None: ssh)."""
    from poprun_py.planning import per_instance
    from poprun_py.planning.mpi import CommandSpec, parse_instance_local_args, split_args
    from poprun_py.supervision.output import one_stream

    launch_env = {name: settings.passed(name, "1")
                  for name in (environment.UNBUFFERED, environment.TORCH_NCCL_ASYNC_ERROR_HANDLING)}
    threads = settings.given(environment.OMP_NUM_THREADS)
    if threads is not None:  # the user's, to every host (Open MPI forwards nothing)
        launch_env[environment.OMP_NUM_THREADS] = threads
    if one_stream(options.output.tee):  # each program's stdout and stderr are one pipe, in the order written
        launch_env[environment.ONE_STREAM] = "1"
    subnet = options.hosts.host_subnet if plan.hosts else None
    if subnet:
        launch_env[environment.HOST_SUBNET] = subnet
    if callback is None:  # nothing crosses hosts: MPI's own sockets (UCX, libfabric) stay on loopback
        for name in (environment.UCX_NET_DEVICES, environment.FI_TCP_IFACE):
            launch_env[name] = settings.passed(name, "lo")
        # Open MPI's TCP transport listens on every interface whatever it is told to use; on one
        # host shared memory carries everything.
        launch_env[environment.OMPI_MCA_BTL] = settings.passed(environment.OMPI_MCA_BTL, "^tcp")
    mpi = options.mpi
    return CommandSpec(
        launch_env=MappingProxyType(launch_env),  # read-only, as the spec is
        # Each instance a stub, its host's supervisor poprun or one of the host's.
        stub=per_instance.stub_command(per_instance.mode()),
        silence_limit=_silence_limit(),
        global_args=tuple(split_args(mpi.mpi_global_args, "--mpi-global-args")),
        local_args=tuple(split_args(mpi.mpi_local_args, "--mpi-local-args")),
        instance_local_args=parse_instance_local_args(mpi.instance_mpi_local_args, plan.num_instances),
        numa_aware=mpi.numa_aware,
        explicit_hosts=bool(plan.hosts),
        callback_address=callback,
        host_subnet=subnet,
        launcher_agent=agent.path if agent is not None else None,
    )


def _say_threads_per_instance(plan: JobPlan, remote: list[str]) -> None:
    """Several instances to a host and no OMP_NUM_THREADS: each gets its share of the cores; say so."""
    if settings.given(environment.OMP_NUM_THREADS) is not None or plan.instances_per_host <= 1:
        return
    from poprun_py.shared.cores import threads_per_instance

    k = plan.instances_per_host
    here = f"; here {len(os.sched_getaffinity(0))} / {k} = {threads_per_instance(k)}" if not remote else ""
    sys.stderr.write(f"poprun: {environment.OMP_NUM_THREADS} is not set: each instance gets its host's usable "
                     f"cores divided by the {k} instances there, at least 1 (torchrun sets 1){here}\n")
    sys.stderr.flush()


def _with_error_dir(plan: JobPlan) -> JobPlan:
    """``plan``, once the directory of its instances' error files is made; without it (it could not
    be made, as is said) the instances get no TORCHELASTIC_ERROR_FILE."""
    if plan.error_dir is None:
        return plan
    try:
        os.mkdir(plan.error_dir, 0o700)  # a new name: another user cannot have made it first
    except OSError as exc:
        log.warning("no %s for the instances: cannot create %s: %s", environment.TORCHELASTIC_ERROR_FILE,
                    plan.error_dir, exc.strerror or exc)
        return plan.replace(error_dir=None)
    return plan


class Start(NamedTuple):
    """What one start of the job runs: its plan, the hosts of it that are not this machine, the
    address they call back on, what gives MASTER_PORT, and the mpiexec command's parts besides the plan."""

    plan: JobPlan
    remote: tuple[str, ...]
    callback: str | None
    master_port: Callable[[], str]
    spec: CommandSpec
    #: What reaches the other hosts; None: ssh.
    agent: Agent | None

    def moved(self, options: LaunchOptions, num_instances: int, hosts: list[str]) -> Start:
        """This start's job with ``num_instances`` instances on ``hosts`` (a restart without lost
        hosts): a new plan from the old one, with the same replicas, id, restarts and error files,
        instance 0's host's address anew."""
        # A discovery script may bring hosts the job did not start on, remote where all were local.
        remote = _remote_hosts(hosts, resolve=True)
        callback = self.callback or _callback_address(hosts, remote, options.hosts.host_subnet, resolve=True)
        master_addr, master_port = _torchrun_contract(hosts, remote, callback, options)
        plan = self.plan.replace(num_instances=num_instances, hosts=tuple(hosts), master_addr=master_addr,
                                 master_port=master_port())
        moved = Start(plan, tuple(remote), callback, master_port, command_spec(options, plan, callback, self.agent),
                      self.agent)
        _check_open_files(plan.instances_per_host, plan.num_instances, options.output.log_dir is not None)
        return moved


def _run(options: LaunchOptions, start: Start, launcher: MpiLauncher, limits: tuple[float, float],
         errors: ErrorFile | None, slots: dict[str, int]) -> int:
    """Start the job, and start it again after a failure while --max-restarts allows, without the
    hosts it lost; the last status. ``limits``: the instances' kill grace, which poprun's own
    escalation waits for too, and the silence limit; ``errors``: --error-file, checked."""
    from poprun_py.supervision.output import OutputOptions, one_stream
    from poprun_py.supervision.supervisor import Supervisor
    from poprun_py.wire.seal import new_secret

    written: list[str] = []
    policy: Restarts | None = None
    restarts = options.failures.max_restarts
    shown = options.output
    said: set[str] = set()  # of logs that could not be written, once for the job (see InstanceOutput)
    records: list[dict[str, object]] = []  # --error-file: each start's end, once one has failed
    status = 1
    error_dir: str | None = None  # made by the first start, it serves every start
    try:
        start = start._replace(plan=_with_error_dir(start.plan))
        error_dir = start.plan.error_dir
        for restart in range(restarts + 1):
            # Each start is a plan of its own: its number, and a free MASTER_PORT for it.
            plan = start.plan.replace(restart=restart, master_port=start.master_port())
            output = OutputOptions(shown.log_dir, shown.tee, shown.prefix_timestamp, append=restart > 0,
                                   one_stream=one_stream(shown.tee))
            # A new secret for every start, which mpiexec gets in its environment and passes on
            # (Open MPI by name, as it does every POPRUN_ variable), so it is on no command line.
            stub_socket = _stub_socket(start, plan)
            spec = start.spec if stub_socket is None else start.spec._replace(launch_env=MappingProxyType(
                {**start.spec.launch_env, environment.STUB_SOCKET: stub_socket, environment.PYTHON: sys.executable}))
            supervisor = Supervisor(plan.num_instances, [i.host for i in plan.instances],
                                    _command(launcher, plan, spec, written), new_secret(), program_argv(options),
                                    show_instance=shown.only_output_from_instance,
                                    listen_address=start.callback or "127.0.0.1", remote_hosts=frozenset(start.remote),
                                    grace=limits[0], start_timeout=options.failures.start_timeout, output=output,
                                    log_failures_said=said,
                                    remote_launcher=start.agent.name if start.agent is not None else "ssh",
                                    silence_limit=limits[1], host_programs=_host_programs(start, plan, output),
                                    stub_socket=stub_socket)
            status = supervisor.run()
            report = supervisor.failure_report() if status else None
            lost = supervisor.lost_hosts() if status else {}
            if status or records:
                records.append({"restart": restart, "hosts": list(plan.host_names), "instances": plan.num_instances,
                                **(report or {"status": status, "reason": None}), "lost_hosts": lost})
                if errors is not None:
                    errors.write(records)
            if status == 0 or supervisor.interrupted is not None or restart == restarts:
                return status
            if policy is None:
                from poprun_py.supervision.restarts import Restarts

                failures = options.failures
                policy = Restarts.for_plan(plan, failures.min_hosts, failures.host_cooldown,
                                           failures.host_discovery_script, slots)
            assert report is not None  # every way a start fails has its report (Supervisor._finish)
            moved = _restart(options, start, restart + 1, str(report["reason"]), lost, policy)
            if moved is None:
                return status
            start = moved
        return status
    finally:
        with interrupts.Held():
            for path in written:
                os.unlink(path)
            if errors is not None:
                errors.close()
            if error_dir is not None:
                _remove_tree(error_dir)


def _host_programs(start: Start, plan: JobPlan, output: OutputOptions) -> HostPrograms:
    """What poprun tells its own host's stubs."""
    from poprun_py.host import programs

    return programs.HostPrograms(plan.instances_per_host, plan.error_dir, output.one_stream,
                                 start.spec.host_subnet)


def _stub_socket(start: Start, plan: JobPlan) -> str | None:
    """A job across hosts: where each host's stubs find their supervisor, the same path on every
    host, in the job's private folder there, one per start (None: one host, whose supervisor
    poprun makes a private folder of its own for it)."""
    if start.callback is None:
        return None
    job = plan.error_dir or f"{paths.temporary_folder()}/poprun-{plan.run_id}"
    return f"{job}/start-{plan.restart}/stubs"


def _command(launcher: MpiLauncher, plan: JobPlan, spec: CommandSpec,
             written: list[str]) -> Callable[[str], tuple[list[str], dict[str, str]]]:
    """What builds the start of ``plan`` once poprun listens: the mpiexec command for its control
    address and what mpiexec needs in its environment (e.g. its ssh options), files it names in
    ``written``."""
    from poprun_py.planning.mpi import build_command

    def command(control_address: str) -> tuple[list[str], dict[str, str]]:
        built = build_command(launcher, plan, spec._replace(control_address=control_address))
        paths = {}
        for placeholder, text in built.files().items():
            paths[placeholder] = _write_file(text)
            written.append(paths[placeholder])
        if paths:
            log.info("the command line would be too long: hosts and app contexts are in %s", ", ".join(written))
        return built.argv(paths), built.env

    return command


def _restart(options: LaunchOptions, start: Start, restart: int, reason: str, lost: dict[str, str],
             policy: Restarts) -> Start | None:
    """Say why the job starts again, wait its backoff, and return where restart number ``restart``
    runs: without the hosts ``lost`` (see ``restarts``); None when too few hosts are left."""
    from poprun_py.supervision.restarts import Layout, backoff

    current = Layout(start.plan.num_instances, list(start.plan.hosts))
    try:
        layout, change = policy.next_layout(current, lost)
    except PlanError as exc:
        sys.stderr.write(f"poprun: {exc}\n")
        sys.stderr.flush()
        return None
    wait = backoff(restart, options.failures.restart_backoff)
    sys.stderr.write(f"poprun: restarting the job ({restart} of {options.failures.max_restarts} restart(s))"
                     f"{f' in {wait:g} s' if wait else ''}: {reason}\n" + (f"poprun: {change}\n" if change else ""))
    sys.stderr.flush()
    time.sleep(wait)
    if layout == current:
        return start
    return start.moved(options, layout.num_instances, layout.hosts)


def _torchrun_contract(hosts: list[str], remote: list[str], callback: str | None,
                       options: LaunchOptions) -> tuple[str, Callable[[], str]]:
    """torchrun's MASTER_ADDR for a start on ``hosts``: instance 0's host as an address every host
    reaches, poprun's callback address when instance 0 runs here (loopback for a one-host job), else
    that host's; and what gives MASTER_PORT for each start: --master-port when given, else a port
    free on MASTER_ADDR when instance 0 runs here (found anew for every start), else torchrun's 29500."""
    from poprun_py.planning.plan import DEFAULT_MASTER_PORT

    dry_run, subnet = options.dry_run, options.hosts.host_subnet
    first = hosts[0] if hosts else ""  # instance 0's host
    here = not hosts or first not in remote
    if here:
        master_addr = callback or "127.0.0.1"
    elif dry_run:
        master_addr = f"<{first}-address>"
    else:
        from poprun_py.shared.network import host_address, in_subnet

        master_addr = host_address(first, subnet)
        if subnet and not in_subnet(master_addr, subnet):
            log.warning("%s=%s, outside --host-subnet %s: instance 0's host %s resolves to no address in it, so "
                        "torch's store is reached on the address its name has", environment.MASTER_ADDR,
                        master_addr, subnet, first)
    chosen = options.hosts.master_port

    def master_port() -> str:
        if chosen is not None:
            return str(chosen)
        if not here:
            return str(DEFAULT_MASTER_PORT)
        if dry_run:
            return "<free-port>"
        from poprun_py.wire.control import free_port

        return str(free_port(master_addr))

    return master_addr, master_port


def _remove_tree(path: str) -> None:
    """``shutil.rmtree`` without importing shutil on the launch path: the error files' directory."""
    try:
        entries = list(os.scandir(path))
    except OSError:
        return
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                _remove_tree(entry.path)
            else:
                os.unlink(entry.path)
        except OSError:
            pass
    try:
        os.rmdir(path)
    except OSError:
        pass


#: Descriptors MPICH's proxy holds per process it starts (stdin, stdout and stderr pipes, the PMI
#: socket), measured. poprun itself, as the supervisor of its host's stubs, holds each stub's
#: connection and its program's two pipes. Plus a margin for the rest.
FILES_PER_LOCAL_INSTANCE = 4
OWN_FILES_PER_STUB = 3
FILES_MARGIN = 64
#: --log-dir: poprun holds each instance's stdout and stderr log open.
LOG_FILES_PER_INSTANCE = 2


def _check_open_files(per_host: int, num_instances: int, log_files: bool) -> None:
    """A host's instances must fit the open-file limit of mpiexec's proxy there, and poprun's own
    descriptors (three per instance of its host, two log files each with --log-dir) its own: raise the soft
    limit to the hard one, and refuse, naming both numbers, a job that would still fail minutes
    into its start with "Too many open files"."""
    proxy = FILES_PER_LOCAL_INSTANCE * per_host + FILES_MARGIN
    own = (OWN_FILES_PER_STUB + LOG_FILES_PER_INSTANCE * log_files) * num_instances + FILES_MARGIN
    need = max(proxy, own)
    if need <= 1024:  # every system allows this much: no need to ask
        return
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and need > hard:
        if proxy >= own:
            raise PlanError(f"{per_host} instances on one host need about {need} open files in mpiexec's process "
                            f"there, more than this system allows ({hard}, ulimit -Hn); start fewer instances per "
                            "host, or raise the limit")
        raise PlanError(f"--log-dir with {num_instances} instances needs about {need} open files in poprun, "
                        f"more than this system allows ({hard}, ulimit -Hn)")
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # mpiexec and its proxies inherit it


def _python_path(horovod: bool) -> str | None:
    """The instances' PYTHONPATH where poprun changes it (--horovod), else None."""
    if not horovod:
        return None
    from poprun_py.planning.horovod import alias_folder, horovod_python_path, installed_horovod

    folder = alias_folder()
    installed = installed_horovod(folder)
    if installed is not None:
        log.warning("--horovod: Horovod is installed (%s): the program imports it, not popdist_py's Horovod API",
                    installed)
    return horovod_python_path(folder)


def _remote_hosts(hosts: list[str], resolve: bool) -> list[str]:
    if not hosts:
        return []
    from poprun_py.shared.network import remote_hosts

    return remote_hosts(hosts, resolve)


def _callback_address(hosts: list[str], remote: list[str], subnet: str | None, resolve: bool) -> str | None:
    """The address remote instances call back on; None for a one-host job (loopback)."""
    if not hosts:
        if subnet:
            log.warning("--host-subnet %s is ignored: no hosts were given, everything runs here", subnet)
        return None
    from poprun_py.shared.network import callback_address

    if not resolve and remote and not subnet:
        return "<poprun-address>"
    address = callback_address(remote, subnet)
    if address:
        log.info("remote hosts call back on %s", address)
    return address


def _write_file(text: str) -> str:
    import tempfile

    fd, path = tempfile.mkstemp(prefix="poprun-", suffix=".mpiexec")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    return path


def _print_dry_run(plan: JobPlan, launcher: MpiLauncher, built: Command, argv: list[bytes]) -> None:
    """The plan and what would run; files are shown by their first and last lines. The program is
    shown as a shell would be given it, its bytes as they are, and how it reaches each instance."""
    import shlex

    print(plan.describe())
    print(f"mpi: {launcher.flavour} {launcher.version} ({built.head[0]})")  # gforker's stand-in for a large job
    for name, value in built.env.items():
        print(f"environment: {name}={shlex.quote(value)}")
    print("command: " + shlex.join(built.argv()))
    sys.stdout.flush()
    sys.stdout.buffer.write(b"program: " + shlex.join(map(os.fsdecode, argv)).encode(errors="surrogateescape")
                            + b"\n  (each instance's stub receives it from its host's supervisor, which has it from "
                              b"poprun, byte for byte; mpiexec never reads it)\n")
    for placeholder, text in built.files().items():
        lines = text.splitlines()
        print(f"{placeholder}: {len(lines)} lines (the command line would be too long)")
        shown = lines if len(lines) <= 6 else [*lines[:3], f"... {len(lines) - 6} more ...", *lines[-3:]]
        for line in shown:
            print("  " + line)


def _resolve_hosts(given: Hosts, script: str | None) -> tuple[list[str], dict[str, int], str]:
    """-H or --host-file (never both: ``LaunchOptions`` refused that); without either, what
    --host-discovery-script ``script`` lists, else what a scheduler gives (``host_sources``); else
    none (this machine). With the slots the source gives hosts and how errors name it."""
    from poprun_py.planning.hosts import expand_hosts, read_host_file

    if given.host is not None:
        return expand_hosts(given.host), {}, "-H"
    if given.host_file is not None:
        return *read_host_file(given.host_file), f"host file {given.host_file}"
    if script is not None:
        from poprun_py.supervision.restarts import discover

        found = discover(script)
        log.info("no -H/--host-file: using the %d host(s) --host-discovery-script %s lists", len(found), script)
        return ([host for host, _ in found], {host: slots for host, slots in found if slots is not None},
                f"--host-discovery-script {script}")
    from poprun_py.planning.host_sources import from_environment

    chosen = from_environment()
    if chosen is None:
        return [], {}, ""
    if chosen.warning:
        log.warning("%s", chosen.warning)
    log.info("%s", chosen.said)
    return chosen.found.hosts, chosen.found.slots, chosen.names


def _check_slots(plan: JobPlan, slots: dict[str, int], source: str) -> None:
    """The first start puts the same number of instances on every host: each must have the slots
    ``source`` gave it for them (restarts fit the slots themselves: ``restarts.spread``)."""
    each = plan.instances_per_host
    short = [f"{host}:{slots[host]}" for host in plan.host_names if host in slots and slots[host] < each]
    if short:
        from poprun_py.planning.plan import elide

        raise PlanError(f"{source} gives {', '.join(elide(short, 8))}: fewer slots than the {each} instances per "
                        f"host that {plan.num_instances} instances on {len(plan.host_names)} hosts need")


def _check_program(program: str | None, any_remote: bool) -> None:
    if not program:
        raise PlanError("missing PROGRAM: give the program to run, e.g. 'poprun --num-instances 2 python train.py'")
    if any_remote:
        return  # remote hosts: the instance's stub reports a missing program there
    from poprun_py.shared.paths import which

    path = which(program) if os.sep not in program else program
    if path is None or not os.path.exists(path):
        raise ProgramError(f"program {program!r} was not found" + ("" if os.sep in program else " on PATH"), 127)
    if os.path.isdir(path) or not os.access(path, os.X_OK):
        raise ProgramError(f"program {program!r} is not an executable file", 126)
