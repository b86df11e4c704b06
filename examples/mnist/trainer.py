"""The network on the engine: its weights as replicated variables and its two replicated steps.

With ``rts`` (and more than one replica) the weights are created the two ways of PopXL's MNIST RTS example:

- W0 with ``rt.replica_sharded_variable``: each replica holds 1/R of it; a step gathers the full
  weight with ``ops.replicated_all_gather(shard)`` and updates only its own shard.
- W1 with ``rt.remote_replica_sharded_variable`` on an explicit ``rt.remote_buffer``: a step loads
  its shard with ``ops.remote_load``, gathers, updates the shard and stores it back with
  ``ops.remote_store``.

The gradient is reduced the same way in both paths, ``replicated_all_reduce(g, op="mean")`` over
all replicas in global replica order, and a sharded weight takes its part with
``ops.replica_sharded_slice`` (as PopXL's example does). The update is elementwise, so a shard's update
is bitwise the corresponding part of the unsharded update: RTS on or off gives the same weights.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import numpy as np

from popdist_py.engine import Runtime, StepContext, ops

from .model import PARAMS, Params, correct, loss_and_grads

log = logging.getLogger(__name__)


class Trainable(NamedTuple):
    """One weight, as the ``Trainable`` of PopXL's example: ``var`` is what the host reads back; ``shards`` the
    RTS shard handle (``replica_sharded_variable``) and ``remote_buffer`` the buffer holding the
    shards (``remote_replica_sharded_variable``); both None for a plain variable."""

    var: Any
    shards: Any | None
    remote_buffer: Any | None
    shape: tuple[int, ...]

    @property
    def sharded(self) -> bool:
        return self.shards is not None or self.remote_buffer is not None


class Network:
    """The trainables of one :class:`Runtime` and the steps ``rt.run`` calls once per local replica."""

    def __init__(self, rt: Runtime, params: Params, *, rts: bool, lr: float) -> None:
        self.rt = rt
        self.lr = np.float32(lr)
        self.rts = rts and rt.replication_factor > 1  # as in PopXL's example: RTS needs replicas to shard over
        if rts and not self.rts:
            log.info("--rts has no effect with a single replica: the weights are plain variables")
        self.trainables = {name: self._create(name, np.asarray(value, np.float32))
                           for name, value in zip(PARAMS, params, strict=True)}

    def _create(self, name: str, data: np.ndarray) -> Trainable:
        rt = self.rt
        if self.rts and name == "W0":
            full, shards = rt.replica_sharded_variable(data, name=name)
            return Trainable(full, shards, None, data.shape)
        if self.rts and name == "W1":
            # one shard per replica: ceil(n / R) elements (the engine pads the last shards)
            buffer = rt.remote_buffer((ops.shard_size(data.shape, rt.replication_factor),), np.float32, entries=1)
            var = rt.remote_replica_sharded_variable(data, buffer, 0, name=name)
            return Trainable(var, None, buffer, data.shape)
        return Trainable(rt.variable(data, name=name), None, None, data.shape)

    # -- inside a step (one call per local replica) --------------------------------------------------
    def _read(self, ctx: StepContext, t: Trainable) -> tuple[np.ndarray, np.ndarray | None]:
        """(full weight, this replica's shard or None)."""
        if t.remote_buffer is not None:
            shard = ops.remote_load(t.remote_buffer, 0)  # a shard array: the gather knows its full shape
            return ops.replicated_all_gather(shard), shard
        if t.shards is not None:
            return ops.replicated_all_gather(t.shards), ctx[t.shards]
        return ctx[t.var], None

    def _weights(self, ctx: StepContext) -> tuple[Params, list[np.ndarray | None]]:
        pairs = [self._read(ctx, t) for t in self.trainables.values()]
        return Params(*(full for full, _ in pairs)), [shard for _, shard in pairs]

    def _update(self, ctx: StepContext, t: Trainable, grad: np.ndarray, shard: np.ndarray | None) -> None:
        grad = ops.replicated_all_reduce(grad, op="mean")
        if shard is None:
            ctx[t.var] = ctx[t.var] - self.lr * grad
            return
        new = shard - self.lr * ops.replica_sharded_slice(grad)
        if t.remote_buffer is not None:
            ops.remote_store(t.remote_buffer, 0, new)
        elif t.shards is not None:
            ctx[t.shards] = new

    def train_step(self, ctx: StepContext, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """One SGD step on this replica's micro-batch; returns the loss averaged over all replicas."""
        params, shards = self._weights(ctx)
        loss, grads = loss_and_grads(params, x, y)
        for t, grad, shard in zip(self.trainables.values(), grads, shards, strict=True):
            self._update(ctx, t, grad, shard)
        return ops.replicated_all_reduce(np.array([loss], np.float32), op="mean")

    def eval_step(self, ctx: StepContext, x: np.ndarray, y: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Correct predictions among the real samples of the whole global test batch."""
        params, _ = self._weights(ctx)
        return ops.replicated_all_reduce(np.array([correct(params, x, y, mask)], np.int64), op="add")

    # -- on the host ---------------------------------------------------------------------------------
    def host_params(self) -> Params:
        """The full weights (collective: every instance calls it and gets the same arrays)."""
        return Params(*(np.asarray(self.rt.get_tensor_data(t.var), np.float32).reshape(t.shape)
                        for t in self.trainables.values()))
