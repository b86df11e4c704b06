"""Horovod's collectives on torch tensors: handles, async ops, and their autograd.

Each op becomes a :class:`~popdist_py.horovod.common.negotiation.Request` for the background
thread; ``*_async`` returns an integer handle at once, ``poll(handle)`` says whether it is done
and ``synchronize(handle)`` waits and returns the result (raising
:class:`HorovodInternalError` on every rank when the ranks disagreed on the op). The blocking
forms are differentiable as Horovod's are. Tensors travel as numpy views of their memory; bfloat16
travels as its bits and is reduced in float32, float16 is reduced in float32 and rounded once.
"""

from __future__ import annotations

import itertools
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, cast

import numpy as np
import torch

from popcontract import settings
from popcontract.environment import HOROVOD_DYNAMIC_PROCESS_SETS
from popdist_py.horovod.common import basics
from popdist_py.horovod.common import negotiation as neg
from popdist_py.horovod.common.exceptions import HorovodInternalError
from popdist_py.horovod.common.process_sets import ProcessSet, global_process_set
from popdist_py.horovod.common.runtime import Handle


class ReduceOp(int):
    """A reduction op: Horovod's Average, Sum, Adasum, Min, Max, Product."""

    _names: ClassVar[dict[int, str]] = {0: "average", 1: "sum", 2: "adasum", 3: "min", 4: "max", 5: "product"}

    def __repr__(self) -> str:
        return self._names.get(int(self), "?").capitalize()


Average = ReduceOp(0)
Sum = ReduceOp(1)
Adasum = ReduceOp(2)
Min = ReduceOp(3)
Max = ReduceOp(4)
Product = ReduceOp(5)

_SUPPORTED = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
              torch.float32, torch.float64, torch.bool}
_REDUCIBLE = _SUPPORTED - {torch.bool}
_NUMPY = {d: torch.empty(0, dtype=d).numpy().dtype for d in _SUPPORTED - {torch.bfloat16}}

#: handle -> (the runtime's handle, what turns it into the result)
_handle_map: dict[int, tuple[Handle, Callable[[Handle], Any]]] = {}
_handles = itertools.count(1)
_names: dict[tuple[str, int], itertools.count[int]] = {}
_lock = threading.Lock()


def _apply(function: type[torch.autograd.Function], *args: Any) -> Any:
    """Run an autograd Function (torch leaves ``apply`` untyped)."""
    return function.apply(*args)  # type: ignore[no-untyped-call]


