"""Horovod's DistributedOptimizer: gradients averaged over the ranks while backward still runs.

It wraps any torch optimizer as a subclass made on the fly (so ``isinstance`` and
``state_dict`` keep working). A hook after each parameter's gradient is accumulated counts the
backward passes; at the ``backward_passes_per_step``-th it starts that gradient's allreduce
(named after the parameter, so ranks whose autograd reaches parameters in different orders
still meet). ``step()`` (or ``synchronize()``) waits for them all, submits those that never got
a gradient (zeros: another rank may have one) and writes the averages into ``.grad``.
Accumulated gradients are summed, not divided by the number of passes, as Horovod does.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from popdist_py.horovod.common import basics
from popdist_py.horovod.common.process_sets import ProcessSet, global_process_set
from popdist_py.horovod.torch import mpi_ops
from popdist_py.horovod.torch.compression import Compression
from popdist_py.horovod.torch.mpi_ops import Adasum, Average


class _DistributedOptimizer(torch.optim.Optimizer):
    """The methods every wrapped optimizer gets; never instantiated itself."""

    def __init__(self, params: Any, named_parameters: Any, compression: Any, backward_passes_per_step: int = 1,
                 op: Any = Average, gradient_predivide_factor: float = 1.0, groups: Any = None,
                 sparse_as_dense: bool = False, process_set: ProcessSet = global_process_set) -> None:
        super(self.__class__, self).__init__(params)  # type: ignore[call-arg]  # the dynamic subclass's base
        self._compression = compression
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [(f"allreduce.noname.{i}.{j}", v) for i, group in enumerate(self.param_groups)
                                for j, v in enumerate(group["params"])]
        if any(not isinstance(p, tuple) for p in named_parameters):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced "
                             "by model.named_parameters().")
        names = [k for k, _ in named_parameters]
        dups = sorted({k for k in names if names.count(k) > 1})
        if dups:
            raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(dups)}")
        all_ids = {id(v) for group in self.param_groups for v in group["params"]}
        unnamed = all_ids - {id(v) for _, v in named_parameters}
        if unnamed:
            raise ValueError("named_parameters was specified, but one or more model parameters were not named. "
                             f"Python object ids: {', '.join(str(i) for i in unnamed)}")
        self._parameter_names = {v: k for k, v in sorted(named_parameters, key=lambda kv: kv[0])}
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {v: backward_passes_per_step for _, v in named_parameters}
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._groups = _groups_of(groups, self.param_groups)
        self._handles: dict[Any, tuple[Any, Any]] = {}
        self._hooks: list[Any] = []
        self._requires_update: set[torch.Tensor] = set()
        self._synchronized = False
        self._should_synchronize = True
        if process_set.included() and (basics.size() > 1 or _elastic()):
            self._register_hooks()

    def load_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._handles = {}
        self._synchronized = False
        self._should_synchronize = True
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        super(self.__class__, self).load_state_dict(*args, **kwargs)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def _register_hooks(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._requires_update.add(p)
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

    def _allreduce_grad_async(self, p: torch.Tensor) -> tuple[Any, Any]:
        if p.grad is None:
            # Another rank may have a gradient for it (a model whose forward differs per rank).
            p.grad = torch.zeros_like(p)
        tensor = p.grad
        name = self._parameter_names.get(p)
        if tensor.is_sparse:
            if not self.sparse_as_dense:
                return mpi_ops.sparse_allreduce_async(tensor, name=name or "", op=self.op,
                                                      process_set=self.process_set), None
            tensor = tensor.to_dense()
        compressed, ctx = self._compression.compress(tensor)
        if self.op == Average:
            pre, post = 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        else:
            pre, post = 1.0, 1.0
        handle = mpi_ops.allreduce_async_(compressed, name=name, op=self.op,
                                          prescale_factor=pre, postscale_factor=post, process_set=self.process_set)
        return handle, ctx

    def _make_hook(self, p: torch.Tensor) -> Any:
        def hook(_param: torch.Tensor) -> None:
            if p in self._handles and self._handles[p][0] is not None and self._allreduce_delay[p] <= 0:
                raise AssertionError("Gradients were computed more than backward_passes_per_step times before call "
                                     "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
            assert self._allreduce_delay[p] > 0
            handle, ctx = None, None
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] == 0:
                handle, ctx = self._allreduce_grad_async(p)
            self._handles[p] = (handle, ctx)
        return hook

    def synchronize(self) -> None:
        """Wait for every gradient's allreduce (starting the ones not yet started) and write the results."""
        if not self.process_set.included():
            self._synchronized = True
            return
        for p in self._requires_update - set(self._handles):
            self._handles[p] = self._allreduce_grad_async(p)
        for p, (handle, _ctx) in list(self._handles.items()):
            if handle is None:
                self._handles[p] = self._allreduce_grad_async(p)
        for p, (handle, ctx) in self._handles.items():
            assert handle is not None
            output = handle() if callable(handle) else self._compression.decompress(mpi_ops.synchronize(handle), ctx)
            self._allreduce_delay[p] = self.backward_passes_per_step
            if p.grad.is_sparse:
                p.grad = output if output.is_sparse else output.to_sparse()
            else:
                p.grad.set_(output)
        self._handles.clear()
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside it, ``step()`` does not synchronize (after an explicit ``synchronize()``)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to "
                              "consider using optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def _wrapped_step(self, closure: Any = None) -> Any:
        """The wrapped optimizer's own step, without synchronizing (broadcast_optimizer_state uses it)."""
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it can cause "
                                 "a race condition.")
        return super(self.__class__, self).zero_grad(set_to_none)


def _elastic() -> bool:
    from popcontract import settings
    from popcontract.environment import HOROVOD_ELASTIC

    return settings.flag(HOROVOD_ELASTIC, False)


def _groups_of(groups: Any, param_groups: list[dict[str, Any]]) -> Any:
    """Validate ``groups`` (a number of groups, or lists of parameters); the grouping itself only
    affects fusion, which the negotiation does for every ready gradient anyway."""
    if groups is None:
        return None
    if isinstance(groups, int):
        if groups < 0:
            raise ValueError(f"groups={groups}: a number of groups must be 0 or more")
        return groups
    if isinstance(groups, list):
        ids = {id(p) for g in param_groups for p in g["params"]}
        for group in groups:
            if not isinstance(group, list) or any(id(p) not in ids for p in group):
                raise ValueError("groups must be a list of lists of the optimizer's parameters")
        return groups
    raise ValueError(f"groups={groups!r}: groups must be a number of groups or a list of lists of parameters")


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,
                         compression: Any = Compression.none, backward_passes_per_step: int = 1,
                         op: Any = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Any = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set) -> Any:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged (``op``) over the ranks: an
    instance of a subclass of its class, made here, which adds ``synchronize()``,
    ``skip_synchronize()`` and ``set_backward_passes_per_step()``."""
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if op == Adasum:
        raise NotImplementedError("Adasum is not available in popdist_py's Horovod; use op=hvd.Average or hvd.Sum")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression,
               backward_passes_per_step, op, gradient_predivide_factor, groups, sparse_as_dense, process_set)
