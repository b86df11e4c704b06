"""popdist_py.engine: L replicas of a step in this process, instances joined by MPI (PopXL's vocabulary).

    from popdist_py.engine import Runtime, ops

    with Runtime() as rt:                      # R, L, offset from poprun's environment
        w = rt.variable(np.zeros(4, np.float32))
        def step(ctx, x):                      # once per local replica, concurrently
            g = ops.replicated_all_reduce(x, op="mean")
            ctx[w] = ctx[w] - 0.1 * g
        rt.run(step, batch)                    # batch has a leading axis of L
        rt.get_tensor_data(w)                  # the full global value, on every instance

Modules: ``runtime`` (Runtime, runs), ``grouping`` (ReplicaGrouping, CommGroup), ``variables``,
``ops`` (collectives inside a step), ``collectives`` (per-signature plans), ``reduce`` (the
canonical reduction order), ``rendezvous`` (local meeting of replica threads), ``transport``
(MPI between instances), ``pool`` (replica threads), ``topology``, ``context``.

Semantics worth knowing: all-reduce and all-gather results, and ``ctx[var]``, are read-only
arrays (shared between local replicas where possible; copy to modify); float reductions follow
a fixed tree over group members, so results are bitwise identical for any split of the replicas
into instances; a failing replica, a mismatched collective or a missing participant raises an
error on every participant instead of hanging.
"""

from popdist_py.engine import ops
from popdist_py.engine.context import StepContext
from popdist_py.engine.grouping import CommGroup, CommGroupType, ReplicaGrouping
from popdist_py.engine.rendezvous import StepAborted
from popdist_py.engine.runtime import Runtime
from popdist_py.engine.transport import PeerAborted
from popdist_py.engine.variables import RETRIEVAL_MODES, Variable

__all__ = [
    "RETRIEVAL_MODES",
    "CommGroup",
    "CommGroupType",
    "PeerAborted",
    "ReplicaGrouping",
    "Runtime",
    "StepAborted",
    "StepContext",
    "Variable",
    "ops",
]
