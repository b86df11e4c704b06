"""The job plan: which instance runs on which host and owns which global replicas.

Instance i owns global replicas [i*L, (i+1)*L) and runs on host i // (I/H), so consecutive
instances share a host, as PopRun lays them out.
"""

from __future__ import annotations

from typing import Any, Final

from popcontract import environment as names
from poprun_py.shared.errors import PlanError
from poprun_py.shared.root_cause import error_file

LOCAL_HOST = "localhost"
#: torchrun's default --master-port, used when instance 0 runs on another host than poprun.
DEFAULT_MASTER_PORT = 29500
#: torchrun's name for the one role every instance has.
ROLE = "default"
#: Longer lists are shown by their ends (plans of thousands of instances stay readable).
SHOWN_IN_FULL = 16


def elide(items: list[str], keep: int = SHOWN_IN_FULL) -> list[str]:
    """``items``, or its first and last few with a line saying how many are left out."""
    if len(items) <= keep:
        return items
    head, tail = keep * 3 // 4, keep // 4
    indent = items[0][:len(items[0]) - len(items[0].lstrip())]
    return [*items[:head], f"{indent}... {len(items) - head - tail} more ...", *items[-tail:]]


def span(numbers: range) -> str:
    """``3`` or ``4-7``."""
    return f"{numbers.start}" if len(numbers) == 1 else f"{numbers.start}-{numbers.stop - 1}"


def _set_once(self: object, name: str, value: object) -> None:
    """Plans are set once, on construction: a changed plan is a new one (``JobPlan.replace``)."""
    if hasattr(self, name):
        raise AttributeError(f"{type(self).__name__} is immutable: {name} cannot be set again; "
                             "build a new one (JobPlan.replace)")
    object.__setattr__(self, name, value)


def _no_delete(self: object, name: str) -> None:
    raise AttributeError(f"{type(self).__name__} is immutable: {name} cannot be deleted")


class InstancePlan:
    """Where one instance runs and which replicas it owns.

    Plain classes here rather than dataclasses: ``dataclasses`` imports ``inspect``, ~10 ms
    that every launch would pay before mpiexec starts.
    """

    __slots__ = ("host", "index", "local_index", "num_local_replicas", "replica_index_offset")
    __setattr__ = _set_once
    __delattr__ = _no_delete

    def __init__(self, index: int, host: str, local_index: int, replica_index_offset: int,
                 num_local_replicas: int) -> None:
        self.index: Final = index
        self.host: Final = host
        self.local_index: Final = local_index
        self.replica_index_offset: Final = replica_index_offset
        self.num_local_replicas: Final = num_local_replicas

    def __repr__(self) -> str:
        return (f"InstancePlan(index={self.index}, host={self.host!r}, local_index={self.local_index}, "
                f"replica_index_offset={self.replica_index_offset}, "
                f"num_local_replicas={self.num_local_replicas})")

    @property
    def replicas(self) -> range:
        return range(self.replica_index_offset, self.replica_index_offset + self.num_local_replicas)


