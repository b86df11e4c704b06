"""Whole-model helpers: broadcast parameters, optimizer state and Python objects; gather objects."""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from typing import Any

import torch

from popdist_py.horovod.common import basics
from popdist_py.horovod.common.process_sets import ProcessSet, global_process_set
from popdist_py.horovod.torch import mpi_ops


def _dumps(obj: Any) -> bytes:
    """cloudpickle where installed (it takes lambdas and local classes), else pickle."""
    try:
        import cloudpickle  # type: ignore[import-untyped]
    except ImportError:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return bytes(cloudpickle.dumps(obj))


def broadcast_parameters(params: Any, root_rank: int, process_set: ProcessSet = global_process_set) -> None:
    """Overwrite every rank's parameters (a ``state_dict()`` or ``named_parameters()``) with the root's."""
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, Iterable):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    handles = [mpi_ops.broadcast_async_(p, root_rank, name, process_set) for name, p in items]
    for handle in handles:
        mpi_ops.synchronize(handle)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """The root's ``obj`` on every rank (pickled; any picklable object)."""
    name = name or type(obj).__name__
    if basics.rank() == root_rank:
        data = _dumps(obj)
        size = torch.tensor([len(data)], dtype=torch.int64)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    mpi_ops.broadcast_(size, root_rank, name=f"{name}.sz", process_set=process_set)
    if basics.rank() != root_rank:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    mpi_ops.broadcast_(payload, root_rank, name=f"{name}.t", process_set=process_set)
    return obj if basics.rank() == root_rank else pickle.loads(payload.numpy().tobytes())


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every rank's ``obj``, in rank order (pickled; any picklable object)."""
    name = name or type(obj).__name__
    data = _dumps(obj)
    sizes = mpi_ops.allgather(torch.tensor([len(data)], dtype=torch.int64), name=f"{name}.sz",
                              process_set=process_set)
    gathered = mpi_ops.allgather(torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else
                                 torch.empty(0, dtype=torch.uint8), name=f"{name}.t", process_set=process_set)
    raw = gathered.numpy().tobytes()
    out, at = [], 0
    for n in sizes.tolist():
        out.append(pickle.loads(raw[at:at + n]))
        at += n
    return out


def _first_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The state of an optimizer that never stepped, made by one step with zero gradients."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam):
                    p.grad = p.grad.to_sparse()
    step = getattr(optimizer, "_wrapped_step", None)
    (step or optimizer.step)()
    return optimizer.state_dict()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None,
                              process_set: ProcessSet = global_process_set) -> None:
    """Overwrite every rank's optimizer state (tensors, scalars and param-group options) with the root's.

    An optimizer that has not stepped yet gets its state made by one step with zero gradients, as
    Horovod does, so that every rank has the same tensors to receive into.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    state_dict = optimizer.state_dict()
    if not state_dict["state"]:
        state_dict = _first_state(optimizer)
    if not state_dict["state"]:
        return
    scalars: dict[str, Any] = {}
    tensors: list[tuple[str, torch.Tensor]] = []
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, group in enumerate(state_dict["param_groups"]):
        for key, value in group.items():
            if key != "params":
                scalars[f"group.{index}.{key}"] = value
        for pid in group["params"]:
            for key, value in state_dict["state"].get(pid, {}).items():
                if torch.is_tensor(value):
                    tensors.append((f"state.{pid}.{key}", value))
                else:
                    scalars[f"state.{pid}.{key}"] = value
    scalars = broadcast_object(scalars, root_rank, name="optimizer_state.scalars", process_set=process_set)
    broadcast_parameters(tensors, root_rank, process_set=process_set)
    for index, group in enumerate(optimizer.param_groups):
        for key in list(group):
            if key != "params" and f"group.{index}.{key}" in scalars:
                group[key] = scalars[f"group.{index}.{key}"]
    for name, value in scalars.items():
        kind, pid, key = name.split(".", 2)
        if kind == "state":
            optimizer.state[params[int(pid)]][key] = value
