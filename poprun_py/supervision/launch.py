"""Turn parsed options into a plan and one mpiexec command, then supervise the job.

Runs on every launch before mpiexec starts, so it imports only what a plain launch needs;
``--dry-run``, host lists and topology printing bring in their modules when asked for.
"""

from __future__ import annotations

import os
import sys
import time

from popcontract import environment
from poprun_py.shared.errors import PlanError
from poprun_py.supervision import interrupts, log, own_output

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing on the launch path
if TYPE_CHECKING:
    from collections.abc import Callable

    from poprun_py.planning.launch_options import LaunchOptions
    from poprun_py.planning.mpi import Command, CommandSpec, MpiLauncher
    from poprun_py.planning.plan import JobPlan
    from poprun_py.supervision.error_file import ErrorFile
    from poprun_py.supervision.restarts import Restarts


class ProgramError(Exception):
    """The program cannot be started here; ``status`` is the shell's (127 not found, 126 not executable)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def launch(options: LaunchOptions) -> int:
    """Run the job ``options`` describe (as click would parse them); its exit status."""
    if not options["dry_run"]:  # the job is what poprun is for now, not its own output
        own_output.job_runs()
    log.configure(options["verbose"])
    grace = _kill_grace()
    from poprun_py.planning.mpi import detect_launcher, find_mpiexec
    from poprun_py.planning.plan import JobPlan

    hosts, slots = _resolve_hosts(options)
    plan = JobPlan(options["num_instances"], options["num_replicas"] or options["num_instances"],
                   options["ipus_per_replica"], tuple(hosts), options["executable_cache_path"])
    _check_slots(plan, slots, options["host_discovery_script"])
    only = options["only_output_from_instance"]
    if only is not None and only >= plan.num_instances:
        raise PlanError(f"--only-output-from-instance {only} is outside the instances 0..{plan.num_instances - 1}")
    if options["log_dir"] is not None or not options["tee"]:
        from poprun_py.supervision.output import check_log_options

        check_log_options(options["log_dir"], options["tee"], create=not options["dry_run"])
    # A dry run asks no resolver: the address remote hosts call back on is shown as a placeholder.
    remote = _remote_hosts(hosts, resolve=not options["dry_run"])
    callback = _callback_address(hosts, remote, options["host_subnet"], resolve=not options["dry_run"])
    # The job's id is the same for every start; a dry run prints the same each time.
    plan.run_id = "<run-id>" if options["dry_run"] else os.urandom(8).hex()
    start = Start(options, plan, remote, callback, _torchrun_contract(plan, options, remote, callback))
    _check_program(options["program"], bool(remote))
    launcher = detect_launcher(find_mpiexec(options["mpi"]), need_version=options["dry_run"] or options["verbose"] > 0)
    if _poprun_picks_the_mpi(options) and not hosts:
        from poprun_py.planning.mpi import one_host_launcher

        launcher = one_host_launcher(launcher)  # opens no port beyond loopback
    log.info("using %s (%s %s)%s", launcher.path, launcher.flavour, launcher.version,
             f", or {launcher.instead.path} for a command too long for it" if launcher.instead else "")
    if callback is None:
        # One host, before anything starts: a launcher that needs poprun's loopback library is
        # refused without it, and so is a command that gforker cannot take and Hydra may not.
        from poprun_py.planning.mpi import build_command

        build_command(launcher, plan, _with_control(start.spec, CONTROL_SHOWN))
    errors = _error_file(options["error_file"])

    if options["print_topology"] or options["dry_run"]:
        from poprun_py.planning.plan_table import render_plan_table

        print(render_plan_table(plan))
    if options["dry_run"]:
        from poprun_py.planning.mpi import build_command

        if errors is not None:
            errors.close()
        shown = _with_control(start.spec, CONTROL_SHOWN)
        _print_dry_run(plan, launcher, build_command(launcher, plan, shown), program_argv(options))
        return 0
    _check_open_files(plan.instances_per_host, plan.num_instances, options["log_dir"] is not None)
    _say_threads_per_instance(plan, remote)
    return _run(options, start, launcher, grace, errors)


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
    return [os.fsencode(word) for word in (options["program"] or "", *options["args"])]


def _poprun_picks_the_mpi(options: LaunchOptions) -> bool:
    """No --mpi, and no option that speaks to a particular mpiexec (its arguments, Hydra's NUMA
    binding): poprun may pick how MPICH starts a one-host job."""
    return not (options["mpi"] or options["mpi_global_args"] or options["mpi_local_args"]
                or options["instance_mpi_local_args"] or options["numa_aware"])


def _kill_grace() -> float:
    """$POPRUN_KILL_GRACE, which every shim reads too: one line here rather than a warning from each."""
    from poprun_py.wire import protocol

    grace = protocol.kill_grace()
    if grace is None:
        raise PlanError(protocol.bad_grace(os.environ[environment.KILL_GRACE]))
    return grace


def _command_spec(options: LaunchOptions, plan: JobPlan, callback: str | None) -> CommandSpec:
    """What the mpiexec command is built from: the environments, the shim and the user's MPI arguments."""
    from poprun_py.instance import SCRIPT
    from poprun_py.planning.mpi import CommandSpec, parse_instance_local_args, split_args
    from poprun_py.supervision.output import one_stream

    job_env = {**plan.job_env(), environment.UNBUFFERED: os.environ.get(environment.UNBUFFERED, "1"),
               environment.TORCH_NCCL_ASYNC_ERROR_HANDLING:
                   os.environ.get(environment.TORCH_NCCL_ASYNC_ERROR_HANDLING, "1")}
    if environment.OMP_NUM_THREADS in os.environ:  # the user's, to every host (Open MPI forwards nothing)
        job_env[environment.OMP_NUM_THREADS] = os.environ[environment.OMP_NUM_THREADS]
    if one_stream(options["tee"]):  # each program's stdout and stderr are one pipe, in the order written
        job_env[environment.ONE_STREAM] = "1"
    if options["host_subnet"] and plan.hosts:
        job_env[environment.HOST_SUBNET] = options["host_subnet"]
    if callback is None:  # nothing crosses hosts: MPI's own sockets (UCX, libfabric) stay on loopback
        for name in (environment.UCX_NET_DEVICES, environment.FI_TCP_IFACE):
            job_env[name] = os.environ.get(name, "lo")
        # Open MPI's TCP transport listens on every interface whatever it is told to use; on one
        # host shared memory carries everything.
        job_env[environment.OMPI_MCA_BTL] = os.environ.get(environment.OMPI_MCA_BTL, "^tcp")
    return CommandSpec(
        job_env=job_env,
        instance_envs=[plan.instance_env(i) for i in range(plan.num_instances)],
        shim=[sys.executable, "-S", SCRIPT],
        global_args=split_args(options["mpi_global_args"], "--mpi-global-args"),
        local_args=split_args(options["mpi_local_args"], "--mpi-local-args"),
        instance_local_args=parse_instance_local_args(options["instance_mpi_local_args"], plan.num_instances),
        numa_aware=options["numa_aware"],
        explicit_hosts=bool(plan.hosts),
        callback_address=callback,
        host_subnet=options["host_subnet"] if plan.hosts else None,
    )


