"""popdist_py.engine: L replicas of a step in this process, instances joined by MPI (PopXL's vocabulary).

    from popdist_py.engine import Runtime, ops

    with Runtime() as rt:                      # R, L, offset from poprun's environment
        w = rt.variable(np.zeros(4, np.float32))
        def step(ctx, x):                      # once per local replica (threads or greenlets)
            g = ops.replicated_all_reduce(x, op="mean")
            ctx[w] = ctx[w] - 0.1 * g
        rt.run(step, batch)                    # batch has a leading axis of L
        rt.get_tensor_data(w)                  # the full global value, on every instance

Layout: ``runtime`` (Runtime, the facade), ``ops`` (what a step calls), ``errors``,
``optimizers``, ``fused`` (bucket planning), ``batch_invariant`` (row-invariant products) and
``pipeline`` are public, and what is exported here carries this package as its module
(``popdist_py.engine.Trainer``). The rest is private, in sub-packages that import one way, lowest
first: ``_placement`` (plain values: which replicas run where, groupings, shard layouts),
``_execution`` (the executors, local work in slices), ``_collectives`` (one collective: dispatch,
the local rendezvous, the exchange plan, the reduction order, MPI transport), ``_state``
(variables, remote buffers, checkpoints), ``_step`` (the replica a step runs as) and, above
``ops`` and ``pipeline``, ``_training`` (the Trainer, tensor locations, off-chip storage,
read-ahead).

Executors (``Runtime(executor=...)``, ``$POPDIST_ENGINE_EXECUTOR``; ``rt.executor`` tells):
``threads`` run the L replicas in parallel, which pays when the process has spare cores (numpy
releases the GIL) but costs each waiting replica an OS wake-up and a GIL hand-off per collective
(tens of microseconds); ``cooperative`` runs them one at a time as greenlets on the calling
thread, so a collective costs a few greenlet switches and a replica that can never arrive is
reported at once. ``auto`` (the default) takes threads when L > 1 and this instance has at least
2 cores to itself (CPU affinity divided by poprun's ``LOCAL_WORLD_SIZE``), else cooperative.
Results and errors are the same either way.

Replicated tensor sharding and remote buffers (PopXL's API):

    full, shard = rt.replica_sharded_variable(w0)          # each replica stores ceil(n / R) elements
    buf = rt.remote_buffer((ops.shard_size(w1.shape, R),), np.float32)
    w1v = rt.remote_replica_sharded_variable(w1, buf, 0)
    def step(ctx, x):
        W0 = ops.replicated_all_gather(shard)              # the full tensor, original shape
        s1 = ops.remote_load(buf, 0); W1 = ops.replicated_all_gather(s1)   # (buffer, offset)
        ...
        ctx[shard] -= lr * ops.replicated_reduce_scatter(
            g0, op="mean", configure_output_for_replicated_tensor_sharding=True)
        ops.remote_store(buf, 0, s1 - lr * ops.replica_sharded_slice(g1_mean))
    rt.save("ckpt.npz"); rt.load("ckpt.npz")               # restores under any split, RTS or not

PopXL's other collectives: ops ``square_add``, ``and``, ``or``; ``ops.replicated_all_reduce_``
(in place); ``ops.replicated_all_gather(x, output_shape="new_axis" | "concat" | "meta_shape" |
"auto")``; ``ops.replicated_slice``; irregular groupings from
``rt.replica_grouping_from_assignments([0, 1, 1, 0])``.

Training (``training``, ``locations``): ``Trainer(rt, params, loss_and_grads, optimizer,
micro_batch_shapes, TrainingOptions(...))`` owns the step: micro-batches accumulated in a fixed
pairwise order (:func:`canonical_sum`), gradients reduced across replicas in fused buckets
(``fused``), the optimizer applied (``optimizers``), with PopART's tensor location settings
deciding for weights and optimizer state whether they are sharded (ZeRO-1/2/3) and over which
domain, and whether they live off chip (``tensor_store``; read ahead by ``readahead`` with
``load_tile_set=TileSet.IO``)::

    opts = TrainingOptions(accumulation_factor=4)
    opts.optimizer_state_tensor_location_settings.location.replicated_tensor_sharding = True
    trainer = Trainer(rt, {"W": w0}, loss_and_grads, Adam(1e-3), [(B, 64), (B,)], opts)
    losses = trainer.step(x, y)           # x: [batches_per_step, 4, L, B, 64] (size-1 axes optional)
    trainer.save("ckpt.npz")              # restores under any split and any location setting

Pipelining (``pipeline``): a replica's model split into :class:`Stage` s (forward, backward,
device) on K devices (threads on cores of their own), run in a 1F1B or GPipe schedule: give a
:class:`Pipeline` to the Trainer in place of ``loss_and_grads``; the weights are bitwise those of
the stages run one after the other (``pipeline.sequential``).

Semantics worth knowing: all-reduce and all-gather results, and ``ctx[var]``, are read-only
arrays (shared between local replicas where possible; copy to modify); float reductions follow
a fixed tree over group members, so results are bitwise identical for any split of the replicas
into instances; a failing replica, a mismatched collective or a missing participant raises an
error on every participant instead of hanging.

Errors (:mod:`.errors`, all exported here): CollectiveError and its kinds
CollectiveMismatchError, CollectiveTimeoutError, InstancesDisagreeError, StepAborted and
PeerAborted (with its kind PeerClosed); CheckpointError (a ValueError) from ``load``;
PipelineStageError from a pipeline stage that raised.
"""

from popdist_py.engine import ops
from popdist_py.engine._placement.grouping import CommGroup, CommGroupType, ReplicaGrouping
from popdist_py.engine._placement.sharding import ShardArray, ShardLayout, ShardMeta
from popdist_py.engine._public import publish as _publish
from popdist_py.engine._state.remote import RemoteBuffer
from popdist_py.engine._state.variables import RETRIEVAL_MODES, Shard, Variable
from popdist_py.engine._step.context import StepContext
from popdist_py.engine._training.locations import (
    ReplicatedTensorSharding,
    TensorLocation,
    TensorLocationSettings,
    TensorStorage,
    TileSet,
    TrainingOptions,
)
from popdist_py.engine._training.training import Trainer, canonical_sum
from popdist_py.engine.errors import (
    CheckpointError,
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    InstancesDisagreeError,
    PeerAborted,
    PeerClosed,
    PipelineStageError,
    StepAborted,
)
from popdist_py.engine.pipeline import Pipeline, Stage
from popdist_py.engine.runtime import Runtime

__all__ = [
    "RETRIEVAL_MODES",
    "CheckpointError",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CommGroup",
    "CommGroupType",
    "InstancesDisagreeError",
    "PeerAborted",
    "PeerClosed",
    "Pipeline",
    "PipelineStageError",
    "RemoteBuffer",
    "ReplicaGrouping",
    "ReplicatedTensorSharding",
    "Runtime",
    "Shard",
    "ShardArray",
    "ShardLayout",
    "ShardMeta",
    "Stage",
    "StepAborted",
    "StepContext",
    "TensorLocation",
    "TensorLocationSettings",
    "TensorStorage",
    "TileSet",
    "Trainer",
    "TrainingOptions",
    "Variable",
    "canonical_sum",
    "ops",
]
_publish(globals())
