"""The Runtime: L local replicas of a step in one process, instances joined by MPI (PopXL's vocabulary).

``Runtime()`` takes R (global replicas), L (replicas in this process) and this instance's replica
offset from the PopDist environment that ``poprun`` sets; ``Runtime(replication=N)`` runs N
replicas in one process. ``rt.run(step, *inputs)`` calls ``step(ctx, *per_replica_inputs)`` once
per local replica, concurrently (in threads or as cooperative greenlets: :mod:`.executor`), and
stacks the outputs along a leading axis of L. Inside a step, ``popdist_py.engine.ops`` provides
the replicated collectives and ``ctx[var]`` a replica's value of a variable.

Variables come in PopXL's kinds: plain (``variable``), replica-sharded (``replica_sharded_variable``,
each replica storing only its shard; :mod:`.sharding`), and off-chip in remote buffers
(``remote_buffer``, ``remote_variable``, ``remote_replica_sharded_variable``; :mod:`.remote`).
``save``/``load`` write and read them all as full host tensors (:mod:`.checkpoint`).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from popdist_py import checks
from popdist_py.engine import checkpoint, context
from popdist_py.engine.exchange import ALL_GATHER, REDUCE_SCATTER, Message, Plan, Signature
from popdist_py.engine.context import StepContext
from popdist_py.engine.cooperative import CooperativePool
from popdist_py.engine.executor import THREADS, choose
from popdist_py.engine.grouping import CommGroup, ReplicaGrouping
from popdist_py.engine.pool import ReplicaPool
from popdist_py.engine.reduce import OPS
from popdist_py.engine.remote import RemoteBuffer, RemoteBuffers, RemoteSlots
from popdist_py.engine.rendezvous import END, Rendezvous, StepAborted, ThreadWaits
from popdist_py.engine.sharding import ShardMeta, sharding_domain
from popdist_py.engine.replicas import ReplicaPlacement, resolve
from popdist_py.engine.transport import HDR_BYTES, HeaderChannel, PeerAborted, Transport
from popdist_py.engine.variables import (
    Shard,
    Variable,
    VariableRegistry,
    as_host_array,
    check_retrieval_mode,
    host_value,
    per_group_values,
)
from popdist_py.errors import CollectiveError, CollectiveMismatchError

log = logging.getLogger(__name__)

_END_HASH = int.from_bytes(hashlib.blake2b(b"end of step", digest_size=8).digest(), "little", signed=True)
#: Validated collective signatures kept (each with its plan and buffers); cleared when full.
_ENTRY_CACHE = 256

Group = ReplicaGrouping | CommGroup | None


class _Link:
    """Binds the transport to the current collective call (its header and how to describe it).

    One per runtime, re-pointed at each call: only one combiner runs at a time.
    """

    __slots__ = ("index", "sig", "transport")

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.sig: Signature | None = None
        self.index = 0

    def channel(self, sendbufs: Sequence[np.ndarray], recvbufs: Sequence[np.ndarray]) -> HeaderChannel:
        return self.transport.channel(sendbufs, recvbufs)

    def exchange(self, channel: HeaderChannel) -> None:
        self.transport.exchange(channel, self.describe)

    def transfer(self, recvs: Sequence[Message], sends: Sequence[Message], tag: int) -> None:
        self.transport.transfer(recvs, sends, tag, self.describe)

    def describe(self) -> tuple[str, tuple, Sequence[str]]:
        assert self.sig is not None
        values, fields = self.sig.agree_signature(self.index)
        return f"{self.sig.kind} #{self.index} of the step", values, fields


class _Entry:
    """A validated collective signature and, once a combiner has needed it, its plan.

    Cached by the call's raw arguments so that repeated calls skip validation, and compared by
    identity at the rendezvous (equal signatures from different entries still match).
    """

    __slots__ = ("hash", "plan", "sig")

    def __init__(self, sig: Signature) -> None:
        self.sig = sig
        self.plan: Plan | None = None
        self.hash = int.from_bytes(hashlib.blake2b(repr(sig).encode(), digest_size=8).digest(), "little", signed=True)


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
        remote_dir: directory for file-backed remote buffers (default ``$POPDIST_REMOTE_DIR``,
            else a private temporary directory); their files are deleted on ``close()``.
        executor: how the L local replicas run (default ``$POPDIST_ENGINE_EXECUTOR``, else
            ``"auto"``; ``rt.executor`` tells the choice). ``"threads"``: in parallel (numpy
            releases the GIL), but each collective costs every waiting replica an OS wake-up and
            a GIL hand-off (tens of us). ``"cooperative"``: greenlets on the calling thread, one
            at a time; a collective costs a few greenlet switches, and a replica that can never
            arrive is reported at once. ``"auto"``: threads when L > 1 and this instance has at
            least 2 cores to itself (CPU affinity divided by ``$LOCAL_WORLD_SIZE``, the
            instances poprun put on this host), else cooperative. Same results and errors
            either way; with L == 1 the step runs directly on the calling thread.

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
    ) -> None:
        R, L, index, comm = resolve(replication, comm)
        self._executor = choose(executor, L)
        self._placement = ReplicaPlacement(R, L, index)
        self._timeout_arg = timeout
        self._timeout = checks.collective_timeout(timeout)
        self._transport: Transport | None = None
        if self._placement.num_instances > 1:
            self._transport = Transport(comm, self._placement.describe_instance, self._timeout)
        self._all = ReplicaGrouping.create(R)
        self._contexts = [StepContext(self, i) for i in range(L)]
        self._pool: ReplicaPool | CooperativePool
        if self._executor == THREADS:
            self._pool = ReplicaPool(L, name=f"replica@{self._placement.offset}")
            waits: ThreadWaits | CooperativePool = ThreadWaits(L)
        else:
            self._pool = waits = CooperativePool(L)
        self._rendezvous = Rendezvous(L, self._combine, self._describe_local, self._describe_deposit, waits)
        self._link = _Link(self._transport) if self._transport is not None else None
        self._entries: dict[tuple, _Entry] = {}
        # the finalizer holds the pool: neither pool may reference the runtime between runs
        self._finalizer = weakref.finalize(self, self._pool.shutdown)
        self._variables = VariableRegistry()
        self._remote = RemoteBuffers(L, index, remote_dir)
        self._run_lock = threading.Lock()
        self._running = False
        self._seq = 0
        self._step_collectives = 0  # collectives combined so far in the current run
        self._end_channel: HeaderChannel | None = None
        self._broken: str | None = None
        self._closed = False
        log.debug("Runtime: %d replicas, %d in this process (instance %d), %s executor", R, L, index, self._executor)

    # -- topology ----------------------------------------------------------------------------------
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
        return self._placement.offset

    @property
    def num_instances(self) -> int:
        return self._placement.num_instances

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
        return range(self._placement.offset, self._placement.offset + self._placement.num_local_replicas)

    def replica_grouping(self, stride: int = 1, group_size: int | None = None) -> ReplicaGrouping:
        """A grouping of the R global replicas (PopXL's ``ir.replica_grouping``)."""
        return ReplicaGrouping.create(self.replication_factor, stride, group_size)

    def replica_grouping_from_assignment(self, assignment: Sequence[int]) -> ReplicaGrouping:
        rg = ReplicaGrouping.from_assignment(list(assignment))
        return self._grouping(rg)

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
            L = self.instance_replication_factor
            arrays = [self._input(k, a) for k, a in enumerate(inputs)]
            if self._timeout_arg is None:
                self._set_timeout(checks.collective_timeout(None))
            self._rendezvous.reset()
            self._step_collectives = 0
            outputs: list[Any] = [None] * L
            failures: list[tuple[int, BaseException]] = []

            def task(i: int) -> None:
                ctx = self._contexts[i]
                ctx.ncoll = 0
                prev = context.swap(ctx)
                try:
                    outputs[i] = step(ctx, *[a[i] for a in arrays])
                    self._end_step(i)
                except BaseException as exc:
                    failures.append((i, exc))
                    self._rendezvous.fail(i, exc)
                finally:
                    context.swap(prev)

            self._running = True
            try:
                if self._executor == THREADS:
                    self._pool.run(task)
                else:
                    self._pool.run(task, self._rendezvous.stall)  # type: ignore[call-arg]
            except BaseException as exc:  # interrupted (Ctrl-C) while the replicas were running
                self._rendezvous.fail(0, exc)
                self._broken = f"Runtime.run was interrupted ({type(exc).__name__}) while its replicas ran"
                raise
            finally:
                self._running = False
            if failures or self._rendezvous.failed:
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

    def _end_step(self, i: int) -> None:
        if self._rendezvous.failed:
            return
        try:
            self._rendezvous.arrive(i, END, self._timeout, wait=False)
        except StepAborted:
            pass

    def _raise_failure(self, failures: list[tuple[int, BaseException]]) -> None:
        L = self.instance_replication_factor
        originals = [(i, e) for i, e in failures if not isinstance(e, StepAborted)]
        if originals:
            i, exc = originals[0]
        elif failures:
            i, exc = failures[0]
        else:  # every failing replica's exception was caught inside its step
            exc = self._rendezvous._failure or CollectiveError("step failed")
            i = self._rendezvous._failed_by or 0
        g = self.replica_index_offset + i
        if L > 1 or self.num_instances > 1:
            exc.add_note(f"raised in {self._placement.describe_replica(g)} (local replica {i}) during Runtime.run")
        for j, other in originals[1:]:
            exc.add_note(
                f"also raised in {self._placement.describe_replica(self.replica_index_offset + j)}: "
                f"{type(other).__name__}: {other}"
            )
        if self._transport is not None and not getattr(exc, "_engine_symmetric", False):
            self._broken = (
                f"a step failed on this instance ({type(exc).__name__}: {exc}); the instances are out of step"
            )
            if not isinstance(exc, PeerAborted):
                self._transport.send_abort(self._seq)
        raise exc

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

    # -- collectives -----------------------------------------------------------------------------------
    def _grouping(self, group: Group) -> ReplicaGrouping:
        if group is None:
            return self._all
        if isinstance(group, ReplicaGrouping):
            if group.num_replicas != self.replication_factor:
                raise ValueError(
                    f"group {group} is for {group.num_replicas} replicas but this runtime has "
                    f"replication_factor={self.replication_factor}"
                )
            return group
        if isinstance(group, CommGroup):
            return group.to_replica_grouping(self.replication_factor)
        raise TypeError(f"group must be a ReplicaGrouping, a CommGroup or None, got {group!r}")

    def collective(
        self, ctx: StepContext, kind: str, x: Any, op: str, group: Group, axis: int = 0,
        meta_shape: tuple[int, ...] | None = None,
    ) -> np.ndarray:
        """Enter collective ``kind`` as ``ctx``'s replica (used by :mod:`popdist_py.engine.ops`).

        ``meta_shape`` selects the RTS layout: a reduce-scatter returns balanced shards of a
        tensor of that shape, an all-gather takes such shards and returns the full tensor.
        """
        arr = x if type(x) is np.ndarray else np.asarray(x)
        key = (kind, op, arr.dtype, arr.shape, group, axis, meta_shape)
        try:
            entry = self._entries.get(key)
        except TypeError:  # unhashable group: let validation say what is wrong
            entry = None
        if entry is None:
            entry = self._entry(key, kind, arr, op, group, axis, meta_shape)
        n = ctx.ncoll = ctx.ncoll + 1
        return self._rendezvous.arrive(ctx.local_index, (entry, arr, n), self._timeout)

    def _entry(
        self, key: tuple, kind: str, arr: np.ndarray, op: str, group: Group, axis: int,
        meta_shape: tuple[int, ...] | None = None,
    ) -> _Entry:
        """Validate a collective's arguments (first call with these arguments only)."""
        dt = arr.dtype
        if dt.hasobject or dt.fields is not None or dt.kind in "SUVMm":
            raise TypeError(f"{kind}: arrays of dtype {dt} cannot be communicated (use a numeric or bool dtype)")
        grouping = self._grouping(group)
        if meta_shape is not None:
            meta_shape = tuple(int(d) for d in meta_shape)
            if kind == ALL_GATHER:
                want = (-(-math.prod(meta_shape) // grouping.group_size),)
                if arr.shape != want or axis != 0:
                    raise ValueError(
                        f"{kind}: an RTS shard of a tensor of shape {meta_shape} over {grouping.group_size} "
                        f"replica(s) has shape {want} and is gathered along axis 0; got shape {arr.shape}, axis={axis}"
                    )
            elif kind == REDUCE_SCATTER and arr.shape != meta_shape:
                raise ValueError(f"{kind}: input of shape {arr.shape} is not the full shape {meta_shape}")
        if kind == ALL_GATHER:
            nd = max(arr.ndim, 1)
            if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not -nd <= axis < nd:
                raise ValueError(f"{kind}: axis={axis!r} is out of range for an input of shape {arr.shape}")
            axis = int(axis) % nd
            op = ""
        else:
            if op not in OPS:
                raise ValueError(f"{kind}: op={op!r} is not supported; use one of {', '.join(OPS)}")
            if op == "mean" and dt.kind not in "fc":
                raise TypeError(f"{kind}: op='mean' needs a floating-point input, got dtype {dt}")
            axis = 0
        entry = _Entry(Signature(kind, op, dt.str, arr.shape, grouping, axis, meta_shape))
        if len(self._entries) >= _ENTRY_CACHE:
            self._entries.clear()
        self._entries[key] = entry
        return entry

    def _combine(self, deposits: list[Any], index: int) -> list[Any] | None:
        """Run by the last replica to arrive: check that everyone agrees, then execute the plan."""
        first = deposits[0]
        if first is END:
            if not all(d is END for d in deposits):
                raise CollectiveMismatchError(self._mismatch(deposits))
            if self._transport is not None and self._step_collectives:
                self._end_exchange()
            return None
        entry = first[0]
        if len(deposits) > 1:
            for d in deposits:
                if d is END or (d[0] is not entry and d[0].sig != entry.sig):
                    raise CollectiveMismatchError(self._mismatch(deposits))
        plan = entry.plan
        if plan is None:
            plan = entry.plan = Plan(self._placement, entry.sig)
        self._seq += 1
        self._step_collectives = first[2]
        link = self._link
        if link is not None:
            plan.set_header(self._seq, first[2], entry.hash)
            link.sig = entry.sig
            link.index = first[2]
        try:
            return plan.run([d[1] for d in deposits], link)
        except CollectiveMismatchError as exc:
            if link is not None:  # raised on every instance by agree(): they are still in step
                exc._engine_symmetric = True  # type: ignore[attr-defined]
            raise

    def _end_exchange(self) -> None:
        """Tell the other instances that this step ended after its collectives, and check they agree.

        An instance still waiting in one more collective then gets a mismatch error at once
        (on every instance, naming both sides) instead of waiting for the timeout. Steps without
        collectives stay local: they need not be run on every instance.
        """
        assert self._transport is not None
        if self._end_channel is None:
            peers = self._transport.peers
            self._end_channel = self._transport.channel([np.zeros(HDR_BYTES, np.uint8) for _ in peers],
                                                        [np.zeros(HDR_BYTES, np.uint8) for _ in peers])
        channel = self._end_channel
        self._seq += 1
        n = self._step_collectives + 1
        for buf in channel.sendbufs:
            buf.view(np.int64)[:] = (self._seq, n, _END_HASH, 0)

        what = f"end of step (after {n - 1} collective{'' if n == 2 else 's'})"

        def describe() -> tuple[str, tuple, Sequence[str]]:
            return what, (what, "", "", (), "", 0), ("collective", "op", "dtype", "shape", "group", "axis")

        try:
            self._transport.exchange(channel, describe)
        except CollectiveMismatchError as exc:
            exc._engine_symmetric = True  # type: ignore[attr-defined]
            raise

    def _mismatch(self, deposits: list[Any]) -> str:
        off = self.replica_index_offset
        by: dict[str, list[int]] = {}
        index = 0
        for i, d in enumerate(deposits):
            if d is END:
                text = "finished its step"
            else:
                text = f"called {d[0].sig.describe()}"
                index = d[2]
            by.setdefault(text, []).append(off + i)
        parts = [f"{self._placement.describe_replicas(rs)} {text}" for text, rs in by.items()]
        return f"collective #{index} of the step: the replicas disagree: " + "; ".join(parts)

    def _describe_deposit(self, deposit: Any) -> str:
        if deposit is END:
            return "end of step"
        return f"{deposit[0].sig.kind} #{deposit[2]} of the step"

    def _describe_local(self, locals_: list[int]) -> str:
        return self._placement.describe_replicas([self.replica_index_offset + i for i in locals_])

    # -- variables -------------------------------------------------------------------------------------
    @property
    def variables(self) -> VariableRegistry:
        return self._variables

    def variable(
        self,
        data: Any,
        replica_grouping: ReplicaGrouping | CommGroup | None = None,
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
        grouping = self._grouping(replica_grouping)
        name = self._variables.new_name() if name is None else self._variables.check_name(name)
        arr = as_host_array(data, dtype, f"variable {name!r}")
        groups = per_group_values(arr, grouping, f"variable {name!r}")
        shape = groups[0].shape
        var = Variable(name, grouping, retrieval_mode, shape, arr.dtype, [None] * self.instance_replication_factor,
                       self.replica_index_offset)  # type: ignore[list-item]
        var.load_groups(groups)
        return self._variables.add(var)

    def replica_sharded_variable(
        self,
        data: Any,
        replica_grouping: ReplicaGrouping | CommGroup | None = None,
        shard_over: int | ReplicaGrouping | CommGroup | None = None,
        name: str | None = None,
        dtype: Any = None,
    ) -> tuple[Variable, Shard]:
        """A variable stored as RTS shards: ``(full, shard)`` as PopXL's ``replica_sharded_variable``.

        Each replica keeps only its ``ceil(n / shard_over)`` elements of the flattened value of
        its group (balanced padding, :mod:`popdist_py.engine.sharding`); ``shard_over`` (default:
        the group size; a divisor of it, or a ReplicaGrouping/CommGroup such as
        ``CommGroup.consecutive(L)``) sets the sharding domain. ``full`` is the variable (host
        access: ``get_tensor_data`` gives the original shape, padding removed); ``shard`` is the
        handle a step uses: ``ctx[shard]`` (its flat shard, writable) and
        ``ops.replicated_all_gather(shard)`` (the full tensor). ``data`` is not retained.
        """
        self._check_idle("replica_sharded_variable")
        grouping = self._grouping(replica_grouping)
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
        directory; default the runtime's ``remote_dir``), deleted when the runtime closes.
        Every instance must create the same buffers in the same order.
        """
        self._check_idle("remote_buffer")
        return self._remote.create(shape, dtype, entries, location, path)

    def remote_variable(
        self,
        data: Any,
        buf: RemoteBuffer,
        offset: int = 0,
        replica_grouping: ReplicaGrouping | CommGroup | None = None,
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
        b = self._owned_buffer(buf, "remote_variable")
        grouping = self._grouping(replica_grouping)
        name = self._variables.new_name("remote") if name is None else self._variables.check_name(name)
        what = f"remote_variable {name!r}"
        i = b.check_index(offset, what + " offset")
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
        replica_grouping: ReplicaGrouping | CommGroup | None = None,
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
        b = self._owned_buffer(buf, "remote_replica_sharded_variable")
        grouping = self._grouping(replica_grouping)
        name = self._variables.new_name("remote_sharded") if name is None else self._variables.check_name(name)
        what = f"remote_replica_sharded_variable {name!r}"
        i = b.check_index(offset, what + " offset")
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

    def _bind(self, b: RemoteBuffer, index: int, var: Variable, groups: list[np.ndarray]) -> Variable:
        b.bind(index, var)
        try:
            var.load_groups(groups)
            self._variables.add(var)
        except BaseException:
            b._bound.pop(index, None)
            raise
        return var

    def _owned_buffer(self, buf: Any, what: str) -> RemoteBuffer:
        if not self._remote.owns(buf):
            raise ValueError(f"{what}: {buf!r} is not a remote buffer of this Runtime "
                             "(create it with rt.remote_buffer)")
        return buf

    def write_variable_data(self, var: Variable, data: Any) -> None:
        """Replace every replica's value from host data shaped like the variable's ``shape_on_host``."""
        self._check_idle("write_variable_data")
        v = self._owned(var)
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
        return host_value(self._owned(var), self._placement, self._transport)

    def get_replica_data(self, var: Variable | Shard) -> np.ndarray:
        """This instance's replicas' values, raw: shape ``(L, *shape_on_replica)`` (no communication).

        For a sharded variable that is ``(L, shard_size)``, padding included.
        """
        v = self._owned(var)
        return np.stack([v.local_value(i) for i in range(self.instance_replication_factor)])

    def _owned(self, var: Any) -> Variable:
        if not self._variables.owns(var):
            raise ValueError(f"{var!r} is not a variable of this Runtime")
        return var.variable if isinstance(var, Shard) else var

    # -- checkpoints ---------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str], metadata: dict[str, Any] | None = None) -> None:
        """Write every variable as a full host tensor to the ``.npz`` file ``path`` (collective).

        Every instance must call it; instance 0 writes, via a temporary file renamed into place.
        ``metadata`` (JSON-serialisable, e.g. an epoch counter) comes back from :meth:`load`.
        See :mod:`popdist_py.engine.checkpoint`.
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
        self._timeout = timeout
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
            self._transport.close(free=self._broken is None)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Runtime(replication_factor={self.replication_factor}, instance_replication_factor="
            f"{self.instance_replication_factor}, replica_index_offset={self.replica_index_offset})"
        )


__all__ = ["Runtime"]
