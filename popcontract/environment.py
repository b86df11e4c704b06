"""Every environment variable poprun-py sets or reads, each name defined here and nowhere else.

This is the contract between the launcher and the library: ``poprun`` writes the ``POPDIST_*``
values of the job plan (``plan.JobPlan.job_env`` / ``instance_env``), ``popdist_py.topology`` reads
them back. Both packages import the names from this module, so a name cannot drift between
writer and reader. docs/environment.md's table lists exactly :data:`VARIABLES` (a test
checks it).

Import-free on purpose: the Python stub and each host's supervisor import it with ``python -S``, and popdist_py
imports it without pulling in any of the launcher.
"""

from __future__ import annotations


class EnvVariable:
    """One environment variable: its name, who sets it, who reads it, and what it means."""

    __slots__ = ("meaning", "name", "read_by", "set_by")

    # Run at import, before `make mutants` activates any mutant: not mutated.
    def __init__(self, name: str, set_by: str, read_by: str, meaning: str) -> None:  # pragma: no mutate block
        self.name = name
        self.set_by = set_by
        self.read_by = read_by
        self.meaning = meaning

    def __repr__(self) -> str:
        return f"EnvVariable({self.name!r})"


#: Every variable, in the order of docs/environment.md's table.
VARIABLES: list[EnvVariable] = []


# Run at import, before `make mutants` activates any mutant: no test could see a change here.
def _define(name: str, set_by: str, read_by: str, meaning: str) -> str:  # pragma: no mutate block
    VARIABLES.append(EnvVariable(name, set_by, read_by, meaning))
    return name


# ------------------------------------------------ the PopDist contract: poprun -> every instance
NUM_TOTAL_REPLICAS = _define("POPDIST_NUM_TOTAL_REPLICAS", "poprun", "popdist_py",
                             "R, all replicas of the job")
NUM_LOCAL_REPLICAS = _define("POPDIST_NUM_LOCAL_REPLICAS", "poprun", "popdist_py",
                             "L = R / I, the replicas this instance drives")
REPLICA_INDEX_OFFSET = _define("POPDIST_REPLICA_INDEX_OFFSET", "poprun", "popdist_py",
                               "the first global replica of this instance (i x L)")
NUM_IPUS_PER_REPLICA = _define("POPDIST_NUM_IPUS_PER_REPLICA", "poprun", "popdist_py",
                               "devices per replica (--ipus-per-replica)")
UNIFORM_REPLICAS = _define("POPDIST_UNIFORM_REPLICAS_PER_INSTANCE", "poprun", "popdist_py",
                           "1: every instance drives the same number of replicas")
NUM_INSTANCES = _define("POPDIST_NUM_INSTANCES", "poprun", "popdist_py", "I, the instances of the job")
INSTANCE_INDEX = _define("POPDIST_INSTANCE_INDEX", "poprun", "popdist_py", "i, this instance")
LOCAL_INSTANCE_INDEX = _define("POPDIST_LOCAL_INSTANCE_INDEX", "poprun", "popdist_py",
                               "this instance's index among those on its host")
EXECUTABLE_CACHE_PATH = _define("POPDIST_EXECUTABLE_CACHE_PATH", "poprun", "the program",
                                "--executable-cache-path, when given")

#: Their presence marks a PopDist environment (poprun always sets them).
REQUIRED = (NUM_TOTAL_REPLICAS, NUM_LOCAL_REPLICAS, REPLICA_INDEX_OFFSET)

# ---------------------------------------------------------- torch-style aliases (rank = instance)
RANK = _define("RANK", "poprun", "the program", "the instance index, as torchrun names it")
WORLD_SIZE = _define("WORLD_SIZE", "poprun", "the program", "the number of instances")
LOCAL_RANK = _define("LOCAL_RANK", "poprun", "the program", "the instance's index on its host")
LOCAL_WORLD_SIZE = _define("LOCAL_WORLD_SIZE", "poprun", "popdist_py.engine",
                           "instances on this host: the engine divides the CPU affinity by it")

