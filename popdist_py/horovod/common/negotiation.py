"""Which collective runs next: ops are matched by name across ranks, never by submission order.

Every rank sends what it submits (a :class:`Request`: its name, kind, dtypes, shapes, op, root)
to one coordinator (rank 0 of the world), which keeps them in a :class:`Table`. An op is *ready*
when every rank of its process set has submitted it (a rank that has joined counts as having
submitted zeros). The coordinator then checks that the ranks agree on it, and announces a
:class:`Response` (or one error naming the ranks and what each sent) to every rank of the set, in
one global order. Every rank runs the responses it gets in that order, so ranks that submitted
in different orders (``DistributedOptimizer``'s hooks fire in whatever order autograd reaches
the parameters) never wait on each other in different collectives. This module is the table
alone: pure Python, no MPI (:mod:`popdist_py.horovod.common.runtime` moves the messages).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import NamedTuple

#: The kinds of request, as Horovod names its ops.
ALLREDUCE = "allreduce"
ALLGATHER = "allgather"
BROADCAST = "broadcast"
ALLTOALL = "alltoall"
REDUCESCATTER = "reducescatter"
BARRIER = "barrier"
JOIN = "join"
ADD_PROCESS_SET = "add_process_set"
REMOVE_PROCESS_SET = "remove_process_set"
#: Kinds that run while ranks have joined (a joined rank sends zeros); the others fail at once.
JOINABLE = (ALLREDUCE, BARRIER, JOIN, ADD_PROCESS_SET, REMOVE_PROCESS_SET)
#: Above this many bytes, ready allreduces are not fused into one buffer (HOROVOD_FUSION_THRESHOLD).
FUSION_THRESHOLD = 64 * 1024 * 1024


class Request(NamedTuple):
    """One op as one rank submitted it; grouped ops carry several tensors under one name. (A
    named tuple: thousands cross the wire a second, and tuples pickle fastest.)"""

    name: str
    kind: str
    process_set: int = 0
    dtypes: tuple[str, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    op: str = ""
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    splits: tuple[int, ...] = ()
    ranks: tuple[int, ...] = ()

    def nbytes(self, itemsize: dict[str, int]) -> int:
        total = 0
        for dtype, shape in zip(self.dtypes, self.shapes, strict=True):
            n = itemsize.get(dtype, 8)
            for d in shape:
                n *= d
            total += n
        return total


class Response(NamedTuple):
    """What every rank of a process set runs next (or the error each raises for those names).

    ``requests`` are the ops it runs, as their first submitter sent them (a fused allreduce has
    several); ``contributions`` holds, per rank of the set in set order, that rank's request (None
    for a rank that has joined); ``value`` is the last rank to join (JOIN) or a new process set's
    id (ADD_PROCESS_SET).
    """

    kind: str
    process_set: int
    requests: tuple[Request, ...]
    contributions: tuple[tuple[Request | None, ...], ...] = ()
    error: str = ""
    value: int = -1
    members: tuple[int, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.requests)


def _differ(kind: str, name: str, what: str, values: Sequence[tuple[int, object]]) -> str:
    listing = ", ".join(f"rank {rank} {value}" for rank, value in values)
    return f"{kind} {name!r}: {what} differ between ranks: {listing}"


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def check(submitted: dict[int, Request]) -> str:
    """The error of a ready op whose ranks disagree (one line naming each rank and its value), or ''."""
    ranks = sorted(submitted)
    first = submitted[ranks[0]]
    name = first.name

    def field_error(what: str, value: object) -> str:
        values = [(r, value(submitted[r])) for r in ranks]  # type: ignore[operator]
        if len({v for _, v in values}) > 1:
            return _differ(first.kind, name, what, values)
        return ""

    kinds = [(r, submitted[r].kind) for r in ranks]
    if len({k for _, k in kinds}) > 1:
        listing = ", ".join(f"rank {r} {k}" for r, k in kinds)
        return f"name {name!r} is used for different ops by different ranks: {listing}"
    checks: list[tuple[str, object]] = [("numbers of tensors", lambda r: len(r.dtypes)),
                                         ("dtypes", lambda r: ", ".join(r.dtypes))]
    kind = first.kind
    if kind in (ALLTOALL, ALLGATHER):
        checks.append(("numbers of dimensions", lambda r: ", ".join(str(len(s)) for s in r.shapes)))
    if kind in (ALLREDUCE, REDUCESCATTER, BROADCAST):
        checks.append(("shapes", lambda r: ", ".join(_shape(s) for s in r.shapes)))
    if kind in (ALLGATHER, ALLTOALL):
        checks.append(("shapes after the first dimension", lambda r: ", ".join(_shape(s[1:]) for s in r.shapes)))
    if kind in (ALLREDUCE, REDUCESCATTER):
        checks += [("ops", lambda r: r.op), ("prescale factors", lambda r: r.prescale),
                   ("postscale factors", lambda r: r.postscale)]
    if kind == BROADCAST:
        checks.append(("root ranks", lambda r: r.root))
    if kind == ADD_PROCESS_SET:
        checks.append(("process sets", lambda r: r.ranks))
    if kind == REMOVE_PROCESS_SET:
        checks.append(("process set ids", lambda r: r.root))
    for what, value in checks:
        error = field_error(what, value)
        if error:
            return error
    return ""


class Table:
    """The coordinator's view: each process set's members, and the ops submitted but not yet run."""

    def __init__(self, world_size: int, process_sets: dict[int, tuple[int, ...]] | None = None,
                 fusion_threshold: int = FUSION_THRESHOLD) -> None:
        self.world_size = world_size
        self.fusion_threshold = fusion_threshold
        self.sets: dict[int, tuple[int, ...]] = dict(process_sets or {0: tuple(range(world_size))})
        self.next_set_id = max(self.sets) + 1
        #: Ids of removed sets, given out again first (first removed, first reused).
        self.free_ids: list[int] = []
        #: (process set, name) -> {rank: request}, in the order of first submission.
        self.pending: dict[tuple[int, str], dict[int, Request]] = {}
        self.joined: list[int] = []
        #: Ranks that shut down, with the reason their peers' ops fail.
        self.gone: dict[int, str] = {}
        #: Why every op fails from now on (the coordinator is shutting down), or "".
        self.closing = ""
        #: When each pending op was first submitted (time.monotonic()), and those warned about.
        self.since: dict[tuple[int, str], float] = {}
        self.warned: set[tuple[int, str]] = set()

    def submit(self, rank: int, requests: Iterable[Request]) -> list[Response]:
        """Take a rank's new requests; returns immediate errors (an op on a set it is not in)."""
        errors: list[Response] = []
        for request in requests:
            if self.closing:
                errors.append(Response(request.kind, request.process_set, (request,), members=(rank,),
                                       error=f"{request.kind} {request.name!r}: {self.closing}"))
                continue
            if request.kind == JOIN:
                if rank not in self.joined:
                    self.joined.append(rank)
                continue
            members = self.sets.get(request.process_set)
            if members is None or rank not in members:
                why = ("no such process set" if members is None
                       else f"rank {rank} is not in it (its ranks: {list(members)})")
                errors.append(Response(request.kind, request.process_set, (request,), members=(rank,),
                                       error=f"{request.kind} {request.name!r}: process set "
                                             f"{request.process_set}: {why}"))
                continue
            key = (request.process_set, request.name)
            if key not in self.pending:
                self.since[key] = time.monotonic()
            self.pending.setdefault(key, {})[rank] = request
        return errors

    def stalled(self, after: float, now: float) -> list[str]:
        """One line for each op that has waited more than ``after`` seconds for ranks that have
        not submitted it (once per op): Horovod's stall warning."""
        lines = []
        for key, began in self.since.items():
            if now - began > after and key not in self.warned:
                self.warned.add(key)
                submitted = self.pending[key]
                request = next(iter(submitted.values()))
                missing = ", ".join(map(str, self._missing_of(key, submitted)))
                lines.append(f"{request.kind} {request.name!r} has waited {now - began:.0f} s for rank(s) {missing}, "
                             f"which have not submitted it (submitted by rank(s) "
                             f"{', '.join(map(str, sorted(submitted)))})")
        return lines

    def expire(self, timeout: float, now: float, what: str) -> list[Response]:
        """Ops that waited more than ``timeout`` seconds fail on the ranks that submitted them,
        naming the ranks that did not (``what``: how to wait longer)."""
        out = []
        for key, began in list(self.since.items()):
            if now - began > timeout:
                submitted = self.pending.pop(key)
                del self.since[key]
                self.warned.discard(key)
                request = next(iter(submitted.values()))
                missing = ", ".join(map(str, self._missing_of(key, submitted)))
                out.append(Response(request.kind, key[0], (request,), members=tuple(sorted(submitted)),
                                    error=f"{request.kind} {request.name!r}: rank(s) {missing} did not submit it "
                                          f"within {timeout:g} s; {what}"))
        return out

    def _missing_of(self, key: tuple[int, str], submitted: dict[int, Request]) -> list[int]:
        return [r for r in self.sets[key[0]] if r not in submitted and r not in self.joined]

    def close(self, reason: str) -> None:
        """The coordinator shuts down: every op not yet run, and every later one, fails with ``reason``."""
        self.closing = reason
        self.joined = []

    def leave(self, rank: int, reason: str) -> None:
        """A rank shut down: every op that still needs it fails, naming it."""
        self.gone[rank] = reason

    def ready(self) -> list[Response]:
        """Ops every rank of their set has submitted, checked, in one order, ready allreduces fused."""
        out: list[Response] = []
        for key in list(self.pending):
            response = self._response(key)
            if response is None:
                continue
            del self.pending[key]
            self.since.pop(key, None)
            self.warned.discard(key)
            if response.kind == ADD_PROCESS_SET and not response.error:
                response = self._add_set(response)
            elif response.kind == REMOVE_PROCESS_SET and not response.error:
                response = self._remove_set(response)
            out.append(response)
        if self.joined and len(self.joined) == self.world_size:
            last = self.joined[-1]
            self.joined = []
            out.append(Response(JOIN, 0, (Request("join", JOIN),), value=last,
                                members=tuple(range(self.world_size))))
        return fuse(out, self.fusion_threshold)

    def _response(self, key: tuple[int, str]) -> Response | None:
        set_id, name = key
        submitted = self.pending[key]
        members = self.sets[set_id]
        any_request = next(iter(submitted.values()))
        if self.closing:
            return Response(any_request.kind, set_id, (any_request,), members=tuple(sorted(submitted)),
                            error=f"{any_request.kind} {name!r}: {self.closing}")
        missing = [r for r in members if r not in submitted]
        gone = [r for r in missing if r in self.gone]
        if gone:
            return Response(any_request.kind, set_id, (any_request,), members=members,
                            error=f"{any_request.kind} {name!r}: rank {gone[0]} {self.gone[gone[0]]} "
                                  f"before submitting it")
        if self.joined and any_request.kind not in JOINABLE:
            # Fail at once, on the ranks that submitted it: a joined rank never will.
            return Response(any_request.kind, set_id, (any_request,), members=tuple(sorted(submitted)),
                            error=f"{any_request.kind} {name!r}: rank {self.joined[0]} has joined; only "
                                  f"allreduce and barrier run while ranks have joined")
        waiting = [r for r in missing if r not in self.joined]
        if waiting:
            return None
        error = check(submitted)
        first = submitted[min(submitted)]
        contributions = (tuple(submitted.get(r) for r in members),)
        return Response(first.kind, set_id, (first,), contributions, error=error, members=members)

    def _add_set(self, response: Response) -> Response:
        ranks = response.requests[0].ranks
        for set_id, members in self.sets.items():
            if members == ranks:
                return Response(ADD_PROCESS_SET, 0, response.requests, members=response.members,
                                error=f"add_process_set: a process set with ranks {list(ranks)} exists "
                                      f"already (id {set_id})")
        if self.free_ids:
            set_id = self.free_ids.pop(0)
        else:
            set_id = self.next_set_id
            self.next_set_id += 1
        self.sets[set_id] = ranks
        return Response(ADD_PROCESS_SET, 0, response.requests, members=response.members, value=set_id)

    def _remove_set(self, response: Response) -> Response:
        set_id = response.requests[0].root
        if set_id == 0 or set_id not in self.sets:
            return Response(REMOVE_PROCESS_SET, 0, response.requests, members=response.members,
                            error=f"remove_process_set: no process set with id {set_id} can be removed")
        if any(key[0] == set_id for key in self.pending):
            return Response(REMOVE_PROCESS_SET, 0, response.requests, members=response.members,
                            error=f"remove_process_set: process set {set_id} has ops in flight")
        del self.sets[set_id]
        self.free_ids.append(set_id)
        return Response(REMOVE_PROCESS_SET, 0, response.requests, members=response.members, value=set_id)


