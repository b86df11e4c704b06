"""The options ``launch`` runs, as ``command.parse`` returns them: named and typed for the type
checker only (imported under ``TYPE_CHECKING``), so a launch pays nothing for them."""

from __future__ import annotations

from typing import TypedDict


class LaunchOptions(TypedDict):
    """One key per option of the ``poprun`` command (the long name, ``-`` as ``_``)."""

    num_instances: int
    num_replicas: int | None
    ipus_per_replica: int
    host: str | None
    host_file: str | None
    host_subnet: str | None
    mpi_global_args: str | None
    mpi_local_args: str | None
    instance_mpi_local_args: tuple[str, ...]
    only_output_from_instance: int | None
    log_dir: str | None
    tee: bool
    prefix_timestamp: bool | str  # yes, no, or "offset"
    print_topology: bool
    numa_aware: bool
    offline_mode: bool
    executable_cache_path: str | None
    export_config: str | None
    overwrite_config: bool
    mpi: str | None
    max_restarts: int
    restart_backoff: int
    min_hosts: int
    host_cooldown: int
    host_discovery_script: str | None
    error_file: str | None
    start_timeout: int
    master_port: int | None
    dry_run: bool
    verbose: int
    program: str | None
    args: tuple[str, ...]