# ------------------------------------- the rest of torchrun's worker contract (one role, one group per host)
GROUP_RANK = _define("GROUP_RANK", "poprun", "the program", "the index of this instance's host (torchrun's node rank)")
GROUP_WORLD_SIZE = _define("GROUP_WORLD_SIZE", "poprun", "the program", "the number of hosts")
ROLE_NAME = _define("ROLE_NAME", "poprun", "the program", "the role of every instance: default (torchrun's)")
ROLE_RANK = _define("ROLE_RANK", "poprun", "the program", "the instance's rank in its role: RANK (one role)")
ROLE_WORLD_SIZE = _define("ROLE_WORLD_SIZE", "poprun", "the program", "the instances of its role: WORLD_SIZE")
MASTER_ADDR = _define("MASTER_ADDR", "poprun", "torch.distributed (env://)",
                      "instance 0's host, as an address every host reaches (127.0.0.1 when one host runs the job)")
MASTER_PORT = _define("MASTER_PORT", "poprun", "torch.distributed (env://)",
                      "a port found free on MASTER_ADDR when instance 0 runs on poprun's host, else --master-port "
                      "(29500); --master-port always wins")
TORCHELASTIC_RUN_ID = _define("TORCHELASTIC_RUN_ID", "poprun", "the program",
                              "this job's id, the same across its restarts")
TORCHELASTIC_MAX_RESTARTS = _define("TORCHELASTIC_MAX_RESTARTS", "poprun", "the program", "--max-restarts")
TORCHELASTIC_USE_AGENT_STORE = _define("TORCHELASTIC_USE_AGENT_STORE", "poprun", "torch.distributed (env://)",
                                       "False: instance 0 hosts torch's TCPStore (there is no agent)")
TORCHELASTIC_ERROR_FILE = _define("TORCHELASTIC_ERROR_FILE", "poprun", "torch's @record",
                                  "this instance's error file, in the job's folder on its host, which its "
                                  "host's supervisor has and removes; a failing instance's root cause and "
                                  "traceback in it reach poprun's summary and --error-file")
TORCH_NCCL_ASYNC_ERROR_HANDLING = _define("TORCH_NCCL_ASYNC_ERROR_HANDLING", "poprun, unless set", "torch (NCCL)",
                                          "1, as torchrun sets it")
OMP_NUM_THREADS = _define("OMP_NUM_THREADS", "its host's supervisor, unless set", "OpenMP, BLAS",
                          "with several instances on a host: its usable cores divided by them (at least 1)")

# ------------------------------------------------------------ knobs a user sets for popdist_py
COLLECTIVE_TIMEOUT = _define("POPDIST_COLLECTIVE_TIMEOUT", "the user", "popdist_py",
                             "seconds to wait for a peer in a collective before naming it (600; inf)")
ENGINE_EXECUTOR = _define("POPDIST_ENGINE_EXECUTOR", "the user", "popdist_py.engine",
                          "how L replicas run: auto (default), threads or cooperative")
ENGINE_THREADS = _define("POPDIST_ENGINE_THREADS", "the user", "popdist_py.engine",
                         "threads that share a large collective's local work (default: this instance's cores, "
                         "its CPUs divided by LOCAL_WORLD_SIZE; 1: the combining replica alone)")
ENGINE_SLICE_BYTES = _define("POPDIST_ENGINE_SLICE_BYTES", "the user", "popdist_py.engine",
                             "the least bytes (read and written) a thread is given of a large collective's local "
                             "work: work under twice this runs whole on one thread (default 16 MiB, "
                             "16777216; `make bench`'s cores section shows where cutting pays on a host)")
REMOTE_DIR = _define("POPDIST_REMOTE_DIR", "the user", "popdist_py.engine",
                     "existing directory for file-backed remote buffers (default: a private one in /dev/shm, or in "
                     "the temp dir when /dev/shm has no room)")

