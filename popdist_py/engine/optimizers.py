"""Optimizers whose updates work on a whole tensor or on any replica's shard of it, bitwise alike.

A training step runs an optimizer either on a whole (flattened) tensor or, with replicated tensor
sharding, on each replica's shard of the weight, its gradient and its state (zero padded at the
shard's end). Every update here is elementwise numpy in the weight's dtype, so the shard results
are bitwise the slices of the whole-tensor result for any shard count. LAMB's trust ratio also
needs whole-tensor norms; :func:`sum_squares_parts` gives exact, partition-independent partial
sums of squares, so the norm is bitwise the same however the tensor is sharded (sum the parts of
all shards, e.g. with ``replicated_all_reduce(parts, "add")`` over the sharding domain, then
:func:`norm_from_parts`).

An update is three phases, so a caller can batch the norm collectives of many tensors:
``direction`` (updates the state in place, returns the direction ``d``), ``trust_ratio`` (1.0 but
for LAMB) and ``apply`` (``weight -= lr * ratio * d`` in place); ``update`` chains them.
Hyper-parameters are plain attributes, each a number or a schedule (a callable from the 1-based
update number to a number), read at every update: change them between steps, nothing is rebuilt.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

#: A hyper-parameter: a value, or a schedule (1-based update number -> value).
Hyper = float | Callable[[int], float]


# ---------------------------------------------------------------------------------------- exact norms
#: frexp exponents of float64 values (subnormals included) and of the squares of float32 values.
_EXP_MIN, _EXP_MAX = -1073, 1024
_BUCKETS = _EXP_MAX - _EXP_MIN + 1
#: A 53-bit mantissa is summed as three integer pieces of 18 bits; each bucket's sum stays an
#: exact float64 integer (below 2**53) for up to 2**35 elements.
_PART_BITS = 18
MAX_NORM_ELEMENTS = 1 << 35
_PART_SCALE = float(1 << _PART_BITS)
_CHUNK = 1 << 18
PARTS_LENGTH = 3 * _BUCKETS


def sum_squares_parts(x: np.ndarray) -> np.ndarray:
    """Exact partial sums of ``x``'s squares: a float64 vector of ``PARTS_LENGTH`` integers.

    Adding the parts of the pieces of a tensor, in any order, gives exactly the parts of the whole:
    each square, computed in float64 (exact for float32, float16 and integer inputs below 2**26;
    float64 inputs' squares are rounded once, the same way everywhere), is split into exponent and
    three integer pieces of its mantissa, and the pieces are summed per exponent, all in integers
    that float64 holds exactly.
    """
    flat = np.asarray(x).reshape(-1)
    if flat.size > MAX_NORM_ELEMENTS:
        raise ValueError(f"sum_squares_parts: {flat.size} elements, at most {MAX_NORM_ELEMENTS} are summed exactly")
    if not (np.issubdtype(flat.dtype, np.floating) or np.issubdtype(flat.dtype, np.integer)):
        raise TypeError(f"sum_squares_parts: dtype {flat.dtype} is not a real number type")
    parts = np.zeros(PARTS_LENGTH, np.float64)
    for begin in range(0, flat.size, _CHUNK):  # in chunks: stays in cache, no huge temporaries
        squares = flat[begin:begin + _CHUNK].astype(np.float64)
        np.multiply(squares, squares, out=squares)
        if not np.isfinite(squares).all():
            raise ValueError("sum_squares_parts: the tensor has infinite or NaN values (or squares beyond float64)")
        mantissa, exponent = np.frexp(squares)
        bucket = exponent.astype(np.intp)
        bucket -= _EXP_MIN
        for k in range(3):  # the mantissa, 18 bits at a time, as exact float64 integers
            mantissa *= _PART_SCALE
            piece = np.floor(mantissa)
            mantissa -= piece
            parts[k * _BUCKETS:(k + 1) * _BUCKETS] += np.bincount(bucket, weights=piece, minlength=_BUCKETS)
    return parts


def norm_from_parts(parts: np.ndarray) -> float:
    """The L2 norm, correctly rounded to float64, of the tensor whose (summed) parts these are."""
    parts = np.asarray(parts, np.float64)
    if parts.shape != (PARTS_LENGTH,):
        raise ValueError(f"norm_from_parts: parts of shape {parts.shape}, expected ({PARTS_LENGTH},)")
    total = 0  # the sum of squares as an integer times 2 ** scale
    for k in range(3):  # piece k of a mantissa m * 2**e weighs 2 ** (e - 18 (k + 1))
        for b in np.flatnonzero(parts[k * _BUCKETS:(k + 1) * _BUCKETS]):
            total += int(parts[k * _BUCKETS + b]) << (int(b) + (2 - k) * _PART_BITS)
    if total == 0:
        return 0.0
    scale = _EXP_MIN - 3 * _PART_BITS  # make the scale even for the root
    if scale % 2:
        total <<= 1
        scale -= 1
    shift = max(0, 120 - total.bit_length()) // 2  # at least 60 bits of root
    total <<= 2 * shift
    root = math.isqrt(total)
    if root * root != total:
        root |= 1  # a sticky bit below the 53 kept, so float() rounds the exact root correctly
    return math.ldexp(float(root), scale // 2 - shift)


def exact_norm(x: np.ndarray) -> float:
    """The L2 norm of ``x`` (local: the whole tensor is ``x``), partition-independent like the parts."""
    return norm_from_parts(sum_squares_parts(x))


# ---------------------------------------------------------------------------------------- optimizers
def _check_number(owner: str, name: str, value: float, low: float, high: float | None, *,
                  high_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise TypeError(f"{owner}: {name}={value!r} is not a number")
    v = float(value)
    above = high is not None and (v >= high if high_open else v > high)
    if not math.isfinite(v) or v < low or above:
        bound = "" if high is None else f", {'below' if high_open else 'at most'} {high:g}"
        raise ValueError(f"{owner}: {name}={value!r} is not valid (a finite number, at least {low:g}{bound})")
    return v


class Optimizer:
    """Base: hyper-parameter resolution, state creation and checks, ``apply`` and ``update``."""

    #: attribute name -> (lowest valid value, highest or None, highest excluded)
    _limits: ClassVar[dict[str, tuple[float, float | None, bool]]] = {"lr": (0.0, None, False)}
    lr: Hyper
    state_names: tuple[str, ...] = ()
    uses_norms = False

    def __init__(self, **hypers: Any) -> None:
        for name, value in hypers.items():
            if not callable(value):
                self._check(name, value)
            setattr(self, name, value)

    def _check(self, name: str, value: Any) -> float:
        low, high, high_open = self._limits[name]
        return _check_number(type(self).__name__, name, value, low, high, high_open=high_open)

    def hyper(self, name: str, step: int) -> float:
        """Attribute ``name`` at 1-based update ``step``: its value, or its schedule's value there."""
        value = getattr(self, name)
        if callable(value):
            value = value(step)
        return self._check(name, value)

    def init_state(self, shape: tuple[int, ...] | int, dtype: Any = np.float32) -> dict[str, np.ndarray]:
        """New zero state tensors, one per name in ``state_names``."""
        return {name: np.zeros(shape, dtype) for name in self.state_names}

    def check(self, weight: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray], step: int) -> None:
        """Shapes, dtypes and state names: one error naming what does not fit, before anything changes."""
        owner = type(self).__name__
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 1:
            raise ValueError(f"{owner}: step={step!r} is not valid (the 1-based update number)")
        if not np.issubdtype(weight.dtype, np.floating):
            raise TypeError(f"{owner}: the weight's dtype {weight.dtype} is not floating point")
        if grad.shape != weight.shape:
            raise ValueError(f"{owner}: gradient shape {grad.shape} differs from the weight's {weight.shape}")
        for name in self._limits:  # schedules too: a bad value is found before the state changes
            self.hyper(name, step)
        missing = [n for n in self.state_names if n not in state]
        if missing:
            raise ValueError(f"{owner}: state lacks {', '.join(missing)} (it needs {', '.join(self.state_names)})")
        for name in self.state_names:
            if state[name].shape != weight.shape or state[name].dtype != weight.dtype:
                raise ValueError(f"{owner}: state {name!r} is {state[name].dtype}{list(state[name].shape)}, "
                                 f"the weight {weight.dtype}{list(weight.shape)}")

    def direction(self, weight: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray], step: int) -> np.ndarray:
        raise NotImplementedError

    def trust_ratio(self, weight_norm: float, direction_norm: float, step: int) -> float:
        """How much of ``lr`` this tensor takes: 1.0 (LAMB overrides)."""
        return 1.0

    def apply(self, weight: np.ndarray, d: np.ndarray, step: int, trust_ratio: float = 1.0) -> None:
        """``weight -= lr * trust_ratio * d`` in place (the scalar is formed once, in float64)."""
        scale = weight.dtype.type(self.hyper("lr", step) * trust_ratio)
        np.subtract(weight, scale * d, out=weight)

    def update(self, weight: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray], step: int,
               norm: Callable[[np.ndarray], float] | None = None) -> None:
        """One update in place. ``norm(x)``: the L2 norm of the whole tensor of which ``x`` is this
        piece (default: ``x`` is the whole tensor); only LAMB asks for it."""
        d = self.direction(weight, grad, state, step)
        ratio = 1.0
        if self.uses_norms:
            measure = norm or exact_norm
            ratio = self.trust_ratio(measure(weight), measure(d), step)
        self.apply(weight, d, step, ratio)


