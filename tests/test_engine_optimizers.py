"""Optimizers against references written from their papers' update rules, bitwise equality of
sharded and whole-tensor updates, and exact partition-independent norms."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from popdist_py.engine.optimizers import (
    LAMB,
    MAX_NORM_ELEMENTS,
    PARTS_LENGTH,
    SGD,
    Adam,
    AdamW,
    Optimizer,
    exact_norm,
    norm_from_parts,
    sum_squares_parts,
)
from popdist_py.engine.sharding import ShardLayout

STEPS = 6


def grads_for(shape: tuple[int, ...], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(STEPS)]


# ------------------------------------------------------------------------------ references (float64)
def ref_sgd(w: np.ndarray, grads: list[np.ndarray], lr: Any, momentum: float = 0.0, dampening: float = 0.0,
            nesterov: bool = False, weight_decay: float = 0.0) -> np.ndarray:
    """PyTorch's documented SGD: g += wd*w; b = g (first) else mu*b + (1-tau)*g; nesterov g + mu*b."""
    w = w.astype(np.float64)
    b = None
    for t, g in enumerate(grads, start=1):
        g = g.astype(np.float64) + weight_decay * w
        if momentum:
            b = g.copy() if b is None else momentum * b + (1 - dampening) * g
            g = g + momentum * b if nesterov else b
        w = w - (lr(t) if callable(lr) else lr) * g
    return w


def ref_adam(w: np.ndarray, grads: list[np.ndarray], lr: float, b1: float, b2: float, eps: float,
             l2: float = 0.0, decoupled: float = 0.0, lamb: bool = False) -> np.ndarray:
    """Kingma & Ba's Adam with bias correction; AdamW's decoupled decay; LAMB's trust ratio."""
    w = w.astype(np.float64)
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        g = g.astype(np.float64) + l2 * w
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        r = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps) + decoupled * w
        ratio = 1.0
        if lamb:
            wn, rn = float(np.linalg.norm(w)), float(np.linalg.norm(r))
            ratio = wn / rn if wn > 0 and rn > 0 else 1.0
        w = w - lr * ratio * r
    return w


def run(opt: Optimizer, w0: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    w = w0.copy()
    state = opt.init_state(w.shape, w.dtype)
    for t, g in enumerate(grads, start=1):
        opt.update(w, g, state, t)
    return w


CASES = [
    (lambda: SGD(0.1), lambda w, g: ref_sgd(w, g, 0.1)),
    (lambda: SGD(0.1, weight_decay=0.01), lambda w, g: ref_sgd(w, g, 0.1, weight_decay=0.01)),
    (lambda: SGD(0.05, momentum=0.9), lambda w, g: ref_sgd(w, g, 0.05, momentum=0.9)),
    (lambda: SGD(0.05, momentum=0.9, dampening=0.3, weight_decay=1e-3),
     lambda w, g: ref_sgd(w, g, 0.05, momentum=0.9, dampening=0.3, weight_decay=1e-3)),
    (lambda: SGD(0.05, momentum=0.8, nesterov=True), lambda w, g: ref_sgd(w, g, 0.05, momentum=0.8, nesterov=True)),
    (lambda: SGD(lambda t: 0.1 / t, momentum=0.5), lambda w, g: ref_sgd(w, g, lambda t: 0.1 / t, momentum=0.5)),
    (lambda: Adam(1e-2), lambda w, g: ref_adam(w, g, 1e-2, 0.9, 0.999, 1e-8)),
    (lambda: Adam(1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
     lambda w, g: ref_adam(w, g, 1e-2, 0.8, 0.99, 1e-6, l2=0.1)),
    (lambda: AdamW(1e-2, weight_decay=0.05), lambda w, g: ref_adam(w, g, 1e-2, 0.9, 0.999, 1e-8, decoupled=0.05)),
    (lambda: LAMB(1e-2), lambda w, g: ref_adam(w, g, 1e-2, 0.9, 0.999, 1e-6, lamb=True)),
    (lambda: LAMB(1e-2, weight_decay=0.01),
     lambda w, g: ref_adam(w, g, 1e-2, 0.9, 0.999, 1e-6, decoupled=0.01, lamb=True)),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_optimizer_matches_its_reference(case: int) -> None:
    make, reference = CASES[case]
    w0 = np.random.default_rng(case).standard_normal((7, 5)).astype(np.float32)
    grads = grads_for(w0.shape, 100 + case)
    got = run(make(), w0, grads)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, reference(w0, grads), rtol=2e-5, atol=2e-6)


def test_hyper_parameters_change_between_steps_without_rebuilding() -> None:
    opt = Adam(1e-2)
    w0 = np.ones(4, np.float32)
    grads = grads_for((4,), 1)
    w, state = w0.copy(), opt.init_state(4)
    for t, g in enumerate(grads, start=1):
        opt.lr = 1e-2 if t <= 3 else 1e-3  # a step schedule set from outside
        opt.update(w, g, state, t)
    split = w0.copy()
    first, second = Adam(1e-2), Adam(1e-3)
    state2 = first.init_state(4)
    for t, g in enumerate(grads, start=1):
        (first if t <= 3 else second).update(split, g, state2, t)
    assert w.tobytes() == split.tobytes()


# ------------------------------------------------------------------------------ the bitwise rule
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("n", [1, 13, 30, 257])
def test_shard_updates_are_slices_of_the_whole_update(case: int, n: int) -> None:
    make, _ = CASES[case]
    rng = np.random.default_rng(n)
    w0 = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, n)).astype(np.float32)
    grads = grads_for((n,), n + 1)
    whole = run(make(), w0, grads)
    for count in range(1, 8):
        layout = ShardLayout(n, count)
        opt = make()
        shards = [layout.shard(w0, j) for j in range(count)]
        states = [opt.init_state(s.shape, s.dtype) for s in shards]

        def shard_norm(pieces: list[np.ndarray]) -> float:
            return norm_from_parts(sum(sum_squares_parts(p) for p in pieces))  # type: ignore[arg-type]

        for t, g in enumerate(grads, start=1):
            gs = [layout.shard(g, j) for j in range(count)]
            ds = [opt.direction(shards[j], gs[j], states[j], t) for j in range(count)]
            ratio = opt.trust_ratio(shard_norm(shards), shard_norm(ds), t) if opt.uses_norms else 1.0
            for j in range(count):
                opt.apply(shards[j], ds[j], t, ratio)
        joined = np.concatenate([shards[j][: layout.real(j)] for j in range(count)])
        assert joined.tobytes() == whole.tobytes(), f"{count} shards"