# ------------------------------------------------- Horovod's knobs, read by popdist_py.horovod
HOROVOD_DYNAMIC_PROCESS_SETS = _define("HOROVOD_DYNAMIC_PROCESS_SETS", "the user", "popdist_py.horovod",
                                       "1: process sets may be added and removed after hvd.init() (0)")
HOROVOD_ELASTIC = _define("HOROVOD_ELASTIC", "the user", "popdist_py.horovod",
                          "1: DistributedOptimizer hooks its gradients even in a one-rank job (0)")
HOROVOD_TIMELINE = _define("HOROVOD_TIMELINE", "the user", "popdist_py.horovod",
                           "a file to write a timeline of the job's ops to (Chrome's trace format), from "
                           "hvd.init() on; DYNAMIC: only between hvd.start_timeline() and hvd.stop_timeline()")
HOROVOD_STALL_CHECK_TIME_SECONDS = _define("HOROVOD_STALL_CHECK_TIME_SECONDS", "the user", "popdist_py.horovod",
                                           "seconds an op may wait for ranks that have not submitted it before "
                                           "rank 0 names them in a warning (60); at POPDIST_COLLECTIVE_TIMEOUT it "
                                           "fails on the ranks that submitted it")
HOROVOD_FUSION_THRESHOLD = _define("HOROVOD_FUSION_THRESHOLD", "the user", "popdist_py.horovod",
                                   "the most bytes of ready allreduces fused into one exchange (67108864, 64 MiB)")

# ------------------------------------------- poprun, its hosts' supervisors and the instances' stubs
CONTROL = _define("POPRUN_CONTROL", "poprun", "a host's supervisor",
                  "address:port where each other host's supervisor reports to poprun")
SECRET = _define("POPRUN_SECRET", "poprun", "a host's supervisor",
                 "this run's secret, which every frame between a host's supervisor and poprun is sealed with; "
                 "in the environment, never on a command line; the program never gets it; "
                 "where poprun cannot be their subreaper, what a launcher agent leaves on poprun's host is "
                 "found by it")
KILL_GRACE = _define("POPRUN_KILL_GRACE", "the user", "the stubs (from their host's supervisor), poprun",
                     "seconds between SIGTERM and SIGKILL when an instance is stopped (3); poprun's "
                     "own escalation waits for it too")
SILENCE_LIMIT = _define("POPRUN_SILENCE_LIMIT", "the user", "poprun, a host's supervisor",
                        "seconds another host's supervisor may say nothing before poprun counts its instances "
                        "lost (its host down, the network cut), and a supervisor may go unanswered by poprun's "
                        "host before it ends and its stubs stop their programs (20; at least 5; inf: never); "
                        "supervisors say something every quarter of it, at least every 5 s; ssh gets half of it "
                        "to connect")
HOST_SUBNET = _define("POPRUN_HOST_SUBNET", "poprun", "a host's supervisor",
                      "--host-subnet: each host's supervisor keeps MPI on its interface in it")
RESTART_COUNT = _define("POPDIST_RESTART_COUNT", "poprun", "the program",
                        "how often the job was restarted (--max-restarts): resume from a checkpoint when > 0")
TORCHELASTIC_RESTART_COUNT = _define("TORCHELASTIC_RESTART_COUNT", "poprun", "the program",
                                     "the same, under torchrun's name")
PYTHONPATH = _define("PYTHONPATH", "the user; poprun --horovod puts popdist_py's `horovod` first", "Python",
                     "where the program's imports are looked for")
UNBUFFERED = _define("PYTHONUNBUFFERED", "poprun, unless set", "Python",
                     "1: a Python program's output reaches poprun line by line")
ONE_STREAM = _define("POPRUN_ONE_STREAM", "poprun", "the stubs (from their host's supervisor)",
                     "1 when poprun's stdout and stderr are one file or terminal (a terminal, `2>&1`) and the "
                     "output is shown there: the program's stdout and stderr are one pipe, as `2>&1` makes them, so "
                     "its lines keep the order it wrote them in; the program does not get it")
