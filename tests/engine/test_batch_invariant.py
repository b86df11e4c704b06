"""The batch-invariant products: exactly their defined order of operations, on every ISA, so a
row's result never depends on the call it comes in (the determinism contract's model side)."""

from __future__ import annotations

import threading
from fractions import Fraction

import numpy as np
import pytest

from popdist_py.engine import canonical_sum
from popdist_py.engine.batch_invariant import ISAS, KC, matmul, outer_sum

pytestmark = [pytest.mark.determinism, pytest.mark.one_executor]  # the kernels alone: no Runtime

DTYPES = [np.float32, np.float64]


def rounded(q: Fraction, dtype: type) -> np.floating:
    """``q`` correctly rounded to ``dtype`` (nearest, ties to even), independently of any FMA."""
    guess = dtype(float(q))  # float(Fraction) is correctly rounded to float64; float32 may be 1 ulp off
    near = [guess, np.nextafter(guess, dtype(np.inf)), np.nextafter(guess, dtype(-np.inf))]
    best = min(abs(Fraction(float(c)) - q) for c in near)
    ties = [c for c in near if abs(Fraction(float(c)) - q) == best]
    uint = np.uint32 if dtype is np.float32 else np.uint64
    return next(c for c in ties if len(ties) == 1 or int(np.array(c).view(uint)) % 2 == 0)


def reference_matmul(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The contract written out: per element an FMA chain over each block of KC k's from 0, the
    blocks' results added left to right, each FMA rounded once (exact rational arithmetic)."""
    dtype = a.dtype.type
    out = np.empty((a.shape[0], w.shape[1]), a.dtype)
    for i in range(a.shape[0]):
        for j in range(w.shape[1]):
            total = None
            for k0 in range(0, a.shape[1], KC):
                acc = dtype(0)
                for k in range(k0, min(k0 + KC, a.shape[1])):
                    acc = rounded(Fraction(float(a[i, k])) * Fraction(float(w[k, j])) + Fraction(float(acc)), dtype)
                total = acc if total is None else dtype(total + acc)
            out[i, j] = total
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("isa", ISAS)
def test_matmul_is_its_defined_fma_chain(dtype: type, isa: int) -> None:
    rng = np.random.default_rng(1)
    a: np.ndarray = rng.standard_normal((3, KC + 7)).astype(dtype)  # two k blocks, the second partial
    w: np.ndarray = rng.standard_normal((KC + 7, 3)).astype(dtype)
    assert matmul(a, w, isa=isa).tobytes() == reference_matmul(a, w).tobytes()


SHAPES = [(1, 1), (3, 5), (17, 9), (64, 64), (100, 33), (KC, 70), (KC + 1, 40), (784, 64), (1030, 257), (2000, 16)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("transposed", [False, True])
def test_a_row_does_not_depend_on_its_call(dtype: type, k: int, n: int, transposed: bool) -> None:
    """Every count of rows from 1, at any position, strided or not, on every ISA: the row's bits."""
    rng = np.random.default_rng([k, n])
    w: np.ndarray = (rng.standard_normal((n, k)).astype(dtype).T if transposed
                     else rng.standard_normal((k, n)).astype(dtype))
    x: np.ndarray = rng.standard_normal((72, k)).astype(dtype)
    alone = np.concatenate([matmul(x[i:i + 1], w) for i in range(len(x))])
    for isa in ISAS:
        assert matmul(x, w, isa=isa).tobytes() == alone.tobytes()
    for rows in [*range(2, 20), 31, 33, 64, 65]:
        for start in (0, 1, 72 - rows):
            assert matmul(x[start:start + rows], w).tobytes() == alone[start:start + rows].tobytes()
    assert matmul(x[::3], w).tobytes() == alone[::3].tobytes()
    assert matmul(np.asfortranarray(x), w).tobytes() == alone.tobytes()
    assert matmul(x.reshape(8, 9, k), w).tobytes() == alone.tobytes()
    assert matmul(x[5], w).tobytes() == alone[5].tobytes()  # one sample, no batch axis
    inside = np.concatenate([w, w], axis=1)[:, :n]  # w's rows where they lie, a row apart of 2n
    for rows in (1, 3, 9):
        assert matmul(x[:rows], inside).tobytes() == alone[:rows].tobytes()
    assert np.allclose(alone, x.astype(np.float64) @ w.astype(np.float64), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("k", "n"), [(1, 1), (5, 3), (9, 70), (64, 64), (130, 33)])
def test_outer_sum_is_the_canonical_tree_of_products(dtype: type, k: int, n: int) -> None:
    rng = np.random.default_rng([k, n, 7])
    x: np.ndarray = rng.standard_normal((67, k)).astype(dtype)
    y: np.ndarray = rng.standard_normal((67, n)).astype(dtype)
    for rows in [*range(1, 26), 31, 32, 33, 64, 67]:
        want = canonical_sum(x[:rows, :, None] * y[:rows, None, :]).tobytes()
        for isa in ISAS:
            assert outer_sum(x[:rows], y[:rows], isa=isa).tobytes() == want
    assert outer_sum(x[:, ::-1], y).tobytes() == canonical_sum(x[:, ::-1, None] * y[:, None, :]).tobytes()


def test_outer_sum_of_a_batch_is_the_tree_of_its_parts() -> None:
    """What the Trainer relies on: 4 micro-batches of 8, summed in the tree, are one batch of 32."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((32, 40)).astype(np.float32)
    y = rng.standard_normal((32, 24)).astype(np.float32)
    parts = np.stack([outer_sum(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)])
    assert canonical_sum(parts).tobytes() == outer_sum(x, y).tobytes()


def test_non_finite_values_give_the_same_bits_on_every_isa() -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((20, 30)).astype(np.float32)
    w = rng.standard_normal((30, 40)).astype(np.float32)
    x[3, 4], x[7, 1], w[2, 5] = np.inf, np.nan, -np.inf
    ys = rng.standard_normal((20, 40)).astype(np.float32)
    results = [(matmul(x, w, isa=i).tobytes(), outer_sum(x, ys, isa=i).tobytes()) for i in ISAS]
    assert all(r == results[0] for r in results)
    with np.errstate(invalid="ignore"):
        got, want = matmul(x, w), x.astype(np.float64) @ w.astype(np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(np.isinf(got), np.isinf(want))


def test_empty_inner_axis_and_rows() -> None:
    assert matmul(np.ones((3, 0), np.float32), np.ones((0, 4), np.float32)).tobytes() == bytes(48)
    assert matmul(np.ones((0, 5), np.float64), np.ones((5, 2))).shape == (0, 2)


def test_replica_threads_compute_at_once_with_the_same_bits() -> None:
    """The kernels release the GIL; results from concurrent threads are the single-thread ones."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((300, 200)).astype(np.float32)
    xs = [rng.standard_normal((64, 300)).astype(np.float32) for _ in range(4)]
    want = [matmul(x, w).tobytes() for x in xs]
    got: dict[int, bytes] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, matmul(xs[i], w).tobytes())) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(4)] == want