_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int8": 1, "uint8": 1, "int16": 2,
             "int32": 4, "int64": 8, "bool": 1}


def fuse(responses: list[Response], threshold: int = FUSION_THRESHOLD) -> list[Response]:
    """Merge neighbouring ready allreduces that can share one buffer (same set, dtypes, op, scales)."""
    out: list[Response] = []
    size = 0
    for response in responses:
        prev = out[-1] if out else None
        nbytes = sum(r.nbytes(_ITEMSIZE) for r in response.requests)
        if (prev is not None and response.kind == ALLREDUCE and prev.kind == ALLREDUCE and not response.error
                and not prev.error and prev.process_set == response.process_set
                and _fusable(prev.requests[0], response.requests[0]) and size + nbytes <= threshold
                and _joined(prev) == _joined(response)):
            out[-1] = Response(ALLREDUCE, prev.process_set, prev.requests + response.requests,
                               prev.contributions + response.contributions, members=prev.members)
            size += nbytes
        else:
            out.append(response)
            size = nbytes
    return out


def _fusable(a: Request, b: Request) -> bool:
    return (a.op, a.prescale, a.postscale, set(a.dtypes)) == (b.op, b.prescale, b.postscale, set(b.dtypes)) \
        and len(set(a.dtypes)) == 1


def _joined(response: Response) -> tuple[bool, ...]:
    return tuple(c is None for c in response.contributions[0]) if response.contributions else ()