STUB = _define("POPRUN_STUB", "the user", "poprun",
               "what runs each instance's program: compiled (the compiled stub, the default where it was built), "
               "python (the stub's Python fallback), each under its host's one supervisor")
PYTHON = _define("POPRUN_PYTHON", "poprun (a job across hosts)", "the stub",
                 "the Python that runs a remote host's supervisor (poprun's own, the same path on every host, as "
                 "the stub's): the first stub of the job on a host starts it")
STUB_SOCKET = _define("POPRUN_STUB_SOCKET", "poprun", "the stub, a host's supervisor",
                      "the Unix socket of the instance's host supervisor, in a directory only the job's user can "
                      "enter, where the stub (poprun_py/stub) gets its program and hands over its pipes (the same "
                      "path on every host: poprun listens there on its own, a remote host's supervisor on its "
                      "host); the program does not see it")

# ------------------------------------------------------------------- the MPI and ssh layer
SLURM_NODELIST = _define("SLURM_JOB_NODELIST", "Slurm", "poprun",
                         "the hosts, when no -H/--host-file is given (of these host sources, the first set wins)")
SLURM_TASKS_PER_NODE = _define("SLURM_TASKS_PER_NODE", "Slurm", "poprun",
                               "the tasks of each host of SLURM_JOB_NODELIST, in its order ('2(x3),1'): their slots")
PBS_NODEFILE = _define("PBS_NODEFILE", "PBS/Torque", "poprun",
                       "a file of the hosts, one line per slot, when no -H/--host-file is given")
LSB_DJOB_HOSTFILE = _define("LSB_DJOB_HOSTFILE", "LSF", "poprun",
                            "a file of the hosts, one line per slot, when no -H/--host-file is given")
LSB_MCPU_HOSTS = _define("LSB_MCPU_HOSTS", "LSF", "poprun",
                         "'host1 n1 host2 n2 ...': the hosts and their slots, without LSB_DJOB_HOSTFILE")
PE_HOSTFILE = _define("PE_HOSTFILE", "Grid Engine", "poprun",
                      "a file of 'host slots queue processor-range' lines, when no -H/--host-file is given")
OMPI_DEFAULT_HOSTFILE = _define("OMPI_MCA_orte_default_hostfile", "the Kubernetes MPI Operator (Open MPI jobs)",
                                "poprun", "a host file of 'host slots=N' lines, when no -H/--host-file is given")
HYDRA_HOST_FILE = _define("HYDRA_HOST_FILE", "the Kubernetes MPI Operator (MPICH jobs)", "poprun",
                          "a host file of 'host:N' lines, when no -H/--host-file is given")
LAUNCHER_AGENT_PRTE = _define("PRTE_MCA_plm_ssh_agent", "the user, a scheduler", "poprun",
                              "the program that starts processes on other hosts, without --launcher-agent")
LAUNCHER_AGENT_OMPI = _define("OMPI_MCA_plm_rsh_agent", "the Kubernetes MPI Operator (v1), the user", "poprun",
                              "the same, by Open MPI's older name (Open MPI 5's mpirun no longer reads it: poprun "
                              "passes it on)")
LAUNCHER_AGENT_HYDRA = _define("HYDRA_LAUNCHER_EXEC", "the user, a scheduler", "poprun",
                               "the same, by Hydra's name")
HYDRA_LAUNCHER = _define("HYDRA_LAUNCHER", "the user, a scheduler", "poprun, MPICH's mpiexec",
                         "Hydra's launcher: poprun adds its ssh options only where it is ssh (or unset)")
HYDRA_SSH_ARGS = _define("HYDRA_LAUNCHER_EXTRA_ARGS", "poprun, unless set", "MPICH's mpiexec",
                         "ssh options for remote hosts (batch mode, connect timeout, keep-alives)")
PRTE_SSH_ARGS = _define("PRTE_MCA_plm_ssh_args", "poprun, unless set", "Open MPI's mpirun",
                        "the same ssh options for Open MPI")
