"""The Runtime: L local replicas of a step in one process, instances joined by MPI (PopXL's vocabulary).

``Runtime()`` takes R (global replicas), L (replicas in this process) and this instance's replica
offset from the PopDist environment that ``poprun`` sets; ``Runtime(replication=N)`` runs N
replicas in one process. ``rt.run(step, *inputs)`` calls ``step(ctx, *per_replica_inputs)`` once
per local replica, concurrently (in threads or as cooperative greenlets: :mod:`.executor`), and
stacks the outputs along a leading axis of L. Inside a step, ``popdist_py.engine.ops`` provides
the replicated collectives (carried out by the runtime's :class:`.dispatch.Dispatcher`) and
``ctx[var]`` a replica's value of a variable.

Variables come in PopXL's kinds: plain (``variable``), replica-sharded (``replica_sharded_variable``,
each replica storing only its shard; :mod:`.sharding`), and off-chip in remote buffers
(``remote_buffer``, ``remote_variable``, ``remote_replica_sharded_variable``; :mod:`.remote`).
``save``/``load`` write and read them all as full host tensors (:mod:`.checkpoint`).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from popdist_py import deadline
from popdist_py.engine._collectives.dispatch import Dispatcher
from popdist_py.engine._collectives.rendezvous import SPIN_SECONDS, ThreadWaits, Waits
from popdist_py.engine._collectives.transport import Transport
from popdist_py.engine._execution.cooperative import CooperativePool
from popdist_py.engine._execution.executor import THREADS, ReplicaExecutor, choose, polls, slice_bytes, slice_threads
from popdist_py.engine._execution.pool import ReplicaPool
from popdist_py.engine._execution.slices import Slicer
from popdist_py.engine._placement.grouping import CommGroup, Group, ReplicaGrouping
from popdist_py.engine._placement.replicas import ReplicaPlacement, runtime_topology
from popdist_py.engine._placement.sharding import ShardMeta, sharding_domain
from popdist_py.engine._state import checkpoint
from popdist_py.engine._state.remote import RemoteBuffer, RemoteBuffers, RemoteSlots
from popdist_py.engine._state.variables import (
    Shard,
    Variable,
    VariableRegistry,
    as_host_array,
    check_retrieval_mode,
    host_value,
    per_group_values,
)
from popdist_py.engine._step import context
from popdist_py.engine._step.context import StepContext
from popdist_py.engine.errors import CollectiveError, InstancesDisagreeError, PeerAborted, PeerClosed, StepAborted

log = logging.getLogger(__name__)

#: How long ``close()`` waits for the other instances to close theirs before it keeps the
#: communicator instead of freeing it (runtimes usually close within moments of each other).
_FAREWELL_WAIT = 2.0


class Runtime:
    """L local replicas in this process; R = I x L global replicas over I instances.

    Arguments:
        replication: total replicas. Omitted: R, L and the offset come from the PopDist
            environment (one instance with one replica without it). Given without ``comm``:
            that many replicas in this process (an error if poprun started several instances).
        comm: an MPI communicator whose ranks are the instances (rank i holds global replicas
            ``i*L .. i*L+L-1``); with ``replication`` it splits the replicas evenly, without it
            the PopDist environment must match it. This is how tests and applications build a
            runtime over a sub-communicator. Default: ``popdist_py.world.world()`` when needed.
        timeout: seconds a collective waits for missing replicas or instances (default:
            ``$POPDIST_COLLECTIVE_TIMEOUT``, else 600).
        remote_dir: existing directory for file-backed remote buffers (default
            ``$POPDIST_REMOTE_DIR``, else a private directory in ``/dev/shm``, or in the temporary
            directory when ``/dev/shm`` has no room); their files are deleted on ``close()``. A
            directory that does not exist is an error naming it (never created).
        executor: how the L local replicas run (default ``$POPDIST_ENGINE_EXECUTOR``, else
            ``"auto"``; ``rt.executor`` tells the choice). ``"threads"``: in parallel (numpy
            releases the GIL), but each collective costs every waiting replica an OS wake-up and
            a GIL hand-off (tens of us). ``"cooperative"``: greenlets on the calling thread, one
            at a time; a collective costs a few greenlet switches, and a replica that can never
            arrive is reported at once. ``"auto"``: threads when 1 < L <= 1024 and this instance has at
            least 2 cores to itself (CPU affinity divided by ``$LOCAL_WORLD_SIZE``, the
            instances poprun put on this host), else cooperative. Same results and errors
            either way; with L == 1 the step runs directly on the calling thread. One process runs
            at most 65536 replicas, the threads executor at most 1024 (an error names the limit).
        threads: threads that share a large collective's local work (summing the local
            replicas' inputs, filling an all-gather's result), each a contiguous slice of the
            elements, so the bits do not depend on it (default ``$POPDIST_ENGINE_THREADS``, else
            this instance's cores: CPU affinity divided by ``$LOCAL_WORLD_SIZE``). 1: the
            replica that combines does it alone. ``rt.threads`` tells the choice. Work is cut
            only from 16 MiB streamed a thread (``$POPDIST_ENGINE_SLICE_BYTES`` sets another).

    Every instance must create its runtimes, variables and collectives in the same order.
    """

    def __init__(
        self,
        replication: int | None = None,
        *,
        comm: Any = None,
        timeout: float | None = None,
        remote_dir: str | os.PathLike[str] | None = None,
        executor: str | None = None,
        threads: int | None = None,
    ) -> None:
        R, L, index, comm = runtime_topology(replication, comm)
        self._executor = choose(executor, L)
        self._slicer = Slicer(slice_threads(threads), name=f"slice@{index}", min_bytes=slice_bytes())
        self._placement = ReplicaPlacement(R, L, index)
        self._timeout_arg = timeout
        seconds = deadline.collective_timeout(timeout)
        self._pool: ReplicaExecutor
        waits: Waits
        if self._executor == THREADS:  # first: it may fail (thread limits), and then stops what it started
            poll = SPIN_SECONDS if polls(L) else 0.0
            self._pool = ReplicaPool(L, name=f"replica@{self._placement.replica_index_offset}")
            waits = ThreadWaits(L, poll)
        else:
            self._pool = waits = CooperativePool(L)
        self._transport: Transport | None = None
        if self._placement.num_instances > 1:
            self._transport = Transport(comm, self._placement.describe_instance, seconds)
        self._dispatcher = Dispatcher(self._placement, self._transport, waits, seconds, self._slicer)
        self._contexts = [StepContext(self, self._dispatcher, i) for i in range(L)]
        # the finalizer holds the pool: neither pool may reference the runtime between runs
        self._finalizer = weakref.finalize(self, _shutdown, self._pool, self._slicer)
        # Peers waiting for this instance in a collective are told at once when this runtime
        # closes, is collected, or the interpreter exits: a step here ended without that collective.
        self._farewell = (weakref.finalize(self, _say_closed, self._transport, self._dispatcher)
                          if self._transport is not None else None)
        self._variables = VariableRegistry()
        self._remote = RemoteBuffers(L, index, remote_dir)
        self._run_lock = threading.Lock()
        self._running = False
        self._broken: str | None = None
        #: why the instances must meet before the next step (a step failed), if they must
        self._renew: str | None = None
        self._closed = False
        log.debug("Runtime: %d replicas, %d in this process (instance %d), %s executor", R, L, index, self._executor)

    # -- where the replicas run ----------------------------------------------------------------------
    @property
    def replication_factor(self) -> int:
        """R: replicas over all instances."""
        return self._placement.replication_factor

    @property
    def instance_replication_factor(self) -> int:
        """L: replicas run by this process."""
        return self._placement.num_local_replicas

    @property
    def replica_index_offset(self) -> int:
        """Global index of this process's first replica."""
        return self._placement.replica_index_offset

    @property
    def num_instances(self) -> int:
        return self._placement.num_instances

    @property
    def threads(self) -> int:
        """Threads that share a large collective's local work (see the class's ``threads``)."""
        return self._slicer.threads

    @property
    def executor(self) -> str:
        """``"threads"`` or ``"cooperative"``: how the local replicas run (see the class docstring)."""
        return self._executor

    @property
    def instance_index(self) -> int:
        return self._placement.instance

    @property
    def local_replicas(self) -> range:
        """Global indices of this process's replicas."""
        offset = self._placement.replica_index_offset
        return range(offset, offset + self._placement.num_local_replicas)

    def replica_grouping(self, stride: int = 1, group_size: int | None = None) -> ReplicaGrouping:
        """A grouping of the R global replicas (PopXL's ``ir.replica_grouping``)."""
        return ReplicaGrouping.create(self.replication_factor, stride, group_size)

    def replica_grouping_from_assignments(self, assignment: Sequence[int]) -> ReplicaGrouping:
        """The grouping with replica ``r`` in group ``assignment[r]`` (PopXL's
        ``ir.replica_grouping_from_assignments``): equal groups numbered in order of first
        appearance, with a constant stride or irregular (e.g. ``[0, 1, 1, 0]``)."""
        return self.resolve_group(ReplicaGrouping.from_assignments(assignment))

    def replica_grouping_from_assignment(self, assignment: Sequence[int]) -> ReplicaGrouping:
        """The older, singular name: constant-stride assignments only (ValueError otherwise)."""
        return self.resolve_group(ReplicaGrouping.from_assignment(assignment))

    def resolve_group(self, group: Group) -> ReplicaGrouping:
        """A ``group`` argument (a ReplicaGrouping of R replicas, a CommGroup, or None for all
        replicas) as a grouping of this runtime's replicas; ValueError/TypeError naming it otherwise."""
        return self._dispatcher.resolve_group(group)

    @property
    def dispatcher(self) -> Dispatcher:
        """The collective dispatcher of this runtime's replicas (:mod:`.dispatch`)."""
        return self._dispatcher

    # -- running steps -------------------------------------------------------------------------------
    def run(self, step: Callable[..., Any], *inputs: Any) -> Any:
        """Run ``step(ctx, *inputs_of_replica)`` on every local replica concurrently (per :attr:`executor`).

        Each input has a leading axis of L; replica ``i`` gets ``input[i]``. Returns the step's
        outputs stacked along a leading axis of L (a tuple of such arrays when the step returns a
        tuple, None when it returns None). An output that is the same read-only array in every
        replica (a collective's result returned as is) comes back as a read-only broadcast view
        instead of L copies. If any replica raises, the others are released from their
        collectives and the first exception is re-raised here.
        """
        if context.peek() is not None:
            raise RuntimeError("Runtime.run cannot be called from inside a step")
        if not self._run_lock.acquire(blocking=False):
            raise RuntimeError("Runtime.run is already running in another thread; runs of one Runtime are sequential")
        try:
            self._check_usable()
            if self._renew is not None:
                self._meet_after_failure(self._renew)
            L = self.instance_replication_factor
            arrays = [self._input(k, a) for k, a in enumerate(inputs)]
            if self._timeout_arg is None:
                self._set_timeout(deadline.collective_timeout(None))
            dispatcher = self._dispatcher
            dispatcher.start_step()
            outputs: list[Any] = [None] * L
            failures: list[tuple[int, BaseException]] = []

            def task(i: int) -> None:
                ctx = self._contexts[i]
                ctx.ncoll = 0
                prev = context.swap(ctx)
                try:
                    outputs[i] = step(ctx, *[a[i] for a in arrays])
                    dispatcher.end_step(i)
                except BaseException as exc:
                    failures.append((i, exc))
                    dispatcher.rendezvous.fail(i, exc)
                finally:
                    context.swap(prev)

            self._running = True
            try:
                self._pool.run(task, dispatcher.rendezvous.stall)
            except BaseException as exc:  # interrupted (Ctrl-C) while the replicas were running
                dispatcher.rendezvous.fail(0, exc)
                self._broken = f"Runtime.run was interrupted ({type(exc).__name__}) while its replicas ran"
                raise
            finally:
                self._running = False
            if failures or dispatcher.rendezvous.failed:
                self._raise_failure(failures)
            return self._stack(outputs)
        finally:
            self._run_lock.release()

    def _input(self, k: int, a: Any) -> np.ndarray:
        arr = np.asarray(a)
        L = self.instance_replication_factor
        if arr.ndim == 0 or arr.shape[0] != L:
            lead = "no leading axis (a scalar)" if arr.ndim == 0 else f"a leading axis of {arr.shape[0]}"
            raise ValueError(
                f"input {k} has shape {arr.shape}, {lead}; inputs need a leading axis of "
                f"L={L} (instance_replication_factor), one slice per local replica"
            )
        return arr

    def _raise_failure(self, failures: list[tuple[int, BaseException]]) -> None:
        L = self.instance_replication_factor
        originals = [(i, e) for i, e in failures if not isinstance(e, StepAborted)]
        if originals:
            i, exc = originals[0]
        elif failures:
            i, exc = failures[0]
        else:  # every failing replica's exception was caught inside its step
            exc = self._dispatcher.rendezvous.failure or CollectiveError("step failed")
            i = self._dispatcher.rendezvous.failed_by or 0
        g = self.replica_index_offset + i
        if L > 1 or self.num_instances > 1:
            exc.add_note(f"raised in {self._placement.describe_replica(g)} (local replica {i}) during Runtime.run")
        for j, other in originals[1:]:
            exc.add_note(
                f"also raised in {self._placement.describe_replica(self.replica_index_offset + j)}: "
                f"{type(other).__name__}: {other}"
            )
        if self._transport is not None and not isinstance(exc, InstancesDisagreeError):
            # The instances are out of step (not all of them raised, or not at the same point): the
            # next run first meets the others, each come once it has seen a failure (its own, or
            # the abort notice sent here); one that closed its runtime can no longer come.
            if isinstance(exc, PeerClosed):
                self._broken = f"a step failed on this instance ({type(exc).__name__}: {exc})"
            else:
                self._renew = f"{type(exc).__name__} on {self._placement.describe_instance(self.instance_index)}"
            if not isinstance(exc, PeerAborted):
                self._transport.send_abort(self._dispatcher.seq)
        raise exc

    def _meet_after_failure(self, why: str) -> None:
        """Meet the other instances after a failed step, and go on over a new communicator."""
        assert self._transport is not None
        try:
            self._transport.renew(why)
        except CollectiveError as exc:
            self._broken = f"the instances could not be brought back in step after a failed step: {exc}"
            raise
        self._dispatcher.renewed()
        self._renew = None

    def _stack(self, outputs: list[Any]) -> Any:
        first = outputs[0]
        describe = self._placement.describe_replica
        off = self.replica_index_offset

        def kinds(o: Any) -> str:
            return "None" if o is None else f"a tuple of {len(o)}" if isinstance(o, tuple) else "an array"

        if any(kinds(o) != kinds(first) for o in outputs):
            listing = ", ".join(f"{describe(off + i)} returned {kinds(o)}" for i, o in enumerate(outputs))
            raise ValueError(f"replicas returned different kinds of output: {listing}")
        if first is None:
            return None
        if isinstance(first, tuple):
            return tuple(self._stack_one([o[k] for o in outputs], f"output {k}") for k in range(len(first)))
        return self._stack_one(outputs, "output")

    def _stack_one(self, values: list[Any], what: str) -> np.ndarray:
        first = values[0]
        if isinstance(first, np.ndarray) and not first.flags.writeable and all(v is first for v in values):
            # one shared read-only result (e.g. an all-reduce returned as is): a view, no copy
            return np.broadcast_to(first, (len(values), *first.shape))
        arrays = [np.asarray(v) for v in values]
        shapes = {(a.shape, a.dtype) for a in arrays}
        if len(shapes) > 1:
            off = self.replica_index_offset
            listing = ", ".join(
                f"{self._placement.describe_replica(off + i)} {a.shape} {a.dtype}" for i, a in enumerate(arrays)
            )
            raise ValueError(f"{what} differs in shape or dtype between replicas: {listing}")
        return np.stack(arrays)

    # -- variables -------------------------------------------------------------------------------------
    @property
    def variables(self) -> VariableRegistry:
        return self._variables

    def variable(
        self,
        data: Any,
        replica_grouping: Group = None,
        retrieval_mode: str = "one_per_group",
        name: str | None = None,
        dtype: Any = None,
    ) -> Variable:
        """A variable whose replicas start from their group's slice of ``data``.

        ``data`` is the full global host array: with more than one group its leading axis has one
        entry per group. Every instance passes the same array (it is not compared).
        """
        self._check_idle("variable")
        check_retrieval_mode(retrieval_mode)
        grouping = self.resolve_group(replica_grouping)
        name = self._variables.new_name() if name is None else self._variables.check_name(name)
        arr = as_host_array(data, dtype, f"variable {name!r}")
        groups = per_group_values(arr, grouping, f"variable {name!r}")
        shape = groups[0].shape
        var = Variable(name, grouping, retrieval_mode, shape, arr.dtype, None, self.replica_index_offset,
                       num_local_replicas=self.instance_replication_factor)
        var.load_groups(groups)
        return self._variables.add(var)

    def replica_sharded_variable(
        self,
        data: Any,
        replica_grouping: Group = None,
        shard_over: int | ReplicaGrouping | CommGroup | None = None,
        name: str | None = None,
        dtype: Any = None,
    ) -> tuple[Variable, Shard]:
        """A variable stored as RTS shards: ``(full, shard)`` as PopXL's ``replica_sharded_variable``.

        Each replica keeps only its ``ceil(n / shard_over)`` elements of the flattened value of
        its group (balanced padding, :mod:`popdist_py.engine._placement.sharding`); ``shard_over`` (default:
        the group size; a divisor of it, or a ReplicaGrouping/CommGroup such as
        ``CommGroup.consecutive(L)``) sets the sharding domain. ``full`` is the variable (host
        access: ``get_tensor_data`` gives the original shape, padding removed); ``shard`` is the
        handle a step uses: ``ctx[shard]`` (its flat shard, writable) and
        ``ops.replicated_all_gather(shard)`` (the full tensor). ``data`` is not retained.
        """
        self._check_idle("replica_sharded_variable")
        grouping = self.resolve_group(replica_grouping)
        name = self._variables.new_name("sharded") if name is None else self._variables.check_name(name)
        what = f"replica_sharded_variable {name!r}"
        arr = as_host_array(data, dtype, what)
        groups = per_group_values(arr, grouping, what)
        meta = ShardMeta(groups[0].shape, sharding_domain(grouping, shard_over, what), name)
        var = Variable(name, grouping, "one_per_group", groups[0].shape, arr.dtype, None, self.replica_index_offset,
                       sharding=meta, num_local_replicas=self.instance_replication_factor)
        var.load_groups(groups)
        self._variables.add(var)
        log.debug("%r: %d bytes per replica", var, var.nbytes)
        return var, var.shard

    def remote_buffer(
        self,
        shape: Any,
        dtype: Any,
        entries: int = 1,
        location: str = "memory",
        path: str | os.PathLike[str] | None = None,
    ) -> RemoteBuffer:
        """Per-replica storage of ``entries`` slots of ``shape``/``dtype`` (PopXL's ``remote_buffer``).

        ``location="file"`` keeps the slots in a memory-mapped temporary file in ``path`` (a
        directory; default the runtime's ``remote_dir``), its space reserved at once (no room is
        an OSError now, not a SIGBUS on a later write), deleted when the runtime closes.
        Every instance must create the same buffers in the same order.
        """
        self._check_idle("remote_buffer")
        return self._remote.create(shape, dtype, entries, location, path)

    def remote_variable(
        self,
        data: Any,
        buf: RemoteBuffer,
        offset: int = 0,
        replica_grouping: Group = None,
        retrieval_mode: str = "one_per_group",
        name: str | None = None,
    ) -> Variable:
        """A variable living in slot ``offset`` of ``buf`` (each replica its own slot, its group's value).

        ``data`` is the host data as for :meth:`variable`; per replica it must have the buffer's
        shape. A step reads and writes it with ``ops.remote_load(buf, offset)`` /
        ``ops.remote_store(buf, offset, x)``.
        """
        self._check_idle("remote_variable")
        check_retrieval_mode(retrieval_mode)
        b = self.owned_buffer(buf, "remote_variable")
        grouping = self.resolve_group(replica_grouping)
        name = self._variables.new_name("remote") if name is None else self._variables.check_name(name)
        what = f"remote_variable {name!r}"
        i = b.check_offset(offset, what)
        arr = as_host_array(data, b.dtype, what)
        groups = per_group_values(arr, grouping, what)
        if groups[0].shape != b.shape:
            raise ValueError(f"{what}: per-replica value has shape {groups[0].shape} but remote buffer "
                             f"{b.name!r} has slots of shape {b.shape}")
        return self._bind(b, i, Variable(name, grouping, retrieval_mode, b.shape, b.dtype, None,
                                         self.replica_index_offset, storage=RemoteSlots(b, i),
                                         num_local_replicas=self.instance_replication_factor), groups)

    def remote_replica_sharded_variable(
        self,
        data: Any,
        buf: RemoteBuffer,
        offset: int = 0,
        replica_grouping: Group = None,
        shard_over: int | ReplicaGrouping | CommGroup | None = None,
        name: str | None = None,
    ) -> Variable:
        """An RTS variable whose shards live in slot ``offset`` of ``buf`` (PopXL's
        ``remote_replica_sharded_variable``): ``buf`` must have shape ``(ceil(n / shard_over),)``.

        A step loads its shard with ``ops.remote_load(buf, offset)`` (a shard array that
        ``ops.replicated_all_gather`` turns into the full tensor) and stores it back with
        ``ops.remote_store``.
        """
        self._check_idle("remote_replica_sharded_variable")
        b = self.owned_buffer(buf, "remote_replica_sharded_variable")
        grouping = self.resolve_group(replica_grouping)
        name = self._variables.new_name("remote_sharded") if name is None else self._variables.check_name(name)
        what = f"remote_replica_sharded_variable {name!r}"
        i = b.check_offset(offset, what)
        arr = as_host_array(data, b.dtype, what)
        groups = per_group_values(arr, grouping, what)
        meta = ShardMeta(groups[0].shape, sharding_domain(grouping, shard_over, what), name)
        if b.shape != meta.shard_shape:
            raise ValueError(
                f"{what}: remote buffer {b.name!r} has slots of shape {b.shape} but a shard of a tensor of shape "
                f"{meta.meta_shape} ({meta.layout.n} elements) over {meta.domain.group_size} replica(s) has shape "
                f"{meta.shard_shape}"
            )
        return self._bind(b, i, Variable(name, grouping, "one_per_group", meta.meta_shape, b.dtype, None,
                                         self.replica_index_offset, sharding=meta, storage=RemoteSlots(b, i),
                                         num_local_replicas=self.instance_replication_factor), groups)

    def _bind(self, b: RemoteBuffer, offset: int, var: Variable, groups: list[np.ndarray]) -> Variable:
        b.bind(offset, var)
        try:
            var.load_groups(groups)
            self._variables.add(var)
        except BaseException:
            b.unbind(offset)
            raise
        return var

    def owned_buffer(self, buf: Any, what: str) -> RemoteBuffer:
        """``buf`` if it is a remote buffer of this runtime; ValueError naming ``what`` otherwise."""
        if not self._remote.owns(buf):
            raise ValueError(f"{what}: {buf!r} is not a remote buffer of this Runtime "
                             "(create it with rt.remote_buffer)")
        owned: RemoteBuffer = buf
        return owned

    def write_variable_data(self, var: Variable, data: Any) -> None:
        """Replace every replica's value from host data shaped like the variable's ``shape_on_host``."""
        self._check_idle("write_variable_data")
        v = self.owned_variable(var)
        arr = as_host_array(data, v.dtype, f"write_variable_data({v.name!r})")
        if arr.shape != v.shape_on_host:
            raise ValueError(
                f"write_variable_data({v.name!r}): data has shape {arr.shape} but the variable's host shape is "
                f"{v.shape_on_host} ({v.replica_grouping.num_groups} group(s) of {v.shape})"
            )
        v.load_groups(per_group_values(arr, v.replica_grouping, v.name))

    def get_tensor_data(self, var: Variable) -> np.ndarray:
        """The variable's global host value: one value per group (``one_per_group``: the group's
        first replica) or per replica (``all_replicas``: shape ``(R, *shape)``).

        With several instances this is collective: every instance calls it and gets the full array.
        """
        self._check_idle("get_tensor_data")
        value = host_value(self.owned_variable(var), self._placement, self._transport)
        assert value is not None  # without a root every instance gets the value
        return value

    def get_replica_data(self, var: Variable | Shard) -> np.ndarray:
        """This instance's replicas' values, raw: shape ``(L, *shape_on_replica)`` (no communication).

        For a sharded variable that is ``(L, shard_size)``, padding included.
        """
        v = self.owned_variable(var)
        return np.stack([v.local_value(i) for i in range(self.instance_replication_factor)])

    def owned_variable(self, var: Any) -> Variable:
        """The variable of this runtime that ``var`` (a Variable or a Shard handle) stands for;
        ValueError otherwise."""
        if not self._variables.owns(var):
            raise ValueError(f"{var!r} is not a variable of this Runtime")
        return var.variable if isinstance(var, Shard) else var

    # -- checkpoints ---------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str], metadata: dict[str, Any] | None = None) -> None:
        """Write every variable as a full host tensor to the ``.npz`` file ``path`` (collective).

        Every instance must call it; instance 0 writes, via a temporary file renamed into place.
        ``metadata`` (JSON-serialisable, e.g. an epoch counter) comes back from :meth:`load`.
        See :mod:`popdist_py.engine._state.checkpoint`.
        """
        self._check_idle("save")
        checkpoint.save(self._variables, self._placement, self._transport, path, metadata)

    def load(self, path: str | os.PathLike[str], strict: bool = True) -> dict[str, Any]:
        """Restore the variables from a checkpoint written by :meth:`save` under any replica/instance
        split (collective); returns its metadata. ``strict``: every variable of this runtime must
        be in the file and vice versa. Raises :class:`CheckpointError` (a ValueError) naming what
        does not fit, before changing anything.
        """
        self._check_idle("load")
        return checkpoint.load(self._variables, self._placement, self._transport, path, strict)

    def state_nbytes(self) -> dict[str, int]:
        """Bytes of variable state this process holds: ``{"memory": ..., "file": ...}`` (file:
        memory-mapped remote buffers), counting each stored array once."""
        mem = file = 0
        for v in self._variables:
            m, f = v.storage.nbytes()
            mem, file = mem + m, file + f
        return {"memory": mem, "file": file}

    # -- lifecycle ---------------------------------------------------------------------------------------
    def _set_timeout(self, timeout: float) -> None:
        self._dispatcher.timeout = timeout
        if self._transport is not None:
            self._transport.timeout = timeout

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("this Runtime is closed")
        if self._broken:
            raise CollectiveError(f"this Runtime can no longer run steps: {self._broken}; create a new Runtime")

    def _check_idle(self, what: str) -> None:
        if self._closed:
            raise RuntimeError("this Runtime is closed")
        if self._running and context.peek() is not None:
            raise RuntimeError(f"{what} cannot be called inside a step; use ctx[var] there")

    def close(self) -> None:
        """Stop the replica threads (if any) and release the communicator. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()
        self._remote.close()
        if self._transport is not None:
            assert self._farewell is not None
            self._farewell.detach()  # said here instead, waiting for the peers' (to free the communicator)
            in_step = self._broken is None and self._renew is None
            wait = min(self._transport.timeout, _FAREWELL_WAIT) if in_step else 0.0
            in_step = self._transport.farewell(self._dispatcher.seq, wait)
            self._transport.close(free=in_step)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Runtime(replication_factor={self.replication_factor}, instance_replication_factor="
            f"{self.instance_replication_factor}, replica_index_offset={self.replica_index_offset})"
        )


def _shutdown(pool: ReplicaExecutor, slicer: Slicer) -> None:
    """Stop the replicas' threads and the slices' threads."""
    pool.shutdown()
    slicer.shutdown()


def _say_closed(transport: Transport, dispatcher: Dispatcher) -> None:
    """Tell the other instances this runtime (never closed) takes part in no further collective."""
    if not transport.MPI.Is_finalized():
        transport.farewell(dispatcher.seq, wait=0.0)


__all__ = ["Runtime"]