def handle_average_backwards_compatibility(op: Any, average: Any) -> ReduceOp:
    """``average=`` is Horovod's older spelling of ``op``: both given is an error, neither is Average."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        return ReduceOp(op)
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average


def _op_name(op: ReduceOp) -> str:
    if op == Adasum:
        raise NotImplementedError("Adasum is not available in popdist_py's Horovod; use op=hvd.Average or "
                                  "hvd.Sum")
    if int(op) not in ReduceOp._names:
        raise ValueError(f"op={op!r} is not a reduction op: valid ops are hvd.Average, hvd.Sum, hvd.Min, hvd.Max, "
                         f"hvd.Product")
    return ReduceOp._names[int(op)]


def _set_id(process_set: ProcessSet) -> int:
    """The id of a registered set this rank is in; ValueError (at the call) otherwise."""
    state = basics.state()
    set_id = process_set.process_set_id
    members = state.runtime.sets.get(set_id) if set_id is not None else None
    if set_id is None or members is None:
        raise ValueError(f"{process_set} is not registered: add it with hvd.add_process_set() or "
                         f"hvd.init(process_sets=...)")
    if state.runtime.rank not in members:
        raise ValueError(f"rank {state.runtime.rank} is not in {process_set}: only its ranks can run ops on it")
    return set_id


def _members(set_id: int) -> tuple[int, ...]:
    return basics.state().runtime.sets[set_id]


def _name(kind: str, name: str | None, set_id: int) -> str:
    """``name``, or the next ``<kind>.noname.<n>``: unnamed ops match by their order among the
    unnamed ops of their kind and process set (whose ranks all make the same calls)."""
    if name is not None:
        return str(name)
    with _lock:
        counter = _names.setdefault((kind, set_id), itertools.count())
        return f"{kind}.noname.{next(counter)}"


def _forget_names(set_id: int) -> None:
    """A process set id is (re)assigned: its unnamed ops count from 0 again on every rank."""
    with _lock:
        for key in [k for k in _names if k[1] == set_id]:
            del _names[key]


def _dtype(tensor: torch.Tensor, kind: str, reducible: bool = False) -> str:
    allowed = _REDUCIBLE if reducible else _SUPPORTED
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{kind}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in allowed or tensor.is_sparse or tensor.device.type != "cpu":
        where = "sparse " if tensor.is_sparse else "" if tensor.device.type == "cpu" else f"{tensor.device} "
        raise ValueError(f"{kind}: a {where}tensor of {tensor.dtype} is not supported: "
                        f"CPU tensors of {', '.join(sorted(str(d).removeprefix('torch.') for d in allowed))} are")
    return str(tensor.dtype).removeprefix("torch.")


def _new_like(tensor: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor like ``tensor``, its memory numpy's: numpy asks the kernel for huge
    pages for large arrays, torch does not, and a fresh 64 MiB result then costs four times as
    much to fill (page faults), more than the exchange itself."""
    if tensor.dtype == torch.bfloat16 or tensor.dtype not in _SUPPORTED:
        return torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return torch.from_numpy(np.empty(tuple(tensor.shape), _NUMPY[tensor.dtype]))