UCX_NET_DEVICES = _define("UCX_NET_DEVICES",
                          "poprun (one host: lo) or its host's supervisor (--host-subnet), unless set",
                          "MPICH (UCX)", "the interface MPI traffic uses on this host")
FI_TCP_IFACE = _define("FI_TCP_IFACE", "poprun (one host: lo) or its host's supervisor (--host-subnet), unless set",
                       "MPICH (libfabric)", "the same, for libfabric's TCP provider")
OMPI_MCA_BTL = _define("OMPI_MCA_btl", "poprun (one host: ^tcp), unless set", "Open MPI",
                       "its byte transfer layers: on one host none over TCP, which listens on every interface")
LD_PRELOAD = _define("LD_PRELOAD", "poprun (one host, Hydra or Open MPI: its _loopback library first), each "
                     "host's supervisor (removes it for the program)", "the dynamic loader",
                     "Hydra's and Open MPI's launchers bind loopback where they would bind every interface")
PMI_FD = _define("PMI_FD", "MPICH's mpiexec", "MPICH, the stub",
                 "the descriptor of the process's line to its launcher; under gforker the stub's last act "
                 "keeps it open until gforker has reaped the stub (see poprun_py.stub.program.leave)")
# ----------------------------------------- MPI launchers -> a program started without poprun
# Under a bare `mpiexec -n N` (or `srun`) popdist_py answers as N instances of one replica each,
# from the launcher's own variables; their presence also tells "started by mpiexec" from
# "started alone" (a program given POPDIST_* for several instances but run without mpiexec).
PMI_RANK = _define("PMI_RANK", "MPICH's mpiexec (Hydra), srun --mpi=pmi2", "popdist_py", "this process's MPI rank")
PMI_SIZE = _define("PMI_SIZE", "MPICH's mpiexec (Hydra), srun --mpi=pmi2", "popdist_py", "the MPI job's process count")
MPI_LOCALRANKID = _define("MPI_LOCALRANKID", "MPICH's mpiexec (Hydra)", "popdist_py",
                          "this process's index on its host")
MPI_LOCALNRANKS = _define("MPI_LOCALNRANKS", "MPICH's mpiexec (Hydra)", "popdist_py", "the processes on this host")
OMPI_RANK = _define("OMPI_COMM_WORLD_RANK", "Open MPI's mpiexec", "popdist_py", "this process's MPI rank")
OMPI_SIZE = _define("OMPI_COMM_WORLD_SIZE", "Open MPI's mpiexec", "popdist_py", "the MPI job's process count")
OMPI_LOCAL_RANK = _define("OMPI_COMM_WORLD_LOCAL_RANK", "Open MPI's mpiexec", "popdist_py",
                          "this process's index on its host")
PMIX_RANK = _define("PMIX_RANK", "PMIx launchers (Open MPI 5, srun --mpi=pmix)", "popdist_py",
                    "this process's MPI rank")
SLURM_NTASKS = _define("SLURM_NTASKS", "srun", "popdist_py", "the job's process count (with PMI_RANK or PMIX_RANK)")
SLURM_LOCALID = _define("SLURM_LOCALID", "srun", "popdist_py", "this process's index on its node")

#: (launcher, rank, size, index on the host) of each MPI launcher, in the order popdist_py tries them.
MPI_LAUNCHERS = (
    ("Open MPI", OMPI_RANK, OMPI_SIZE, OMPI_LOCAL_RANK),
    ("MPICH (Hydra)", PMI_RANK, PMI_SIZE, MPI_LOCALRANKID),
    ("srun with PMIx", PMIX_RANK, SLURM_NTASKS, SLURM_LOCALID),
)
#: Set by every MPI launcher for its ranks.
MPI_RANK_VARIABLES = (PMI_RANK, PMI_SIZE, OMPI_SIZE, PMIX_RANK, MPI_LOCALNRANKS)

#: Prefixes of the variables Open MPI is told to forward to every host (MPICH forwards all).
FORWARDED_PREFIXES = ("POPDIST_", "POPRUN_", "MPI4PY_")
