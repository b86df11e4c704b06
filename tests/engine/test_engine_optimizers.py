"""Optimizers against references written from their papers' update rules, bitwise equality of
sharded and whole-tensor updates, and exact partition-independent norms."""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from popdist_py.engine._placement.sharding import ShardLayout
from popdist_py.engine.optimizers import (
    LAMB,
    MAX_NORM_ELEMENTS,
    PARTS_LENGTH,
    SGD,
    UPDATE_BLOCK_BYTES,
    Adam,
    AdamW,
    Optimizer,
    exact_norm,
    norm_from_parts,
    sum_squares_parts,
)

pytestmark = pytest.mark.one_executor  # pure values: no Runtime

STEPS = 6
Lr = float | Callable[[int], float]


def grads_for(shape: tuple[int, ...], seed: int, dtype: Any = np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(STEPS)]


def value(h: Lr, t: int) -> float:
    return h(t) if callable(h) else h


# ------------------------------------------------------------------------------ references (float64)
def ref_sgd(w: np.ndarray, grads: list[np.ndarray], lr: Lr, momentum: Lr = 0.0, dampening: float = 0.0,
            nesterov: bool = False, weight_decay: float = 0.0) -> np.ndarray:
    """PyTorch's documented SGD: g += wd*w; b = g (first) else mu*b + (1-tau)*g; nesterov g + mu*b."""
    w = w.astype(np.float64)
    b: np.ndarray | None = None
    for t, grad in enumerate(grads, start=1):
        g = grad.astype(np.float64) + weight_decay * w
        mu = value(momentum, t)
        if mu:
            b = g.copy() if b is None else mu * b + (1 - dampening) * g
            g = g + mu * b if nesterov else b
        w = w - value(lr, t) * g
    return w


def ref_adam(w: np.ndarray, grads: list[np.ndarray], lr: Lr, b1: Lr, b2: float, eps: float,
             l2: float = 0.0, decoupled: float = 0.0, lamb: bool = False) -> np.ndarray:
    """Kingma & Ba's Adam with bias correction (beta1 may vary: m_hat divides by 1 - beta1_t ** t,
    as the implementation does); AdamW's decoupled decay; LAMB's trust ratio ||w|| / ||r||."""
    w = w.astype(np.float64)
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for t, grad in enumerate(grads, start=1):
        g = grad.astype(np.float64) + l2 * w
        beta1 = value(b1, t)
        m = beta1 * m + (1 - beta1) * g
        v = b2 * v + (1 - b2) * g * g
        r = (m / (1 - beta1**t)) / (np.sqrt(v / (1 - b2**t)) + eps) + decoupled * w
        ratio = 1.0
        if lamb:
            wn, rn = float(np.linalg.norm(w)), float(np.linalg.norm(r))
            ratio = wn / rn if wn > 0 and rn > 0 else 1.0
        w = w - value(lr, t) * ratio * r
    return w