# ------------------------------------------------------------------------------ exact norms
def exact_reference(x: np.ndarray) -> float:
    """The correctly rounded root of the exact sum of squares (Fractions; ties cannot occur)."""
    kind_int = x.dtype.kind in "iu"
    total = sum(((Fraction(int(v)) if kind_int else Fraction(float(v))) ** 2 for v in x.reshape(-1)), Fraction(0))
    if total == 0:
        return 0.0
    num, den = total.numerator, total.denominator
    k = 1200 + den.bit_length()  # far below float64's last bit, subnormals included
    root = math.isqrt((num << (2 * k)) // den)
    exact = root * root * den == num << (2 * k)
    try:
        return float(Fraction(2 * root + (0 if exact else 1), 2 ** (k + 1)))  # Fraction rounds correctly
    except OverflowError:
        return math.inf


def random_tensor(rng: np.random.Generator, dtype: Any, n: int) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -(1 << 53)), min(info.max, 1 << 53), n, dtype=dtype, endpoint=True)
    finfo = np.finfo(dtype)
    low, high = math.log10(float(finfo.smallest_subnormal)), math.log10(float(finfo.max))
    kind = int(rng.integers(3))
    x: np.ndarray
    with np.errstate(all="ignore"):
        if kind == 0:  # every magnitude
            x = rng.standard_normal(n) * 10.0 ** rng.uniform(low, high, n)
        elif kind == 1:  # subnormals
            x = rng.integers(-1000, 1000, n) * float(finfo.smallest_subnormal)
        else:  # one scale
            x = rng.standard_normal(n) * 10.0 ** rng.uniform(low, high)
        x = x.astype(dtype)
    return np.where(np.isfinite(x), x, dtype.type(1)).astype(dtype)


DTYPES = [np.float16, np.float32, np.float64, np.int8, np.uint16, np.int32, np.int64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(8))
def test_sum_squares_parts_are_partition_independent_and_exact(seed: int, dtype: Any) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    x = random_tensor(rng, dtype, n)
    whole = sum_squares_parts(x)
    assert whole.shape == (PARTS_LENGTH,) and whole.dtype == np.float64
    assert norm_from_parts(whole) == exact_reference(x)
    for _ in range(3):  # random partitions (empty pieces too), added in random orders
        cuts = np.sort(rng.integers(0, n + 1, int(rng.integers(1, 7))))
        pieces = np.split(x, cuts)
        total = np.zeros(PARTS_LENGTH)
        for k in rng.permutation(len(pieces)):
            total = total + sum_squares_parts(pieces[k])
        assert total.tobytes() == whole.tobytes()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_zero_padded_shards_give_the_parts_of_the_whole(dtype: Any) -> None:
    x = random_tensor(np.random.default_rng(3), dtype, 30)
    for count in range(1, 8):
        layout = ShardLayout(30, count)
        total = sum((sum_squares_parts(layout.shard(x, j)) for j in range(count)), np.zeros(PARTS_LENGTH))
        assert total.tobytes() == sum_squares_parts(x).tobytes()


