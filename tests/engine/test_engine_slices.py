"""A large collective's local work in slices on several threads: how it is cut, that it runs on
several threads, and that no result's bits depend on how many."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest

from popcontract.environment import ENGINE_SLICE_BYTES, ENGINE_THREADS
from popcontract.settings import PopdistEnvError
from popdist_py.engine import ReplicaGrouping, Runtime, ops
from popdist_py.engine._collectives.segments import Segments
from popdist_py.engine._execution.executor import cores_per_instance
from popdist_py.engine._execution.slices import ALIGN, MIN_SLICE_BYTES, Slicer

MiB = 1 << 20
#: The least bytes of a slice in these tests: a few MiB of data then runs in several slices.
SMALL = 1 << 20


def small_slices(rt: Runtime) -> Slicer:
    """``rt``'s slicer, cutting work into slices from :data:`SMALL` bytes (not MIN_SLICE_BYTES)."""
    slicer = rt.dispatcher.slicer
    assert slicer is not None
    slicer.min_bytes = SMALL
    return slicer


@pytest.mark.one_executor  # no Runtime
@pytest.mark.parametrize("threads", [1, 2, 3, 4, 16])
@pytest.mark.parametrize("n", [1, ALIGN - 1, 3 * ALIGN + 5, 1 << 20, (1 << 22) + 37])
@pytest.mark.parametrize("nbytes", [0, MIN_SLICE_BYTES, 5 * MIN_SLICE_BYTES - 1, 64 * MiB])
def test_cuts_cover_the_elements_in_aligned_slices(threads: int, n: int, nbytes: int) -> None:
    cuts = Slicer(threads).cuts(n, nbytes)
    assert cuts[0][0] == 0 and cuts[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(cuts))  # contiguous
    assert all(hi > lo for lo, hi in cuts)
    assert len(cuts) <= max(1, min(threads, nbytes // MIN_SLICE_BYTES))
    assert all(hi % ALIGN == 0 for _, hi in cuts[:-1])
    assert Slicer(threads).splits(nbytes) == (threads > 1 and nbytes >= 2 * MIN_SLICE_BYTES)
    if threads > 1 and nbytes >= 2 * MIN_SLICE_BYTES and n >= 2 * ALIGN:
        assert len(cuts) == min(threads, nbytes // MIN_SLICE_BYTES, n // ALIGN)
        sizes = [hi - lo for lo, hi in cuts]
        assert max(sizes) - min(sizes) <= 2 * ALIGN  # even shares


@pytest.mark.one_executor  # no Runtime
def test_slices_run_at_once_on_their_own_threads_the_first_on_the_caller() -> None:
    slicer = Slicer(3, name="test-slice")
    seen: list[tuple[int, int, int]] = []
    lock = threading.Lock()
    # broken unless the three slices run at the same time
    together: threading.Barrier | None = threading.Barrier(3, timeout=30)

    def record(lo: int, hi: int) -> None:
        if together is not None:
            together.wait()
        with lock:
            seen.append((lo, hi, threading.get_ident()))

    try:
        n = 3 * ALIGN * 100
        assert slicer.run(record, n, 3 * MIN_SLICE_BYTES) == 3 and slicer.split_runs == 1
        assert sorted((lo, hi) for lo, hi, _ in seen) == slicer.cuts(n, 3 * MIN_SLICE_BYTES)
        owner = {lo: ident for lo, _, ident in seen}
        assert owner[0] == threading.get_ident()
        assert len(set(owner.values())) == 3
        seen.clear()
        together = None
        assert slicer.run(record, n, MIN_SLICE_BYTES) == 1  # small: whole, on the caller
        assert seen == [(0, n, threading.get_ident())] and slicer.split_runs == 1
        assert slicer.run(lambda lo, hi: None, n, 3 * MIN_SLICE_BYTES) == 3 and slicer.split_runs == 2
        # the same two threads ran both splits: the pool is kept between runs
        assert len([t for t in threading.enumerate() if t.name.startswith("test-slice")]) == 2
    finally:
        slicer.shutdown()
    assert not [t for t in threading.enumerate() if t.name.startswith("test-slice")]


@pytest.mark.one_executor  # no Runtime
def test_a_slicer_needs_a_thread_and_names_its_threads() -> None:
    with pytest.raises(ValueError, match="threads=0 must be >= 1"):
        Slicer(0)
    slicer = Slicer(2)
    try:
        slicer.run(lambda lo, hi: None, 2 * ALIGN, 2 * MIN_SLICE_BYTES)
        assert [t.name for t in threading.enumerate() if t.name.startswith("slice_")] == ["slice_0"]
    finally:
        slicer.shutdown()


@pytest.mark.one_executor  # no Runtime
def test_a_failing_slice_is_raised_once_every_slice_has_finished() -> None:
    slicer = Slicer(2)
    started, go, raising = threading.Event(), threading.Event(), threading.Event()
    finished: list[int] = []
    outcome: list[BaseException] = []

    def work(lo: int, hi: int) -> None:
        if lo == 0:  # the caller's slice fails while the other is still running
            started.wait(30)
            raising.set()
            raise ValueError("slice 0 failed")
        started.set()
        go.wait(30)
        finished.append(lo)

    def call() -> None:
        try:
            slicer.run(work, 4 * ALIGN, 4 * MIN_SLICE_BYTES)
        except ValueError as exc:
            outcome.append(exc)

    runner = threading.Thread(target=call)
    runner.start()
    try:
        assert raising.wait(30)
        runner.join(0.2)
        assert runner.is_alive(), "run returned while a slice was still writing"
    finally:
        go.set()
        runner.join(30)
        slicer.shutdown()
    assert [str(e) for e in outcome] == ["slice 0 failed"] and finished == [2 * ALIGN]


@pytest.mark.slow  # forks
def test_a_forked_child_starts_its_own_threads() -> None:
    import os

    slicer = Slicer(2)
    hits: list[int] = []
    slicer.run(lambda lo, hi: hits.append(lo), 4 * ALIGN, 4 * MIN_SLICE_BYTES)
    pid = os.fork()
    if pid == 0:  # the child: the parent's pool threads do not exist here
        try:
            slicer.run(lambda lo, hi: hits.append(lo), 4 * ALIGN, 4 * MIN_SLICE_BYTES)
            os._exit(0 if sorted(hits[2:]) == [0, 2 * ALIGN] else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    slicer.shutdown()
    assert os.waitstatus_to_exitcode(status) == 0


def test_runtime_threads_come_from_the_argument_the_environment_or_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENGINE_THREADS, raising=False)
    with Runtime(2) as rt:
        assert rt.threads == max(1, cores_per_instance())
    monkeypatch.setenv(ENGINE_THREADS, "3")
    with Runtime(2) as rt:
        assert rt.threads == 3
    with Runtime(2, threads=1) as rt:
        assert rt.threads == 1
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(ENGINE_THREADS, bad)
        with pytest.raises(PopdistEnvError, match=f"{ENGINE_THREADS}='{bad}'"):
            Runtime(2)
    monkeypatch.delenv(ENGINE_THREADS)
    with pytest.raises(ValueError, match="threads=0 is invalid"):
        Runtime(2, threads=0)
    with pytest.raises(TypeError, match="threads must be an integer"):
        Runtime(2, threads=True)


def test_the_slice_size_comes_from_the_environment_and_moves_where_work_is_cut(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """POPDIST_ENGINE_SLICE_BYTES: 1 MiB cuts a 2 x 1 MiB all-reduce (3 MiB streamed) that the
    default leaves whole; a bad value is one line naming the variable."""
    x = np.arange(2 * MiB // 4 * 2, dtype=np.float32).reshape(2, -1)
    monkeypatch.delenv(ENGINE_SLICE_BYTES, raising=False)
    for setting, cut in ((None, 0), (str(MiB), 1)):
        if setting is not None:
            monkeypatch.setenv(ENGINE_SLICE_BYTES, setting)
        with Runtime(2, threads=2) as rt:
            slicer = rt.dispatcher.slicer
            assert slicer is not None and slicer.min_bytes == (MIN_SLICE_BYTES if setting is None else MiB)
            got = rt.run(lambda ctx, xi: ops.replicated_all_reduce(xi, op="add"), x[:, : MiB // 4])
            assert slicer.split_runs == cut
        np.testing.assert_array_equal(got[0], x[0, : MiB // 4] + x[1, : MiB // 4])
    for bad in ("0", "16MiB", "-1"):
        monkeypatch.setenv(ENGINE_SLICE_BYTES, bad)
        with pytest.raises(PopdistEnvError, match=f"^{ENGINE_SLICE_BYTES}='{bad}'"):
            Runtime(2)


def test_a_large_collective_runs_on_the_slice_threads_and_close_stops_them() -> None:
    def slice_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("slice@")]

    before = slice_threads()
    x = np.ones((2, 2 * MiB), np.float32)
    rt = Runtime(2, threads=2)
    assert rt.dispatcher.slicer is not None and rt.dispatcher.slicer.min_bytes == MIN_SLICE_BYTES
    small_slices(rt)
    rt.run(lambda ctx, xi: ops.replicated_all_reduce(xi, op="add"), x[:, :ALIGN])  # small: no threads
    assert slice_threads() == before
    got: list[np.ndarray] = []
    rt.run(lambda ctx, xi: got.append(ops.replicated_all_reduce(xi, op="add")), x)
    assert len(slice_threads()) == len(before) + 1
    assert np.all(got[0] == 2) and got[0] is got[1]  # one result, shared
    rt.close()
    assert slice_threads() == before


def _wild(rng: np.random.Generator, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    if np.dtype(dtype).kind == "i":
        return rng.integers(-1000, 1000, shape).astype(dtype)
    return (rng.standard_normal(shape) * 10.0 ** rng.integers(-4, 5, shape)).astype(dtype)


#: (kind, op, dtype): float additions run in the compiled kernel, the others in numpy
CASES = [("all_reduce", "add", np.float32), ("all_reduce", "mean", np.float64), ("all_reduce", "max", np.float32),
         ("all_reduce", "add", np.int32), ("reduce_scatter", "add", np.float32),
         ("reduce_scatter", "mean", np.float32), ("rts_reduce_scatter", "add", np.float32),
         ("all_gather", "", np.float32), ("rts_all_gather", "", np.float32),
         ("all_reduce_pieces", "mean", np.float32), ("rts_reduce_scatter_pieces", "add", np.float64)]


@pytest.mark.determinism
@pytest.mark.parametrize("L", [2, 3, 4])
@pytest.mark.parametrize(("kind", "op", "dtype"), CASES)
def test_bits_do_not_depend_on_the_threads(L: int, kind: str, op: str, dtype: type) -> None:
    n = (1 << 20) + 37 if dtype is not np.float64 else (1 << 19) + 37  # several slices, a ragged end
    x = _wild(np.random.default_rng(L), (L, n), dtype)
    groupings = [ReplicaGrouping.create(L)] + ([ReplicaGrouping.create(L, 1, 2)] if L == 4 else [])

    def step(ctx: object, xi: np.ndarray, rg: ReplicaGrouping) -> np.ndarray:
        if kind.endswith("_pieces"):  # a fused bucket: the input in pieces of many sizes, read in place
            pieces = Segments(np.split(xi, [1, 5000, 5001, 300_000, 300_100, n - 2048]), xi.dtype)
            if kind == "all_reduce_pieces":
                return ops.replicated_all_reduce(pieces, op=op, group=rg)
            return ops.replicated_reduce_scatter(pieces, op=op, group=rg,
                                                 configure_output_for_replicated_tensor_sharding=True)
        if kind == "all_reduce":
            return ops.replicated_all_reduce(xi, op=op, group=rg)
        if kind == "reduce_scatter":
            return ops.replicated_reduce_scatter(xi, op=op, group=rg)
        if kind == "rts_reduce_scatter":
            return ops.replicated_reduce_scatter(xi, op=op, group=rg,
                                                 configure_output_for_replicated_tensor_sharding=True)
        if kind == "rts_all_gather":  # the shards of a tensor whose size the group does not divide
            shard = ops.replicated_reduce_scatter(xi[:-3], op="add", group=rg,
                                                  configure_output_for_replicated_tensor_sharding=True)
            return ops.replicated_all_gather(shard)
        return ops.replicated_all_gather(xi[: n // rg.group_size], group=rg)

    results = {}
    for threads in (1, 2, 3):
        with Runtime(L, threads=threads) as rt:
            slicer = small_slices(rt)
            results[threads] = [rt.run(lambda ctx, xi, rg=rg: step(ctx, xi, rg), x) for rg in groupings]
            assert (slicer.split_runs > 0) == (threads > 1)
    for threads in (2, 3):
        for got, expect in zip(results[threads], results[1], strict=True):
            for g, e in zip(got, expect, strict=True):
                assert g.dtype == e.dtype and g.shape == e.shape
                assert g.tobytes() == e.tobytes()