def run(opt: Optimizer, w0: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    w = w0.copy()
    state = opt.init_state(w.shape, w.dtype)
    for t, g in enumerate(grads, start=1):
        opt.update(w, g, state, t)
    return w


def warmup(t: int) -> float:
    return 0.02 * min(1.0, t / 3)


CASES: list[tuple[Callable[[], Optimizer], Callable[[np.ndarray, list[np.ndarray]], np.ndarray]]] = [
    (lambda: SGD(0.1), lambda w, g: ref_sgd(w, g, 0.1)),
    (lambda: SGD(0.1, weight_decay=0.01), lambda w, g: ref_sgd(w, g, 0.1, weight_decay=0.01)),
    (lambda: SGD(0.05, momentum=0.9), lambda w, g: ref_sgd(w, g, 0.05, momentum=0.9)),
    (lambda: SGD(0.05, momentum=0.9, dampening=0.3, weight_decay=1e-3),
     lambda w, g: ref_sgd(w, g, 0.05, momentum=0.9, dampening=0.3, weight_decay=1e-3)),
    (lambda: SGD(0.05, momentum=0.8, nesterov=True), lambda w, g: ref_sgd(w, g, 0.05, momentum=0.8, nesterov=True)),
    (lambda: SGD(0.05, momentum=0.8, nesterov=True, weight_decay=0.1),
     lambda w, g: ref_sgd(w, g, 0.05, momentum=0.8, nesterov=True, weight_decay=0.1)),
    (lambda: SGD(lambda t: 0.1 / t, momentum=0.5), lambda w, g: ref_sgd(w, g, lambda t: 0.1 / t, momentum=0.5)),
    (lambda: SGD(0.05, momentum=lambda t: 0.5 + 0.05 * t, nesterov=True),
     lambda w, g: ref_sgd(w, g, 0.05, momentum=lambda t: 0.5 + 0.05 * t, nesterov=True)),
    (lambda: Adam(1e-2), lambda w, g: ref_adam(w, g, 1e-2, 0.9, 0.999, 1e-8)),
    (lambda: Adam(1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
     lambda w, g: ref_adam(w, g, 1e-2, 0.8, 0.99, 1e-6, l2=0.1)),
    (lambda: Adam(warmup, betas=(lambda t: 0.9 - 0.01 * t, 0.99)),
     lambda w, g: ref_adam(w, g, warmup, lambda t: 0.9 - 0.01 * t, 0.99, 1e-8)),
    (lambda: AdamW(1e-2), lambda w, g: ref_adam(w, g, 1e-2, 0.9, 0.999, 1e-8, decoupled=0.01)),
    (lambda: AdamW(1e-2, weight_decay=0.05), lambda w, g: ref_adam(w, g, 1e-2, 0.9, 0.999, 1e-8, decoupled=0.05)),
    (lambda: LAMB(1e-2), lambda w, g: ref_adam(w, g, 1e-2, 0.9, 0.999, 1e-6, lamb=True)),
    (lambda: LAMB(1e-2, weight_decay=0.01),
     lambda w, g: ref_adam(w, g, 1e-2, 0.9, 0.999, 1e-6, decoupled=0.01, lamb=True)),
    (lambda: LAMB(warmup, betas=(0.8, 0.9), weight_decay=0.1),
     lambda w, g: ref_adam(w, g, warmup, 0.8, 0.9, 1e-6, decoupled=0.1, lamb=True)),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_optimizer_matches_its_reference(case: int) -> None:
    make, reference = CASES[case]
    w0 = np.random.default_rng(case).standard_normal((7, 5)).astype(np.float32)
    grads = grads_for(w0.shape, 100 + case)
    got = run(make(), w0, grads)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, reference(w0, grads), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_float64_weights_follow_the_reference_closely(case: int) -> None:
    make, reference = CASES[case]
    w0 = np.random.default_rng(case).standard_normal(20)
    grads = grads_for(w0.shape, 200 + case, np.float64)
    got = run(make(), w0, grads)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, reference(w0, grads), rtol=1e-12, atol=1e-14)


def test_float16_weights_and_a_float64_gradient_compute_in_the_weights_dtype() -> None:
    w0 = np.linspace(-1, 1, 9).astype(np.float16)
    g64 = [g.astype(np.float64) for g in grads_for((9,), 3)]
    g16 = [g.astype(np.float16) for g in g64]
    for make in (lambda: SGD(0.1, momentum=0.9), lambda: Adam(1e-2, eps=1e-4)):
        got = run(make(), w0, g64)
        assert got.dtype == np.float16
        assert got.tobytes() == run(make(), w0, g16).tobytes()  # the gradient is cast first


# ------------------------------------------------------------------------------ hyper-parameters
def test_hyper_parameters_change_between_steps_without_rebuilding() -> None:
    opt = Adam(1e-2)
    w0 = np.ones(4, np.float32)
    grads = grads_for((4,), 1)
    w, state = w0.copy(), opt.init_state(4)
    for t, g in enumerate(grads, start=1):
        opt.lr = 1e-2 if t <= 3 else 1e-3  # a step schedule set from outside
        opt.betas = (0.9, 0.99) if t <= 2 else (0.8, 0.99)
        opt.update(w, g, state, t)
    split = w0.copy()
    state2 = Adam(1e-2).init_state(4)
    for t, g in enumerate(grads, start=1):
        Adam(1e-2 if t <= 3 else 1e-3, betas=(0.9 if t <= 2 else 0.8, 0.99)).update(split, g, state2, t)
    assert w.tobytes() == split.tobytes()
    scheduled = Adam(lambda t: 1e-2 if t <= 3 else 1e-3, betas=(lambda t: 0.9 if t <= 2 else 0.8, 0.99))
    assert run(scheduled, w0, grads).tobytes() == w.tobytes()
    assert scheduled.hypers(4) == {"lr": 1e-3, "beta1": 0.8, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.0}
    assert scheduled.betas[1] == 0.99 and "Adam(lr=<function" in repr(scheduled)


def test_sgd_momentum_set_later_asks_for_its_buffer() -> None:
    opt = SGD(0.1)
    assert opt.state_names == ()
    opt.momentum = 0.9
    # a property of the momentum just set, not the () mypy narrowed it to above
    assert opt.state_names == ("momentum_buffer",)  # type: ignore[comparison-overlap]
    with pytest.raises(ValueError, match="state lacks momentum_buffer"):
        opt.update(np.ones(3, np.float32), np.ones(3, np.float32), {}, 1)
    assert SGD(0.1, momentum=lambda t: 0.0).state_names == ("momentum_buffer",)


def test_a_momentum_schedule_at_zero_leaves_the_buffer_alone() -> None:
    opt = SGD(0.1, momentum=lambda t: 0.0 if t == 2 else 0.5)
    w, g = np.zeros(3, np.float32), np.ones(3, np.float32)
    state = opt.init_state(3)
    opt.update(w, g, state, 1)
    before = state["momentum_buffer"].copy()
    opt.update(w, g, state, 2)
    assert state["momentum_buffer"].tobytes() == before.tobytes()
    assert w.tolist() == [-0.2] * 3 or np.allclose(w, -0.2)


# ------------------------------------------------------------------------------ the bitwise rule
def shard_norm(pieces: list[np.ndarray]) -> float:
    """What the trainer does: every shard's parts added (in reverse, as another tree might), one norm."""
    total = np.zeros(PARTS_LENGTH)
    for p in reversed(pieces):
        total = total + sum_squares_parts(p)
    return norm_from_parts(total)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("n", [1, 13, 30, 257])
def test_shard_updates_are_slices_of_the_whole_update(case: int, n: int, dtype: Any) -> None:
    make, _ = CASES[case]
    rng = np.random.default_rng(n)
    w0 = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, n)).astype(dtype)
    grads = grads_for((n,), n + 1, dtype)
    whole = run(make(), w0, grads)
    for count in range(1, 8):
        layout = ShardLayout(n, count)
        opt = make()
        shards = [layout.shard(w0, j) for j in range(count)]
        states = [opt.init_state(s.shape, s.dtype) for s in shards]
        for t, g in enumerate(grads, start=1):
            gs = [layout.shard(g, j) for j in range(count)]
            if not opt.uses_norms:
                for j in range(count):
                    opt.update(shards[j], gs[j], states[j], t)
                continue
            ds = [opt.direction(shards[j], gs[j], states[j], t) for j in range(count)]
            ratio = opt.trust_ratio(shard_norm(shards), shard_norm(ds), t)
            for j in range(count):
                opt.apply(shards[j], ds[j], t, ratio)
        assert layout.join(np.stack(shards)).tobytes() == whole.tobytes(), f"{count} shards"
        for j in range(count):  # padding stays zero, in the weight and in the state
            assert not shards[j][layout.real(j):].any()
            assert not any(s[layout.real(j):].any() for s in states[j].values())