class SGD(Optimizer):
    """Stochastic gradient descent with PyTorch's rules: L2 ``weight_decay`` added to the gradient;
    the momentum buffer starts as the first step's gradient; ``nesterov`` looks ahead."""

    _limits: ClassVar[dict[str, tuple[float, float | None, bool]]] = {
        "lr": (0.0, None, False), "momentum": (0.0, None, False),
        "dampening": (0.0, 1.0, False), "weight_decay": (0.0, None, False)}
    momentum: Hyper
    dampening: Hyper
    weight_decay: Hyper

    def __init__(self, lr: Hyper, momentum: Hyper = 0.0, dampening: Hyper = 0.0, nesterov: bool = False,
                 weight_decay: Hyper = 0.0) -> None:
        super().__init__(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay)
        if not isinstance(nesterov, bool):
            raise TypeError(f"SGD: nesterov={nesterov!r} is not True or False")
        if nesterov and (callable(momentum) or momentum == 0 or callable(dampening) or dampening != 0):
            raise ValueError(f"SGD: nesterov needs a constant momentum > 0 and dampening 0 "
                             f"(got momentum={momentum!r}, dampening={dampening!r})")
        self.nesterov = nesterov
        self.state_names = ("momentum_buffer",) if callable(momentum) or momentum != 0 else ()

    def direction(self, weight: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray], step: int) -> np.ndarray:
        self.check(weight, grad, state, step)
        t = weight.dtype.type
        decay = self.hyper("weight_decay", step)
        d = grad + t(decay) * weight if decay else grad.copy()
        if not self.state_names:
            return d
        momentum, dampening = self.hyper("momentum", step), self.hyper("dampening", step)
        buf = state["momentum_buffer"]
        if step == 1:
            buf[...] = d
        else:
            np.multiply(buf, t(momentum), out=buf)
            np.add(buf, t(1.0 - dampening) * d, out=buf)
        if self.nesterov:
            return d + t(momentum) * buf
        return buf.copy()


