"""The exchange of one replicated collective on one instance: its plan, and running it.

A :class:`CollectivePlan` is built once per collective signature (kind, op, dtype, shape, grouping) and
cached: which local replicas belong to which group, which groups span instances, what this
instance sends to and receives from each other instance (:class:`SendSpec`, :class:`RecvSpec`,
in an order both sides derive identically), and the reductions compiled to flat
programs (:class:`.reduce.Program`) over the canonical tree. Running a plan takes the arrays the
local replicas deposited at the rendezvous and returns one result per local replica.

Reductions (all-reduce, reduce-scatter) of a group that spans instances:

1. Each instance computes, for every other instance of the group, its partials (the maximal
   complete subtrees of its own members: a single partial for consecutive groups and a
   power-of-two L) restricted to that instance's region of the flattened array, and sends them.
   Small arrays (up to ``EAGER_LIMIT`` bytes) travel inside the per-collective header message
   and every region is the whole array (one message exchange in all); large arrays are split
   into one contiguous region per instance (a reduce-scatter by chunk exchange). For
   reduce-scatter the regions are exactly the slices the local members keep.
2. Each instance completes the tree over its own region in one cache-blocked pass from its
   members' data and the received partials (its own partials are recomputed there, not stored).
3. Large all-reduces then exchange the completed regions (an all-gather).

Groups whose members are all local are reduced in-process; only what crosses instances goes
through MPI. All-reduce and all-gather results are shared, read-only, by a group's local members.
The local work of a large collective (each reduction over whole arrays, the copies into an
all-gather's result) runs in contiguous slices of elements on the runtime's
:class:`.slices.Slicer` threads: each element still goes through the same operations.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from popdist_py.engine._collectives.reduce import UFUNCS, Node, Program, decompose
from popdist_py.engine._collectives.segments import dense
from popdist_py.engine._collectives.transport import HDR_BYTES, STATUS_OK, TAG_DATA, TAG_GATHER
from popdist_py.engine._execution.slices import Slicer
from popdist_py.engine._placement.grouping import ReplicaGrouping
from popdist_py.engine._placement.replicas import ReplicaPlacement
from popdist_py.engine._placement.sharding import ShardLayout, end_bounds

#: Per-replica input size (bytes) up to which data travels inside the header message.
EAGER_LIMIT = 32 * 1024

#: The header words ``[seq, index, hash, status]`` as native int64 (the int64 view's layout).
_HEADER = struct.Struct("=4q")

#: ``arr.setflags(write=False)`` without the attribute lookup (a third of ``arr.flags.writeable = False``)
_setflags = np.ndarray.setflags

ALL_REDUCE = "replicated_all_reduce"
REDUCE_SCATTER = "replicated_reduce_scatter"
ALL_GATHER = "replicated_all_gather"


class Signature(NamedTuple):
    """What every participant of one collective must agree on."""

    kind: str
    op: str
    dtype: str
    shape: tuple[int, ...]
    group: ReplicaGrouping
    axis: int
    #: Replicated tensor sharding: the full (unsharded) shape. A reduce-scatter then returns
    #: shards in the balanced RTS layout; an all-gather takes shards and returns the full tensor.
    meta_shape: tuple[int, ...] | None = None

    def describe(self) -> str:
        parts = [f"dtype={np.dtype(self.dtype).name}", f"shape={self.shape}", f"group=({self.group.describe()})"]
        if self.kind == ALL_GATHER:
            parts.insert(0, f"axis={self.axis}")
        else:
            parts.insert(0, f"op={self.op}")
        if self.meta_shape is not None:
            parts.append(f"RTS full shape={self.meta_shape}")
        return f"{self.kind}({', '.join(parts)})"

    def agree_signature(self, index: int) -> tuple[tuple[str, str, str, tuple[int, ...], str, int], tuple[str, ...]]:
        """(signature, field names) in the form ``agreement.agree`` reports."""
        rts = "" if self.meta_shape is None else f" (RTS, full shape {self.meta_shape})"
        values = (f"{self.kind}{rts} #{index} of the step", self.op, np.dtype(self.dtype).name, self.shape,
                  self.group.describe(), self.axis)
        return values, ("collective", "op", "dtype", "shape", "group", "axis")


#: (peer instance, buffer) of one point-to-point message
Message = tuple[int, np.ndarray]


class Link(Protocol):
    """What a plan needs from the transport for one call (bound to that call's header)."""

    def channel(self, sendbufs: Sequence[np.ndarray], recvbufs: Sequence[np.ndarray]) -> Any: ...

    def exchange(self, channel: Any) -> None: ...

    def transfer(self, recvs: Sequence[Message], sends: Sequence[Message], tag: int) -> None: ...


class GroupPlan:
    """One group that has members on this instance, with its compiled reductions."""

    __slots__ = (
        "cross",
        "k0",
        "k1",
        "local",
        "owners",
        "piece_programs",
        "pieces",
        "program",
        "ranges",
        "region_program",
        "regions",
        "remote_inputs",
        "size",
    )

    def __init__(self, placement: ReplicaPlacement, grouping: ReplicaGrouping, group: int) -> None:
        me = placement.instance
        members = grouping.members(group)
        ranges: dict[int, list[int]] = {}
        for k, m in enumerate(members):
            r = ranges.setdefault(placement.owner(m), [k, k])
            r[1] = k + 1
        self.size = len(members)
        self.ranges = {j: (a, b) for j, (a, b) in ranges.items()}
        self.owners = tuple(sorted(self.ranges))
        self.k0, self.k1 = self.ranges[me]
        #: local replica index of each of this instance's members, in member order
        self.local = tuple(members[k] - placement.replica_index_offset for k in range(self.k0, self.k1))
        self.cross = len(self.owners) > 1
        self.pieces = {j: tuple(decompose(a, b, self.size)) for j, (a, b) in self.ranges.items()}
        self.regions: dict[int, tuple[int, int]] = {}
        leaves = [(k, k + 1) for k in range(self.k0, self.k1)]
        self.program: Program | None = None
        #: my piece -> (program over my leaves, positions in ``local`` of those leaves)
        self.piece_programs: dict[Node, tuple[Program, list[int]]] = {}
        self.region_program: Program | None = None
        #: (peer position, position in that peer's receive list) of each remote program input
        self.remote_inputs: list[tuple[int, int]] = []
        if not self.cross:
            self.program = Program((0, self.size), leaves)
            return
        for node in self.pieces[me]:
            inside = [j for j, (k, _) in enumerate(leaves) if node[0] <= k < node[1]]
            self.piece_programs[node] = (Program(node, [leaves[j] for j in inside]), inside)


class SendSpec(NamedTuple):
    """One piece of data this instance sends a peer in a collective."""

    #: index of the group in :attr:`CollectivePlan.groups`
    group: int
    #: the tree node whose partial is sent (a reduction), or the leaf ``(k, k + 1)``: member
    #: ``k``'s whole input (an all-gather)
    node: Node
    #: the elements ``lo:hi`` of the flattened array that are sent
    lo: int
    hi: int


class RecvSpec(NamedTuple):
    """One piece of data this instance receives from a peer in a collective."""

    #: index of the group in :attr:`CollectivePlan.groups`
    group: int
    #: the peer's tree node (its partial over that node, or member ``node[0]``'s input)
    node: Node
    #: elements received
    elements: int


class LocalJob(NamedTuple):
    """A group with every member on this instance, reduced in-process."""

    group: GroupPlan
    program: Program
    #: local replicas of its members, in member order
    inputs: tuple[int, ...]


class SendJob(NamedTuple):
    """A partial of my members for a peer's region of a spanning group."""

    peer: int
    program: Program
    #: local replicas whose data the program reduces
    inputs: list[int]
    lo: int
    hi: int
    #: where the partial goes; None (bulk, a single member): that member's data is sent as it is
    dest: np.ndarray | None


class RegionJob(NamedTuple):
    """My region ``lo:hi`` of a spanning group, from my members and the peers' partials."""

    group: GroupPlan
    program: Program
    lo: int
    hi: int
    #: the peers' partials for my region (receive buffers)
    remote: list[np.ndarray]


class PieceJob(NamedTuple):
    """Eager all-reduce: one of my pieces computed once into a message, then copied into the others."""

    program: Program
    inputs: list[int]
    dest: np.ndarray
    copies: list[np.ndarray]


class SmallJob(NamedTuple):
    """Eager all-reduce: a spanning group's result from my pieces and the peers' pieces."""

    group: GroupPlan
    program: Program
    arrays: list[np.ndarray]


class CollectivePlan:
    """Everything about one collective signature on this instance that does not depend on the data."""

    def __init__(self, placement: ReplicaPlacement, sig: Signature, eager_limit: int = EAGER_LIMIT,
                 slicer: Slicer | None = None) -> None:
        self.placement = placement
        #: runs large local work in slices on several threads (None: one thread, the caller's)
        self.slicer = slicer if slicer is not None and slicer.threads > 1 else None
        self.sig = sig
        self.kind = sig.kind
        self.dtype = np.dtype(sig.dtype)
        self.shape = sig.shape
        self.n = n = math.prod(sig.shape)
        self.itemsize = isz = self.dtype.itemsize
        self.ufunc = UFUNCS.get(sig.op, np.add)
        self.divide_by = sig.group.group_size if sig.op == "mean" else 0
        grouping = sig.group
        G = self.group_size = grouping.group_size
        me = placement.instance
        offset = placement.replica_index_offset
        local_groups = sorted({grouping.group_of(offset + r) for r in range(placement.num_local_replicas)})
        self.groups = [GroupPlan(placement, grouping, g) for g in local_groups]
        self.eager = n * isz <= eager_limit
        self.chunk = -(-n // G) if self.kind == REDUCE_SCATTER else 0  # elements of each member's slice
        #: RTS: the balanced layout of the full tensor over the group (reduce-scatter output,
        #: all-gather input); otherwise reduce-scatter slices are contiguous, padded at the end.
        self.rts: ShardLayout | None = None
        if sig.meta_shape is not None:
            self.rts = ShardLayout(math.prod(sig.meta_shape), G)
        self.bounds = (self.rts.bounds if self.rts is not None and self.kind == REDUCE_SCATTER
                       else end_bounds(n, G))
        self._set_regions()
        self.cross = [gp for gp in self.groups if gp.cross]
        self.peers = tuple(p for p in range(placement.num_instances) if p != me)
        self._set_specs(me)
        if self.kind != ALL_GATHER:
            self._set_region_programs()
        self._set_buffers()
        #: the outgoing messages' headers, as buffers for ``struct.pack_into``
        self._headers = [b.data[:HDR_BYTES] for b in self.sendbufs]
        #: the header messages as persistent requests, built by the first call that has a link
        self.channel: Any = None
        self._compile_jobs()
        self.flat_shape = len(self.shape) == 1
        #: the divisor of a mean, as the dtype's scalar (what :func:`.reduce.finish_mean` divides by)
        self.divisor = self.dtype.type(self.divide_by) if self.divide_by else None
        self.small = self.kind == ALL_REDUCE and self.eager
        if self.small:
            self._compile_small()

    def _set_regions(self) -> None:
        """Each owner's region of the tensor in each local group: the whole tensor (eager all-reduce),
        an even share (bulk all-reduce) or its members' slices (reduce-scatter)."""
        n = self.n
        for gp in self.groups:
            if self.kind == ALL_REDUCE:
                if self.eager:
                    gp.regions = dict.fromkeys(gp.owners, (0, n))
                else:
                    c = len(gp.owners)
                    gp.regions = {j: (i * n // c, (i + 1) * n // c) for i, j in enumerate(gp.owners)}
            elif self.kind == REDUCE_SCATTER:
                bd = self.bounds
                gp.regions = {j: (bd[a], bd[b]) for j, (a, b) in gp.ranges.items()}

    def _set_specs(self, me: int) -> None:
        """What goes to / comes from each peer, in an order both sides derive identically: groups
        ascending, then the sender's pieces (or members) ascending."""
        n = self.n
        self.send_specs: list[list[SendSpec]] = []
        self.recv_specs: list[list[RecvSpec]] = []
        for p in self.peers:
            sends: list[SendSpec] = []
            recvs: list[RecvSpec] = []
            for gi, gp in enumerate(self.groups):
                if p not in gp.ranges:
                    continue
                if self.kind == ALL_GATHER:
                    sends += [SendSpec(gi, (k, k + 1), 0, n) for k in range(gp.k0, gp.k1)]
                    a, b = gp.ranges[p]
                    recvs += [RecvSpec(gi, (k, k + 1), n) for k in range(a, b)]
                else:
                    lo, hi = gp.regions[p]
                    sends += [SendSpec(gi, node, lo, hi) for node in gp.pieces[me]]
                    mlo, mhi = gp.regions[me]
                    recvs += [RecvSpec(gi, node, mhi - mlo) for node in gp.pieces[p]]
            self.send_specs.append(sends)
            self.recv_specs.append(recvs)

    def _set_region_programs(self) -> None:
        """A group that spans instances reduces its region from its local pieces and the peers'."""
        for gi, gp in enumerate(self.groups):
            if not gp.cross:
                continue
            inputs = [(k, k + 1) for k in range(gp.k0, gp.k1)]
            for pi, rspecs in enumerate(self.recv_specs):
                for si, rspec in enumerate(rspecs):
                    if rspec.group == gi:
                        inputs.append(rspec.node)
                        gp.remote_inputs.append((pi, si))
            gp.region_program = Program((0, self.group_size), inputs)

    def _set_buffers(self) -> None:
        """The messages' buffers: eager, the payload follows the header in one message (typed views
        of it, one per spec; the buffers never move); bulk, headers alone, with partials of non-leaf
        pieces computed into send buffers and the peers' partials landing in receive buffers."""
        isz = self.itemsize
        self.send_views: list[list[np.ndarray]] = []
        self.recv_data: list[list[np.ndarray]]
        if self.eager:
            send_counts = [[s.hi - s.lo for s in specs] for specs in self.send_specs]
            recv_counts = [[r.elements for r in specs] for specs in self.recv_specs]
            self.sendbufs = [np.zeros(HDR_BYTES + isz * sum(c), np.uint8) for c in send_counts]
            self.recvbufs = [np.zeros(HDR_BYTES + isz * sum(c), np.uint8) for c in recv_counts]
            self.send_views = [self._views(b, c) for b, c in zip(self.sendbufs, send_counts, strict=True)]
            self.recv_data = [self._views(b, c) for b, c in zip(self.recvbufs, recv_counts, strict=True)]
            #: where each send spec's data goes before it is sent
            self.send_data: Sequence[Sequence[np.ndarray | None]] = self.send_views
        else:
            self.sendbufs = [np.zeros(HDR_BYTES, np.uint8) for _ in self.peers]
            self.recvbufs = [np.zeros(HDR_BYTES, np.uint8) for _ in self.peers]
            self.send_data = [
                [None if self.kind == ALL_GATHER or s.node[1] - s.node[0] == 1 else np.empty(s.hi - s.lo, self.dtype)
                 for s in specs]
                for specs in self.send_specs
            ]
            self.recv_data = [
                [np.empty(0 if self.kind == ALL_GATHER else r.elements, self.dtype) for r in specs]
                for specs in self.recv_specs
            ]

    def _compile_jobs(self) -> None:
        """Flatten the per-call work of reductions into lists, so a call does no lookups."""
        self.local_jobs = [LocalJob(gp, gp.program, gp.local) for gp in self.groups if gp.program is not None]
        self.send_jobs: list[SendJob] = []
        self.region_jobs: list[RegionJob] = []
        if self.kind == ALL_GATHER:
            return
        me = self.placement.instance
        for p, dests, specs in zip(self.peers, self.send_data, self.send_specs, strict=True):
            for dest, spec in zip(dests, specs, strict=True):
                gp = self.groups[spec.group]
                prog, pos = gp.piece_programs[spec.node]
                self.send_jobs.append(SendJob(p, prog, [gp.local[j] for j in pos], spec.lo, spec.hi, dest))
        for gp in self.groups:
            if gp.region_program is not None:
                lo, hi = gp.regions[me]
                remote = [self.recv_data[pi][si] for pi, si in gp.remote_inputs]
                self.region_jobs.append(RegionJob(gp, gp.region_program, lo, hi, remote))

    def _compile_small(self) -> None:
        """Jobs of the eager all-reduce (the latency-bound case), with every buffer bound in advance.

        Every peer's region is the whole array, so each of my pieces of a spanning group is
        computed once, into the first message that carries it (copied into the others), and
        the region program starts from those pieces instead of recomputing them from my
        members: the same tree nodes from the same values, so the same bits.
        """
        self.piece_jobs: list[PieceJob] = []
        first: dict[tuple[int, Node], np.ndarray] = {}
        for dests, specs in zip(self.send_views, self.send_specs, strict=True):
            for dest, spec in zip(dests, specs, strict=True):
                key = (spec.group, spec.node)
                have = first.get(key)
                if have is not None:
                    next(j for j in self.piece_jobs if j.dest is have).copies.append(dest)
                    continue
                first[key] = dest
                gp = self.groups[spec.group]
                prog, pos = gp.piece_programs[spec.node]
                self.piece_jobs.append(PieceJob(prog, [gp.local[j] for j in pos], dest, []))
        self.small_jobs: list[SmallJob] = []
        me = self.placement.instance
        for gi, gp in enumerate(self.groups):
            if not gp.cross:
                continue
            nodes = list(gp.pieces[me])
            arrays = [first[(gi, node)] for node in nodes]
            for pi, si in gp.remote_inputs:
                nodes.append(self.recv_specs[pi][si].node)
                arrays.append(self.recv_data[pi][si])
            self.small_jobs.append(SmallJob(gp, Program((0, self.group_size), nodes), arrays))

    # -- helpers -----------------------------------------------------------------------------------
    def _views(self, buf: np.ndarray, counts: Sequence[int]) -> list[np.ndarray]:
        views, off = [], HDR_BYTES
        for c in counts:
            nb = c * self.itemsize
            views.append(buf[off : off + nb].view(self.dtype))
            off += nb
        return views

    def _exchange(self, link: Link) -> None:
        channel = self.channel
        if channel is None:
            channel = self.channel = link.channel(self.sendbufs, self.recvbufs)
        link.exchange(channel)

    def set_header(self, seq: int, index: int, sig_hash: int) -> None:
        """Write ``[seq, index, hash, OK]`` into every outgoing message (what the peers' must match)."""
        for header in self._headers:  # struct: cheaper than numpy item assignments for four words
            _HEADER.pack_into(header, 0, seq, index, sig_hash, STATUS_OK)

    def _fill(self, prog: Program, inputs: Sequence[Any], out: np.ndarray, divide_by: int = 0) -> np.ndarray:
        """``prog`` over the 1-D ``inputs`` (arrays or :class:`.segments.Segments`, a fused bucket's
        pieces, sliced alike) into ``out``, ``/ divide_by``; in slices on the slicer's threads when
        the work is large."""
        slicer, ufunc = self.slicer, self.ufunc
        nbytes = out.nbytes * (len(inputs) + 1)
        if slicer is None or not slicer.splits(nbytes):
            return prog.run_blocked(inputs, ufunc, out, divide_by)

        def part(lo: int, hi: int) -> None:
            prog.run_blocked([a[lo:hi] for a in inputs], ufunc, out[lo:hi], divide_by)

        slicer.run(part, out.shape[0], nbytes)
        return out

    def _fill_shards(self, prog: Program, inputs: Sequence[Any], out: np.ndarray, k0: int, k1: int,
                     divide_by: int) -> None:
        """RTS reduce-scatter: ``prog`` over the elements of members ``k0 .. k1-1``, which ``inputs``
        hold packed from member ``k0``'s first, written straight into their shards in ``out``
        (:attr:`chunk` elements each, their padding left zero), in slices when large. (Reducing
        them packed and then moving each shard to its place was a serial pass over the result.)"""
        bd, cs, ufunc = self.bounds, self.chunk, self.ufunc
        base = bd[k0]
        #: (first, end) of each member's elements in ``inputs``, and where its shard starts in ``out``
        shards = [(bd[k] - base, bd[k + 1] - base, (k - k0) * cs) for k in range(k0, k1)]

        def part(lo: int, hi: int) -> None:
            for first, end, at in shards:
                a, b = max(first, lo), min(end, hi)
                if a < b:
                    prog.run_blocked([x[a:b] for x in inputs], ufunc, out[at + a - first : at + b - first], divide_by)

        total = bd[k1] - base
        slicer = self.slicer
        nbytes = total * self.itemsize * (len(inputs) + 1)
        if slicer is None or not slicer.splits(nbytes):
            part(0, total)
        else:
            slicer.run(part, total, nbytes)

    def _copy(self, pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        """``dst[...] = src`` for each pair (arrays of one shape); in slices on the slicer's threads
        when the copies are large and every array is C-contiguous."""
        slicer = self.slicer
        nbytes = 2 * sum(src.nbytes for _, src in pairs)
        if slicer is None or not slicer.splits(nbytes) or not all(
                d.flags.c_contiguous and s.flags.c_contiguous for d, s in pairs):
            for dst, src in pairs:
                dst[...] = src
            return
        flat = [(d.reshape(-1), s.reshape(-1)) for d, s in pairs]

        def part(lo: int, hi: int) -> None:
            for dst, src in flat:
                dst[lo:hi] = src[lo:hi]

        slicer.run(part, flat[0][0].shape[0], nbytes)

    # -- execution ---------------------------------------------------------------------------------
    def run(self, xs: Sequence[np.ndarray], link: Link | None) -> list[Any]:
        """Results for every local replica from the arrays they deposited (``xs[local index]``)."""
        flat = xs if self.flat_shape else [x.reshape(-1) for x in xs]  # (deposits have the signature's shape)
        if self.small:
            return self._all_reduce_small(flat, link)
        if self.kind == ALL_GATHER:
            return self._gather(xs, link)
        return self._reduce(flat, link)

    def _all_reduce_small(self, flat: Sequence[np.ndarray], link: Link | None) -> list[Any]:
        """:meth:`_reduce` for an eager all-reduce, trimmed to the bone (no slicing, no blocking)."""
        ufunc, n, dtype, divisor = self.ufunc, self.n, self.dtype, self.divisor
        results: list[Any] = [None] * self.placement.num_local_replicas
        for _, prog, members in self.local_jobs:
            out = np.empty(n, dtype)
            prog.run([flat[li] for li in members], ufunc, out)
            if divisor is not None:
                np.divide(out, divisor, out=out)
            full = out if self.flat_shape else out.reshape(self.shape)
            _setflags(full, write=False)
            for li in members:
                results[li] = full
        if link is None:
            return results
        for prog, inputs, dest, copies in self.piece_jobs:
            prog.run([flat[li] for li in inputs], ufunc, dest)
            for other in copies:
                np.copyto(other, dest)
        self._exchange(link)
        for gp, prog, arrays in self.small_jobs:
            out = np.empty(n, dtype)
            prog.run(arrays, ufunc, out)
            if divisor is not None:
                np.divide(out, divisor, out=out)
            full = out if self.flat_shape else out.reshape(self.shape)
            _setflags(full, write=False)
            for li in gp.local:
                results[li] = full
        return results

    def _reduce(self, flat: Sequence[np.ndarray], link: Link | None) -> list[Any]:
        ufunc, n, div, dtype = self.ufunc, self.n, self.divide_by, self.dtype
        results: list[Any] = [None] * self.placement.num_local_replicas
        for gp, prog, members in self.local_jobs:  # groups with every member here
            out = np.empty(n, dtype) if self.kind == ALL_REDUCE else np.zeros(self.group_size * self.chunk, dtype)
            if self.rts is None:
                self._fill(prog, [flat[li] for li in members], out[:n], div)
            else:
                self._fill_shards(prog, [flat[li] for li in members], out, gp.k0, gp.k1, div)
            self._assign(results, gp, out, 0)
        if link is None:
            return results
        # 1. my partials for each peer's region, 2. exchange them
        if self.eager:
            for _, prog, inputs, lo, hi, dest in self.send_jobs:
                assert dest is not None  # eager: every partial goes into its message
                prog.run_blocked([flat[li][lo:hi] for li in inputs], ufunc, dest)
            self._exchange(link)
        else:
            self._exchange(link)
            sends = []
            for p, prog, inputs, lo, hi, dest in self.send_jobs:
                if dest is None:  # a single member: send its data as it is (packed, if in pieces)
                    sends.append((p, dense(flat[inputs[0]][lo:hi])))
                else:
                    sends.append((p, self._fill(prog, [flat[li][lo:hi] for li in inputs], dest)))
            recvs = [(p, buf) for p, bufs in zip(self.peers, self.recv_data, strict=True) for buf in bufs]
            link.transfer(recvs, sends, TAG_DATA)
        # 3. my region of each spanning group, in one pass from my members' data and the peers' partials
        me = self.placement.instance
        outs: list[tuple[GroupPlan, np.ndarray]] = []
        for gp, prog, lo, hi, remote in self.region_jobs:
            region_inputs = [flat[li][lo:hi] for li in gp.local]
            region_inputs += remote
            if self.kind == ALL_REDUCE:
                out = np.empty(n, dtype)
                self._fill(prog, region_inputs, out[lo:hi], div)
            else:
                out = np.zeros((gp.k1 - gp.k0) * self.chunk, dtype)
                if self.rts is None:
                    self._fill(prog, region_inputs, out[: hi - lo], div)
                else:
                    self._fill_shards(prog, region_inputs, out, gp.k0, gp.k1, div)
            outs.append((gp, out))
        # 4. all-reduce in bulk: every instance has completed one region; exchange them
        if self.kind == ALL_REDUCE and not self.eager and outs:
            recvs, sends = [], []
            for gp, out in outs:
                lo, hi = gp.regions[me]
                for p in gp.owners:
                    if p != me:
                        plo, phi = gp.regions[p]
                        recvs.append((p, out[plo:phi]))
                        sends.append((p, out[lo:hi]))
            link.transfer(recvs, sends, TAG_GATHER)
        for gp, out in outs:
            self._assign(results, gp, out, gp.k0)
        return results

    def _assign(self, results: list[Any], gp: GroupPlan, out: np.ndarray, first_member: int) -> None:
        if self.kind == ALL_REDUCE:
            full = out.reshape(self.shape)
            full.flags.writeable = False  # shared by the group's local members
            for li in gp.local:
                results[li] = full
        else:
            cs = self.chunk
            for k, li in zip(range(gp.k0, gp.k1), gp.local, strict=True):
                i = k - first_member
                results[li] = out[i * cs : (i + 1) * cs]

    def _gather(self, xs: Sequence[np.ndarray], link: Link | None) -> list[Any]:
        G, shape = self.group_size, self.shape
        stacks = []
        copies = []
        for gp in self.groups:
            stacked = np.empty((G, *shape), self.dtype)
            copies += [(stacked[k, ...], xs[li]) for k, li in zip(range(gp.k0, gp.k1), gp.local, strict=True)]
            stacks.append(stacked)
        self._copy(copies)
        if link is not None:
            # the specs of an all-gather carry members as leaves: node[0] is the member
            if self.eager:
                for views, sspecs in zip(self.send_views, self.send_specs, strict=True):
                    for view, s in zip(views, sspecs, strict=True):
                        view[:] = stacks[s.group][s.node[0]].reshape(-1)
                self._exchange(link)
                for views, rspecs in zip(self.recv_data, self.recv_specs, strict=True):
                    for view, r in zip(views, rspecs, strict=True):
                        stacks[r.group][r.node[0]].reshape(-1)[:] = view
            else:
                self._exchange(link)
                recvs = [(p, stacks[r.group][r.node[0]].reshape(-1))
                         for p, rspecs in zip(self.peers, self.recv_specs, strict=True) for r in rspecs]
                sends = [(p, stacks[s.group][s.node[0]].reshape(-1))
                         for p, sspecs in zip(self.peers, self.send_specs, strict=True) for s in sspecs]
                link.transfer(recvs, sends, TAG_DATA)
        results: list[Any] = [None] * self.placement.num_local_replicas
        for gp, stacked in zip(self.groups, stacks, strict=True):
            if self.rts is not None:  # shards -> the full tensor without its padding
                joined = stacked.reshape(-1) if not self.rts.padding else self.rts.join(stacked)
                full = joined.reshape(self.sig.meta_shape)
            else:
                full = concat_members(stacked, self.sig.axis)
            full.flags.writeable = False  # shared by the group's local members
            for li in gp.local:
                results[li] = full
        return results


def concat_members(stacked: np.ndarray, axis: int) -> np.ndarray:
    """``np.concatenate(list(stacked), axis)`` without the list: members along ``axis`` (0-d: stacked)."""
    G, *shape = stacked.shape
    if not shape:
        return stacked
    if axis == 0:
        return stacked.reshape((G * shape[0], *shape[1:]))
    moved = np.moveaxis(stacked, 0, axis)
    return moved.reshape((*shape[:axis], G * shape[axis], *shape[axis + 1 :]))