def expression_direction(opt: Optimizer, w: np.ndarray, g: np.ndarray, state: dict[str, np.ndarray],
                         step: int) -> np.ndarray:
    """The rules as numpy expressions (each temporary a new array), in the order the optimizers
    compute them: their scratch-buffer form must give exactly these bits."""
    t = w.dtype.type
    h = opt.hypers(step)
    if isinstance(opt, SGD):
        sgd = g + t(h["weight_decay"]) * w if h["weight_decay"] else g.copy()
        if not h["momentum"]:
            return sgd
        buf = state["momentum_buffer"]
        if step == 1:
            buf[...] = sgd
        else:
            np.multiply(buf, t(h["momentum"]), out=buf)
            np.add(buf, t(1.0 - h["dampening"]) * sgd, out=buf)
        return sgd + t(h["momentum"]) * buf if opt.nesterov else buf.copy()
    assert isinstance(opt, Adam)
    decay = h["weight_decay"]
    g = g + t(decay) * w if decay and not opt.decoupled else g
    m, v = state["exp_avg"], state["exp_avg_sq"]
    np.multiply(m, t(h["beta1"]), out=m)
    np.add(m, t(1.0 - h["beta1"]) * g, out=m)
    np.multiply(v, t(h["beta2"]), out=v)
    np.add(v, t(1.0 - h["beta2"]) * (g * g), out=v)
    d: np.ndarray = (m / t(1.0 - h["beta1"] ** step)) / (np.sqrt(v / t(1.0 - h["beta2"] ** step)) + t(h["eps"]))
    if decay and opt.decoupled:
        d += t(decay) * w
    return d


