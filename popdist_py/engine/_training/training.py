"""A training step the engine owns: micro-batches, gradient accumulation, fused reduction, optimizer.

The user gives a per-replica function ``loss_and_grads(params, *micro_batch) -> (loss, grads)``
(``params``: a dict of read-only full weights by name; ``grads``: a dict by name, or a NamedTuple
such as the MNIST example's ``Params``) and an optimizer;
:meth:`Trainer.step` feeds host data shaped ``[batches_per_step, accumulation_factor, L,
*micro_batch_shape]`` (size-1 axes optional, PopART's rule) and, per batch and replica:

1. gathers the weights that are sharded (their full value exists only inside the step: ZeRO-3)
   and loads those that are off chip (remote buffers in memory-mapped files; read ahead on a
   background thread when ``load_tile_set`` is IO);
2. runs the function on each of the ``accumulation_factor`` micro-batches and accumulates the
   gradients in a fixed order, the left-to-right pairwise tree of :func:`canonical_sum`;
3. divides by the factor (``reduction="mean"``) and reduces the gradients across replicas (mean or
   sum, PopART's ReductionType) in fused buckets of about ``fused_reduction_bytes``
   (:mod:`.fused`): all-reduced whole, or, for weights updated on shards, reduce-scattered so
   each replica receives only its shards (ZeRO-2);
4. applies the optimizer weight by weight: on the whole tensor when the optimizer state is
   whole, else on this replica's shard of weight, gradient and state, followed by an all-gather
   of a weight that is stored whole (ZeRO-1/2). LAMB's norms are exact sums over the shards, one
   collective per domain for all tensors. The next weight's off-chip state is read ahead while
   this one is updated.

Where each tensor lives follows PopART's tensor location settings (:mod:`.locations`):
``TrainingOptions.weight_tensor_location_settings``, ``optimizer_state_tensor_location_settings``
(storage on or off chip, replicated tensor sharding with a minimum element count, a sharding
domain such as ``CommGroup.consecutive(L)`` or all replicas across instances) and per-tensor
overrides by name; ``trainer.placements`` tells the outcome.

Every choice above keeps results bitwise identical: reductions are elementwise over a fixed tree
of replicas, optimizer updates are elementwise, so every location setting, fused and per-tensor
reduction and any split into instances give the same weights bit for bit. Accumulating ``A``
micro-batches of ``B`` samples equals one micro-batch of ``A * B`` samples bitwise when
``loss_and_grads`` sums its per-sample gradients with :func:`canonical_sum` and ``B`` is a power
of two (dividing by a power of two is exact, so ``(sum / B) / A`` rounds once, as ``sum / (A * B)``).

The weights, each optimizer state tensor (``"<weight>/<state>"``) and the update count
(``"trainer/step"``) are engine variables; :meth:`Trainer.save`/:meth:`Trainer.load` (or
``rt.save``/``rt.load``) store them as full tensors, so a checkpoint restores under any split
and any location setting.
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from popdist_py import validate
from popdist_py.engine import fused, ops
from popdist_py.engine._execution.executor import THREADS
from popdist_py.engine._placement.grouping import ReplicaGrouping
from popdist_py.engine._placement.sharding import ShardArray, ShardLayout, ShardMeta
from popdist_py.engine._state.pages import prefault, release
from popdist_py.engine._training.locations import (
    OFF_CHIP,
    TensorStorage,
    TrainingOptions,
    WeightPlacement,
    place_weights,
    state_name,
    training_reduction,
)
from popdist_py.engine._training.readahead import Job, ReadAhead
from popdist_py.engine._training.tensor_store import TensorStore
from popdist_py.engine.optimizers import Optimizer, exact_norm, norm_from_parts, sum_squares_parts
from popdist_py.engine.pipeline import Pipeline

log = logging.getLogger(__name__)

#: The update counter of a Trainer with the default name ("<name>/step").
STEP_VARIABLE = "trainer/step"
#: The key of :meth:`Trainer.save`'s own entry in a checkpoint's metadata.
TRAINER_METADATA = "trainer"

#: What ``loss_and_grads`` returns as gradients: by weight name, or a NamedTuple with a field per weight.
Gradients = Mapping[str, np.ndarray] | tuple[np.ndarray, ...]
LossAndGrads = Callable[..., tuple[Any, Gradients]]


# ----------------------------------------------------------------------------------- fixed order
class PairwiseSum:
    """Adds values in the left-to-right pairwise tree of :func:`canonical_sum`, one at a time:
    complete power-of-two blocks are merged as they fill, the rest folded left to right at the end.

    ``spill``: where the pending blocks wait (an off-chip accumulator: :class:`SpillSlots`);
    default: in memory. The additions, and so the bits, are the same either way."""

    def __init__(self, spill: SpillSlots | None = None) -> None:
        self._blocks: list[tuple[int, Any]] = []
        self._spill = spill

    def add(self, value: Any) -> None:
        size = 1
        while self._blocks and self._blocks[-1][0] == size:
            _, left = self._blocks.pop()
            value = self._load(len(self._blocks), left) + value
            size *= 2
        self._blocks.append((size, value if self._spill is None else self._spill.keep(len(self._blocks), value)))

    def total(self) -> Any:
        """The sum (a new array when the blocks were spilled; their slots are released)."""
        if not self._blocks:
            raise ValueError("PairwiseSum: nothing was added")
        result = self._load(0, self._blocks[0][1])
        if self._spill is not None and len(self._blocks) == 1:
            result = np.array(result, copy=True)
        for k, (_, value) in enumerate(self._blocks[1:], 1):
            result = result + self._load(k, value)
        if self._spill is not None:
            self._spill.release(len(self._blocks))
        self._blocks = []
        return result

    def _load(self, index: int, stored: Any) -> Any:
        return stored if self._spill is None else self._spill.load(index)


class SpillSlots:
    """One replica's slots of an off-chip accumulator: the pending blocks of a :class:`PairwiseSum`,
    block ``k`` of the stack in slot ``k`` of a file-backed remote buffer, paged out between
    micro-batches (PopART's accumulator tensor location OffChip)."""

    def __init__(self, buffer: Any, local_index: int) -> None:
        self._buffer = buffer
        self._local = local_index

    def keep(self, index: int, value: np.ndarray) -> np.ndarray:
        slot: np.ndarray = self._buffer.slot(self._local, index)
        np.copyto(slot, value)
        release(slot)
        return slot

    def load(self, index: int) -> np.ndarray:
        slot: np.ndarray = self._buffer.slot(self._local, index)
        prefault(slot)
        return slot

    def release(self, count: int) -> None:
        for index in range(count):
            release(self._buffer.slot(self._local, index))


def canonical_sum(values: np.ndarray, axis: int = 0) -> np.ndarray:
    """Sum over ``axis`` in the left-to-right pairwise tree that :class:`PairwiseSum` (and so the
    trainer's accumulation) uses: blocks of 2**k consecutive entries, largest first, each summed
    by pairing neighbours level by level, then the blocks from left to right."""
    x = np.moveaxis(np.asarray(values), axis, 0)
    n = x.shape[0]
    if n == 0:
        raise ValueError("canonical_sum: the axis is empty")
    result: np.ndarray | None = None
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


# ----------------------------------------------------------------------------------- the trainer
def _check_pipeline(pipeline: Pipeline, weights: Mapping[str, np.ndarray],
                    placements: Mapping[str, WeightPlacement]) -> None:
    """ValueError when the pipeline's stages do not own exactly the trainer's weights, or a
    weight's accumulator is sharded (that reduce-scatters every micro-batch, a collective the
    stages' device threads cannot make)."""
    missing = [w for w in weights if w not in pipeline.weights]
    unknown = [w for w in pipeline.weights if w not in weights]
    if missing or unknown:
        parts = ([f"weights {', '.join(map(repr, missing))} belong to no stage"] if missing else []) + \
                ([f"stages claim {', '.join(map(repr, unknown))}, which are not weights of the trainer"] if unknown
                 else [])
        raise ValueError("the pipeline does not fit the weights: " + "; ".join(parts))
    sharded = [w for w, p in placements.items() if p.accumulator.sharded]
    if sharded:
        raise ValueError(f"the accumulators of {', '.join(map(repr, sharded))} are sharded, which a pipeline does not "
                         "support (a reduce-scatter per micro-batch from the stages' devices); keep them whole")


def _checked_options(name: str, options: TrainingOptions | None, optimizer: Optimizer,
                     loss_and_grads: LossAndGrads | Pipeline) -> TrainingOptions:
    """The Trainer's arguments other than its weights, checked; its own copy of the options."""
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"Trainer name {name!r} is not valid (a non-empty str without '/'); it names the update "
                         "counter, '<name>/step', so that several trainers can share a runtime")
    options = copy.deepcopy(options) if options is not None else TrainingOptions()
    if not isinstance(options, TrainingOptions):
        raise TypeError(f"options is a {type(options).__name__}, not a TrainingOptions")
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"optimizer is a {type(optimizer).__name__}, not a popdist_py.engine.optimizers.Optimizer")
    if not callable(loss_and_grads) and not isinstance(loss_and_grads, Pipeline):
        raise TypeError("loss_and_grads must be callable, (params, *micro_batch) -> (loss, grads), or a Pipeline")
    return options


