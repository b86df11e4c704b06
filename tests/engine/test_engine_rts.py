"""Replicated tensor sharding in one process: the balanced layout, the RTS collectives, sharded
variables and domains, training steps bitwise equal to the replicated ones, and memory."""

from __future__ import annotations

import gc
import math
import tracemalloc
import weakref

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from popdist_py.engine import CommGroup, ReplicaGrouping, Runtime, Shard, ShardArray, ShardLayout, ops
from tests.engine_helpers import valid_groupings


def wild(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return (rng.standard_normal(shape) * 10.0 ** rng.integers(-4, 5, shape)).astype(np.float32)


def reference_shards(flat: np.ndarray, k: int) -> list[np.ndarray]:
    """The layout restated: ceil(n/k) per shard, the last (k*s - n) shards end with one zero each."""
    n = flat.size
    s = -(-n // k)
    pads = k * s - n
    out, pos = [], 0
    for j in range(k):
        real = s - (1 if j >= k - pads else 0)
        out.append(np.concatenate([flat[pos : pos + real], np.zeros(s - real, flat.dtype)]))
        pos += real
    assert pos == n
    return out


# -- layout ------------------------------------------------------------------------------------------


@pytest.mark.one_executor  # no Runtime
def test_seed_example_30_elements_over_4() -> None:
    layout = ShardLayout(30, 4)
    assert (layout.shard_size, layout.padding, layout.full_shards) == (8, 2, 2)
    assert [layout.real(j) for j in range(4)] == [8, 8, 7, 7]
    shards = layout.split(np.arange(1, 31, dtype=np.float32))
    assert shards[0].tolist() == list(range(1, 9)) and shards[1].tolist() == list(range(9, 17))
    assert shards[2].tolist() == [*list(range(17, 24)), 0] and shards[3].tolist() == [*list(range(24, 31)), 0]
    assert layout.join(shards).tolist() == list(range(1, 31))


@pytest.mark.one_executor  # no Runtime
def test_layout_sizes_and_indices_are_checked() -> None:
    with pytest.raises(ValueError, match=r"^shard layout: n=-1 is invalid: it must be an integer >= 0$"):
        ShardLayout(-1, 2)
    with pytest.raises(ValueError, match=r"^shard layout: count=0 is invalid: it must be an integer >= 1$"):
        ShardLayout(3, 0)
    with pytest.raises(ValueError, match=r"^shard index=4 is outside the valid range \[0, 3\] for count=4$"):
        ShardLayout(30, 4).shard(np.zeros(30), 4)


@pytest.mark.one_executor  # no Runtime
@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 400), k=st.integers(1, 17))
def test_layout_is_balanced_and_round_trips(n: int, k: int) -> None:
    layout = ShardLayout(n, k)
    flat = np.arange(1, n + 1, dtype=np.int64)  # no zeros: padding is recognisable
    s = layout.shard_size
    assert s == math.ceil(n / k) and 0 <= layout.padding < k and k * s == n + layout.padding
    shards = layout.split(flat)
    assert shards.shape == (k, s)
    real = [int(np.count_nonzero(row)) for row in shards]
    assert sum(real) == n and max(real, default=0) - min(real, default=0) <= 1  # balanced
    assert real == sorted(real, reverse=True)  # the short shards are the last ones
    for j, row in enumerate(shards):
        assert not row[real[j]:].any()  # each shard's padding is at its end
        assert row.tolist() == layout.shard(flat, j).tolist()
        assert layout.bounds[j + 1] - layout.bounds[j] == layout.real(j) == real[j]
    for got, want in zip(shards, reference_shards(flat, k), strict=True):
        assert got.tolist() == want.tolist()
    assert layout.join(shards.reshape(-1)).tolist() == flat.tolist()


# -- collectives ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("R", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("shape", [(30,), (5, 2, 3), (1,), (7, 13), (9001,)])
def test_slice_then_gather_round_trips(R: int, shape: tuple[int, ...]) -> None:
    x = wild(np.random.default_rng(R), shape)
    with Runtime(replication=R) as rt:
        for rg in valid_groupings(R):
            layout = ShardLayout(x.size, rg.group_size)

            def step(ctx, rg=rg):  # type: ignore[no-untyped-def]
                s = ops.replica_sharded_slice(x, group=rg)
                assert isinstance(s, ShardArray) and s.meta is not None and s.meta.meta_shape == shape
                return s, ops.replicated_all_gather(s)  # the shard's own domain: no group needed

            shards, full = rt.run(step)
            for r in range(R):
                assert shards[r].tobytes() == layout.shard(x.reshape(-1), rg.index_in_group(r)).tobytes()
                assert full[r].shape == shape and full[r].tobytes() == x.tobytes()