def _say_threads_per_instance(plan: JobPlan, remote: list[str]) -> None:
    """Several instances to a host and no OMP_NUM_THREADS: each gets its share of the cores; say so."""
    if environment.OMP_NUM_THREADS in os.environ or plan.instances_per_host <= 1:
        return
    from poprun_py.shared.cores import threads_per_instance

    k = plan.instances_per_host
    here = f"; here {len(os.sched_getaffinity(0))} / {k} = {threads_per_instance(k)}" if not remote else ""
    sys.stderr.write(f"poprun: {environment.OMP_NUM_THREADS} is not set: each instance gets its host's usable "
                     f"cores divided by the {k} instances there, at least 1 (torchrun sets 1){here}\n")
    sys.stderr.flush()


def _make_error_dir(plan: JobPlan, spec: CommandSpec) -> None:
    """The directory of the instances' error files; without it they get no TORCHELASTIC_ERROR_FILE."""
    if plan.error_dir is None:
        return
    try:
        os.mkdir(plan.error_dir, 0o700)  # a new name: another user cannot have made it first
    except OSError as exc:
        log.warning("no %s for the instances: cannot create %s: %s", environment.TORCHELASTIC_ERROR_FILE,
                    plan.error_dir, exc.strerror or exc)
        plan.error_dir = None
        spec.instance_envs = [plan.instance_env(i) for i in range(plan.num_instances)]


