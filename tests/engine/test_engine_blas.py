"""Replica threads that compute at once share the BLAS library's threads (engine/_execution/blas.py):
each BLAS library (numpy's OpenBLAS, loaded and real) runs on its threads divided by L while the
threads executor runs a step, whole under the cooperative executor, and set back after either."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from threadpoolctl import ThreadpoolController

from popdist_py.engine import Runtime, StepContext
from popdist_py.engine._execution.blas import BlasShare

#: numpy's own BLAS, which every step below calls
BLAS = ThreadpoolController().select(user_api="blas")


def blas_threads() -> int:
    (threads,) = {lib.num_threads for lib in BLAS.lib_controllers}
    return int(threads)


@pytest.fixture
def configured() -> Iterator[int]:
    """The BLAS threads for the test: 6 (OpenBLAS may have more threads than cores), which tells a
    division by L from other rules (6 // 2 = 3, 6 // 4 = 1)."""
    with BLAS.limit(limits=6):
        threads = blas_threads()
        if threads != 6:  # pragma: no cover - a BLAS library that keeps to fewer threads
            pytest.skip(f"numpy's BLAS runs on at most {threads} threads here")
        yield threads
    assert BLAS.lib_controllers, "numpy has no BLAS library threadpoolctl can see"


@pytest.mark.one_executor  # no Runtime
def test_a_share_divides_each_librarys_threads_and_gives_them_back(configured: int) -> None:
    for sharers, inside in [(1, 6), (2, 3), (4, 1), (7, 1)]:
        with BlasShare(sharers).shared():
            assert blas_threads() == inside, sharers
        assert blas_threads() == configured


@pytest.mark.one_executor  # no Runtime
def test_a_library_on_one_thread_stays_on_one() -> None:
    with BLAS.limit(limits=1), BlasShare(4).shared():
        assert blas_threads() == 1


def _seen(ctx: StepContext, x: np.ndarray) -> np.ndarray:
    """The BLAS threads this replica's step runs with, beside a product that uses them."""
    return np.array([blas_threads(), float((x @ x.T).sum() > -1)])


@pytest.mark.parametrize("L", [2, 3])
def test_replica_threads_share_the_blas_threads_while_their_step_runs(configured: int, L: int) -> None:
    rt = Runtime(L, executor="threads")
    try:
        seen = rt.run(_seen, np.ones((L, 64, 64), np.float32))
    finally:
        rt.close()
    assert seen[:, 0].tolist() == [max(1, configured // L)] * L
    assert blas_threads() == configured


def test_cooperative_replicas_take_turns_and_keep_every_blas_thread(configured: int) -> None:
    rt = Runtime(2, executor="cooperative")
    try:
        seen = rt.run(_seen, np.ones((2, 64, 64), np.float32))
    finally:
        rt.close()
    assert seen[:, 0].tolist() == [configured] * 2


def test_the_blas_threads_come_back_after_a_step_that_failed(configured: int) -> None:
    def fails(ctx: StepContext, x: np.ndarray) -> None:
        assert blas_threads() == max(1, configured // 2)
        raise ValueError("the step fails")

    rt = Runtime(2, executor="threads")
    try:
        with pytest.raises(ValueError, match="fails"):
            rt.run(fails, np.ones((2, 4), np.float32))
    finally:
        rt.close()
    assert blas_threads() == configured