def _checked_weights(params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The initial weights by name, as arrays: names without '/', floating point values."""
    if not params:
        raise ValueError("params is empty: give the initial weights by name")
    arrays: dict[str, np.ndarray] = {}
    for weight, value in params.items():
        if not isinstance(weight, str) or not weight or "/" in weight:
            raise ValueError(f"weight name {weight!r} is not valid (a non-empty str without '/')")
        arr = np.asarray(value)
        if not np.issubdtype(arr.dtype, np.floating):
            raise TypeError(f"weight {weight!r} has dtype {arr.dtype}; weights are floating point")
        arrays[weight] = arr
    return arrays


def _check_names_free(rt: Any, names: list[str]) -> None:
    """A Trainer's variables are named after its weights and its update counter: none may exist yet."""
    taken = [n for n in names if n in rt.variables]
    if taken:
        raise ValueError(f"this runtime already has variables named {', '.join(map(repr, taken))}; a Trainer "
                         "names its variables after the weights and its update counter '<name>/step' (give "
                         "another trainer of the runtime other weight names and another name=)")


class Trainer:
    """Owns the training step of a runtime: see the module docstring.

    ``params``: initial weights by name (host arrays, every instance passes the same);
    ``micro_batch_shapes``: the shape of one micro-batch of each input (what ``loss_and_grads``
    receives, e.g. ``[(B, 64), (B,)]``), which tells which leading axes of the host data are
    present. ``placements`` tells where every weight, optimizer state and accumulator lives
    (:mod:`.locations`). Close it (or use it as a context manager) to stop its read-ahead threads.
    """

    def __init__(self, rt: Any, params: Mapping[str, Any], loss_and_grads: LossAndGrads | Pipeline,
                 optimizer: Optimizer, micro_batch_shapes: Sequence[tuple[int, ...]],
                 options: TrainingOptions | None = None, name: str = "trainer") -> None:
        options = _checked_options(name, options, optimizer, loss_and_grads)
        arrays = _checked_weights(params)
        self.micro_batch_shapes = [tuple(validate.non_negative("micro_batch_shapes entry", d) for d in s)
                                   for s in micro_batch_shapes]
        everyone = rt.replica_grouping()
        shapes = {n: a.shape for n, a in arrays.items()}
        placements = place_weights(options, everyone, shapes, tuple(optimizer.state_names))
        step_name = f"{name}/step"
        _check_names_free(rt, [*arrays, *(state_name(w, s) for w in arrays for s in optimizer.state_names), step_name])
        self.pipeline = loss_and_grads if isinstance(loss_and_grads, Pipeline) else None
        if self.pipeline is not None:
            _check_pipeline(self.pipeline, arrays, placements)
        self.rt = rt
        self.name = name
        self.options = options
        self.optimizer = optimizer
        # a pipeline's stages one after the other: the same model (what steps of a pipeline do not call)
        self.loss_and_grads: LossAndGrads = (loss_and_grads.sequential if isinstance(loss_and_grads, Pipeline)
                                             else loss_and_grads)
        self.placements = placements
        self.op = training_reduction(options.reduction)
        self._everyone = everyone
        self._shapes = {n: a.shape for n, a in arrays.items()}
        # the variables: weights and state as placed, the update count
        self._weights = {n: TensorStore(rt, n, a, placements[n].weight) for n, a in arrays.items()}
        self._states = {n: {s: TensorStore(rt, state_name(n, s), zeros, placements[n].states[s])
                            for s, zeros in optimizer.init_state(a.shape, a.dtype).items()}
                        for n, a in arrays.items()}
        self.step_var = rt.variable(np.zeros((), np.int64), name=step_name)
        # accumulators: whole ones are reduced once per batch; sharded ones receive each
        # micro-batch's gradient reduce-scattered (their weights' updates run on the same shards)
        scattered = {n for n, p in placements.items() if p.accumulator.sharded}
        self.fusion = fused.plan_buckets({n: (a.size, a.dtype, self._scatter_domain(placements[n]))
                                  for n, a in arrays.items() if n not in scattered}, options.fused_reduction_bytes)
        self.micro_fusion = fused.plan_buckets({n: (a.size, a.dtype, placements[n].domain)
                                        for n, a in arrays.items() if n in scattered}, options.fused_reduction_bytes)
        self._spills = {n: self._spill_buffer(rt, a, placements[n]) for n, a in arrays.items()
                        if placements[n].accumulator.off_chip and options.accumulation_factor > 1}
        self._read_ahead = ReadAhead(rt.instance_replication_factor)
        #: a pipeline without accumulation runs continuously: each stage updates after each backward
        self.continuous = (self.pipeline is not None and options.accumulation_factor == 1
                           and len(self.pipeline.stages) > 1)
        if self.pipeline is not None:
            self._start_pipeline(self.pipeline, arrays)
        if self.continuous:
            log.warning("pipelining without gradient accumulation: each stage updates its weights while later "
                        "micro-batches are in flight, so they see stale weights (Zhang et al., arXiv:1912.12675); "
                        "set accumulation_factor > 1 to flush the pipeline before each update")

    def _start_pipeline(self, pipeline: Pipeline, arrays: dict[str, np.ndarray]) -> None:
        """The pipeline's devices started for this runtime's replicas, and each stage's fused reduction."""
        options, rt = self.options, self.rt
        activations = options.activation_tensor_location_settings
        pipeline.start(rt.instance_replication_factor,
                       TensorStorage.parse(activations.location.storage, "activation storage") is OFF_CHIP,
                       activations.min_elements_for_off_chip, replicas_meet=rt.executor == THREADS)
        self._stage_fusions = [fused.plan_buckets({n: (arrays[n].size, arrays[n].dtype,
                                               self._scatter_domain(self.placements[n])) for n in stage.weights},
                                          options.fused_reduction_bytes) for stage in pipeline.stages]

    def _spill_buffer(self, rt: Any, value: np.ndarray, p: WeightPlacement) -> Any:
        """The file-backed slots of an off-chip accumulator: one per pending block of the pairwise
        sum (at most the bit length of the accumulation factor), of the whole gradient or a shard."""
        shape = (ShardLayout(value.size, p.domain.group_size).shard_size,) if p.accumulator.sharded else value.shape
        return rt.remote_buffer(shape, value.dtype, entries=self.options.accumulation_factor.bit_length(),
                                location="file")

    def _scatter_domain(self, p: WeightPlacement) -> ReplicaGrouping | None:
        """The domain over which a weight's gradient is scattered (its update runs on shards), or None."""
        return p.domain if p.update_sharded else None

    # -------------------------------------------------------------------------------- host side
    def step(self, *data: Any) -> np.ndarray:
        """Run ``batches_per_step`` updates on ``data`` (one array per input); the loss of each
        (reduced over micro-batches and replicas as ``reduction`` says), shape ``[batches_per_step]``."""
        batches = self._batches(data)
        if self.continuous:  # every batch of the step through the pipeline at once: [L, batches_per_step, ...]
            return np.asarray(self.rt.run(self._continuous_step, *(np.moveaxis(x[:, 0], 1, 0) for x in batches))[0])
        losses = []
        for b in range(batches[0].shape[0]):
            per_replica = [np.moveaxis(x[b], 1, 0) for x in batches]  # [L, A, *micro_batch]
            losses.append(self.rt.run(self._replica_step, *per_replica)[0, 0])
        return np.asarray(losses)

    def weights(self) -> dict[str, np.ndarray]:
        """The current weights, full, on every instance (collective across instances)."""
        return {n: self.rt.get_tensor_data(store.var) for n, store in self._weights.items()}

    def write_weights(self, values: Mapping[str, Any]) -> None:
        """Replace some or all weights with full host arrays (every instance passes the same)."""
        unknown = [n for n in values if n not in self._weights]
        if unknown:
            raise ValueError(f"write_weights: {', '.join(map(repr, unknown))} is not a weight of this trainer "
                             f"(weights: {', '.join(map(repr, self._weights))})")
        for name, value in values.items():
            self.rt.write_variable_data(self._weights[name].var, value)

    def optimizer_state(self) -> dict[str, np.ndarray]:
        """Every optimizer state tensor, full, by name ``"<weight>/<state>"`` (collective)."""
        return {store.var.name: self.rt.get_tensor_data(store.var)
                for states in self._states.values() for store in states.values()}

    @property
    def updates(self) -> int:
        """Weight updates applied so far (restored by ``load``)."""
        return int(self.rt.get_tensor_data(self.step_var))

    def variables(self) -> list[Any]:
        """The trainer's engine variables: weights, optimizer state, the update count."""
        return [*(s.var for s in self._weights.values()),
                *(s.var for states in self._states.values() for s in states.values()), self.step_var]

    def close(self) -> None:
        """Stop the read-ahead threads and a pipeline's device workers (the variables stay with the
        runtime). Idempotent."""
        self._read_ahead.close()
        if self.pipeline is not None:
            self.pipeline.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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

    # -------------------------------------------------------------------------------- checkpoints
    def save(self, path: Any, metadata: dict[str, Any] | None = None) -> None:
        """Write the runtime's variables (the weights, optimizer state and update count among them)
        as full host tensors, with what interprets them (optimizer, reduction, accumulation,
        placements) under the metadata key ``"trainer"`` (collective; :meth:`Runtime.save`).

        The file restores under any split and any location setting: tensors are stored whole."""
        info = {"optimizer": type(self.optimizer).__name__, "state_names": list(self.optimizer.state_names),
                "reduction": self.op, "accumulation_factor": self.options.accumulation_factor,
                "weights": {n: list(s) for n, s in self._shapes.items()},
                "placements": [t.describe() for p in self.placements.values() for t in p.tensors()]}
        self.rt.save(path, {**(metadata or {}), TRAINER_METADATA: info})

    def load(self, path: Any, strict: bool = True) -> dict[str, Any]:
        """Restore weights, optimizer state and update count saved by :meth:`save` (or ``rt.save``)
        under any split and location setting; returns the caller's metadata. Collective; raises
        :class:`~popdist_py.engine.CheckpointError` naming what does not fit before changing anything."""
        metadata: dict[str, Any] = self.rt.load(path, strict)
        metadata.pop(TRAINER_METADATA, None)
        return metadata

    # -------------------------------------------------------------------------------- replica side
    def _replica_step(self, ctx: Any, *inputs: np.ndarray) -> np.ndarray:
        params, loaded = self._weights_for_step(ctx)
        A, i = self.options.accumulation_factor, ctx.local_index
        sums = {n: PairwiseSum(SpillSlots(self._spills[n], i) if n in self._spills else None) for n in params}
        loss_sum = self._accumulate(ctx, params, inputs, sums)
        totals = {n: acc.total() for n, acc in sums.items()}
        loss = loss_sum.total()
        if self.op == "mean" and A > 1:
            totals = {n: g / g.dtype.type(A) for n, g in totals.items()}
            loss = loss / A
        reduced = dict(fused.reduce(self.fusion, {n: totals[n] for n in self.fusion.index}, self.op,
                                    ctx.replica_index, self._everyone))
        for n in self.micro_fusion.index:  # summed over the replicas already: the mean's division
            g = totals[n]
            reduced[n] = g / g.dtype.type(self._everyone.group_size) if self.op == "mean" else g
        del totals
        step = int(ctx[self.step_var]) + 1
        self._update(ctx, params, loaded, reduced, step)
        ctx[self.step_var] = np.int64(step)
        return ops.replicated_all_reduce(np.asarray([loss]), op=self.op)

    def _accumulate(self, ctx: Any, params: dict[str, np.ndarray], inputs: Sequence[np.ndarray],
                    sums: dict[str, PairwiseSum]) -> PairwiseSum:
        """Every micro-batch's gradients into ``sums`` in micro-batch order (through the pipeline's
        devices, or here one after another); the sum of their losses."""
        A = self.options.accumulation_factor
        loss_sum = PairwiseSum()
        if self.pipeline is not None:  # each stage's device adds its weights' gradients in micro-batch order
            def on_grads(weight: str, grad: Any) -> None:
                sums[weight].add(_gradient(weight, grad, params[weight]))

            micro_batches = [tuple(x[a] for x in inputs) for a in range(A)]
            for loss in self.pipeline.run(ctx.local_index, ctx.replica_index, params, micro_batches, on_grads):
                loss_sum.add(np.asarray(loss, np.float64))
            return loss_sum
        for a in range(A):
            loss, grads = self.loss_and_grads(params, *(x[a] for x in inputs))
            grads = self._checked(grads, params)
            if self.micro_fusion.buckets:  # sharded accumulators: this replica's shard of the replicas' sum
                shards = fused.reduce(self.micro_fusion, grads, "add", ctx.replica_index, self._everyone)
                for n in shards:
                    sums[n].add(shards[n])
            for n in self.fusion.index:
                sums[n].add(grads[n])
            del grads
            loss_sum.add(np.asarray(loss, np.float64))
        return loss_sum

    def _continuous_step(self, ctx: Any, *inputs: np.ndarray) -> np.ndarray:
        """Continuous pipelining: the step's batches (one micro-batch each) flow through the
        pipeline without a flush; each stage's gradients of a batch are reduced across replicas
        and applied as soon as its backward is done (on this thread, in the pipeline's update
        order, the same on every replica), and its later forwards see the new weights."""
        pipeline = self.pipeline
        assert pipeline is not None
        params, loaded = self._weights_for_step(ctx)
        base = int(ctx[self.step_var])
        pending: dict[str, np.ndarray] = {}  # a stage's gradients of its latest backward

        def on_grads(weight: str, grad: Any) -> None:
            pending[weight] = _gradient(weight, grad, params[weight])

        def update(stage: int, m: int) -> dict[str, np.ndarray]:
            names = pipeline.stages[stage].weights
            grads = {n: pending.pop(n) for n in names}
            reduced = fused.reduce(self._stage_fusions[stage], grads, self.op, ctx.replica_index, self._everyone)
            self._update(ctx, params, loaded, reduced, base + m + 1, names)
            for n in names:  # a sharded weight is gathered again (the others were updated in place)
                store = self._weights[n]
                if store.sharded:
                    params[n] = ops.replicated_all_gather(store.shard_array(loaded[n]), output_shape="meta_shape")
            return params

        batches = inputs[0].shape[0]
        micro_batches = [tuple(x[b] for x in inputs) for b in range(batches)]
        losses = pipeline.run(ctx.local_index, ctx.replica_index, params, micro_batches, on_grads, update)
        ctx[self.step_var] = np.int64(base + batches)
        return ops.replicated_all_reduce(np.asarray(losses, np.float64), op=self.op)

    def _weights_for_step(self, ctx: Any) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(the full weights the model reads, read-only; this replica's stored values, flat, which
        the update changes in place). A sharded weight is gathered: its full value exists only in
        this step (ZeRO-3). Off-chip weights are mapped in in order, the next ahead when marked IO."""
        jobs: list[Job[np.ndarray]] = [(functools.partial(store.fetch, ctx.local_index), store.placement.read_ahead)
                                       for store in self._weights.values()]
        params: dict[str, np.ndarray] = {}
        loaded: dict[str, np.ndarray] = {}
        for (name, store), value in zip(self._weights.items(), self._read_ahead.in_order(jobs), strict=True):
            loaded[name] = value
            if store.sharded:
                params[name] = ops.replicated_all_gather(store.shard_array(value), output_shape="meta_shape")
            else:
                view = value.reshape(self._shapes[name])
                view.flags.writeable = False
                params[name] = view
        return params, loaded

    def _load_states(self, name: str, local_index: int) -> dict[str, np.ndarray]:
        return {s: store.fetch(local_index) for s, store in self._states[name].items()}

    def _update(self, ctx: Any, params: Mapping[str, np.ndarray], loaded: Mapping[str, np.ndarray],
                reduced: Mapping[str, np.ndarray], step: int, names: Sequence[str] | None = None) -> None:
        """The optimizer on each weight (of ``names``, default all) in turn, on the whole tensor or
        this replica's shards; the next weight's off-chip state is read ahead (when marked IO)
        while this one is updated."""
        opt = self.optimizer
        i = ctx.local_index
        names = list(self._states) if names is None else list(names)
        jobs: list[Job[dict[str, np.ndarray]]] = [
            (functools.partial(self._load_states, name, i),
             any(s.placement.read_ahead for s in self._states[name].values())) for name in names]
        waiting: list[tuple[str, np.ndarray, np.ndarray]] = []  # LAMB: (name, weight, direction) until the norms
        for name, state in zip(names, self._read_ahead.in_order(jobs), strict=True):
            weight = self._weight_piece(ctx, name, params, loaded)
            if opt.uses_norms:
                waiting.append((name, weight, opt.direction(weight, np.asarray(reduced[name]), state, step)))
            else:
                opt.update(weight, np.asarray(reduced[name]), state, step)
            for s, store in self._states[name].items():
                store.save(i, state[s])
            del state
            if not opt.uses_norms:
                self._put_weight(ctx, name, weight)
        if waiting:
            for (name, weight, d), ratio in zip(waiting, self._trust_ratios(waiting, step), strict=True):
                opt.apply(weight, d, step, ratio)
                self._put_weight(ctx, name, weight)

    def _weight_piece(self, ctx: Any, name: str, params: Mapping[str, np.ndarray],
                      loaded: Mapping[str, np.ndarray]) -> np.ndarray:
        """The flat, writable weight the update changes: this replica's shard or the whole tensor."""
        store, p = self._weights[name], self.placements[name]
        if store.sharded and p.update_sharded:
            return loaded[name]
        if p.update_sharded:  # ZeRO-1/2: this replica's shard of the whole weight
            layout = ShardLayout(params[name].size, p.domain.group_size)
            return layout.shard(params[name].reshape(-1), p.domain.index_in_group(ctx.replica_index))
        if store.sharded:  # whole update of a sharded weight: a private copy of the gathered one
            return np.array(params[name], copy=True).reshape(-1)
        return loaded[name]

    def _put_weight(self, ctx: Any, name: str, weight: np.ndarray) -> None:
        store, p = self._weights[name], self.placements[name]
        if p.update_sharded and not store.sharded:  # ZeRO-1/2: every replica gets the whole updated weight
            whole = ShardMeta(self._shapes[name], p.domain)
            weight = ops.replicated_all_gather(ShardArray.wrap(weight, whole), output_shape="meta_shape")
        elif store.sharded and not p.update_sharded:  # keep this replica's shard of the whole update
            meta = store.var.sharding
            assert meta is not None
            weight = meta.layout.shard(weight, meta.shard_index(ctx.replica_index))
        store.save(ctx.local_index, weight)

    def _trust_ratios(self, waiting: list[tuple[str, np.ndarray, np.ndarray]], step: int) -> list[float]:
        """LAMB's ratio per weight: whole-tensor norms; for shards, exact parts summed over the
        domain, one collective per domain for all tensors."""
        opt = self.optimizer
        ratios = [1.0] * len(waiting)
        by_domain: dict[ReplicaGrouping, list[int]] = {}
        for k, (name, weight, d) in enumerate(waiting):
            p = self.placements[name]
            if p.update_sharded:
                by_domain.setdefault(p.domain, []).append(k)
            else:
                ratios[k] = opt.trust_ratio(exact_norm(weight), exact_norm(d), step)
        for domain, ks in by_domain.items():
            parts = np.stack([sum_squares_parts(x) for k in ks for x in waiting[k][1:]])
            total = ops.replicated_all_reduce(parts, op="add", group=domain)
            for m, k in enumerate(ks):
                ratios[k] = opt.trust_ratio(norm_from_parts(total[2 * m]), norm_from_parts(total[2 * m + 1]), step)
        return ratios

    def _checked(self, grads: Any, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if hasattr(grads, "_asdict"):  # a NamedTuple of gradients, as the MNIST model returns
            grads = grads._asdict()
        if not isinstance(grads, Mapping) or set(grads) != set(params):
            got = sorted(grads) if isinstance(grads, Mapping) else type(grads).__name__
            raise ValueError(f"loss_and_grads returned gradients for {got}; expected one per weight: {sorted(params)}")
        return {name: _gradient(name, grads[name], p) for name, p in params.items()}


def _gradient(name: str, grad: Any, weight: np.ndarray) -> np.ndarray:
    """``grad`` as an array of the weight's shape and dtype, or ValueError naming both shapes."""
    g = np.asarray(grad)
    if g.shape != weight.shape:
        raise ValueError(f"the gradient of {name!r} has shape {g.shape}, the weight {weight.shape}")
    return g.astype(weight.dtype, copy=False)


__all__ = ["STEP_VARIABLE", "TRAINER_METADATA", "PairwiseSum", "Trainer", "canonical_sum"]