class Start:
    """What one start of the job runs: its plan, the hosts of it that are not this machine, the
    address they call back on, the mpiexec command's parts, and what gives MASTER_PORT."""

    def __init__(self, options: LaunchOptions, plan: JobPlan, remote: list[str], callback: str | None,
                 master_port: Callable[[], str]) -> None:
        self.plan = plan
        self.remote = remote
        self.callback = callback
        self.master_port = master_port
        self.spec = _command_spec(options, plan, callback)

    def moved(self, options: LaunchOptions, num_instances: int, hosts: list[str]) -> Start:
        """This start's job with ``num_instances`` instances on ``hosts`` (a restart without lost
        hosts): the same replicas, id, restarts and error files, instance 0's host's address anew."""
        from poprun_py.planning.plan import JobPlan

        old = self.plan
        plan = JobPlan(num_instances, old.num_replicas, old.ipus_per_replica, tuple(hosts), old.executable_cache_path,
                       run_id=old.run_id)
        # A discovery script may bring hosts the job did not start on, remote where all were local.
        remote = _remote_hosts(hosts, resolve=True)
        callback = self.callback or _callback_address(hosts, remote, options["host_subnet"], resolve=True)
        _check_open_files(plan.instances_per_host, plan.num_instances, options["log_dir"] is not None)
        master_port = _torchrun_contract(plan, options, remote, callback)
        plan.error_dir = old.error_dir  # the first start's folder (None: it could not be made, as was said)
        return Start(options, plan, remote, callback, master_port)


def _run(options: LaunchOptions, start: Start, launcher: MpiLauncher, grace: float,
         errors: ErrorFile | None) -> int:
    """Start the job, and start it again after a failure while --max-restarts allows, without the
    hosts it lost; the last status. ``grace``: the instances' kill grace, which poprun's own
    escalation waits for too; ``errors``: --error-file, checked."""
    from poprun_py.planning.mpi import build_command
    from poprun_py.supervision.output import OutputOptions
    from poprun_py.supervision.supervisor import Supervisor
    from poprun_py.wire.seal import new_secret

    written: list[str] = []
    first = start.plan  # its error files' directory serves every start
    policy: Restarts | None = None

    def command(control_address: str) -> list[str]:
        built = build_command(launcher, start.plan, _with_control(start.spec, control_address))
        os.environ.update(built.env)  # for mpiexec (its ssh options); the instances inherit them too
        paths = {}
        for placeholder, text in built.files().items():
            paths[placeholder] = _write_file(text)
            written.append(paths[placeholder])
        if paths:
            log.info("the command line would be too long: hosts and app contexts are in %s", ", ".join(written))
        return built.argv(paths)

    restarts = options["max_restarts"]
    output = OutputOptions(options["log_dir"], options["tee"], options["prefix_timestamp"])  # for every start
    records: list[dict[str, object]] = []  # --error-file: each start's end, once one has failed
    status = 1
    try:
        _make_error_dir(first, start.spec)
        for restart in range(restarts + 1):
            job_env = start.spec.job_env
            job_env[environment.RESTART_COUNT] = str(restart)
            job_env[environment.TORCHELASTIC_RESTART_COUNT] = str(restart)
            job_env[environment.MASTER_PORT] = start.master_port()  # a free one for every start
            # A new secret for every start; mpiexec passes it on from its environment (Open MPI by
            # name, as it does every POPRUN_ variable), so it is on no command line.
            secret = os.environ[environment.SECRET] = new_secret()
            output.append, output.one_stream = restart > 0, environment.ONE_STREAM in job_env
            supervisor = Supervisor(start.plan.num_instances, [i.host for i in start.plan.instances], command,
                                    secret, program_argv(options), show_instance=options["only_output_from_instance"],
                                    listen_address=start.callback or "127.0.0.1", remote_hosts=frozenset(start.remote),
                                    grace=grace, start_timeout=options["start_timeout"],
                                    output=output)
            status = supervisor.run()
            report = supervisor.failure_report() if status else None
            lost = supervisor.lost_hosts() if status else {}
            if status or records:
                records.append({"restart": restart, "hosts": list(start.plan.host_names),
                                "instances": start.plan.num_instances,
                                **(report or {"status": status, "reason": None}), "lost_hosts": lost})
                if errors is not None:
                    errors.write(records)
            if status == 0 or supervisor.interrupted is not None or restart == restarts:
                return status
            if policy is None:
                from poprun_py.supervision.restarts import Restarts

                policy = Restarts.for_plan(start.plan, options["min_hosts"], options["host_cooldown"],
                                           options["host_discovery_script"])
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
            if first.error_dir is not None:
                _remove_tree(first.error_dir)


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
    wait = backoff(restart, options["restart_backoff"])
    sys.stderr.write(f"poprun: restarting the job ({restart} of {options['max_restarts']} restart(s))"
                     f"{f' in {wait:g} s' if wait else ''}: {reason}\n" + (f"poprun: {change}\n" if change else ""))
    sys.stderr.flush()
    time.sleep(wait)
    if layout == current:
        return start
    return start.moved(options, layout.num_instances, layout.hosts)