@pytest.mark.determinism
@pytest.mark.parametrize("R", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("n", [1, 7, 30, 9001])  # 9001 float32: past the eager size, uneven
@pytest.mark.parametrize("op", ["add", "mean", "max", "mul"])
def test_rts_reduce_scatter_is_bitwise_the_slice_of_the_all_reduce(R: int, n: int, op: str) -> None:
    x = wild(np.random.default_rng(n + R), (R, n))
    with Runtime(replication=R) as rt:
        for rg in valid_groupings(R):
            def step(ctx, xi, rg=rg):  # type: ignore[no-untyped-def]
                rs = ops.replicated_reduce_scatter(xi, op=op, group=rg,
                                                   configure_output_for_replicated_tensor_sharding=True)
                ref = ops.replica_sharded_slice(ops.replicated_all_reduce(xi, op=op, group=rg), group=rg)
                return rs, ref, ops.replicated_all_gather(rs), ops.replicated_all_reduce(xi, op=op, group=rg)

            rs, ref, gathered, allreduce = rt.run(step, x)
            assert rs.shape == (R, -(-n // rg.group_size))
            assert rs.tobytes() == ref.tobytes()
            assert gathered.tobytes() == allreduce.tobytes()


def test_rts_reduce_scatter_keeps_the_input_shape_for_the_gather() -> None:
    x = np.arange(4 * 30, dtype=np.float32).reshape(4, 5, 2, 3)
    with Runtime(replication=4) as rt:
        got = rt.run(lambda ctx, xi: ops.replicated_all_gather(ops.replicated_reduce_scatter(
            xi, configure_output_for_replicated_tensor_sharding=True)), x)
    assert got.shape == (4, 5, 2, 3) and np.array_equal(got[1], x.sum(0))


def test_plain_reduce_scatter_keeps_its_contiguous_layout() -> None:
    x = np.arange(30, dtype=np.float32)
    with Runtime(replication=4) as rt:
        got = rt.run(lambda ctx: ops.replicated_reduce_scatter(x))
    assert got.reshape(-1)[:30].tolist() == (4 * x).tolist() and got[3, 6:].tolist() == [0, 0]


def test_plain_arrays_still_gather_by_concatenation() -> None:
    with Runtime(replication=4) as rt:
        got = rt.run(lambda ctx: ops.replicated_all_gather(np.full(3, ctx.replica_index)))
        assert got[0].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
        # a shard that lost its meta (reshaped) is an ordinary array again
        got = rt.run(lambda ctx: ops.replicated_all_gather(
            ops.replica_sharded_slice(np.arange(8.0)).reshape(1, 2)))
        assert got.shape == (4, 4, 2)


# -- sharded variables -----------------------------------------------------------------------------


def test_sharded_variable_stores_balanced_shards() -> None:
    data = np.arange(1, 31, dtype=np.float32).reshape(5, 2, 3)
    with Runtime(replication=4) as rt:
        full, shard = rt.replica_sharded_variable(data, name="w")
        assert isinstance(shard, Shard) and shard.variable is full and full.shard is shard
        assert (full.shape, full.shape_on_replica, shard.shape, shard.meta_shape) == ((5, 2, 3), (8,), (8,), (5, 2, 3))
        raw = rt.get_replica_data(full)
        assert raw.tolist() == [list(range(1, 9)), list(range(9, 17)), [*list(range(17, 24)), 0],
                                [*list(range(24, 31)), 0]]
        assert rt.get_replica_data(shard).tobytes() == raw.tobytes()
        got = rt.get_tensor_data(full)
        assert got.shape == (5, 2, 3) and got.dtype == np.float32 and np.array_equal(got, data)
        # a Shard handle stands for its variable (typed Variable only)
        assert np.array_equal(rt.get_tensor_data(shard), data)  # type: ignore[arg-type]
        rt.write_variable_data(full, data * 2)
        assert np.array_equal(rt.get_tensor_data(full), data * 2)
        assert rt.variables["w"] is full


def test_shards_inside_a_step() -> None:
    data = np.arange(30, dtype=np.float32)
    with Runtime(replication=4) as rt:
        full, shard = rt.replica_sharded_variable(data)

        def step(ctx):  # type: ignore[no-untyped-def]
            s = ctx[shard]
            assert isinstance(s, ShardArray) and s.flags.writeable and s.shape == (8,)
            before = ops.replicated_all_gather(shard)  # the handle itself
            ctx[shard] -= np.float32(1)  # read/write in place
            ctx[full] = ctx[full] * np.float32(2)  # the variable works as the handle
            after = ops.replicated_all_gather(ctx[shard])
            return before, after

        before, after = rt.run(step)
        assert np.array_equal(before[3], data) and np.array_equal(after[0], (data - 1) * 2)
        assert np.array_equal(rt.get_tensor_data(full), (data - 1) * 2)
        # the padding is ordinary storage (elementwise ops apply to it: (0 - 1) * 2); downloads drop it
        assert rt.get_replica_data(full)[3, -1] == -2
        with pytest.raises(ValueError, match=r"shape \(30,\) but the shard shape is \(8,\)"):
            rt.run(lambda ctx: ctx.__setitem__(shard, data))  # writes are checked


@pytest.mark.parametrize("stride, group_size, shard_over", [
    (1, 4, None), (1, 4, 2), (1, 4, 1), (1, 2, None), (2, 2, None), (1, 8, 4), (2, 4, 2), (4, 2, 2),
])
def test_domains_follow_popxl(stride: int, group_size: int, shard_over: int | None) -> None:
    R = 8
    with Runtime(replication=R) as rt:
        rg = rt.replica_grouping(stride, group_size)
        host = np.arange(rg.num_groups * 10, dtype=np.float32).reshape(rg.num_groups, 10) + 1
        data = host if rg.num_groups > 1 else host[0]
        full, shard = rt.replica_sharded_variable(data, replica_grouping=rg, shard_over=shard_over)
        k = shard_over or group_size
        assert shard.domain == ReplicaGrouping.create(R, stride if k > 1 else 1, k)
        layout = ShardLayout(10, k)
        raw = rt.get_replica_data(full)
        for r in range(R):
            member = rg.index_in_group(r)
            # the value repeats every shard_over members; member m holds shard m % shard_over
            assert raw[r].tolist() == layout.shard(host[rg.group_of(r)], member % k).tolist()
        assert np.array_equal(rt.get_tensor_data(full), data)
        gathered = rt.run(lambda ctx: ops.replicated_all_gather(shard))
        for r in range(R):
            assert gathered[r].tolist() == host[rg.group_of(r)].tolist()


def test_consecutive_domain_of_the_local_replicas() -> None:
    with Runtime(replication=4) as rt:
        full, shard = rt.replica_sharded_variable(np.arange(6.0), shard_over=CommGroup.consecutive(2))
        assert shard.domain == ReplicaGrouping.create(4, 1, 2)
        assert rt.get_replica_data(full).tolist() == [[0, 1, 2], [3, 4, 5], [0, 1, 2], [3, 4, 5]]
        assert rt.run(lambda ctx: ops.replicated_all_gather(shard))[3].tolist() == list(range(6))


def test_bad_sharding_requests_are_named() -> None:
    with Runtime(replication=4) as rt:
        with pytest.raises(ValueError, match=r"shard_over=3 must divide the replica group size 4.*\[1, 2, 4\]"):
            rt.replica_sharded_variable(np.zeros(6), shard_over=3)
        with pytest.raises(ValueError, match="does not split the variable's groups"):
            rt.replica_sharded_variable(np.zeros(6), shard_over=CommGroup.orthogonal(2))
        with pytest.raises(TypeError, match="shard_over must be"):
            rt.replica_sharded_variable(np.zeros(6), shard_over="all")  # type: ignore[arg-type]
        for bad in (0, -2):
            with pytest.raises(ValueError, match=rf"shard_over={bad} is invalid: it must be an integer >= 1"):
                rt.replica_sharded_variable(np.zeros(6), shard_over=bad)
        with pytest.raises(ValueError, match=r"needs a leading axis of 2"):
            rt.replica_sharded_variable(np.zeros(6), replica_grouping=rt.replica_grouping(group_size=2))
        _full, shard = rt.replica_sharded_variable(np.zeros(6), name="s")
        with pytest.raises(ValueError, match="'s' already exists"):
            rt.replica_sharded_variable(np.zeros(6), name="s")
        with pytest.raises(ValueError, match="not the sharding domain"):
            rt.run(lambda ctx: ops.replicated_all_gather(shard, group=CommGroup.consecutive(2)))
        with pytest.raises(ValueError, match="axis=1"):
            rt.run(lambda ctx: ops.replicated_all_gather(ctx[shard], axis=1))
        plain = rt.variable(np.zeros(3))
        with pytest.raises(ValueError, match="not replica-sharded"):
            rt.run(lambda ctx: ops.replicated_all_gather(plain))
        with pytest.raises(ValueError, match="not replica-sharded"):
            plain.shard  # noqa: B018


# -- training: RTS is the sharded form of the replicated update, bitwise ------------------------------


def sgd_momentum(rt: Runtime, rts: bool, steps: int = 4, shape: tuple[int, ...] = (37, 29)) -> np.ndarray:
    """``w -= lr * m; m = beta * m + mean(g)``, replicated, or with w and m sharded (ZeRO-style)."""
    R, L, off = rt.replication_factor, rt.instance_replication_factor, rt.replica_index_offset
    rng = np.random.default_rng(7)
    w0 = wild(rng, shape)
    lr, beta = np.float32(0.05), np.float32(0.9)
    if rts:
        w, ws = rt.replica_sharded_variable(w0, name="w")
        m, ms = rt.replica_sharded_variable(np.zeros(shape, np.float32), name="m")
    else:
        w = rt.variable(w0, name="w")
        m = rt.variable(np.zeros(shape, np.float32), name="m")

    def step(ctx, x):  # type: ignore[no-untyped-def]
        full = ops.replicated_all_gather(ws) if rts else ctx[w]
        g = np.tanh(full * x)  # a per-replica "gradient" that depends on the full weight
        if rts:
            ctx[ms] = beta * ctx[ms] + ops.replicated_reduce_scatter(
                g, op="mean", configure_output_for_replicated_tensor_sharding=True)
            ctx[ws] -= lr * ctx[ms]
        else:
            ctx[m] = beta * ctx[m] + ops.replicated_all_reduce(g, op="mean")
            ctx[w] = ctx[w] - lr * ctx[m]

    for s in range(steps):
        x = wild(np.random.default_rng([s, 1]), (R, *shape))
        rt.run(step, x[off : off + L])
    return np.concatenate([rt.get_tensor_data(w).reshape(-1), rt.get_tensor_data(m).reshape(-1)])


@pytest.mark.determinism
@pytest.mark.parametrize("R", [2, 3, 4, 7])
def test_rts_training_is_bitwise_the_replicated_training(R: int) -> None:
    with Runtime(replication=R) as rt:
        ref = sgd_momentum(rt, rts=False)
    with Runtime(replication=R) as rt:
        got = sgd_momentum(rt, rts=True)
    assert got.tobytes() == ref.tobytes()
    assert np.isfinite(got).all() and np.abs(got).max() > 0


def test_rts_training_with_a_large_tensor() -> None:
    with Runtime(replication=4) as rt:
        ref = sgd_momentum(rt, rts=False, steps=2, shape=(101, 203))  # bulk collectives
    with Runtime(replication=4) as rt:
        assert sgd_momentum(rt, rts=True, steps=2, shape=(101, 203)).tobytes() == ref.tobytes()


# -- memory ------------------------------------------------------------------------------------------


def test_host_data_is_not_retained() -> None:
    with Runtime(replication=4) as rt:
        data = np.ones((64, 64), np.float32)
        ref = weakref.ref(data)
        _full, _shard = rt.replica_sharded_variable(data)
        del data
        gc.collect()
        assert ref() is None
        assert rt.state_nbytes() == {"memory": 4 * 1024 * 4, "file": 0}


def state_bytes(rts: bool, L: int = 4, n: int = 1 << 20) -> tuple[int, int]:
    """(bytes traced by creating weight + momentum + one step, state_nbytes) at L replicas."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        with Runtime(replication=L) as rt:
            w0 = np.ones(n, np.float32)
            if rts:
                w, ws = rt.replica_sharded_variable(w0)
                m, ms = rt.replica_sharded_variable(np.zeros(n, np.float32))
            else:
                w = rt.variable(w0)
                m = rt.variable(np.zeros(n, np.float32))
            del w0

            def step(ctx):  # type: ignore[no-untyped-def]
                if rts:
                    ctx[ms] += np.float32(1)
                    ctx[ws] -= ctx[ms]
                else:
                    ctx[m] = ctx[m] + np.float32(1)
                    ctx[w] = ctx[w] - ctx[m]

            rt.run(step)
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - base
            return held, rt.state_nbytes()["memory"]
    finally:
        tracemalloc.stop()


def test_rts_state_is_at_most_a_third_of_the_replicated_state_at_L4() -> None:
    rep_traced, rep_state = state_bytes(rts=False)
    rts_traced, rts_state = state_bytes(rts=True)
    assert rep_state == 2 * 4 * 4 * (1 << 20)  # 4 replicas x (w + m) x 4 MiB
    assert rts_state == 2 * 4 * (1 << 20)  # each replica a quarter of each
    assert rts_state <= 0.3 * rep_state
    # what the process really holds after the step (every allocation numpy made), not just our count
    assert rts_traced <= 0.3 * rep_traced, (rts_traced, rep_traced)
    assert rep_traced >= rep_state