class JobPlan:
    """The whole job as one start runs it: instances x replicas over hosts, and torchrun's contract
    (where instance 0 hosts torch's store, the job's id, its restarts and which this is, the
    directory of the instances' error files, ``None``: no error files). Every field is given and
    checked on construction and never changes: a restart's plan is a new one (``replace``), and
    each instance's environment is computed from the plan alone (``job_env``, ``instance_env``)."""

    __slots__ = ("error_dir", "executable_cache_path", "hosts", "ipus_per_replica", "master_addr", "master_port",
                 "max_restarts", "num_instances", "num_replicas", "python_path", "restart", "run_id")
    __setattr__ = _set_once
    __delattr__ = _no_delete

    def __init__(self, num_instances: int, num_replicas: int, ipus_per_replica: int = 1,
                 hosts: tuple[str, ...] = (), executable_cache_path: str | None = None,
                 master_addr: str = "127.0.0.1", master_port: int | str = DEFAULT_MASTER_PORT,
                 run_id: str = "none", max_restarts: int = 0, error_dir: str | None = None,
                 restart: int = 0, python_path: str | None = None) -> None:
        self.num_instances: Final = num_instances
        self.num_replicas: Final = num_replicas
        self.ipus_per_replica: Final = ipus_per_replica
        self.hosts: Final = tuple(hosts)
        self.executable_cache_path: Final = executable_cache_path
        self.master_addr: Final = master_addr
        self.master_port: Final = master_port
        self.run_id: Final = run_id
        self.max_restarts: Final = max_restarts
        self.error_dir: Final = error_dir
        #: Which start of the job this is: 0 for the first, then 1 .. max_restarts.
        self.restart: Final = restart
        #: The instances' PYTHONPATH, where poprun changes it (--horovod); None: as poprun's.
        self.python_path: Final = python_path
        for name in ("num_instances", "num_replicas", "ipus_per_replica"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                flag = "--" + name.replace("_", "-")
                raise PlanError(f"{flag} must be a positive integer, got {value!r}")
        if self.num_replicas % self.num_instances:
            raise PlanError(
                f"--num-replicas {self.num_replicas} cannot be divided evenly among "
                f"--num-instances {self.num_instances}; use a multiple of {self.num_instances} "
                f"replicas or a divisor of {self.num_replicas} instances"
            )
        if self.hosts and self.num_instances % len(self.hosts):
            raise PlanError(
                f"--num-instances {self.num_instances} cannot be spread evenly over "
                f"{len(self.hosts)} hosts ({', '.join(elide(list(self.hosts), 8))}); "
                f"use a multiple of {len(self.hosts)} instances"
            )
        if not (isinstance(max_restarts, int) and isinstance(restart, int) and 0 <= restart <= max_restarts):
            raise PlanError(f"restart {restart!r} is outside the job's restarts 0..{max_restarts!r} (--max-restarts)")

    def replace(self, **changes: Any) -> JobPlan:
        """This plan with ``changes`` (fields by name), checked as a new plan: each start of a job
        (its restart number and MASTER_PORT) and a restart on the hosts left are new plans."""
        fields: dict[str, Any] = {name: getattr(self, name) for name in JobPlan.__slots__}
        unknown = changes.keys() - fields.keys()
        if unknown:
            raise TypeError(f"JobPlan has no field(s) {', '.join(sorted(unknown))}")
        return JobPlan(**{**fields, **changes})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JobPlan) and all(getattr(self, n) == getattr(other, n) for n in JobPlan.__slots__)

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, n) for n in JobPlan.__slots__))

    def __repr__(self) -> str:
        return "JobPlan(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in JobPlan.__slots__) + ")"

    @property
    def num_local_replicas(self) -> int:
        return self.num_replicas // self.num_instances

    @property
    def host_names(self) -> tuple[str, ...]:
        return self.hosts or (LOCAL_HOST,)

    @property
    def instances_per_host(self) -> int:
        return self.num_instances // len(self.host_names)

    def instance(self, index: int) -> InstancePlan:
        if not 0 <= index < self.num_instances:
            raise PlanError(f"instance {index} is outside 0..{self.num_instances - 1}")
        per_host = self.instances_per_host
        return InstancePlan(
            index=index,
            host=self.host_names[index // per_host],
            local_index=index % per_host,
            replica_index_offset=index * self.num_local_replicas,
            num_local_replicas=self.num_local_replicas,
        )

    @property
    def instances(self) -> list[InstancePlan]:
        return [self.instance(i) for i in range(self.num_instances)]

    def job_env(self) -> dict[str, str]:
        """Variables that are the same for every instance."""
        env = {
            names.NUM_TOTAL_REPLICAS: str(self.num_replicas),
            names.NUM_LOCAL_REPLICAS: str(self.num_local_replicas),
            names.NUM_IPUS_PER_REPLICA: str(self.ipus_per_replica),
            names.UNIFORM_REPLICAS: "1",
            names.NUM_INSTANCES: str(self.num_instances),
            names.WORLD_SIZE: str(self.num_instances),
            names.LOCAL_WORLD_SIZE: str(self.instances_per_host),
            names.GROUP_WORLD_SIZE: str(len(self.host_names)),
            names.ROLE_NAME: ROLE,
            names.ROLE_WORLD_SIZE: str(self.num_instances),
            names.MASTER_ADDR: self.master_addr,
            names.MASTER_PORT: str(self.master_port),
            names.TORCHELASTIC_RUN_ID: self.run_id,
            names.TORCHELASTIC_MAX_RESTARTS: str(self.max_restarts),
            names.TORCHELASTIC_RESTART_COUNT: str(self.restart),
            names.RESTART_COUNT: str(self.restart),
            names.TORCHELASTIC_USE_AGENT_STORE: "False",
        }
        if self.executable_cache_path:
            env[names.EXECUTABLE_CACHE_PATH] = self.executable_cache_path
        if self.python_path is not None:
            env[names.PYTHONPATH] = self.python_path
        return env

    def instance_env(self, index: int) -> dict[str, str]:
        """Variables that differ between instances."""
        inst = self.instance(index)
        env = {
            names.INSTANCE_INDEX: str(inst.index),
            names.LOCAL_INSTANCE_INDEX: str(inst.local_index),
            names.REPLICA_INDEX_OFFSET: str(inst.replica_index_offset),
            names.RANK: str(inst.index),
            names.LOCAL_RANK: str(inst.local_index),
            names.GROUP_RANK: str(inst.index // self.instances_per_host),
            names.ROLE_RANK: str(inst.index),
        }
        if self.error_dir is not None:
            env[names.TORCHELASTIC_ERROR_FILE] = error_file(self.error_dir, inst.index)
        return env

    def describe(self) -> str:
        """One line per instance (the ends of a long plan): what ``--dry-run`` prints."""
        lines = [
            (f"job: {self.num_instances} instance(s) x {self.num_local_replicas} local replica(s) = "
             f"{self.num_replicas} replica(s), {self.ipus_per_replica} IPU(s) per replica, "
             f"{len(self.host_names)} host(s)")
        ]
        lines += elide([(f"  instance {inst.index} on {inst.host} (local index {inst.local_index}): "
                         f"replicas {span(inst.replicas)}") for inst in self.instances])
        return "\n".join(lines)