def _torchrun_contract(plan: JobPlan, options: LaunchOptions, remote: list[str],
                       callback: str | None) -> Callable[[], str]:
    """Fill in the plan's part of torchrun's worker contract: the job's id, its restarts, the
    directory of the error files, and MASTER_ADDR, instance 0's host as an address every host
    reaches: poprun's callback address when instance 0 runs here (loopback for a one-host job),
    else that host's. Returns what gives MASTER_PORT for each start: --master-port when given, else
    a port free on MASTER_ADDR when instance 0 runs here (found anew for every start), else
    torchrun's 29500."""
    from poprun_py.planning.plan import DEFAULT_MASTER_PORT

    dry_run = options["dry_run"]
    plan.max_restarts = options["max_restarts"]
    plan.error_dir = f"{temporary_folder()}/poprun-{plan.run_id}"
    first = plan.instance(0).host
    here = not plan.hosts or first not in remote
    if here:
        plan.master_addr = callback or "127.0.0.1"
    elif dry_run:
        plan.master_addr = f"<{first}-address>"
    else:
        from poprun_py.shared.network import host_address, in_subnet

        plan.master_addr = host_address(first, options["host_subnet"])
        if options["host_subnet"] and not in_subnet(plan.master_addr, options["host_subnet"]):
            log.warning("%s=%s, outside --host-subnet %s: instance 0's host %s resolves to no address in it, so "
                        "torch's store is reached on the address its name has", environment.MASTER_ADDR,
                        plan.master_addr, options["host_subnet"], first)
    chosen = options["master_port"]

    def master_port() -> str:
        if chosen is not None:
            return str(chosen)
        if not here:
            return str(DEFAULT_MASTER_PORT)
        if dry_run:
            return "<free-port>"
        from poprun_py.wire.control import free_port

        return str(free_port(plan.master_addr))

    plan.master_port = master_port()
    return master_port


#: Where the job's directory of error files may go, in order, as ``tempfile.gettempdir`` looks
#: (without importing ``tempfile``, which brings ``shutil`` and ``random`` to every launch): the
#: folder the environment names, then the usual ones.
TEMPORARY_VARIABLES = ("TMPDIR", "TEMP", "TMP")
TEMPORARY_FOLDERS = ("/tmp", "/var/tmp", "/usr/tmp")


def temporary_folder() -> str:
    """The folder of the job's directory of error files, the same path on every host (a remote
    host's shims create it): the first of TMPDIR, TEMP, TMP, /tmp, /var/tmp, /usr/tmp that is a
    folder poprun can write to here (a read-only /tmp is passed over); /tmp when none is, so that
    the warning names it."""
    named = [os.environ.get(name, "") for name in TEMPORARY_VARIABLES]
    for folder in [os.path.abspath(path) for path in named if path] + list(TEMPORARY_FOLDERS):
        if os.path.isdir(folder) and os.access(folder, os.W_OK | os.X_OK):
            return folder
    return TEMPORARY_FOLDERS[0]


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
#: socket), measured; poprun itself holds one socket per instance. Plus a margin for the rest.
FILES_PER_LOCAL_INSTANCE = 4
FILES_MARGIN = 64
#: --log-dir: poprun holds each instance's stdout and stderr log open.
LOG_FILES_PER_INSTANCE = 2


