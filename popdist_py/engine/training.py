"""A training step the engine owns: micro-batches, gradient accumulation, fused reduction, optimizer.

The user gives a per-replica function ``loss_and_grads(params, *micro_batch) -> (loss, grads)``
(``params`` and ``grads``: dicts of arrays by weight name, read-only params) and an optimizer;
:meth:`Trainer.step` feeds host data shaped ``[batches_per_step, accumulation_factor, L,
*micro_batch_shape]`` (size-1 axes optional, PopART's rule) and, per batch and replica:

1. runs the function on each of the ``accumulation_factor`` micro-batches and accumulates the
   gradients in a fixed order, the left-to-right pairwise tree of :func:`canonical_sum`;
2. divides by the factor (``reduction="mean"``) and reduces the gradients across replicas (mean or
   sum, PopART's ReductionType), in buckets of ``fused_reduction_bytes``: one collective per
   bucket. A bucket of tensors whose optimizer state is sharded over all replicas is laid out
   shard-major and reduce-scattered, so each replica receives only its shards (ZeRO-2);
3. applies the optimizer: on the whole tensor when its state is replicated; on this replica's
   shard of weight, gradient and state when the state is sharded, followed by an all-gather of
   the weight (ZeRO-1/2). LAMB's norms are then exact sums over the shards.

Every choice above keeps results bitwise identical: reductions are elementwise over a fixed tree
of replicas, optimizer updates are elementwise, so replicated and sharded state, fused and
per-tensor reduction and any split into instances give the same weights bit for bit. Accumulating
``A`` micro-batches of ``B`` samples equals one micro-batch of ``A * B`` samples bitwise when
``loss_and_grads`` sums its per-sample gradients with :func:`canonical_sum` and ``A`` and ``B`` are
powers of two (divisions by powers of two are exact).

The weights, each optimizer state tensor (``"<weight>/<state>"``) and the update count
(``"trainer/step"``) are engine variables, so ``rt.save``/``rt.load`` checkpoint the training
state and restore it under any split and any state placement.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from popdist_py import validate
from popdist_py.engine import ops
from popdist_py.engine.grouping import CommGroup, ReplicaGrouping
from popdist_py.engine.locations import REDUCTIONS, TensorLocation, TrainingOptions
from popdist_py.engine.optimizers import Optimizer, exact_norm, norm_from_parts, sum_squares_parts
from popdist_py.engine.sharding import ShardLayout

STEP_VARIABLE = "trainer/step"

LossAndGrads = Callable[..., tuple[Any, Mapping[str, np.ndarray]]]


# ----------------------------------------------------------------------------------- fixed order
class PairwiseSum:
    """Adds values in the left-to-right pairwise tree of :func:`canonical_sum`, one at a time:
    complete power-of-two blocks are merged as they fill, the rest folded left to right at the end."""

    def __init__(self) -> None:
        self._blocks: list[tuple[int, Any]] = []

    def add(self, value: Any) -> None:
        size = 1
        while self._blocks and self._blocks[-1][0] == size:
            _, left = self._blocks.pop()
            value = left + value
            size *= 2
        self._blocks.append((size, value))

    def total(self) -> Any:
        if not self._blocks:
            raise ValueError("PairwiseSum: nothing was added")
        result = self._blocks[0][1]
        for _, value in self._blocks[1:]:
            result = result + value
        return result


def canonical_sum(values: np.ndarray, axis: int = 0) -> np.ndarray:
    """Sum over ``axis`` in the left-to-right pairwise tree that :class:`PairwiseSum` (and so the
    trainer's accumulation) uses: blocks of 2**k consecutive entries, largest first, each summed
    by pairing neighbours level by level, then the blocks from left to right."""
    x = np.moveaxis(np.asarray(values), axis, 0)
    n = x.shape[0]
    if n == 0:
        raise ValueError("canonical_sum: the axis is empty")
    result = None
    start = 0
    for bit in reversed(range(n.bit_length())):
        size = 1 << bit
        if not n & size:
            continue
        block = x[start:start + size]
        while block.shape[0] > 1:
            block = block[0::2] + block[1::2]
        result = block[0] if result is None else result + block[0]
        start += size
    assert result is not None
    return result


# ----------------------------------------------------------------------------------- placement
class Placement:
    """Where one weight's optimizer state lives: replicated (``domain`` None) or sharded."""

    def __init__(self, domain: ReplicaGrouping | None, everyone: ReplicaGrouping) -> None:
        self.domain = domain
        #: a reduce-scatter over all replicas hands each replica exactly its shards (ZeRO-2); over a
        #: smaller domain the reduction over all replicas comes first (the same tree: same bits).
        self.scatter = domain is not None and domain == everyone


def _resolve_domain(rt: Any, location: TensorLocation, where: str) -> ReplicaGrouping:
    domain = location.sharding_domain
    grouping = rt.resolve_group(domain) if domain is not None else rt.replica_grouping()  # checks it fits
    if not grouping.is_const:
        raise ValueError(f"{where}.sharding_domain {domain!r} is irregular; a sharding domain is a stride/size "
                         "grouping such as CommGroup.consecutive(L)")
    return grouping


# ----------------------------------------------------------------------------------- the trainer
class Trainer:
    """Owns the training step of a runtime: see the module docstring.

    ``params``: initial weights by name (host arrays, every instance passes the same);
    ``micro_batch_shapes``: the shape of one micro-batch of each input (what ``loss_and_grads``
    receives, e.g. ``[(B, 64), (B,)]``), which tells which leading axes of the host data are
    present.
    """

    def __init__(self, rt: Any, params: Mapping[str, Any], loss_and_grads: LossAndGrads, optimizer: Optimizer,
                 micro_batch_shapes: Sequence[tuple[int, ...]], options: TrainingOptions | None = None) -> None:
        options = options or TrainingOptions()
        if not isinstance(options, TrainingOptions):
            raise TypeError(f"options is a {type(options).__name__}, not a TrainingOptions")
        options.check()
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer is a {type(optimizer).__name__}, not a popdist_py.engine.optimizers.Optimizer")
        if not callable(loss_and_grads):
            raise TypeError("loss_and_grads must be callable: (params, *micro_batch) -> (loss, grads)")
        if not params:
            raise ValueError("params is empty: give the initial weights by name")
        arrays: dict[str, np.ndarray] = {}
        for name, value in params.items():
            if not isinstance(name, str) or not name or "/" in name:
                raise ValueError(f"weight name {name!r} is not valid (a non-empty str without '/')")
            arr = np.asarray(value)
            if not np.issubdtype(arr.dtype, np.floating):
                raise TypeError(f"weight {name!r} has dtype {arr.dtype}; weights are floating point")
            arrays[name] = arr
        self.micro_batch_shapes = [tuple(validate.non_negative("micro_batch_shapes entry", d) for d in s)
                                   for s in micro_batch_shapes]
        everyone = rt.replica_grouping()
        settings = options.optimizer_state_tensor_location_settings
        state_names = {f"{w}/{s}" for w in arrays for s in optimizer.state_names}
        unknown = sorted(set(options.tensor_location_settings_override) - state_names)
        if unknown:
            valid = ", ".join(sorted(state_names)) or "none: this optimizer keeps no state"
            raise ValueError(f"tensor_location_settings_override names {', '.join(map(repr, unknown))}, which "
                             f"is not an optimizer state tensor of this trainer (valid: {valid})")
        placements: dict[str, Placement] = {}
        for name, arr in arrays.items():
            chosen: set[ReplicaGrouping | None] = set()
            for state in optimizer.state_names or ("",):
                key = f"{name}/{state}"
                location = options.tensor_location_settings_override.get(key)
                where = f"tensor_location_settings_override[{key!r}]"
                if location is None:
                    location, where = settings.location, "optimizer_state_tensor_location_settings.location"
                    if arr.size < settings.min_elements_for_replicated_tensor_sharding:
                        location = TensorLocation()
                chosen.add(_resolve_domain(rt, location, where) if location.replicated_tensor_sharding else None)
            if len(chosen) > 1:
                raise ValueError(f"the optimizer state tensors of weight {name!r} are placed differently; they are "
                                 "updated together, so give them one location")
            placements[name] = Placement(chosen.pop(), everyone)
        self.rt = rt
        self.options = options
        self.optimizer = optimizer
        self.loss_and_grads = loss_and_grads
        self.placements = placements
        self.op = REDUCTIONS[options.reduction]
        # the variables: weights replicated, state as placed, the update count
        self.weights_vars = {n: rt.variable(a, name=n) for n, a in arrays.items()}
        self.state_vars: dict[str, dict[str, Any]] = {}
        for name, arr in arrays.items():
            domain = placements[name].domain
            self.state_vars[name] = {}
            for state, zeros in optimizer.init_state(arr.shape, arr.dtype).items():
                key = f"{name}/{state}"
                if domain is None:
                    self.state_vars[name][state] = rt.variable(zeros, name=key)
                else:
                    _, shard = rt.replica_sharded_variable(zeros, shard_over=domain, name=key)
                    self.state_vars[name][state] = shard
        self.step_var = rt.variable(np.zeros((), np.int64), name=STEP_VARIABLE)
        self.buckets = self._plan_buckets(arrays)

    # -------------------------------------------------------------------------------- host side
    def step(self, *data: Any) -> np.ndarray:
        """Run ``batches_per_step`` updates on ``data`` (one array per input); the loss of each
        (reduced over micro-batches and replicas as ``reduction`` says), shape ``[batches_per_step]``."""
        batches = self._batches(data)
        losses = []
        for b in range(batches[0].shape[0]):
            per_replica = [np.moveaxis(x[b], 1, 0) for x in batches]  # [L, A, *micro_batch]
            losses.append(self.rt.run(self._replica_step, *per_replica)[0, 0])
        return np.asarray(losses)

    def weights(self) -> dict[str, np.ndarray]:
        """The current weights, full, on every instance."""
        return {n: self.rt.get_tensor_data(v) for n, v in self.weights_vars.items()}

    @property
    def updates(self) -> int:
        """Weight updates applied so far (restored by ``rt.load``)."""
        return int(self.rt.get_tensor_data(self.step_var))

    def _batches(self, data: Sequence[Any]) -> list[np.ndarray]:
        """Each input as ``[batches_per_step, A, L, *micro_batch]``: size-1 axes may be left out."""
        if len(data) != len(self.micro_batch_shapes):
            raise ValueError(f"step takes {len(self.micro_batch_shapes)} input(s) (micro_batch_shapes), "
                             f"got {len(data)}")
        A, L = self.options.accumulation_factor, self.rt.instance_replication_factor
        out, steps = [], set()
        for k, (value, shape) in enumerate(zip(data, self.micro_batch_shapes, strict=True)):
            x = np.asarray(value)
            tail = x.shape[x.ndim - len(shape):] if len(shape) <= x.ndim else None
            if tail != shape:
                raise ValueError(f"input {k} has shape {x.shape}; it must end with the micro-batch shape {shape}")
            leading = x.shape[:x.ndim - len(shape)]
            readings = set()
            for keep_a, keep_l in itertools.product((True, False), repeat=2):
                if (not keep_a and A != 1) or (not keep_l and L != 1):
                    continue
                known = (A,) * keep_a + (L,) * keep_l
                if leading[len(leading) - len(known):] != known:
                    continue
                head = leading[:len(leading) - len(known)]
                if len(head) <= 1:
                    readings.add(head[0] if head else 1)
            if len(readings) != 1:
                raise ValueError(
                    f"input {k} has leading axes {leading}, expected [batches_per_step, accumulation_factor={A}, "
                    f"replicas in this instance={L}] before the micro-batch shape {shape} (axes of size 1 may be "
                    "left out)" + (f"; it reads as several batches_per_step: {sorted(readings)}" if readings else ""))
            bps = readings.pop()
            steps.add(bps)
            out.append(x.reshape((bps, A, L, *shape)))
        if len(steps) != 1:
            raise ValueError(f"the inputs give different batches_per_step: {sorted(steps)}")
        return out

    def _plan_buckets(self, arrays: Mapping[str, np.ndarray]) -> list[tuple[bool, ReplicaGrouping | None, list[str]]]:
        """Consecutive weights of one kind (scattered over all replicas, or reduced whole) in
        buckets of about ``fused_reduction_bytes``; each bucket is one collective."""
        buckets: list[tuple[bool, ReplicaGrouping | None, list[str]]] = []
        size = 0
        for name, arr in arrays.items():
            p = self.placements[name]
            kind = (p.scatter, p.domain if p.scatter else None, arr.dtype)
            if buckets and (buckets[-1][0], buckets[-1][1], arrays[buckets[-1][2][0]].dtype) == kind \
                    and size + arr.nbytes <= self.options.fused_reduction_bytes:
                buckets[-1][2].append(name)
                size += arr.nbytes
            else:
                buckets.append((p.scatter, kind[1], [name]))
                size = arr.nbytes
        return buckets

    # -------------------------------------------------------------------------------- replica side
    def _replica_step(self, ctx: Any, *inputs: np.ndarray) -> np.ndarray:
        params = {n: ctx[v] for n, v in self.weights_vars.items()}
        grads_sum, loss_sum = PairwiseSum(), PairwiseSum()
        for a in range(self.options.accumulation_factor):
            loss, grads = self.loss_and_grads(params, *(x[a] for x in inputs))
            grads_sum.add(self._checked(grads, params))
            loss_sum.add(np.asarray(loss, np.float64))
        grads = grads_sum.total()
        loss = loss_sum.total()
        if self.op == "mean" and self.options.accumulation_factor > 1:
            factor = self.options.accumulation_factor
            grads = {n: g / g.dtype.type(factor) for n, g in grads.items()}
            loss = loss / factor
        reduced = self._reduce(grads)
        step = int(ctx[self.step_var]) + 1
        new_weights = self._update(ctx, params, reduced, step)
        for name, value in new_weights.items():
            ctx[self.weights_vars[name]] = value
        ctx[self.step_var] = np.int64(step)
        return ops.replicated_all_reduce(np.asarray([loss]), op=self.op)

    def _checked(self, grads: Any, params: Mapping[str, np.ndarray]) -> _Grads:
        if not isinstance(grads, Mapping) or set(grads) != set(params):
            got = sorted(grads) if isinstance(grads, Mapping) else type(grads).__name__
            raise ValueError(f"loss_and_grads returned gradients for {got}; expected one per weight: {sorted(params)}")
        out = {}
        for name, p in params.items():
            g = np.asarray(grads[name])
            if g.shape != p.shape:
                raise ValueError(f"the gradient of {name!r} has shape {g.shape}, the weight {p.shape}")
            out[name] = g.astype(p.dtype, copy=False)
        return _Grads(out)

    def _reduce(self, grads: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Across replicas, one collective per bucket: full tensors, or this replica's shards."""
        out: dict[str, np.ndarray] = {}
        for scatter, domain, names in self.buckets:
            if not scatter:
                flat = np.concatenate([grads[n].reshape(-1) for n in names])
                reduced = ops.replicated_all_reduce(flat, op=self.op)
                offset = 0
                for n in names:
                    size = grads[n].size
                    out[n] = reduced[offset:offset + size].reshape(grads[n].shape)
                    offset += size
                continue
            assert domain is not None
            k = domain.group_size
            layouts = [ShardLayout(grads[n].size, k) for n in names]
            # shard-major: shard j of every tensor, then shard j + 1 ...: member j receives its shards
            flat = np.concatenate([lay.shard(grads[n].reshape(-1), j)
                                   for j in range(k) for n, lay in zip(names, layouts, strict=True)])
            mine = ops.replicated_reduce_scatter(flat, op=self.op, group=domain)
            offset = 0
            for n, lay in zip(names, layouts, strict=True):
                out[n] = np.asarray(mine[offset:offset + lay.shard_size])
                offset += lay.shard_size
        return out

    def _update(self, ctx: Any, params: Mapping[str, np.ndarray], reduced: Mapping[str, np.ndarray],
                step: int) -> dict[str, np.ndarray]:
        opt = self.optimizer
        new: dict[str, np.ndarray] = {}
        for name, p in params.items():
            placement = self.placements[name]
            handles = self.state_vars[name]
            if placement.domain is None:
                weight = np.array(p, copy=True)
                state = {s: np.array(ctx[h], copy=True) for s, h in handles.items()}
                opt.update(weight, np.asarray(reduced[name]), state, step, norm=exact_norm)
                for s, h in handles.items():
                    ctx[h] = state[s]
                new[name] = weight
                continue
            domain = placement.domain
            weight = ops.replica_sharded_slice(p, group=domain)  # a new array, with its shard meta
            grad = reduced[name]
            if not placement.scatter:  # reduced whole over all replicas: this replica's shard of it
                grad = ops.replica_sharded_slice(grad, group=domain)
            state = {s: ctx[h] for s, h in handles.items()}  # this replica's shards, updated in place
            d = opt.direction(weight, np.asarray(grad), state, step)
            ratio = 1.0
            if opt.uses_norms:
                parts = np.stack([sum_squares_parts(weight), sum_squares_parts(d)])
                total = ops.replicated_all_reduce(parts, op="add", group=domain)
                ratio = opt.trust_ratio(norm_from_parts(total[0]), norm_from_parts(total[1]), step)
            opt.apply(weight, d, step, ratio)
            new[name] = np.asarray(ops.replicated_all_gather(weight, group=domain, output_shape="meta_shape"))
        return new


class _Grads(dict[str, np.ndarray]):
    """Gradients by name that add elementwise (so :class:`PairwiseSum` accumulates dicts)."""

    def __add__(self, other: _Grads) -> _Grads:
        return _Grads({n: g + other[n] for n, g in self.items()})


__all__ = ["STEP_VARIABLE", "CommGroup", "PairwiseSum", "Trainer", "canonical_sum"]
