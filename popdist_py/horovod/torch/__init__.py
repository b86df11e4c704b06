"""Horovod's PyTorch API (``import popdist_py.horovod.torch as hvd``) on today's torch.

Everything a Horovod program calls: ``init``, where this rank stands, the collectives
(synchronous, ``_async`` with ``poll``/``synchronize``, in place with ``_``), process sets,
``join``, ``DistributedOptimizer``, the broadcasts of parameters, optimizer state and objects,
and ``elastic``. It runs over the MPI world of the job (``poprun``, ``mpiexec`` or ``srun``).
"""

from popdist_py.horovod.common.basics import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
    sycl_built,
)
from popdist_py.horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from popdist_py.horovod.common.process_sets import ProcessSet, global_process_set
from popdist_py.horovod.torch.compression import Compression
from popdist_py.horovod.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from popdist_py.horovod.torch.mpi_ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    add_process_set,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    remove_process_set,
    sparse_allreduce_async,
    synchronize,
)
from popdist_py.horovod.torch.optimizer import DistributedOptimizer

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError", "HostsUpdatedInterrupt",
    "Max", "Min", "ProcessSet", "Product", "ReduceOp", "Sum", "add_process_set", "allgather", "allgather_async",
    "allgather_object", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall",
    "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "ccl_built", "cross_rank",
    "cross_size", "cuda_built", "ddl_built", "global_process_set", "gloo_built", "gloo_enabled",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async",
    "init", "is_homogeneous", "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "poll", "rank", "reducescatter", "reducescatter_async",
    "remove_process_set", "rocm_built", "shutdown", "size", "sparse_allreduce_async", "sycl_built", "synchronize",
]