@pytest.mark.parametrize(("call", "message"), [
    (lambda: matmul(np.ones((2, 3), np.float32), np.ones((3, 2))),
     "both be float32 or both float64, got float32 and float64"),
    (lambda: matmul(np.ones((2, 3), np.int64), np.ones((3, 2), np.int64)), "got int64 and int64"),
    (lambda: matmul(np.ones((2, 3), np.float32), np.ones((4, 2), np.float32)), "got shapes (2, 3) and (4, 2)"),
    (lambda: matmul(np.float32(1), np.ones((1, 2), np.float32)),  # type: ignore[arg-type]  # a scalar, refused
     "x must be [..., K] and w [K, N]"),
    (lambda: matmul(np.ones((2, 3), np.float32), np.ones(3, np.float32)), "got shapes (2, 3) and (3,)"),
    (lambda: outer_sum(np.ones((2, 3)), np.ones((3, 2))), "the same B >= 1, got shapes (2, 3) and (3, 2)"),
    (lambda: outer_sum(np.ones((0, 3)), np.ones((0, 2))), "the same B >= 1, got shapes (0, 3) and (0, 2)"),
    (lambda: matmul(np.ones((2, 3)), np.ones((3, 2)), isa=7), "isa 7 is not one this CPU runs"),
])
def test_bad_operands_are_one_clear_line(call: object, message: str) -> None:
    with pytest.raises((TypeError, ValueError)) as info:
        call()  # type: ignore[operator]
    assert message in str(info.value) and "\n" not in str(info.value)
