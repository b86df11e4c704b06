"""The collective dispatcher of one runtime: from a replica's call to the combined results.

A replica that calls a collective (:mod:`.ops`) enters :meth:`Dispatcher.collective`: its
arguments are validated once per distinct call (a cached :class:`Entry`), it deposits its array
at the rendezvous (:mod:`.rendezvous`), and the last local replica to arrive combines: it checks
that every local replica called the same collective, then runs the signature's plan
(:mod:`.exchange`), which exchanges with the other instances over the transport
(:mod:`.transport`) when the groups span instances. The end of each replica's step is a deposit
too, so a replica that calls fewer collectives is a mismatch reported at once; with several
instances, the end of a step that had collectives is exchanged as well.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from popdist_py import validate
from popdist_py.engine._collectives.exchange import (
    ALL_GATHER,
    EAGER_LIMIT,
    REDUCE_SCATTER,
    CollectivePlan,
    Message,
    Signature,
)
from popdist_py.engine._collectives.reduce import check_operands, reduction_op
from popdist_py.engine._collectives.rendezvous import END, POLL_BYTES, Rendezvous, Waits
from popdist_py.engine._collectives.segments import Segments
from popdist_py.engine._collectives.transport import HDR_BYTES, HeaderChannel, Transport
from popdist_py.engine._execution.slices import Slicer
from popdist_py.engine._placement.grouping import Group, ReplicaGrouping, replica_grouping_of
from popdist_py.engine._placement.replicas import ReplicaPlacement
from popdist_py.engine.errors import CollectiveMismatchError, StepAborted
from popdist_py.op_names import SQUARE_ADD

_END_HASH = int.from_bytes(hashlib.blake2b(b"end of step", digest_size=8).digest(), "little", signed=True)
#: Validated collective signatures kept (each with its plan and buffers); cleared when full.
_ENTRY_CACHE = 256
#: What an :class:`Entry` is cached by: a call's raw (kind, op, dtype, shape, group, axis, meta_shape)
_Key = tuple[str, str, np.dtype[Any], tuple[int, ...], Group, int, tuple[int, ...] | None]


class Caller(Protocol):
    """What the dispatcher uses of the replica that calls a collective: its step context
    (:class:`popdist_py.engine.StepContext`, a level above the collectives, which it does not import)."""

    local_index: int
    #: collectives the replica has entered in the current step
    ncoll: int


class CallLink:
    """Binds the transport to the current collective call (its header and how to describe it).

    One per runtime, re-pointed at each call: only one combiner runs at a time.
    """

    __slots__ = ("index", "sig", "step", "transport")

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.sig: Signature | None = None
        self.index = 0
        #: the current step's number (Runtime.run calls so far): only in error messages, as local
        #: steps need not run on every instance
        self.step = 0

    def channel(self, sendbufs: Sequence[np.ndarray], recvbufs: Sequence[np.ndarray]) -> HeaderChannel:
        return self.transport.channel(sendbufs, recvbufs)

    def exchange(self, channel: HeaderChannel) -> None:
        self.transport.exchange(channel, self.describe)

    def transfer(self, recvs: Sequence[Message], sends: Sequence[Message], tag: int) -> None:
        self.transport.transfer(recvs, sends, tag, self.describe)

    def describe(self) -> tuple[str, tuple[Any, ...], Sequence[str]]:
        assert self.sig is not None
        values, fields = self.sig.agree_signature(self.index)
        return f"{self.sig.kind} #{self.index} of the step", (*values, self.step), (*fields, "step")


class Entry:
    """A validated collective signature and, once a combiner has needed it, its plan.

    Cached by the call's raw arguments so that repeated calls skip validation, and compared by
    identity at the rendezvous (equal signatures from different entries still match).
    """

    __slots__ = ("brief", "hash", "plan", "sig", "square")

    def __init__(self, sig: Signature) -> None:
        self.sig = sig
        self.plan: CollectivePlan | None = None
        #: square_add: each replica squares its input before depositing it (then the plan adds)
        self.square = sig.op == SQUARE_ADD
        #: small enough (per replica) for a waiting replica thread to poll for (see rendezvous)
        self.brief = math.prod(sig.shape) * np.dtype(sig.dtype).itemsize <= POLL_BYTES
        self.hash = int.from_bytes(hashlib.blake2b(repr(sig).encode(), digest_size=8).digest(), "little", signed=True)


#: What a replica deposits at the rendezvous for a collective: ``(entry, array, index in the
#: step)`` (a plain tuple: built on every call), or :data:`.rendezvous.END` when its step returned.
Deposit = tuple[Entry, np.ndarray, int]


class Dispatcher:
    """The collectives of one runtime's L local replicas (and, through ``transport``, of every instance).

    ``waits`` is the executor's way of waiting at the rendezvous; ``timeout`` (seconds, settable)
    bounds every wait for a missing replica or instance; ``slicer`` runs a large collective's
    local work on several threads (None: on the combining replica's).
    """

    def __init__(self, placement: ReplicaPlacement, transport: Transport | None, waits: Waits,
                 timeout: float, slicer: Slicer | None = None) -> None:
        self.placement = placement
        self.slicer = slicer
        self.transport = transport
        self.timeout = timeout
        self.rendezvous = Rendezvous(placement.num_local_replicas, self._combine, self._describe_local,
                                     self._describe_deposit, waits)
        self._everyone = ReplicaGrouping.create(placement.replication_factor)
        self._link = CallLink(transport) if transport is not None else None
        self._entries: dict[_Key, Entry] = {}
        #: collectives (and step ends) exchanged with the other instances so far: each header's sequence number
        self.seq = 0
        self._step_collectives = 0  # collectives combined so far in the current run
        self._end_channel: HeaderChannel | None = None

    def resolve_group(self, group: Group) -> ReplicaGrouping:
        """``group`` (None: every replica) as a grouping of this runtime's replicas."""
        if group is None:
            return self._everyone
        return replica_grouping_of(group, self.placement.replication_factor)

    def plans(self) -> list[CollectivePlan]:
        """The plans built so far (one per collective signature that has run)."""
        return [e.plan for e in self._entries.values() if e.plan is not None]

    def renewed(self) -> None:
        """The transport goes on over a new communicator (after a failed step): every header
        channel is made again there, and the sequence numbers start afresh on every instance."""
        for plan in self.plans():
            plan.channel = None
        self._end_channel = None
        self.seq = 0

    # -- a step --------------------------------------------------------------------------------------
    def start_step(self) -> None:
        """Forget the previous run's deposits and failure."""
        self.rendezvous.reset()
        self._step_collectives = 0
        if self._link is not None:
            self._link.step += 1

    def end_step(self, index: int) -> None:
        """Local replica ``index`` returned from its step: deposit its end (a mismatch if others are
        still in a collective), without waiting for the others unless it is the last."""
        if self.rendezvous.failed:
            return
        try:
            self.rendezvous.arrive(index, END, self.timeout, wait=False)
        except StepAborted:
            pass

    def collective(
        self, ctx: Caller, kind: str, x: Any, op: str, group: Group, axis: int = 0,
        meta_shape: tuple[int, ...] | None = None,
    ) -> np.ndarray:
        """Enter collective ``kind`` as ``ctx``'s replica (used by :mod:`popdist_py.engine.ops`).

        ``meta_shape`` selects the RTS layout: a reduce-scatter returns balanced shards of a
        tensor of that shape, an all-gather takes such shards and returns the full tensor.
        """
        arr = x if type(x) is np.ndarray else _array(x, kind)
        key = (kind, op, arr.dtype, arr.shape, group, axis, meta_shape)
        try:
            entry = self._entries.get(key)
        except TypeError:  # unhashable group: let validation say what is wrong
            entry = None
        if entry is None:
            entry = self._entry(key, kind, arr, op, group, axis, meta_shape)
        if entry.square:
            arr = np.square(arr)
        n = ctx.ncoll = ctx.ncoll + 1
        result: np.ndarray = self.rendezvous.arrive(ctx.local_index, (entry, arr, n), self.timeout,
                                                    brief=entry.brief)
        return result

    def _entry(
        self, key: _Key, kind: str, arr: np.ndarray, op: str, group: Group, axis: int,
        meta_shape: tuple[int, ...] | None = None,
    ) -> Entry:
        """Validate a collective's arguments (first call with these arguments only)."""
        dt = arr.dtype
        if dt.hasobject or dt.fields is not None or dt.kind in "SUVMm":
            raise TypeError(f"{kind}: arrays of dtype {dt} cannot be communicated (use a numeric or bool dtype)")
        grouping = self.resolve_group(group)
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
            axis = validate.integer(f"{kind}: axis", axis)
            if not -nd <= axis < nd:
                raise ValueError(f"{kind}: axis={axis!r} is out of range for an input of shape {arr.shape}")
            axis %= nd
            op = ""
        else:
            op = reduction_op(op, kind)
            check_operands(op, dt, kind)
            axis = 0
        entry = Entry(Signature(kind, op, dt.str, arr.shape, grouping, axis, meta_shape))
        if len(self._entries) >= _ENTRY_CACHE:
            self._entries.clear()
        self._entries[key] = entry
        return entry

    # -- combining (run by the last local replica to arrive) -------------------------------------------
    def _combine(self, deposits: list[Any]) -> list[Any] | None:
        """Check that every local replica agrees, then execute the plan (or end the step)."""
        first = deposits[0]
        if first is END:
            if not all(d is END for d in deposits):
                raise CollectiveMismatchError(self._mismatch(deposits))
            if self.transport is not None and self._step_collectives:
                self._end_exchange(self.transport)
            return None
        entry: Entry = first[0]
        if len(deposits) > 1:
            for d in deposits:
                if d is END or (d[0] is not entry and d[0].sig != entry.sig):
                    raise CollectiveMismatchError(self._mismatch(deposits))
        plan = entry.plan
        if plan is None:
            plan = entry.plan = CollectivePlan(self.placement, entry.sig, slicer=self.slicer)
        self.seq += 1
        self._step_collectives = first[2]
        link = self._link
        if link is not None:
            plan.set_header(self.seq, first[2], entry.hash)
            link.sig = entry.sig
            link.index = first[2]
        return plan.run([d[1] for d in deposits], link)

    def _end_exchange(self, transport: Transport) -> None:
        """Tell the other instances that this step ended after its collectives, and check they agree.

        An instance still waiting in one more collective then gets a mismatch error at once
        (:class:`.errors.InstancesDisagreeError` on every instance, naming both sides) instead of
        waiting for the timeout. Steps without collectives stay local: they need not be run on
        every instance.
        """
        if self._end_channel is None:
            peers = transport.peers
            self._end_channel = transport.channel([np.zeros(HDR_BYTES, np.uint8) for _ in peers],
                                                  [np.zeros(HDR_BYTES, np.uint8) for _ in peers])
        channel = self._end_channel
        self.seq += 1
        n = self._step_collectives + 1
        for buf in channel.sendbufs:
            buf.view(np.int64)[:] = (self.seq, n, _END_HASH, 0)

        what = f"end of step (after {n - 1} collective{'' if n == 2 else 's'})"

        step = self._link.step if self._link is not None else 0

        def describe() -> tuple[str, tuple[Any, ...], Sequence[str]]:
            return (what, (what, "", "", (), "", 0, step),
                    ("collective", "op", "dtype", "shape", "group", "axis", "step"))

        transport.exchange(channel, describe)

    # -- error messages ------------------------------------------------------------------------------------
    def _mismatch(self, deposits: list[Any]) -> str:
        off = self.placement.replica_index_offset
        by: dict[str, list[int]] = {}
        index = 0
        for i, d in enumerate(deposits):
            if d is END:
                text = "finished its step"
            else:
                text = f"called {d[0].sig.describe()}"
                index = d[2]
            by.setdefault(text, []).append(off + i)
        parts = [f"{self.placement.describe_replicas(rs)} {text}" for text, rs in by.items()]
        return f"collective #{index} of the step: the replicas disagree: " + "; ".join(parts)

    def _describe_deposit(self, deposit: Any) -> str:
        if deposit is END:
            return "end of step"
        return f"{deposit[0].sig.kind} #{deposit[2]} of the step"

    def _describe_local(self, locals_: list[int]) -> str:
        return self.placement.describe_replicas([self.placement.replica_index_offset + i for i in locals_])


def _array(x: Any, kind: str) -> Any:
    """A collective's input: :class:`.segments.Segments` stay in pieces for a reduction large
    enough to be reduced block by block (read in place); anything else becomes an array."""
    if type(x) is Segments and kind != ALL_GATHER and x.size * x.dtype.itemsize > EAGER_LIMIT:
        return x
    return np.asarray(x)


__all__ = ["CallLink", "Deposit", "Dispatcher", "Entry"]