def test_norm_edge_cases() -> None:
    assert exact_norm(np.zeros(5, np.float32)) == 0.0
    assert exact_norm(np.zeros(0, np.float32)) == 0.0
    assert exact_norm(np.array([3.0, 4.0], np.float32)) == 5.0
    assert exact_norm(np.array([[3.0], [4.0]])) == 5.0  # any shape: the flat tensor
    tiny = np.array([1e-45, 1e-45], np.float32)  # subnormal float32
    assert exact_norm(tiny) == exact_reference(tiny)
    big = np.full(3, 3e38, np.float32)
    assert exact_norm(big) == exact_reference(big)
    assert exact_norm(np.array([5e-324])) == 5e-324  # a subnormal norm, not rounded twice
    assert exact_norm(np.array([1e300, 1e300])) == exact_reference(np.array([1e300, 1e300]))
    assert exact_norm(np.full(4, np.finfo(np.float64).max)) == math.inf  # beyond float64
    assert math.isnan(exact_norm(np.array([np.nan, np.inf, 1.0], np.float32)))
    assert exact_norm(np.array([-np.inf, 1.0], np.float16)) == math.inf
    assert exact_norm(np.array([np.inf, 1.0])) == math.inf


def test_norm_matches_a_float64_sum_on_a_large_tensor() -> None:
    x = np.random.default_rng(0).standard_normal(300_001).astype(np.float32)
    x64 = x.astype(np.float64)
    assert exact_norm(x) == pytest.approx(math.sqrt(math.fsum(x64 * x64)), rel=1e-15)


def test_bad_norm_input() -> None:
    with pytest.raises(ValueError, match=rf"parts of shape \(3,\), expected \({PARTS_LENGTH},\)"):
        norm_from_parts(np.zeros(3))
    with pytest.raises(ValueError, match="not sums of sum_squares_parts"):
        norm_from_parts(np.full(PARTS_LENGTH, 0.5))
    with pytest.raises(TypeError, match="dtype complex128 is not supported"):
        sum_squares_parts(np.zeros(3, np.complex128))
    with pytest.raises(ValueError, match="beyond 2\\*\\*53"):
        sum_squares_parts(np.array([1 << 60], np.int64))
    assert MAX_NORM_ELEMENTS == 1 << 29


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("make,message", [
    (lambda: SGD(-0.1), r"SGD: lr=-0.1 is not valid \(a finite number, at least 0\)"),
    (lambda: SGD(float("nan")), "SGD: lr=nan is not valid"),
    (lambda: SGD("0.1"), "SGD: lr='0.1' is not a number"),  # type: ignore[arg-type]
    (lambda: SGD(0.1, nesterov=True), "nesterov needs a constant momentum > 0"),
    (lambda: SGD(0.1, dampening=2.0), "dampening=2.0 is not valid"),
    (lambda: Adam(0.1, betas=(1.0, 0.9)), r"Adam: beta1=1.0 is not valid \(a finite number, at least 0, below 1\)"),
    (lambda: Adam(0.1, betas=(0.9,)), "betas=.* is not a pair"),  # type: ignore[arg-type]
    (lambda: LAMB(0.1, eps=-1.0), "LAMB: eps=-1.0 is not valid"),
])
def test_bad_hyper_parameters_are_one_clear_error(make: Any, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        make()


def test_bad_state_step_or_schedule_changes_nothing() -> None:
    opt = Adam(lambda t: 0.1 if t < 2 else float("inf"))
    w = np.ones(3, np.float32)
    g = np.ones(3, np.float32)
    state = opt.init_state(3)
    before = {k: v.copy() for k, v in state.items()}
    with pytest.raises(ValueError, match="state lacks exp_avg_sq"):
        opt.update(w, g, {"exp_avg": state["exp_avg"]}, 1)
    with pytest.raises(ValueError, match=r"gradient shape \(2,\) differs from the weight's \(3,\)"):
        opt.update(w, np.ones(2, np.float32), state, 1)
    with pytest.raises(ValueError, match="step=0 is not valid"):
        opt.update(w, g, state, 0)
    assert w.tolist() == [1.0] * 3 and all(np.array_equal(state[k], before[k]) for k in state)
    opt.update(w, g, state, 1)
    after_one = [w.copy()] + [v.copy() for v in state.values()]
    with pytest.raises(ValueError, match="lr=inf is not valid"):
        opt.update(w, g, state, 2)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(after_one, [w, *state.values()], strict=True))
