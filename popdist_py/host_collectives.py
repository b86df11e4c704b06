"""Host collectives across instances on numpy arrays: allreduce, allgather, broadcast, barrier.

Arrays travel with mpi4py's buffer (upper-case) calls, never pickled. Before each collective the
participants :func:`~popdist_py.agreement.agree` on (op, shape, dtype, root), so a mismatch is an
error naming the instances and their values on every instance, and a missing instance is named
after the timeout; the MPI call itself then runs at full speed, non-blocking and polled with the
same deadline (a participant that stops after agreeing is a timeout, not a hang). The participants are the
instances of the current scope (all of them, or those of the enclosing ``execute_on_instances``).
In a one-instance job no MPI is used and the results are copies of the input.

Inputs are never modified; non-contiguous inputs are copied; results are new arrays with the
dtype of the input. The mean of an integer array is the floor of the exact mean (``sum // n``),
in the input dtype, so that every dtype keeps its dtype; convert to float first for a
fractional mean. float16 is reduced in float32 and rounded back once.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from popcontract.environment import COLLECTIVE_TIMEOUT
from popdist_py import agreement, validate
from popdist_py.deadline import collective_timeout, poll
from popdist_py.errors import CollectiveTimeoutError
from popdist_py.instances import Scope, current_scope
from popdist_py.op_names import TO_HOST

#: Busy-poll a data exchange this long before yielding (most complete within microseconds), and
#: yield this long before sleeping between polls: a large exchange takes milliseconds, and a sleep
#: would add up to one to it.
_SPIN = 50e-6
_YIELD = 0.05
#: Valid ``op`` names of :func:`allreduce` (plus the aliases ``add`` and ``mul``).
OPS = ("sum", "mean", "min", "max", "prod")
REDUCE_FIELDS = ("op", "shape", "dtype")


def _check_array(what: str, array: Any) -> np.ndarray:
    if not isinstance(array, (np.ndarray, np.generic)):
        text = repr(array)
        text = text if len(text) <= 60 else text[:57] + "..."
        raise TypeError(
            f"{what}: expected a numpy array, got {type(array).__name__} {text}; convert it with numpy.asarray()"
        )
    a = np.asarray(array)
    if a.dtype.hasobject:
        raise TypeError(f"{what}: arrays of dtype {a.dtype} hold Python objects and cannot be sent as buffers")
    if not a.flags.c_contiguous:
        a = np.array(a, order="C")
    return a


_dtype_names: dict[np.dtype, str] = {}


def _dtype_name(dtype: np.dtype) -> str:
    """``str(dtype)`` ('float32', '>i4', ...), cached: it costs microseconds per call."""
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype)
    return name


def _check_op(op: Any) -> str:
    name = op.lower() if isinstance(op, str) else op
    name = TO_HOST.get(name, name) if isinstance(name, str) else name
    if name not in OPS:
        aliases = ", ".join(f"{engine} for {host}" for engine, host in TO_HOST.items())
        raise ValueError(f"allreduce: op={op!r} is not valid: valid ops are {', '.join(OPS)} (or {aliases})")
    return name


def _check_reducible(a: np.ndarray, op: str) -> None:
    kind = a.dtype.kind
    if kind == "b":
        if op not in ("min", "max"):
            raise TypeError(
                f"allreduce: op={op!r} is not defined for bool arrays: use 'min' (logical and), 'max' "
                "(logical or) or convert with astype(int)"
            )
    elif kind == "c":
        if op in ("min", "max"):
            raise TypeError(f"allreduce: op={op!r} is not defined for complex arrays ({a.dtype}): "
                            "use sum, mean or prod")
    elif kind not in "iuf":
        raise TypeError(f"allreduce: cannot reduce arrays of dtype {a.dtype}: "
                        "use a numeric dtype (int, uint, float, complex)")


def _native(a: np.ndarray) -> np.ndarray:
    return a if a.dtype.isnative else a.astype(a.dtype.newbyteorder("="))


def _mpi_op(op: str, kind: str) -> Any:
    from mpi4py import MPI

    if kind == "b":
        return MPI.LAND if op == "min" else MPI.LOR
    return {"sum": MPI.SUM, "mean": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}[op]


def agree(scope: Scope, what: str, signature: tuple[Any, ...], fields: tuple[str, ...], timeout: float | None) -> None:
    """The first step of every collective here: the ranks of ``scope`` agree that they all call
    ``what`` with the same ``signature`` (named by ``fields``) before any data moves."""
    agreement.agree(scope.comm, what, signature, timeout=timeout, describe_rank=scope.describe, fields=fields)


def _complete(scope: Scope, what: str, request: Any, timeout: float | None) -> None:
    """Wait for the data exchange of ``what``, which every participant has agreed to, with the
    collective deadline: a participant that stops after agreeing (SIGSTOP, a debugger, a host
    that stalls) must not hang the others for ever. The exchange cannot be cancelled, so on a
    timeout the communicator is marked broken."""
    t = collective_timeout(timeout)
    if poll(request.Test, time.monotonic() + t, spin=_SPIN, yield_for=_YIELD):
        return
    agreement.mark_broken(scope.comm, f"an earlier collective ({what}) timed out in its data exchange")
    raise CollectiveTimeoutError(
        f"{what}: timed out after {t:g} s in its data exchange, after all {scope.size} participants had "
        f"arrived: one stopped responding (stopped by a signal or a debugger, or its host stalled); "
        f"set {COLLECTIVE_TIMEOUT} to wait longer")


def allreduce(array: np.ndarray, op: str = "sum", *, timeout: float | None = None) -> np.ndarray:
    """Reduce ``array`` element-wise over the instances (``op`` in sum, mean, min, max, prod).

    Every instance gets the result, a new array with the input's shape and dtype.
    """
    a = _check_array("allreduce", array)
    name = _check_op(op)
    _check_reducible(a, name)
    scope = current_scope()
    if scope.comm is None:
        return a.copy()
    agree(scope, "allreduce", (name, a.shape, _dtype_name(a.dtype)), REDUCE_FIELDS, timeout)
    work = _native(a)
    if work.dtype == np.float16:
        work = work.astype(np.float32)
    out = np.empty_like(work)
    if work.size:
        # mpi4py maps the (native) numpy dtype to MPI's predefined datatype, as reductions need.
        _complete(scope, "allreduce", scope.comm.Iallreduce(work, out, op=_mpi_op(name, work.dtype.kind)), timeout)
    if name == "mean":
        if out.dtype.kind in "fc":
            out /= scope.size
        else:
            out //= scope.size
    return out.astype(a.dtype, copy=False)


def allgather(array: np.ndarray, *, timeout: float | None = None) -> np.ndarray:
    """Gather ``array`` from every instance: a new array with a leading instance axis.

    Row ``k`` comes from the ``k``-th participating instance (instance ``k`` outside
    ``execute_on_instances``). Any fixed-size dtype can be gathered.
    """
    a = _check_array("allgather", array)
    scope = current_scope()
    if scope.comm is None:
        return a[np.newaxis].copy()
    agree(scope, "allgather", (a.shape, _dtype_name(a.dtype)), ("shape", "dtype"), timeout)
    out = np.empty((scope.size, *a.shape), dtype=a.dtype)
    if a.nbytes:
        from mpi4py import MPI

        _complete(scope, "allgather", scope.comm.Iallgather([a, MPI.BYTE], [out, MPI.BYTE]), timeout)
    return out


def broadcast(array: np.ndarray, root: int = 0, *, timeout: float | None = None) -> np.ndarray:
    """Every instance gets a copy of instance ``root``'s ``array`` (all pass the same shape and dtype)."""
    a = _check_array("broadcast", array)
    scope = current_scope()
    root = validate.integer("broadcast: root", root)
    if root not in scope.instances:
        raise ValueError(f"broadcast: root={root} is not a valid instance: valid instances are {scope.valid()}")
    if scope.comm is None:
        return a.copy()
    agree(scope, "broadcast", (root, a.shape, _dtype_name(a.dtype)), ("root", "shape", "dtype"), timeout)
    out = a.copy() if scope.me == root else np.empty_like(a)
    if a.nbytes:
        from mpi4py import MPI

        _complete(scope, "broadcast", scope.comm.Ibcast([out, MPI.BYTE], root=scope.rank_of(root)), timeout)
    return out


def barrier(*, timeout: float | None = None) -> None:
    """Wait until every instance of the current scope has arrived (naming those that do not)."""
    scope = current_scope()
    if scope.comm is not None:
        agreement.agree(scope.comm, "barrier", (), timeout=timeout, describe_rank=scope.describe)


def synchronize() -> None:
    """PopDist's name for :func:`barrier` (the two may be mixed across instances)."""
    barrier()
