"""The coordinator's table (popdist_py.horovod.common.negotiation), without MPI: which op is
ready, in which order, checked how, fused how."""

from __future__ import annotations

from popdist_py.horovod.common import negotiation as neg
from popdist_py.horovod.common.negotiation import Request, Table


def allreduce(name: str, shape: tuple[int, ...] = (4,), dtype: str = "float32", op: str = "sum",
              process_set: int = 0) -> Request:
    return Request(name, neg.ALLREDUCE, process_set, (dtype,), (shape,), op)


def test_an_op_is_ready_once_every_rank_submitted_it_whatever_their_order() -> None:
    table = Table(3)
    table.submit(0, [allreduce("a"), allreduce("b")])
    table.submit(1, [allreduce("b"), allreduce("a")])
    assert table.ready() == []
    table.submit(2, [allreduce("b")])
    (b,) = table.ready()
    assert b.names == ("b",) and b.members == (0, 1, 2) and not b.error
    table.submit(2, [allreduce("a")])
    assert [r.names for r in table.ready()] == [("a",)]
    assert table.pending == {}


def test_ops_ready_together_are_announced_in_first_submission_order_and_fused() -> None:
    table = Table(2)
    table.submit(1, [allreduce("y"), allreduce("x"), allreduce("z", dtype="float64")])
    table.submit(0, [allreduce("x"), allreduce("y"), allreduce("z", dtype="float64")])
    responses = table.ready()
    assert [r.names for r in responses] == [("y", "x"), ("z",)]  # one buffer per dtype and op


def test_fusion_stops_at_the_threshold() -> None:
    table = Table(1, fusion_threshold=32)
    table.submit(0, [allreduce(n, shape=(4,)) for n in "abc"])  # 16 bytes each
    assert [r.names for r in table.ready()] == [("a", "b"), ("c",)]


def test_a_disagreement_is_one_error_naming_each_rank_and_its_value() -> None:
    table = Table(3)
    for rank, shape in enumerate([(4,), (4,), (5, 2)]):
        table.submit(rank, [allreduce("g", shape=shape)])
    (response,) = table.ready()
    assert response.error == "allreduce 'g': shapes differ between ranks: rank 0 (4,), rank 1 (4,), rank 2 (5, 2)"
    assert response.members == (0, 1, 2)


def test_one_name_for_two_kinds_of_op_is_an_error() -> None:
    table = Table(2)
    table.submit(0, [allreduce("t")])
    table.submit(1, [Request("t", neg.BROADCAST, 0, ("float32",), ((4,),), root=0)])
    (response,) = table.ready()
    assert response.error == "name 't' is used for different ops by different ranks: rank 0 allreduce, rank 1 broadcast"


def test_a_joined_rank_counts_as_sending_zeros_to_allreduce_and_join_answers_the_last() -> None:
    table = Table(3)
    table.submit(2, [Request("join", neg.JOIN)])
    table.submit(0, [allreduce("a")])
    table.submit(1, [allreduce("a")])
    (response,) = table.ready()
    assert not response.error and response.contributions[0][2] is None and response.members == (0, 1, 2)
    table.submit(0, [Request("join", neg.JOIN)])
    table.submit(1, [Request("join", neg.JOIN)])
    (join,) = table.ready()
    assert join.kind == neg.JOIN and join.value == 1 and join.members == (0, 1, 2)
    assert table.joined == []


def test_while_a_rank_has_joined_an_allgather_fails_at_once_for_those_who_asked() -> None:
    table = Table(3)
    table.submit(0, [Request("join", neg.JOIN)])
    table.submit(1, [Request("g", neg.ALLGATHER, 0, ("float32",), ((1,),))])
    (response,) = table.ready()
    assert response.members == (1,)
    assert response.error == "allgather 'g': rank 0 has joined; only allreduce and barrier run while ranks have joined"


def test_a_rank_that_left_fails_the_ops_that_need_it() -> None:
    table = Table(2)
    table.submit(0, [allreduce("a")])
    table.leave(1, "shut down (Horovod has been shut down)")
    (response,) = table.ready()
    assert response.error == "allreduce 'a': rank 1 shut down (Horovod has been shut down) before submitting it"


def test_process_sets_are_numbered_and_their_ids_reused_first_freed_first() -> None:
    table = Table(2)

    def collective(request: Request) -> neg.Response:
        table.submit(0, [request])
        table.submit(1, [request])
        (response,) = table.ready()
        return response

    assert collective(Request("add.0", neg.ADD_PROCESS_SET, ranks=(0,))).value == 1
    assert collective(Request("add.1", neg.ADD_PROCESS_SET, ranks=(1,))).value == 2
    assert "exists already (id 1)" in collective(Request("add.2", neg.ADD_PROCESS_SET, ranks=(0,))).error
    assert collective(Request("rm.0", neg.REMOVE_PROCESS_SET, root=1)).value == 1
    assert collective(Request("rm.1", neg.REMOVE_PROCESS_SET, root=2)).value == 2
    assert collective(Request("add.3", neg.ADD_PROCESS_SET, ranks=(1,))).value == 1
    (error,) = table.submit(0, [allreduce("x", process_set=1)])
    assert error.error == "allreduce 'x': process set 1: rank 0 is not in it (its ranks: [1])"


def test_an_op_on_a_set_the_rank_is_not_in_is_refused_to_that_rank_alone() -> None:
    table = Table(2, {0: (0, 1), 1: (1,)})
    (error,) = table.submit(0, [allreduce("x", process_set=1)])
    assert error.members == (0,) and "rank 0 is not in it" in error.error


def test_an_op_some_ranks_never_submit_is_named_then_fails_for_those_who_did() -> None:
    table = Table(3)
    table.submit(0, [allreduce("lonely")])
    table.submit(2, [allreduce("lonely")])
    began = table.since[(0, "lonely")]
    assert table.stalled(60, began + 30) == []
    assert table.stalled(60, began + 61) == [
        "allreduce 'lonely' has waited 61 s for rank(s) 1, which have not submitted it (submitted by rank(s) 0, 2)"]
    assert table.stalled(60, began + 62) == []  # once per op
    assert table.expire(600, began + 599, "wait longer") == []
    (failed,) = table.expire(600, began + 601, "set POPDIST_COLLECTIVE_TIMEOUT to wait longer")
    assert failed.members == (0, 2) and failed.error == (
        "allreduce 'lonely': rank(s) 1 did not submit it within 600 s; set POPDIST_COLLECTIVE_TIMEOUT to wait longer")
    assert table.pending == {} and table.since == {}


def test_a_barrier_is_ready_only_once_every_rank_of_its_set_has_arrived() -> None:
    table = Table(3, {0: (0, 1, 2), 1: (0, 2)})
    table.submit(0, [Request("b", neg.BARRIER, 0), Request("s", neg.BARRIER, 1)])
    table.submit(1, [Request("b", neg.BARRIER, 0)])
    assert table.ready() == []  # rank 2 is in both and has come to neither
    table.submit(2, [Request("s", neg.BARRIER, 1)])
    (in_set,) = table.ready()
    assert (in_set.names, in_set.members) == (("s",), (0, 2))
    table.submit(2, [Request("b", neg.BARRIER, 0)])
    assert [(r.names, r.members) for r in table.ready()] == [(("b",), (0, 1, 2))]