@pytest.mark.determinism
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_directions_have_the_bits_of_their_rules_as_expressions(case: int, dtype: Any) -> None:
    make, _ = CASES[case]
    opt, ref = make(), make()
    rng = np.random.default_rng(case)
    w = (rng.standard_normal(300) * 10.0 ** rng.integers(-3, 3, 300)).astype(dtype)
    state, ref_state = opt.init_state(w.shape, dtype), ref.init_state(w.shape, dtype)
    for t, g in enumerate(grads_for(w.shape, case, dtype), start=1):
        d = opt.direction(w, g, state, t)
        assert d.tobytes() == expression_direction(ref, w, g, ref_state, t).tobytes(), t
        assert all(state[k].tobytes() == ref_state[k].tobytes() for k in state), t
        w = w - dtype(0.01) * d


@pytest.mark.determinism
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_updates_block_by_block_give_the_bits_of_the_whole_tensor(case: int, dtype: Any) -> None:
    """A weight of several update blocks and part of one, flat, 2-D, and one that is no contiguous
    array (updated whole): ``update``'s bits are those of ``direction`` and ``apply`` on the
    whole tensor, and the state's too."""
    make, _ = CASES[case]
    block = UPDATE_BLOCK_BYTES // np.dtype(dtype).itemsize
    rng = np.random.default_rng(case)
    n = 37 * (2 * block // 37 + 3)  # two blocks and part of a third, in 37 rows
    w0 = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, n)).astype(dtype)
    grads = grads_for((n,), case + 1, dtype)[:3]
    for shape, order, blocks in (((n,), "C", [block, block, n - 2 * block]),
                                 ((37, n // 37), "C", [block, block, n - 2 * block]), ((37, n // 37), "F", [n])):
        opt, whole = make(), make()
        if not opt.uses_norms:  # the blocks the update works on, in order
            sizes: list[int] = []
            direction = opt._direction

            def recording(w: np.ndarray, *rest: Any, direction: Any = direction, sizes: list[int] = sizes) -> Any:
                sizes.append(w.size)
                return direction(w, *rest)

            opt._direction = recording  # type: ignore[method-assign, assignment]
        w = w0.reshape(shape).copy(order="F" if order == "F" else "C")
        ref = w.copy(order="K")
        state = {k: v.copy(order="F" if order == "F" else "C") for k, v in opt.init_state(shape, dtype).items()}
        ref_state = whole.init_state(shape, dtype)
        for t, g in enumerate(grads, start=1):
            opt.update(w, g.reshape(shape), state, t)
            d = whole.direction(ref, g.reshape(shape), ref_state, t)
            if whole.uses_norms:
                whole.apply(ref, d, t, whole.trust_ratio(exact_norm(ref), exact_norm(d), t))
            else:
                whole.apply(ref, d, t)
        assert np.ascontiguousarray(w).tobytes() == np.ascontiguousarray(ref).tobytes(), (shape, order)
        assert all(np.ascontiguousarray(state[k]).tobytes() == ref_state[k].tobytes() for k in state), (shape, order)
        if not opt.uses_norms:
            assert sizes == blocks * len(grads), (shape, order)


def test_update_with_a_norm_callable_uses_it_for_both_norms() -> None:
    seen: list[int] = []

    def norm(x: np.ndarray) -> float:
        seen.append(x.size)
        return 2.0

    w = np.ones(4, np.float32)
    opt = LAMB(0.1)
    opt.update(w, np.ones(4, np.float32), opt.init_state(4), 1, norm=norm)
    assert seen == [4, 4]
    d = 1 / (1 + np.float32(1e-6))  # m_hat = v_hat = 1 at the first step
    assert np.array_equal(w, np.ones(4, np.float32) - np.float32(0.1) * d)


def test_trust_ratio_rules() -> None:
    lamb = LAMB(0.1)
    assert lamb.trust_ratio(3.0, 1.5, 1) == 2.0
    assert lamb.trust_ratio(0.0, 1.5, 1) == 1.0 and lamb.trust_ratio(3.0, 0.0, 1) == 1.0
    assert math.isnan(lamb.trust_ratio(math.nan, 1.0, 1))
    assert Adam(0.1).trust_ratio(3.0, 1.5, 1) == 1.0


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
    (lambda: SGD(-0.1), r"SGD: lr=-0.1 is not valid \(a finite number at least 0\)"),
    (lambda: SGD(float("nan")), "SGD: lr=nan is not valid"),
    (lambda: SGD("0.1"),  # type: ignore[arg-type]
     "SGD: lr='0.1' is not a number"),
    (lambda: SGD(True), "SGD: lr=True is not a number"),
    (lambda: SGD(0.1, nesterov=True), "nesterov needs momentum > 0 and dampening 0"),
    (lambda: SGD(0.1, momentum=0.9, dampening=0.1, nesterov=True), "nesterov needs momentum > 0 and dampening 0"),
    (lambda: SGD(0.1, momentum=0.9, nesterov=1),  # type: ignore[arg-type]
     "SGD: nesterov must be True or False, got 1"),
    (lambda: SGD(0.1, dampening=2.0), r"dampening=2.0 is not valid \(a finite number at least 0 and at most 1\)"),
    (lambda: Adam(0.1, betas=(1.0, 0.9)), r"Adam: beta1=1.0 is not valid \(a finite number at least 0 and below 1\)"),
    (lambda: Adam(0.1, betas=(0.9, -0.1)), "Adam: beta2=-0.1 is not valid"),
    (lambda: Adam(0.1, betas=(0.9,)),  # type: ignore[arg-type]
     "betas=.* is not a pair"),
    (lambda: Adam(0.1, eps=0.0), r"Adam: eps=0.0 is not valid \(a finite number above 0\)"),
    (lambda: AdamW(0.1, weight_decay=-1), "AdamW: weight_decay=-1 is not valid"),
    (lambda: LAMB(0.1, eps=-1.0), "LAMB: eps=-1.0 is not valid"),
])
def test_bad_hyper_parameters_are_one_clear_error(make: Any, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        make()


def test_bad_assignments_and_names() -> None:
    opt = Adam(0.1)
    with pytest.raises(ValueError, match=r"Adam: beta1=1\.5 is not valid"):
        opt.betas = (1.5, 0.9)
    assert opt.betas == (0.9, 0.999)
    with pytest.raises(ValueError, match=r"Adam: no hyper-parameter 'momentum' \(it has lr, beta1"):
        opt.hyper("momentum", 1)
    with pytest.raises(TypeError, match="state dtype int32 is not floating point"):
        opt.init_state(3, np.int32)


def unchanged(before: list[np.ndarray], after: list[np.ndarray]) -> bool:
    return all(a.tobytes() == b.tobytes() for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("make", [lambda: SGD(0.1, momentum=0.9), lambda: Adam(0.1), lambda: LAMB(0.1)])
def test_bad_state_step_or_arrays_change_nothing(make: Callable[[], Optimizer]) -> None:
    opt = make()
    name = opt.state_names[0]
    w, g = np.ones(3, np.float32), np.ones(3, np.float32)
    state = opt.init_state(3)
    snapshot = [w.copy(), *(v.copy() for v in state.values())]
    bad: list[tuple[Any, Any, Any, Any, str]] = [
        (w, g, {}, 1, f"state lacks {name}"),
        (w, np.ones(2, np.float32), state, 1, r"gradient shape \(2,\) differs from the weight's \(3,\)"),
        (w, g, state, 0, r"step \(the 1-based update number\)=0 is invalid"),
        (w, g, state, 1.5, "must be an integer"),
        (w, g, {**state, name: np.zeros(4, np.float32)}, 1, rf"state '{name}' is float32\[4\], it must be like"),
        (w, g, {**state, name: np.zeros(3, np.float64)}, 1, rf"state '{name}' is float64\[3\]"),
        (w, np.ones(3, complex), state, 1, "gradient dtype complex128 is not a real number type"),
        (np.ones(3, np.int32), g, state, 1, "the weight must be a floating-point ndarray"),
        (np.broadcast_to(np.float32(1), (3,)), g, state, 1, "the weight is read-only"),
    ]
    for weight, grad, st, step, message in bad:
        with pytest.raises((ValueError, TypeError), match=message):
            opt.update(weight, grad, st, step)
        assert unchanged(snapshot, [w, *state.values()])


def test_bad_schedule_values_are_found_before_the_state_changes() -> None:
    opt = Adam(lambda t: 0.1 if t < 2 else float("inf"))
    w, g = np.ones(3, np.float32), np.ones(3, np.float32)
    state = opt.init_state(3)
    opt.update(w, g, state, 1)
    after_one = [w.copy(), *(v.copy() for v in state.values())]
    with pytest.raises(ValueError, match=r"Adam: lr\(2\)=inf is not valid"):
        opt.update(w, g, state, 2)
    opt.lr = 0.1
    opt.beta2 = lambda t: "0.9"  # type: ignore[assignment,return-value]
    with pytest.raises(TypeError, match=r"beta2\(2\)='0.9' is not a number"):
        opt.update(w, g, state, 2)
    opt.beta2 = 0.999
    nesterov = SGD(0.1, momentum=lambda t: 0.9 if t < 2 else 0.0, nesterov=True)
    w2, nstate = np.ones(3, np.float32), nesterov.init_state(3)
    nesterov.update(w2, g, nstate, 1)
    after_one += [w2.copy(), nstate["momentum_buffer"].copy()]
    with pytest.raises(ValueError, match="nesterov needs momentum > 0 and dampening 0 at update 2"):
        nesterov.update(w2, g, nstate, 2)
    assert unchanged(after_one, [w, *state.values(), w2, nstate["momentum_buffer"]])


def test_eps_that_rounds_to_zero_in_the_weights_dtype_is_refused() -> None:
    opt = Adam(0.1)  # eps 1e-8 is 0 in float16: 0 / 0 where the gradient was always 0
    w = np.ones(3, np.float16)
    state = opt.init_state(3, np.float16)
    with pytest.raises(ValueError, match=r"eps=1e-08 is 0 in the weight's dtype float16; use at least 5\.96046e-08"):
        opt.update(w, np.ones(3, np.float16), state, 1)
    assert not any(v.any() for v in state.values())


def test_apply_checks_the_direction_shape() -> None:
    with pytest.raises(ValueError, match=r"direction shape \(2,\) differs from the weight's \(3,\)"):
        SGD(0.1).apply(np.ones(3, np.float32), np.ones(2, np.float32), 1)