def _check_open_files(per_host: int, num_instances: int, log_files: bool) -> None:
    """A host's instances must fit the open-file limit of mpiexec's proxy there, and poprun's own
    connections (one per instance, two log files each with --log-dir) its own: raise the soft
    limit to the hard one, and refuse, naming both numbers, a job that would still fail minutes
    into its start with "Too many open files"."""
    proxy = FILES_PER_LOCAL_INSTANCE * per_host + FILES_MARGIN
    own = (1 + LOG_FILES_PER_INSTANCE * log_files) * num_instances + FILES_MARGIN
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


#: poprun's control address where no real one is known yet (a dry run, the checks before the start).
CONTROL_SHOWN = "<poprun-address>:<port>"


def _with_control(spec: CommandSpec, control_address: str) -> CommandSpec:
    spec.job_env[environment.CONTROL] = control_address
    return spec


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
    shown as a shell would be given it, its bytes as they are."""
    import shlex

    print(plan.describe())
    print(f"mpi: {launcher.flavour} {launcher.version} ({built.head[0]})")  # gforker's stand-in for a large job
    for name, value in built.env.items():
        print(f"environment: {name}={shlex.quote(value)}")
    print("command: " + shlex.join(built.argv()))
    sys.stdout.flush()
    sys.stdout.buffer.write(b"program: " + shlex.join(map(os.fsdecode, argv)).encode(errors="surrogateescape")
                            + b"\n  (each instance's shim receives it from poprun over the control connection, "
                              b"byte for byte; mpiexec never reads it)\n")
    for placeholder, text in built.files().items():
        lines = text.splitlines()
        print(f"{placeholder}: {len(lines)} lines (the command line would be too long)")
        shown = lines if len(lines) <= 6 else [*lines[:3], f"... {len(lines) - 6} more ...", *lines[-3:]]
        for line in shown:
            print("  " + line)


def _resolve_hosts(options: LaunchOptions) -> tuple[list[str], dict[str, int]]:
    """-H or --host-file; without either, what --host-discovery-script lists (with the slots it
    gives hosts), or inside a Slurm allocation its nodes; else none (this machine)."""
    if options["host"] is not None and options["host_file"] is not None:
        raise PlanError("--host and --host-file exclude each other; give only one of them")
    if options["host"] is None and options["host_file"] is None:
        script = options["host_discovery_script"]
        if script is not None:
            from poprun_py.supervision.restarts import discover

            found = discover(script)
            log.info("no -H/--host-file: using the %d host(s) --host-discovery-script %s lists", len(found), script)
            return [host for host, _ in found], {host: slots for host, slots in found if slots is not None}
        nodes = os.environ.get(environment.SLURM_NODELIST)
        if not nodes:
            return [], {}
        from poprun_py.planning.hosts import expand_hosts

        hosts = expand_hosts(nodes)
        log.info("no -H/--host-file: using the Slurm allocation's %d node(s) from %s=%s as hosts",
                 len(hosts), environment.SLURM_NODELIST, nodes)
        return hosts, {}
    from poprun_py.planning.hosts import expand_hosts, read_host_file

    if options["host"] is not None:
        return expand_hosts(options["host"]), {}
    assert options["host_file"] is not None
    return read_host_file(options["host_file"]), {}


def _check_slots(plan: JobPlan, slots: dict[str, int], script: str | None) -> None:
    """The first start puts the same number of instances on every host: each must have the slots
    the discovery script gave it for them (restarts fit the slots themselves: ``restarts.spread``)."""
    each = plan.instances_per_host
    short = [f"{host}:{slots[host]}" for host in plan.host_names if host in slots and slots[host] < each]
    if short:
        raise PlanError(f"--host-discovery-script {script} gives {', '.join(short)}: fewer slots than the "
                        f"{each} instances per host that {plan.num_instances} instances on "
                        f"{len(plan.host_names)} hosts need")


def _check_program(program: str | None, any_remote: bool) -> None:
    if not program:
        raise PlanError("missing PROGRAM: give the program to run, e.g. 'poprun --num-instances 2 python train.py'")
    if any_remote:
        return  # remote hosts: the instance shim reports a missing program there
    from poprun_py.shared.paths import which

    path = which(program) if os.sep not in program else program
    if path is None or not os.path.exists(path):
        raise ProgramError(f"program {program!r} was not found" + ("" if os.sep in program else " on PATH"), 127)
    if os.path.isdir(path) or not os.access(path, os.X_OK):
        raise ProgramError(f"program {program!r} is not an executable file", 126)
