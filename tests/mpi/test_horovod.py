"""popdist_py.horovod.torch on real MPI ranks: Horovod's semantics in the project's own words.

Run with ``mpiexec -n 2``, ``-n 3`` and ``-n 4`` (the mpi part):
``timeout 300 .venv/bin/mpiexec -n 3 .venv/bin/python -m pytest -q --with-mpi tests/mpi/test_horovod.py``
Every rank runs the same tests in the same order; ``hvd.init()`` is once for the whole module.
"""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import time
import warnings
from collections.abc import Iterator

import pytest
import torch

import popdist_py.horovod.torch as hvd
from popcontract.environment import COLLECTIVE_TIMEOUT, HOROVOD_DYNAMIC_PROCESS_SETS, HOROVOD_TIMELINE, PMI_SIZE

pytestmark = [pytest.mark.mpi(min_size=2),
              pytest.mark.skipif(int(os.environ.get(PMI_SIZE, "2")) > 3,
                                 reason="Horovod's API is checked at 2 and 3 ranks (4 on 2 cores only adds time)")]


@pytest.fixture(scope="module", autouse=True)
def _horovod() -> Iterator[None]:
    hvd.init()
    yield


def same_bytes_everywhere(t: torch.Tensor) -> bool:
    """Whether ``t`` holds the same bits on every rank (compared as bytes, so -0.0 and NaN count)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    gathered = hvd.allgather(raw.reshape(1, -1))
    return bool((gathered == gathered[0]).all())


def test_where_this_rank_stands() -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    assert (hvd.rank(), hvd.size()) == (world.Get_rank(), world.Get_size())
    assert hvd.local_size() == hvd.size() and hvd.local_rank() == hvd.rank()  # one host
    assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)
    assert hvd.is_initialized() and hvd.is_homogeneous() and hvd.mpi_enabled() and not hvd.gloo_enabled()
    hvd.init()  # again: nothing changes
    assert hvd.size() == world.Get_size()


def test_ops_submitted_in_different_orders_meet_by_name() -> None:
    names = [f"grad.{i}" for i in range(8)]
    order = names if hvd.rank() % 2 == 0 else list(reversed(names))
    handles = {name: hvd.allreduce_async(torch.full((3, int(name[-1]) + 1), float(hvd.rank())), name=name,
                                         op=hvd.Sum) for name in order}
    total = sum(range(hvd.size()))
    for name in names:
        out = hvd.synchronize(handles[name])
        assert torch.equal(out, torch.full((3, int(name[-1]) + 1), float(total)))


def test_a_broadcast_and_an_allgather_in_opposite_orders_do_not_deadlock() -> None:
    if hvd.rank() == 0:
        b = hvd.broadcast_async(torch.arange(4.0), root_rank=0, name="b")
        g = hvd.allgather_async(torch.ones(1, 2) * hvd.rank(), name="g")
    else:
        g = hvd.allgather_async(torch.ones(1, 2) * hvd.rank(), name="g")
        b = hvd.broadcast_async(torch.zeros(4), root_rank=0, name="b")
    assert torch.equal(hvd.synchronize(b), torch.arange(4.0))
    assert hvd.synchronize(g)[:, 0].tolist() == [float(r) for r in range(hvd.size())]


@pytest.mark.parametrize("what, make", [
    ("shapes", lambda r: torch.ones(2 + r)),
    ("dtypes", lambda r: torch.ones(3, dtype=torch.float32 if r == 0 else torch.float64)),
])
def test_a_mismatch_is_one_error_on_every_rank_naming_each_rank(what: str, make: object) -> None:
    tensor = make(hvd.rank())  # type: ignore[operator]
    with pytest.raises(hvd.HorovodInternalError) as info:
        hvd.allreduce(tensor, name=f"mismatch.{what}")
    message = str(info.value)
    assert f"allreduce 'mismatch.{what}': {what} differ between ranks: rank 0 " in message
    assert all(f"rank {r} " in message for r in range(hvd.size()))
    # The ranks go on together: the next op works.
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [float(hvd.size())] * 2


def test_ranks_disagreeing_on_the_op_or_the_root_fail_alike() -> None:
    op = hvd.Sum if hvd.rank() == 0 else hvd.Max
    with pytest.raises(hvd.HorovodInternalError, match="ops differ between ranks: rank 0 sum, rank 1 max"):
        hvd.allreduce(torch.ones(2), name="mismatch.op", op=op)
    with pytest.raises(hvd.HorovodInternalError, match="root ranks differ between ranks: rank 0 0, rank 1 1"):
        hvd.broadcast(torch.ones(2), root_rank=min(hvd.rank(), 1), name="mismatch.root")


def test_a_name_in_flight_twice_is_a_value_error_at_the_call() -> None:
    from mpi4py import MPI

    gate = MPI.COMM_WORLD.Dup()  # the others submit only after rank 0's second try: "twice" is in flight there
    if hvd.rank() == 0:
        first = hvd.allreduce_async(torch.ones(2), name="twice")
        with pytest.raises(ValueError, match="an op named 'twice' is already in flight on rank 0"):
            hvd.allreduce_async(torch.ones(2), name="twice")
        for r in range(1, hvd.size()):
            gate.send(None, dest=r, tag=6)
    else:
        gate.recv(source=0, tag=6)
        first = hvd.allreduce_async(torch.ones(2), name="twice")
    gate.Free()
    hvd.synchronize(first)
    hvd.synchronize(hvd.allreduce_async(torch.ones(2), name="twice"))  # free again once done


def test_reductions_are_the_same_bits_on_every_rank() -> None:
    g = torch.Generator().manual_seed(1000 + hvd.rank())
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        x = (torch.randn(4097, generator=g) * 3).to(dtype)  # every rank's product fits in float16
        for op in (hvd.Sum, hvd.Average, hvd.Product, hvd.Min, hvd.Max):
            out = hvd.allreduce(x, op=op)
            assert out.dtype == dtype
            assert same_bytes_everywhere(out), (dtype, op)


def test_average_divides_and_scales_as_horovod_does() -> None:
    n = hvd.size()
    x = torch.arange(1, 7, dtype=torch.float32) * (hvd.rank() + 1)
    expected = torch.arange(1, 7, dtype=torch.float32) * sum(range(1, n + 1)) / n
    assert torch.allclose(hvd.allreduce(x), expected)
    assert torch.allclose(hvd.allreduce(x, prescale_factor=2.0, postscale_factor=0.5), expected)
    ints = torch.tensor([7, -7, 10], dtype=torch.int64)
    # integers: the exact sum, divided in float64 and truncated toward zero
    assert hvd.allreduce(ints).tolist() == [7, -7, 10]
    assert hvd.allreduce(ints, op=hvd.Sum, postscale_factor=0.5).tolist() == [int(7 * n * 0.5), int(-7 * n * 0.5),
                                                                              int(10 * n * 0.5)]


def test_async_ops_run_in_the_background() -> None:
    handles = [hvd.allreduce_async(torch.ones(1 << 16), name=f"bg.{i}") for i in range(6)]
    for h in handles:
        while not hvd.poll(h):
            pass  # the main thread does nothing for them: the background thread completes them
        assert torch.equal(hvd.synchronize(h), torch.ones(1 << 16))
    with pytest.raises(ValueError, match="not an op in flight"):
        hvd.poll(handles[0])


def test_join_lets_ranks_with_less_data_finish() -> None:
    n, me = hvd.size(), hvd.rank()
    batches = me + 1  # rank r has r + 1 batches
    for b in range(batches):
        out = hvd.allreduce(torch.ones(3), name=f"join.step.{b}", op=hvd.Average)
        # ranks that have joined send zeros; the average still divides by every rank
        active = n - b
        assert torch.allclose(out, torch.full((3,), active / n))
    last = hvd.join()
    assert last == n - 1  # the rank with the most batches joins last, and every rank is told so
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == n  # and after the join, all ranks are back


def test_while_a_rank_has_joined_other_collectives_fail_at_once() -> None:
    if hvd.rank() == 0:
        assert hvd.join() in range(hvd.size())
        return
    with pytest.raises(hvd.HorovodInternalError, match="rank 0 has joined; only allreduce and barrier run"):
        hvd.allgather(torch.ones(1), name="after.join")
    hvd.join()


def test_allgather_alltoall_reducescatter_shapes() -> None:
    n, me = hvd.size(), hvd.rank()
    gathered = hvd.allgather(torch.full((me + 1, 2), me))
    assert gathered[:, 0].tolist() == [r for r in range(n) for _ in range(r + 1)]
    splits = [me + 1] * n
    out, received = hvd.alltoall(torch.full((sum(splits), 3), me), splits=splits)
    assert received.tolist() == [r + 1 for r in range(n)] and out.shape == (sum(r + 1 for r in range(n)), 3)
    assert out[:, 0].tolist() == [r for r in range(n) for _ in range(r + 1)]
    rows = 2 * n + 1
    share = hvd.reducescatter(torch.ones(rows, 2), op=hvd.Sum)
    assert share.shape == (2 + (1 if me < 1 else 0), 2) and torch.equal(share, torch.full(share.shape, float(n)))


def test_gradients_flow_through_the_collectives() -> None:
    x = torch.ones(4, requires_grad=True)
    hvd.allreduce(x, op=hvd.Sum).sum().backward()  # type: ignore[no-untyped-call]  # torch: unannotated
    assert x.grad is not None and torch.equal(x.grad, torch.full((4,), float(hvd.size())))
    y = torch.ones(2, 3, requires_grad=True)
    hvd.allgather(y).sum().backward()  # type: ignore[no-untyped-call]  # torch: unannotated
    assert y.grad is not None and torch.equal(y.grad, torch.ones(2, 3))
    z = torch.ones(3, requires_grad=True)
    hvd.broadcast(z, root_rank=0).sum().backward()  # type: ignore[no-untyped-call]  # torch: unannotated
    assert z.grad is not None and torch.equal(z.grad, torch.full((3,), 1.0 if hvd.rank() == 0 else 0.0))


def test_process_sets_run_ops_over_their_ranks_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HOROVOD_DYNAMIC_PROCESS_SETS, "1")
    evens = hvd.add_process_set([r for r in range(hvd.size()) if r % 2 == 0])
    assert evens.process_set_id is not None and evens.size() == len(evens.ranks)
    if evens.included():
        out = hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=evens)
        assert out.tolist() == [float(len(evens.ranks))] * 2
        assert evens.rank() == evens.ranks.index(hvd.rank())
    else:
        with pytest.raises(ValueError, match="is not in ProcessSet"):
            hvd.allreduce(torch.ones(2), process_set=evens)
    with pytest.raises(ValueError, match="Attempted to add a duplicate process set"):
        hvd.add_process_set(list(range(hvd.size())))
    assert hvd.remove_process_set(evens) and evens.process_set_id is None
    assert not hvd.remove_process_set(hvd.global_process_set)


def test_process_sets_need_their_variable_after_init(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(HOROVOD_DYNAMIC_PROCESS_SETS, raising=False)
    with pytest.raises(ValueError, match="HOROVOD_DYNAMIC_PROCESS_SETS=1"):
        hvd.add_process_set([0])


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


def _data(rank: int, batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)) for _ in range(batches)]


def test_distributed_optimizer_steps_as_one_optimizer_on_the_averaged_gradient() -> None:
    n = hvd.size()
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.SGD)
    reference = _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    loss_fn = torch.nn.MSELoss()
    for step in range(3):
        x, y = _data(hvd.rank(), 3)[step]
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        # the reference: every rank's batch, gradients averaged by hand, in one process
        ref_opt.zero_grad()
        for r in range(n):
            xr, yr = _data(r, 3)[step]
            (loss_fn(reference(xr), yr) / n).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6)
        assert same_bytes_everywhere(p)


def test_backward_passes_per_step_sums_the_local_passes() -> None:
    model = torch.nn.Linear(3, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(), backward_passes_per_step=2, op=hvd.Sum)
    for _ in range(2):
        model(torch.ones(1, 3)).sum().backward()
    opt.synchronize()
    # 2 local passes accumulated, then summed over the ranks; never divided by the passes
    assert model.weight.grad is not None
    assert torch.equal(model.weight.grad, torch.full((1, 3), 2.0 * hvd.size()))
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()
    for _ in range(2):
        model(torch.ones(1, 3)).sum().backward()
    with pytest.raises(AssertionError, match="more than backward_passes_per_step"):
        model(torch.ones(1, 3)).sum().backward()
    opt.synchronize()  # what the third pass added is undefined (the reduction was under way), as in Horovod
    opt.zero_grad()


def test_a_parameter_without_a_gradient_on_one_rank_is_reduced_with_zeros() -> None:
    a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    model = torch.nn.ModuleDict({"a": a, "b": b})
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(), op=hvd.Sum)
    out = a(torch.ones(1, 2))
    if hvd.rank() == 0:
        out = out + b(torch.ones(1, 2))
    out.sum().backward()
    opt.step()
    assert b.weight.grad is not None and torch.equal(b.weight.grad, torch.ones(1, 2))
    with pytest.raises(ValueError, match="must be unique"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[("w", p) for p in model.parameters()])
    opt.zero_grad()


def test_a_step_after_synchronize_without_skip_warns_once() -> None:
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert [str(w.message) for w in caught if "skip_synchronize" in str(w.message)]
    opt.zero_grad()


def test_broadcast_optimizer_state_copies_tensors_scalars_and_options() -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (hvd.rank() + 1), betas=(0.8, 0.9 + 0.01 * hvd.rank()))
    if hvd.rank() == 0:
        for x, y in _data(0, 2):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]  # torch: unannotated
            opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["betas"] == (0.8, 0.9)
    for p in model.parameters():
        state = opt.state[p]
        assert same_bytes_everywhere(state["exp_avg"]) and same_bytes_everywhere(state["exp_avg_sq"])
        assert float(state["step"]) == 2.0
    with pytest.raises(ValueError, match="LBFGS"):
        hvd.broadcast_optimizer_state(torch.optim.LBFGS(model.parameters()), root_rank=0)


def test_objects_travel_pickled() -> None:
    got = hvd.broadcast_object({"epoch": 3, "rank": hvd.rank()}, root_rank=0)
    assert got == {"epoch": 3, "rank": 0}
    assert hvd.allgather_object(("r", hvd.rank())) == [("r", r) for r in range(hvd.size())]


def test_fp16_compression_reduces_halves_and_restores_the_dtype() -> None:
    x = torch.full((5,), 0.5 + hvd.rank())
    out = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.full((5,), float(sum(0.5 + r for r in range(hvd.size())))))


def test_unnamed_ops_of_different_process_sets_keep_their_own_count(monkeypatch: pytest.MonkeyPatch) -> None:
    # Ranks run different numbers of unnamed ops in different sets; the world's next unnamed op still meets.
    monkeypatch.setenv(HOROVOD_DYNAMIC_PROCESS_SETS, "1")
    alone = [hvd.add_process_set([r]) for r in range(hvd.size())]
    mine = alone[hvd.rank()]
    for _ in itertools.repeat(None, hvd.rank() + 1):
        hvd.allreduce(torch.ones(1), process_set=mine)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == hvd.size()
    for ps in alone:
        hvd.remove_process_set(ps)


def test_barrier_waits_for_every_rank() -> None:
    hvd.barrier()
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == hvd.size()


def test_a_rank_that_shuts_down_fails_the_ops_that_need_it_naming_it() -> None:
    if hvd.rank() == 1:
        hvd.shutdown()
        assert not hvd.is_initialized()
        with pytest.raises(ValueError, match="Horovod has not been initialized"):
            hvd.size()
    else:
        with pytest.raises(hvd.HorovodInternalError,
                           match=r"allreduce 'after.leave': rank 1 shut down \(Horovod has been shut down\)"):
            hvd.allreduce(torch.ones(1), name="after.leave")
    hvd.shutdown()
    hvd.init()  # every rank again: a new start of Horovod on the same world
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == hvd.size()


def test_a_timeline_shows_each_ops_negotiation_and_run(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="HOROVOD_TIMELINE=DYNAMIC"):
        hvd.start_timeline(str(tmp_path / "never.json"))
    monkeypatch.setenv(HOROVOD_TIMELINE, "DYNAMIC")
    path = tmp_path / "timeline.json"
    hvd.start_timeline(str(path), mark_cycles=True)
    hvd.allreduce(torch.ones(3), name="traced")
    hvd.stop_timeline()
    if hvd.rank() == 0:  # rank 0, the coordinator, writes it
        events = json.loads(path.read_text())
        names = {e.get("args", {}).get("name") for e in events if e.get("ph") == "M"}
        phases = [e.get("name") for e in events if e.get("ph") == "B"]
        assert "allreduce.traced" in names and phases[:2] == ["NEGOTIATE_ALLREDUCE", "ALLREDUCE"]
        assert any(e.get("name") == "CYCLE_START" for e in events)
    else:
        assert not path.exists()


def test_an_op_a_rank_never_submits_fails_after_the_timeout_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from mpi4py import MPI

    monkeypatch.setenv(COLLECTIVE_TIMEOUT, "2")
    gate = MPI.COMM_WORLD.Dup()  # rank 1 goes on once rank 0 has its error (a message, not a sleep)
    try:
        if hvd.rank() == 1:
            while not gate.Iprobe(source=0, tag=5):
                time.sleep(0.01)
            gate.recv(source=0, tag=5)
        else:
            with pytest.raises(hvd.HorovodInternalError,
                               match=r"^allreduce 'lonely': rank\(s\) 1 did not submit it within 2 s; set "
                                     r"POPDIST_COLLECTIVE_TIMEOUT to wait longer$"):
                hvd.allreduce(torch.ones(1), name="lonely")
            if hvd.rank() == 0:
                gate.send(None, dest=1, tag=5)
    finally:
        gate.Free()
    monkeypatch.undo()
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == hvd.size()