class Adam(Optimizer):
    """Adam (Kingma & Ba) with bias correction; ``weight_decay`` is L2, added to the gradient."""

    _limits: ClassVar[dict[str, tuple[float, float | None, bool]]] = {
        "lr": (0.0, None, False), "beta1": (0.0, 1.0, True), "beta2": (0.0, 1.0, True),
        "eps": (0.0, None, False), "weight_decay": (0.0, None, False)}
    beta1: Hyper
    beta2: Hyper
    eps: Hyper
    weight_decay: Hyper
    state_names = ("exp_avg", "exp_avg_sq")
    decoupled = False

    def __init__(self, lr: Hyper, betas: tuple[Hyper, Hyper] = (0.9, 0.999), eps: Hyper = 1e-8,
                 weight_decay: Hyper = 0.0) -> None:
        if not isinstance(betas, tuple | list) or len(betas) != 2:
            raise ValueError(f"{type(self).__name__}: betas={betas!r} is not a pair (beta1, beta2)")
        super().__init__(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay)

    @property
    def betas(self) -> tuple[Hyper, Hyper]:
        return (self.beta1, self.beta2)

    def direction(self, weight: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray], step: int) -> np.ndarray:
        self.check(weight, grad, state, step)
        t = weight.dtype.type
        beta1, beta2 = self.hyper("beta1", step), self.hyper("beta2", step)
        eps, decay = self.hyper("eps", step), self.hyper("weight_decay", step)
        g = grad + t(decay) * weight if decay and not self.decoupled else grad
        m, v = state["exp_avg"], state["exp_avg_sq"]
        np.multiply(m, t(beta1), out=m)
        np.add(m, t(1.0 - beta1) * g, out=m)
        np.multiply(v, t(beta2), out=v)
        np.add(v, t(1.0 - beta2) * (g * g), out=v)
        m_hat = m / t(1.0 - beta1 ** step)
        v_hat = v / t(1.0 - beta2 ** step)
        d = m_hat / (np.sqrt(v_hat) + t(eps))
        if decay and self.decoupled:
            d += t(decay) * weight
        return d


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter): ``weight_decay * w`` joins the
    direction, so the applied step is ``lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * w)``."""

    decoupled = True

    def __init__(self, lr: Hyper, betas: tuple[Hyper, Hyper] = (0.9, 0.999), eps: Hyper = 1e-8,
                 weight_decay: Hyper = 0.01) -> None:
        super().__init__(lr, betas, eps, weight_decay)


class LAMB(AdamW):
    """LAMB (You et al., arXiv:1904.00962): AdamW's direction ``r`` scaled per tensor by the trust
    ratio ``||w|| / ||r||`` (1.0 when either norm is 0), so every layer moves by about ``lr``
    relative to its own size. The norms are of whole tensors, also when the tensor is sharded."""

    uses_norms = True

    def __init__(self, lr: Hyper, betas: tuple[Hyper, Hyper] = (0.9, 0.999), eps: Hyper = 1e-6,
                 weight_decay: Hyper = 0.0) -> None:
        super().__init__(lr, betas, eps, weight_decay)

    def trust_ratio(self, weight_norm: float, direction_norm: float, step: int) -> float:
        if weight_norm > 0.0 and direction_norm > 0.0:
            return weight_norm / direction_norm
        return 1.0


#: The optimizers by name (the example's ``--optimizer``; ``momentum`` is SGD with momentum 0.9).
OPTIMIZERS: dict[str, Callable[..., Optimizer]] = {"sgd": SGD, "adam": Adam, "adamw": AdamW, "lamb": LAMB}

__all__ = ["LAMB", "MAX_NORM_ELEMENTS", "OPTIMIZERS", "PARTS_LENGTH", "SGD", "Adam", "AdamW", "Hyper",
           "Optimizer", "exact_norm", "norm_from_parts", "sum_squares_parts"]
