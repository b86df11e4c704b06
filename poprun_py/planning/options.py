"""The options of one ``poprun`` run: built once from the command line (``from_command_line``),
checked there, and read-only after; nothing downstream sees click's dictionary.

Named tuples rather than frozen dataclasses: a plain launch imports no ``dataclasses``
(``test_poprun_lean_launch`` holds it to that) while ``typing`` comes with click anyway; a named
tuple refuses assignment to its fields, and the type checker knows it too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from poprun_py.shared.errors import PlanError


class Hosts(NamedTuple):
    """Where the job runs and how its hosts are reached: ``-H``, ``--host-file``, ``--host-subnet``,
    ``--master-port``, ``--launcher-agent``."""

    host: str | None
    host_file: str | None
    host_subnet: str | None
    master_port: int | None
    launcher_agent: str | None


class Mpi(NamedTuple):
    """Which mpiexec and what else it is given: ``--mpi``, ``--mpi-global-args``, ``--mpi-local-args``,
    ``--instance-mpi-local-args``, ``--numa-aware`` (Hydra's and Open MPI's binding)."""

    mpi: str | None
    mpi_global_args: str | None
    mpi_local_args: str | None
    instance_mpi_local_args: tuple[str, ...]
    numa_aware: bool

    def speaks_to_an_mpiexec(self) -> bool:
        """Whether any of these names a particular mpiexec or its arguments; else poprun may pick
        how MPICH starts a one-host job."""
        return bool(self.mpi or self.mpi_global_args or self.mpi_local_args or self.instance_mpi_local_args
                    or self.numa_aware)


class Output(NamedTuple):
    """How the instances' output is shown and kept: ``--only-output-from-instance``, ``--log-dir``,
    ``--tee``, ``--prefix-timestamp`` (yes, no, or "offset")."""

    only_output_from_instance: int | None
    log_dir: str | None
    tee: bool
    prefix_timestamp: bool | str


class Failures(NamedTuple):
    """What happens when the job fails or does not start: restarts, their hosts, --error-file and
    --start-timeout."""

    max_restarts: int
    restart_backoff: int
    min_hosts: int
    host_cooldown: int
    host_discovery_script: str | None
    error_file: str | None
    start_timeout: int


class LaunchOptions(NamedTuple):
    """Every option of the ``poprun`` command that reaches the launch (the V-IPU ones are warned
    about and dropped, ``--import-config`` is click's alone), by the option's name (``-`` as ``_``),
    the related ones in groups."""

    num_instances: int
    num_replicas: int | None
    ipus_per_replica: int
    executable_cache_path: str | None
    horovod: bool
    dry_run: bool
    verbose: int
    print_topology: bool
    offline_mode: bool
    export_config: str | None
    overwrite_config: bool
    hosts: Hosts
    mpi: Mpi
    output: Output
    failures: Failures
    program: str | None
    args: tuple[str, ...]

    @classmethod
    def from_command_line(cls, given: Mapping[str, Any]) -> LaunchOptions:
        """The options click parsed (``given``: one value per parameter, by its name), with the checks
        that need no more than the options: a PlanError (exit 2) in one line naming the value."""
        groups = {name: group._make(given[field] for field in group._fields)
                  for name, group in GROUPS.items()}
        fields: dict[str, Any] = {name: groups[name] if name in groups else given[name]
                                  for name in cls._fields}
        options = cls(**fields)
        options.check()
        return options

    def check(self) -> None:
        """A PlanError naming the value for what is wrong in the options themselves, before any
        host is looked up or file read."""
        if self.hosts.host is not None and self.hosts.host_file is not None:
            raise PlanError("--host and --host-file exclude each other; give only one of them")
        only = self.output.only_output_from_instance
        if only is not None and only >= self.num_instances:
            raise PlanError(f"--only-output-from-instance {only} is outside the instances 0..{self.num_instances - 1}")
        from poprun_py.planning.mpi import parse_instance_local_args, split_args

        split_args(self.mpi.mpi_global_args, "--mpi-global-args")
        split_args(self.mpi.mpi_local_args, "--mpi-local-args")
        parse_instance_local_args(self.mpi.instance_mpi_local_args, self.num_instances)

    @property
    def replicas(self) -> int:
        """--num-replicas, by default one per instance."""
        return self.num_replicas or self.num_instances


#: LaunchOptions' groups, by field name.
GROUPS: dict[str, type[Hosts | Mpi | Output | Failures]] = {
    "hosts": Hosts, "mpi": Mpi, "output": Output, "failures": Failures}