def _view(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a numpy array (bfloat16 as its int16 bits)."""
    t = tensor.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy()


def _submit(request: neg.Request, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray] | None,
            finish: Callable[[Handle], Any]) -> int:
    runtime = basics.state().runtime
    handle = runtime.submit(request, inputs, outputs)
    number = next(_handles)
    _handle_map[number] = (handle, finish)
    return number


def _one(handle: int) -> torch.Tensor:
    return cast(torch.Tensor, synchronize(handle))


def _some(handle: int) -> tuple[torch.Tensor, ...]:
    return cast(tuple[torch.Tensor, ...], synchronize(handle))


def _many(handle: int) -> list[torch.Tensor]:
    return cast(list[torch.Tensor], synchronize(handle))


def poll(handle: int) -> bool:
    """True when the op of ``handle`` is done (``synchronize`` will not wait)."""
    if handle not in _handle_map:
        raise ValueError(f"poll: handle {handle} is not an op in flight")
    return _handle_map[handle][0].done.is_set()


def synchronize(handle: int) -> Any:
    """Wait for the op of ``handle`` and return its result; HorovodInternalError when it failed."""
    if handle not in _handle_map:
        return None
    runtime_handle, finish = _handle_map[handle]
    runtime_handle.done.wait()
    del _handle_map[handle]
    if runtime_handle.error:
        raise HorovodInternalError(runtime_handle.error)
    return finish(runtime_handle)


# -- allreduce -------------------------------------------------------------------------------

def _reduce_dtype(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().float() if tensor.dtype == torch.bfloat16 else tensor.detach()


def _allreduce_async(tensors: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], name: str | None,
                     op: ReduceOp, prescale_factor: float, postscale_factor: float, process_set: ProcessSet,
                     kind: str = "allreduce", in_place: bool = False) -> int:
    op_name = _op_name(op)
    set_id = _set_id(process_set)
    dtypes = tuple(_dtype(t, kind, reducible=True) for t in tensors)
    work = [_reduce_dtype(t).contiguous() for t in tensors]
    results = [o if o.dtype != torch.bfloat16 and o.is_contiguous() else _new_like(w)
               for o, w in zip(outputs, work, strict=True)]
    shapes = tuple(tuple(t.shape) for t in tensors)
    request = neg.Request(_name(kind, name, set_id), neg.ALLREDUCE, set_id, dtypes, shapes, op_name, -1,
                          float(prescale_factor), float(postscale_factor))

    def finish(handle: Handle) -> Any:
        for out, result in zip(outputs, results, strict=True):
            if out is not result:
                out.copy_(result)
        if kind == "grouped_allreduce":
            return tuple(outputs) if in_place else list(outputs)
        return outputs[0]

    return _submit(request, [w.numpy() for w in work], [r.numpy() for r in results], finish)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start reducing ``tensor`` over the ranks into a new tensor; returns a handle."""
    op = handle_average_backwards_compatibility(op, average)
    return _allreduce_async([tensor], [_new_like(tensor)], name, op, prescale_factor, postscale_factor,
                            process_set)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start reducing ``tensor`` in place; returns a handle."""
    op = handle_average_backwards_compatibility(op, average)
    return _allreduce_async([tensor], [tensor.data], name, op, prescale_factor, postscale_factor, process_set)


class HorovodAllreduce(torch.autograd.Function):
    """allreduce with a gradient: the gradient is reduced the same way."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, prescale_factor: float,
                postscale_factor: float, process_set: ProcessSet) -> torch.Tensor:
        ctx.op, ctx.prescale_factor, ctx.postscale_factor = op, prescale_factor, postscale_factor
        ctx.process_set = process_set
        return _one(_allreduce_async([tensor], [_new_like(tensor)], name, op, prescale_factor,
                                            postscale_factor, process_set))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grad = allreduce(grad_output, op=ctx.op, prescale_factor=ctx.prescale_factor,
                         postscale_factor=ctx.postscale_factor, process_set=ctx.process_set)
        return grad, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = None, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks (Average by default): a new tensor, differentiable."""
    from popdist_py.horovod.torch.compression import Compression

    op = handle_average_backwards_compatibility(op, average)
    compression = compression or Compression.none
    compressed, ctx = compression.compress(tensor)
    reduced = _apply(HorovodAllreduce, compressed, name, op, prescale_factor, postscale_factor, process_set)
    return cast(torch.Tensor, compression.decompress(reduced, ctx))


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks in place and return it."""
    return _one(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                        process_set))


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start reducing a list of tensors as one op (one name, one fused exchange); returns a handle."""
    op = handle_average_backwards_compatibility(op, average)
    return _allreduce_async(list(tensors), [_new_like(t) for t in tensors], name, op, prescale_factor,
                            postscale_factor, process_set, kind="grouped_allreduce")


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> int:
    """Start reducing a list of tensors in place as one op; returns a handle."""
    op = handle_average_backwards_compatibility(op, average)
    return _allreduce_async(list(tensors), [t.data for t in tensors], name, op, prescale_factor, postscale_factor,
                            process_set, kind="grouped_allreduce", in_place=True)


class HorovodGroupedAllreduce(torch.autograd.Function):
    """grouped_allreduce with gradients, reduced as one group again."""

    @staticmethod
    def forward(ctx: Any, name: str | None, op: ReduceOp, prescale_factor: float, postscale_factor: float,
                process_set: ProcessSet, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.op, ctx.prescale_factor, ctx.postscale_factor = op, prescale_factor, postscale_factor
        ctx.process_set = process_set
        handle = _allreduce_async(list(tensors), [_new_like(t) for t in tensors], name, op,
                                  prescale_factor, postscale_factor, process_set, kind="grouped_allreduce")
        return tuple(synchronize(handle))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        grads = grouped_allreduce(list(grad_outputs), op=ctx.op, prescale_factor=ctx.prescale_factor,
                                  postscale_factor=ctx.postscale_factor, process_set=ctx.process_set)
        return (None, None, None, None, None, *grads)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: Any = None, op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce a list of tensors as one op: new tensors, differentiable."""
    from popdist_py.horovod.torch.compression import Compression

    op = handle_average_backwards_compatibility(op, average)
    compression = compression or Compression.none
    packed = [compression.compress(t) for t in tensors]
    reduced = _apply(HorovodGroupedAllreduce, name, op, prescale_factor, postscale_factor, process_set,
                                            *[c for c, _ in packed])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, packed, strict=True)]


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> tuple[torch.Tensor, ...]:
    """Reduce a list of tensors in place as one op and return them."""
    return _some(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


# -- allgather -------------------------------------------------------------------------------

def _allgather_async(tensors: Sequence[torch.Tensor], name: str | None, process_set: ProcessSet,
                     kind: str) -> int:
    set_id = _set_id(process_set)
    for t in tensors:
        if t.dim() == 0:
            raise HorovodInternalError(f"{kind}: a tensor of at least one dimension is needed (got a scalar)")
    dtypes = tuple(_dtype(t, kind) for t in tensors)
    shapes = tuple(tuple(t.shape) for t in tensors)
    request = neg.Request(_name(kind, name, set_id), neg.ALLGATHER, set_id, dtypes, shapes)
    originals = [t.dtype for t in tensors]

    def finish(handle: Handle) -> Any:
        outs = [_tensor(a, d) for a, d in zip(handle.outputs, originals, strict=True)]
        return tuple(outs) if kind == "grouped_allgather" else outs[0]

    return _submit(request, [np.ascontiguousarray(_view(t)) for t in tensors], None, finish)


def _tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(array)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start concatenating every rank's ``tensor`` along the first dimension; returns a handle."""
    return _allgather_async([tensor], name, process_set, "allgather")


class HorovodAllgather(torch.autograd.Function):
    """allgather with a gradient: the gradient is averaged, then each rank takes its own rows."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: ProcessSet) -> torch.Tensor:
        ctx.dim = tensor.shape[0]
        ctx.process_set = process_set
        return _one(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grad_reduced = allreduce(grad_output, op=Average, process_set=ctx.process_set)
        dims = allgather(torch.tensor([ctx.dim], dtype=torch.int64), process_set=ctx.process_set)
        offset = int(dims[:ctx.process_set.rank()].sum())
        return grad_reduced.narrow(0, offset, ctx.dim), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along the first dimension (sizes may differ there)."""
    return cast(torch.Tensor, _apply(HorovodAllgather, tensor, name, process_set))


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start allgathers of several tensors as one op; returns a handle."""
    return _allgather_async(list(tensors), name, process_set, "grouped_allgather")


class HorovodGroupedAllgather(torch.autograd.Function):
    """grouped_allgather with gradients: each averaged, then each rank takes its own rows."""

    @staticmethod
    def forward(ctx: Any, name: str | None, process_set: ProcessSet, *tensors: torch.Tensor) -> tuple[Any, ...]:
        ctx.dims = [t.shape[0] for t in tensors]
        ctx.process_set = process_set
        return _some(grouped_allgather_async(tensors, name, process_set))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        reduced = grouped_allreduce(list(grad_outputs), op=Average, process_set=ctx.process_set)
        dims = allgather(torch.tensor([ctx.dims], dtype=torch.int64), process_set=ctx.process_set)
        offsets = dims[:ctx.process_set.rank()].sum(dim=0).tolist()
        grads = [g.narrow(0, int(at), n) for g, at, n in zip(reduced, offsets, ctx.dims, strict=True)]
        return (None, None, *grads)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> tuple[torch.Tensor, ...]:
    """allgather of several tensors as one op (differentiable)."""
    return cast(tuple[torch.Tensor, ...], _apply(HorovodGroupedAllgather, name, process_set, *tensors))


# -- broadcast -------------------------------------------------------------------------------

def _broadcast_async(tensor: torch.Tensor, output: torch.Tensor, root_rank: int, name: str | None,
                     process_set: ProcessSet) -> int:
    set_id = _set_id(process_set)
    dtype = _dtype(tensor, "broadcast")
    members = _members(set_id)
    if not isinstance(root_rank, int) or root_rank not in members:
        raise ValueError(f"broadcast: root_rank={root_rank!r} is not a rank of the process set: valid ranks are "
                         f"{', '.join(map(str, members))}")
    src = tensor.detach().contiguous()
    work = output if output.is_contiguous() else _new_like(output)
    request = neg.Request(_name("broadcast", name, set_id), neg.BROADCAST, set_id, (dtype,), (tuple(tensor.shape),),
                          root=int(root_rank))

    def finish(handle: Handle) -> torch.Tensor:
        if work is not output:
            output.copy_(work)
        return output

    return _submit(request, [_view(src)], [_view(work)], finish)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start copying rank ``root_rank``'s ``tensor`` to a new tensor on every rank; returns a handle."""
    return _broadcast_async(tensor, _new_like(tensor), root_rank, name, process_set)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start overwriting ``tensor`` with rank ``root_rank``'s; returns a handle."""
    return _broadcast_async(tensor, tensor.data, root_rank, name, process_set)


class HorovodBroadcast(torch.autograd.Function):
    """broadcast with a gradient: the averaged gradient on the root, zero elsewhere."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None,
                process_set: ProcessSet) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return _one(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grad_reduced = allreduce(grad_output, op=Average, process_set=ctx.process_set)
        if basics.rank() != ctx.root_rank:
            grad_reduced = grad_reduced * 0
        return grad_reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Rank ``root_rank``'s ``tensor`` on every rank, as a new tensor (differentiable)."""
    return cast(torch.Tensor, _apply(HorovodBroadcast, tensor, root_rank, name, process_set))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with rank ``root_rank``'s and return it."""
    return _one(broadcast_async_(tensor, root_rank, name, process_set))


# -- alltoall --------------------------------------------------------------------------------

def alltoall_async(tensor: torch.Tensor, splits: torch.Tensor | Sequence[int] | None = None,
                   name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    """Start sending ``splits[j]`` rows of ``tensor`` to rank j (equal parts when None); returns a handle."""
    set_id = _set_id(process_set)
    dtype = _dtype(tensor, "alltoall")
    n = len(_members(set_id))
    if tensor.dim() == 0:
        raise HorovodInternalError("alltoall: a tensor of at least one dimension is needed (got a scalar)")
    rows = tensor.shape[0]
    if splits is None:
        if rows % n:
            raise ValueError(f"alltoall: the first dimension ({rows}) must be a multiple of the number of ranks "
                             f"({n}) when no splits are given")
        parts = [rows // n] * n
    else:
        if not isinstance(splits, torch.Tensor):
            splits = torch.tensor(list(splits), dtype=torch.int32)
        if splits.dim() != 1 or splits.dtype != torch.int32:
            raise ValueError(f"alltoall: splits must be a 1-D tensor of int32 (or a list of ints), got "
                             f"{splits.dim()}-D {str(splits.dtype).removeprefix('torch.')}")
        parts = [int(x) for x in splits.tolist()]
        if len(parts) != n or any(x < 0 for x in parts) or sum(parts) > rows:
            raise ValueError(f"alltoall: splits {parts} must be {n} non-negative numbers adding up to at most the "
                             f"first dimension ({rows})")
    request = neg.Request(_name("alltoall", name, set_id), neg.ALLTOALL, set_id, (dtype,), (tuple(tensor.shape),),
                          splits=tuple(parts))
    original = tensor.dtype

    def finish(handle: Handle) -> tuple[torch.Tensor, torch.Tensor]:
        return _tensor(handle.outputs[0], original), torch.tensor(handle.value, dtype=torch.int32)

    return _submit(request, [np.ascontiguousarray(_view(tensor))], None, finish)


class HorovodAlltoall(torch.autograd.Function):
    """alltoall with a gradient: the gradient's rows go back where they came from."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None,
                process_set: ProcessSet) -> tuple[torch.Tensor, torch.Tensor]:
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor, _grad_splits: Any) -> tuple[Any, ...]:
        grad, _ = alltoall(grad_output.contiguous(), splits=ctx.received, process_set=ctx.process_set)
        return grad, None, None, None


def alltoall(tensor: torch.Tensor, splits: torch.Tensor | Sequence[int] | None = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Rows of every rank's ``tensor`` sent to each rank: the rows received, and with ``splits``
    given, also the number received from each rank."""
    output, received = _apply(HorovodAlltoall, tensor, splits, name, process_set)
    return output if splits is None else (output, received)


# -- reducescatter ---------------------------------------------------------------------------

def _reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None, op: ReduceOp, process_set: ProcessSet,
                         prescale_factor: float, postscale_factor: float, kind: str) -> int:
    if op not in (Sum, Average):
        raise HorovodInternalError(f"{kind}: op={op!r} is not supported: reducescatter takes hvd.Sum or "
                                   f"hvd.Average")
    op_name = _op_name(op)
    set_id = _set_id(process_set)
    dtypes = tuple(_dtype(t, kind, reducible=True) for t in tensors)
    for t in tensors:
        if t.dim() == 0:
            raise ValueError(f"{kind}: a tensor of at least one dimension is needed (got a scalar)")
    work = [_reduce_dtype(t).contiguous() for t in tensors]
    shapes = tuple(tuple(t.shape) for t in tensors)
    request = neg.Request(_name(kind, name, set_id), neg.REDUCESCATTER, set_id, dtypes, shapes, op_name, -1,
                          float(prescale_factor), float(postscale_factor))
    originals = [t.dtype for t in tensors]

    def finish(handle: Handle) -> Any:
        outs = [torch.from_numpy(a).to(d) for a, d in zip(handle.outputs, originals, strict=True)]
        return outs if kind == "grouped_reducescatter" else outs[0]

    return _submit(request, [w.numpy() for w in work], None, finish)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """Start reducing ``tensor`` and giving each rank its share of the first dimension; returns a handle."""
    return _reducescatter_async([tensor], name, ReduceOp(op), process_set, prescale_factor, postscale_factor,
                                "reducescatter")


class HorovodReducescatter(torch.autograd.Function):
    """reducescatter with a gradient: the gradients of the shares gathered (and scaled alike)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, process_set: ProcessSet,
                prescale_factor: float, postscale_factor: float) -> torch.Tensor:
        ctx.op, ctx.process_set = op, process_set
        ctx.prescale_factor, ctx.postscale_factor = prescale_factor, postscale_factor
        return _one(reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        factor = ctx.prescale_factor * ctx.postscale_factor * (ctx.process_set.size() if ctx.op == Sum else 1)
        if factor != 1.0:
            grad_output = grad_output * factor
        return allgather(grad_output, process_set=ctx.process_set), None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = None, op: Any = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """This rank's share of the reduction of every rank's ``tensor`` (differentiable)."""
    from popdist_py.horovod.torch.compression import Compression

    compression = compression or Compression.none
    compressed, ctx = compression.compress(tensor)
    out = _apply(HorovodReducescatter, compressed, name, ReduceOp(op), process_set, prescale_factor,
                 postscale_factor)
    return cast(torch.Tensor, compression.decompress(out, ctx))


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None, op: Any = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """Start reducescatters of several tensors as one op; returns a handle."""
    return _reducescatter_async(list(tensors), name, ReduceOp(op), process_set, prescale_factor, postscale_factor,
                                "grouped_reducescatter")


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None, compression: Any = None,
                          op: Any = Average, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """reducescatter of several tensors as one op."""
    from popdist_py.horovod.torch.compression import Compression

    compression = compression or Compression.none
    packed = [compression.compress(t) for t in tensors]
    outs = _apply(HorovodGroupedReducescatter, name, ReduceOp(op), process_set, prescale_factor, postscale_factor,
                  *[c for c, _ in packed])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, packed, strict=True)]


class HorovodGroupedReducescatter(torch.autograd.Function):
    """grouped_reducescatter with gradients: each share's gradient gathered (and scaled alike)."""

    @staticmethod
    def forward(ctx: Any, name: str | None, op: ReduceOp, process_set: ProcessSet, prescale_factor: float,
                postscale_factor: float, *tensors: torch.Tensor) -> tuple[Any, ...]:
        ctx.op, ctx.process_set = op, process_set
        ctx.prescale_factor, ctx.postscale_factor = prescale_factor, postscale_factor
        return tuple(_many(grouped_reducescatter_async(tensors, name, op, process_set, prescale_factor,
                                                       postscale_factor)))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        factor = ctx.prescale_factor * ctx.postscale_factor * (ctx.process_set.size() if ctx.op == Sum else 1)
        grads = [g * factor if factor != 1.0 else g for g in grad_outputs]
        return (None, None, None, None, None, *grouped_allgather(grads, process_set=ctx.process_set))


# -- sparse tensors --------------------------------------------------------------------------

def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: Any,
                           process_set: ProcessSet = global_process_set) -> Callable[[], torch.Tensor]:
    """Start reducing a sparse tensor by gathering every rank's indices and values; returns a
    function that waits and gives the (uncoalesced) sparse sum, or average."""
    indices = allgather_async(tensor._indices().transpose(0, 1).contiguous(), name=f"{name}.indices",
                              process_set=process_set)
    values = allgather_async(tensor._values(), name=f"{name}.values", process_set=process_set)
    shape = tensor.size()

    def wait() -> torch.Tensor:
        gathered_indices, gathered_values = _one(indices), _one(values)
        if ReduceOp(op) == Average:
            gathered_values = gathered_values / len(_members(_set_id(process_set)))
        return torch.sparse_coo_tensor(gathered_indices.transpose(0, 1), gathered_values, shape)

    return wait


# -- barrier, join, process sets -------------------------------------------------------------

def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of ``process_set`` has called barrier."""
    set_id = _set_id(process_set)
    synchronize(_submit(neg.Request(_name("barrier", None, set_id), neg.BARRIER, set_id), (), None,
                        lambda h: None))


def join(device: int = -1) -> int:
    """This rank has no more data: it takes part in the others' allreduces with zeros until every
    rank has joined; returns the last rank to join."""
    basics.state()
    return int(synchronize(_submit(neg.Request("join", neg.JOIN), (), None, lambda h: h.value)))


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set (collective: every rank calls it with the same ranks); returns it."""
    state = basics.state()
    if not settings.flag(HOROVOD_DYNAMIC_PROCESS_SETS, False):
        raise ValueError(f"add_process_set: process sets can be added after hvd.init() only with "
                         f"{HOROVOD_DYNAMIC_PROCESS_SETS}=1; or give them to hvd.init(process_sets=...)")
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ValueError(f"{ps} is registered already")
    ps.ranks = basics.ranks_of(ps, state.comm)
    for set_id, members in state.runtime.sets.items():
        if list(members) == ps.ranks:
            raise ValueError(f"Attempted to add a duplicate process set: process set {set_id} has ranks {ps.ranks}")
    request = neg.Request(_name("add_process_set", None, 0), neg.ADD_PROCESS_SET, 0, ranks=tuple(ps.ranks))
    set_id = synchronize(_submit(request, (), None, lambda h: h.value))
    ps.process_set_id = int(set_id)
    _forget_names(ps.process_set_id)
    state.process_sets[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (collective); False when it was not registered."""
    state = basics.state()
    if process_set.process_set_id is None or process_set.process_set_id == 0:
        return False
    if not settings.flag(HOROVOD_DYNAMIC_PROCESS_SETS, False):
        raise ValueError(f"remove_process_set: process sets can be removed only with "
                         f"{HOROVOD_DYNAMIC_PROCESS_SETS}=1")
    request = neg.Request(_name("remove_process_set", None, 0), neg.REMOVE_PROCESS_SET, 0,
                          root=process_set.process_set_id)
    synchronize(_submit(request, (), None, lambda h: h.value))
    state.process_sets.pop(process_set.process_set_id, None)
    process_set._invalidate()
    return True

