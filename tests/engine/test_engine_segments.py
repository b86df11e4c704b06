"""Collectives on inputs in pieces (Segments) and the fused gradient reduction that uses them:
bitwise the results of the packed array and of one collective per tensor, for every layout of
pieces (small ones packed in runs, large ones read in place, pieces longer than a block, pieces
cut differently on different replicas), op, grouping and sharding domain."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from popdist_py.engine import CommGroup, ReplicaGrouping, Runtime, fused, ops
from popdist_py.engine._collectives.reduce import BLOCK, Program
from popdist_py.engine._collectives.segments import DIRECT, Segments, dense
from popdist_py.engine._placement.sharding import ShardLayout
from tests.engine.segments_data import MIXED, gradients, pieces
from tests.engine_helpers import valid_groupings


# ------------------------------------------------------------------------------------ the sequence
@pytest.mark.one_executor  # no Runtime
def test_segments_read_as_their_concatenation() -> None:
    rng = np.random.default_rng(0)
    ps = pieces(rng, MIXED)
    s = Segments(ps, np.float32)
    packed = np.concatenate([p.reshape(-1) for p in ps])
    assert s.shape == packed.shape and s.size == len(s) == packed.size
    assert np.asarray(s).tobytes() == packed.tobytes()
    scratch = np.empty(packed.size, np.float32)
    for lo, hi in [(0, 0), (0, 1), (3, 9), (5, DIRECT + 50), (100, packed.size), (packed.size, packed.size)]:
        assert s.block(lo, hi, scratch).tobytes() == packed[lo:hi].tobytes()
        assert dense(s[lo:hi]).tobytes() == packed[lo:hi].tobytes()
    inside = s[10:20]  # inside the piece of DIRECT - 1 elements: a view, no copy
    assert isinstance(inside, np.ndarray) and np.shares_memory(inside, ps[2])
    assert s.reshape(-1) is s and s.reshape(packed.size) is s


@pytest.mark.one_executor  # no Runtime
def test_cuts_cover_the_range_and_keep_large_pieces_whole() -> None:
    rng = np.random.default_rng(1)
    for block in (64, 1000, DIRECT, BLOCK):
        sizes = [int(n) for n in rng.choice([0, 1, 3, 100, DIRECT, DIRECT + 9, 5 * DIRECT], 60)]
        s = Segments(pieces(rng, sizes), np.float32)
        cuts = s.cuts(block)
        assert [lo for lo, _, _ in cuts] == [0, *(hi for _, hi, _ in cuts[:-1])] and cuts[-1][1] == s.size
        assert all(0 < hi - lo <= block for lo, hi, _ in cuts)
        starts = np.cumsum([0, *sizes])
        for lo, hi, k in cuts:
            if k >= 0:  # a whole piece, large enough to be read in place
                assert (starts[k], starts[k + 1]) == (lo, hi) and hi - lo >= DIRECT
        whole = {k for _, _, k in cuts if k >= 0}
        assert whole == {k for k, n in enumerate(sizes) if DIRECT <= n <= block}


@pytest.mark.one_executor  # no Runtime
def test_bad_uses_are_refused() -> None:
    s = Segments([np.zeros(3, np.float32), np.zeros(4, np.float32)], np.float32)
    with pytest.raises(TypeError, match="contiguous slices"):
        s[::2]
    with pytest.raises(ValueError, match="cannot reshape to"):
        s.reshape(7, 1)
    with pytest.raises(TypeError, match="dtype float32; got float64"):
        Segments([np.zeros(3, np.float32), np.zeros(3)], np.float32)
    with pytest.raises(ValueError, match="2 pieces but 1 sizes"):
        Segments([np.zeros(3, np.float32)] * 2, np.float32, [3])


@pytest.mark.one_executor  # no Runtime
@pytest.mark.parametrize("members", [1, 2, 3, 4, 5])
def test_program_on_pieces_equals_program_on_arrays(members: int) -> None:
    rng = np.random.default_rng(members)
    prog = Program((0, members), [(k, k + 1) for k in range(members)])
    inputs = [pieces(rng, MIXED) for _ in range(members)]
    packed = [np.concatenate([p.reshape(-1) for p in ps]) for ps in inputs]
    expect = prog.run_blocked(packed, np.add, np.empty_like(packed[0]), divide_by=members)
    got = prog.run_blocked([Segments(ps, np.float32) for ps in inputs], np.add, np.empty_like(packed[0]),
                           divide_by=members)
    assert got.tobytes() == expect.tobytes()
    # pieces cut differently on each input (and a plain array among them): blocks, packed where needed
    odd = [Segments(np.array_split(p, 3 + m), np.float32) for m, p in enumerate(packed)]
    mixed: list[Any] = [packed[0], *odd[1:]]
    got = prog.run_blocked(mixed, np.add, np.empty_like(packed[0]), divide_by=members)
    assert got.tobytes() == expect.tobytes()


# ------------------------------------------------------------------------------------ collectives
@pytest.mark.parametrize("op", ["add", "mean", "max", "square_add"])
def test_collectives_on_pieces_equal_the_packed_array(op: str) -> None:
    R = 4
    rng = np.random.default_rng(7)
    # every replica cuts its input the same way, except replica 3, which cuts it its own way
    data = [pieces(rng, MIXED) for _ in range(R)]
    packed = [np.concatenate([p.reshape(-1) for p in ps]) for ps in data]
    odd = np.array_split(packed[3], 5)

    def step(ctx: Any) -> tuple[np.ndarray, ...]:
        r = ctx.replica_index
        mine = Segments(odd if r == 3 else data[r], np.float32)
        out = []
        for rg in valid_groupings(R):
            out.append(ops.replicated_all_reduce(mine, op=op, group=rg))
            out.append(ops.replicated_all_reduce(packed[r], op=op, group=rg))
            out.append(ops.replicated_reduce_scatter(mine, op=op, group=rg))
            out.append(ops.replicated_reduce_scatter(packed[r], op=op, group=rg))
        return tuple(out)

    with Runtime(replication=R) as rt:
        results = rt.run(step)
    for got, expect in zip(results[0::2], results[1::2], strict=True):
        assert got.tobytes() == expect.tobytes()


@pytest.mark.parametrize("op", ["add", "mean"])
def test_fused_reduction_equals_one_collective_per_tensor(op: str) -> None:
    R = 4
    rng = np.random.default_rng(3)
    shapes, grads = gradients(rng, R)
    with Runtime(replication=R) as rt:
        everyone = rt.replica_grouping()
        # whole; scattered over all replicas, over consecutive pairs (two levels), over a strided pair
        domains = [None, everyone, CommGroup.consecutive(2).to_replica_grouping(R), ReplicaGrouping.create(R, 2, 2)]
        for limit in (1, 4096, 1 << 20, 1 << 30):
            for domain in domains:
                fusion = fused.plan_buckets(
                    {n: (int(np.prod(s)), np.dtype(np.float32), domain) for n, s in shapes.items()}, limit)
                if limit == 1 << 30:
                    assert len(fusion.buckets) == 1

                def step(ctx: Any, fusion: Any = fusion, domain: Any = domain) -> tuple[np.ndarray, ...]:
                    g = grads[ctx.local_index]
                    got = fused.reduce(fusion, g, op, ctx.replica_index, everyone)
                    assert list(got) == list(shapes) and len(got) == len(shapes)
                    out = []
                    for n in shapes:
                        whole = ops.replicated_all_reduce(g[n], op=op).reshape(-1)
                        if domain is not None:  # this replica's shard of the whole, padded
                            lay = ShardLayout(whole.size, domain.group_size)
                            whole = lay.shard(whole, domain.index_in_group(ctx.replica_index))
                        out.append(np.stack([np.asarray(got[n]), whole]))
                    return tuple(out)

                for result in rt.run(step):
                    for pair in result:
                        assert pair[0].tobytes() == pair[1].tobytes(), (limit, domain)
