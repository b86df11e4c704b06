"""Optimizers whose updates work on a whole tensor or on any replica's shard of it, bitwise alike.

A training step runs an optimizer either on a whole (flattened) tensor or, with replicated tensor
sharding, on each replica's shard of the weight, its gradient and its state (zero padded at the
shard's end). Every update here is elementwise numpy in the weight's dtype, so the shard results
are bitwise the slices of the whole-tensor result for any shard count, and zero padding stays
zero. LAMB's trust ratio also needs whole-tensor norms; :func:`sum_squares_parts` gives exact,
partition-independent partial sums of squares, so the norm is bitwise the same however the
tensor is sharded (sum the parts of all shards, e.g. with ``replicated_all_reduce(parts, "add")``
over the sharding domain, then :func:`norm_from_parts`).

An update is three phases, so a caller can batch the norm collectives of many tensors:
``direction`` (checks everything, updates the state in place, returns the direction ``d``),
``trust_ratio`` (1.0 but for LAMB) and ``apply`` (``weight -= lr * ratio * d`` in place);
``update`` chains them. Hyper-parameters are plain attributes, each a number or a schedule (a
callable from the 1-based update number to a number), read at every update: change them between
steps, nothing is rebuilt.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np

from popdist_py import validate

#: A hyper-parameter: a value, or a schedule (1-based update number -> value).
Hyper = float | Callable[[int], float]


# ---------------------------------------------------------------------------------------- exact norms
# The parts are integer-valued float64 sums in fixed slots, each slot weighing a fixed power of
# two, so adding the parts of any partition in any order gives exactly the parts of the whole.
#
# Region A (float16, float32 and 8/16-bit integers; the fast path): a square x*x is exact in
# float64 with at most 48 significant bits, (hi * 2**24 + lo) * 2**(E - 1070) with E its biased
# float64 exponent and hi, lo < 2**24 read straight from its bits. hi and lo are summed per E:
# exact while a slot adds fewer than 2**29 values. Zeros add nothing (so do shard padding's).
# Region B (float64, 32/64-bit integers): x = m * 2**e (frexp) and m = h + l, h its top 26 bits
# rounded to nearest, |l| <= 2**-27 with 26 bits; h*h, 2*h*l and l*l are exact and add up to m*m.
# Each such term t = u * 2**(f + 2e) (u its frexp mantissa) goes to bucket b of _WIDTH exponents
# (f + 2e - _EXP_MIN = _WIDTH * b + o) as q = u * 2**o = p0 + p1 2**-18 + p2 2**-36 + p3 2**-54,
# integers |p_k| <= 2**18, summed per bucket and k: exact while a slot adds fewer than 2**35.
_A_FIRST = 724  # region A's slot E - 724 holds the squares of biased exponent E; slot 0 stays 0
_A_SLOTS = 1280 - _A_FIRST  # float32 squares: 2**-298 (E = 725) .. below 2**256 (E = 1279)
_A_MASK = np.uint64((1 << 24) - 1)
_WIDTH = 18
_PIECES = 4  # 18 + 53 bits of q in 4 pieces of 18
_EXP_MIN, _EXP_MAX = -2251, 2049  # frexp exponents of region B terms: l*l of 2**-1074 .. h*h of 2**1024
_BUCKETS = -(-(_EXP_MAX - _EXP_MIN + 1) // _WIDTH)
_B_START = 2 * _A_SLOTS
#: Length of a parts vector: region A (hi, lo), region B (4 pieces), the counts of NaN and inf.
PARTS_LENGTH = _B_START + _PIECES * _BUCKETS + 2
#: The most elements a whole tensor may have for its norm to be exact: float16, float32 and small
#: integers; float64 and 32/64-bit integers (three terms each).
MAX_NORM_ELEMENTS = 1 << 29
MAX_NORM_ELEMENTS_FLOAT64 = 1 << 33
_CHUNK = 1 << 14  # elements per pass: the temporaries (128 KiB each) stay in cache
_SQUARE_EXACT = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.int8, np.uint8, np.int16, np.uint16))
_SPLIT = frozenset(np.dtype(t) for t in (np.float64, np.int32, np.uint32, np.int64, np.uint64))


def sum_squares_parts(x: np.ndarray) -> np.ndarray:
    """Exact partial sums of ``x``'s squares: a float64 vector of ``PARTS_LENGTH`` integers.

    Adding the parts of the pieces of a tensor, in any order (an all-reduce with "add"), gives
    exactly the parts of the whole, so :func:`norm_from_parts` of the sum is bitwise the same for
    every sharding. Exact for float16, float32 and float64 (float64 without overflow or underflow:
    its squares are never formed, only exact products of mantissa halves; about 12x slower) and
    for integers up to 2**53 in magnitude. NaN and infinite values are counted, not refused: the
    norm is then NaN or inf, as IEEE arithmetic would have it, and every replica still takes part
    in the same collectives. The whole tensor may have at most ``MAX_NORM_ELEMENTS`` elements
    (float64 and 32/64-bit integers: ``MAX_NORM_ELEMENTS_FLOAT64``); a piece can only check itself.
    """
    flat = np.asarray(x).reshape(-1)
    dtype = flat.dtype
    if dtype not in _SQUARE_EXACT and dtype not in _SPLIT:
        raise TypeError(f"sum_squares_parts: dtype {dtype} is not supported (float16, float32, float64 "
                        f"or an integer type)")
    limit = MAX_NORM_ELEMENTS if dtype in _SQUARE_EXACT else MAX_NORM_ELEMENTS_FLOAT64
    if flat.size > limit:
        raise ValueError(f"sum_squares_parts: {flat.size} elements of {dtype}; at most {limit} are summed exactly")
    if dtype.kind in "iu" and dtype.itemsize == 8 and flat.size and (
            int(flat.max()) > 1 << 53 or int(flat.min()) < -(1 << 53)):
        raise ValueError(f"sum_squares_parts: {dtype} values beyond 2**53 in magnitude are not summed exactly")
    parts = np.zeros(PARTS_LENGTH, np.float64)
    region_a = parts[:_B_START].reshape(2, _A_SLOTS)
    region_b = parts[_B_START:-2].reshape(_PIECES, _BUCKETS)
    for begin in range(0, flat.size, _CHUNK):
        chunk = flat[begin:begin + _CHUNK]
        if dtype in _SQUARE_EXACT and _add_squares(region_a, chunk):
            continue
        finite = np.isfinite(chunk)
        if not finite.all():
            parts[-2] += np.count_nonzero(np.isnan(chunk))
            parts[-1] += np.count_nonzero(np.isinf(chunk))
            chunk = np.where(finite, chunk, 0)
        if dtype in _SQUARE_EXACT:
            _add_squares(region_a, chunk)
        else:
            _add_split_squares(region_b, chunk.astype(np.float64))
    return parts


def _add_squares(region: np.ndarray, chunk: np.ndarray) -> bool:
    """Region A: adds the squares of ``chunk`` (exact in float64, at most 48 bits) by their bits,
    or returns False, adding nothing, when one is NaN or inf (exponent 2047: a slot beyond)."""
    squares = chunk.astype(np.float64)
    np.multiply(squares, squares, out=squares)
    bits = squares.view(np.uint64)
    slot = (bits >> np.uint64(52)).astype(np.intp)  # the biased exponent (squares are >= 0)
    slot -= _A_FIRST
    np.maximum(slot, 0, out=slot)  # zeros (exponent 0) to slot 0, which norm_from_parts skips
    bits &= np.uint64((1 << 52) - 1)
    bits |= np.uint64(1 << 52)  # the 53-bit significand, whose low 5 bits are 0
    high = np.bincount(slot, weights=(bits >> np.uint64(29)).astype(np.float64), minlength=_A_SLOTS)
    if high.size > _A_SLOTS:
        return False
    high[0] = 0.0  # zeros (with a spurious implicit bit) add nothing: padding changes no part
    bits >>= np.uint64(5)
    bits &= _A_MASK
    region[0] += high
    region[1] += np.bincount(slot, weights=bits.astype(np.float64), minlength=_A_SLOTS)
    return True


def _add_split_squares(region: np.ndarray, values: np.ndarray) -> None:
    """Region B: the three exact terms of each float64 value's square, in pieces by bucket."""
    mantissa, exponent = np.frexp(values)
    high = np.rint(mantissa * 2.0**26)
    high *= 2.0**-26
    low = mantissa - high
    twice = exponent.astype(np.intp)
    twice *= 2
    twice -= _EXP_MIN
    for term in (high * high, 2.0 * high * low, low * low):
        q, shift = np.frexp(term)
        shift = shift + twice  # >= 0: a zero term's exponent is 2e >= -2146
        bucket = shift // _WIDTH
        shift -= _WIDTH * bucket
        shift += 1023
        shift <<= 52
        q *= shift.view(np.float64)  # 2**o, built from its bits; |q| < 2**18
        for k in range(_PIECES):
            piece = np.floor(q)
            q -= piece
            q *= float(1 << _WIDTH)
            region[k] += np.bincount(bucket, weights=piece, minlength=_BUCKETS)


def norm_from_parts(parts: np.ndarray) -> float:
    """The L2 norm, correctly rounded to float64, of the tensor whose (summed) parts these are:
    NaN if it has a NaN, inf if it has an infinite value (or the norm exceeds float64)."""
    parts = np.asarray(parts, np.float64)
    if parts.shape != (PARTS_LENGTH,):
        raise ValueError(f"norm_from_parts: parts of shape {parts.shape}, expected ({PARTS_LENGTH},) "
                         f"from sum_squares_parts")
    if not (np.isfinite(parts).all() and (parts == np.floor(parts)).all() and parts[:_B_START].min() >= 0
            and parts[-2:].min() >= 0):
        raise ValueError("norm_from_parts: these are not sums of sum_squares_parts vectors "
                         "(non-integer, non-finite or negative values)")
    if parts[-2]:
        return math.nan
    if parts[-1]:
        return math.inf
    # the sum of squares as an integer times 2 ** (_EXP_MIN - 54), region B's last piece
    base = _EXP_MIN - _WIDTH * (_PIECES - 1)
    total = 0
    region_a = parts[:_B_START].reshape(2, _A_SLOTS)
    for slot in np.flatnonzero(region_a[:, 1:].any(axis=0)).tolist():
        biased = slot + 1 + _A_FIRST  # (hi * 2**24 + lo) * 2 ** (biased - 1070)
        total += ((int(region_a[0, slot + 1]) << 24) + int(region_a[1, slot + 1])) << (biased - 1070 - base)
    region_b = parts[_B_START:-2].reshape(_PIECES, _BUCKETS)
    for k in range(_PIECES):
        for b in np.flatnonzero(region_b[k]).tolist():
            total += int(region_b[k, b]) << (_WIDTH * b + _WIDTH * (_PIECES - 1 - k))
    if total < 0:
        raise ValueError("norm_from_parts: these parts sum to a negative value; they are not sums of squares")
    return _sqrt_rounded(total, base)


def _sqrt_rounded(total: int, scale: int) -> float:
    """``sqrt(total * 2**scale)`` correctly rounded to float64 (round half to even), subnormal
    and overflowing results included: an integer root of at least 66 bits, whether it is exact,
    and the rounding done here on integers, so nothing is rounded twice."""
    if total == 0:
        return 0.0
    if scale % 2:
        total <<= 1
        scale -= 1
    shift = (133 - total.bit_length()) // 2  # 4**shift * total has >= 131 bits
    if shift >= 0:
        scaled, lost = total << 2 * shift, False
    else:
        scaled, lost = total >> -2 * shift, total & ((1 << -2 * shift) - 1) != 0
    root = math.isqrt(scaled)  # sqrt(total * 2**scale) = (root + frac) * 2**unit, 0 <= frac < 1
    inexact = lost or root * root != scaled
    unit = scale // 2 - shift
    ulp = max(root.bit_length() - 1 + unit - 52, -1074)  # the weight of the result's last bit
    drop = ulp - unit  # >= 13
    kept, rest, half = root >> drop, root & ((1 << drop) - 1), 1 << (drop - 1)
    if rest > half or (rest == half and (inexact or kept & 1)):
        kept += 1
    if kept.bit_length() + ulp > 1024:
        return math.inf
    return math.ldexp(float(kept), ulp)


def exact_norm(x: np.ndarray) -> float:
    """The L2 norm of ``x`` (local: the whole tensor is ``x``), partition-independent like the parts."""
    return norm_from_parts(sum_squares_parts(x))


# ---------------------------------------------------------------------------------------- optimizers
#: A hyper-parameter's valid range: (low, low excluded, high or None, high excluded).
_Range = tuple[float, bool, float | None, bool]
_AT_LEAST_0: _Range = (0.0, False, None, False)
_ABOVE_0: _Range = (0.0, True, None, False)
_UNIT: _Range = (0.0, False, 1.0, False)
_BELOW_1: _Range = (0.0, False, 1.0, True)


def _check_number(owner: str, name: str, value: Any, valid: _Range) -> float:
    """``value`` as a float inside ``valid``, else one error naming it and the valid range."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.floating | np.integer):
        raise TypeError(f"{owner}: {name}={value!r} is not a number (nor a schedule: a callable step -> number)")
    v = float(value)
    low, low_open, high, high_open = valid
    if not (math.isfinite(v) and (v > low if low_open else v >= low)
            and (high is None or (v < high if high_open else v <= high))):
        bound = f"{'above' if low_open else 'at least'} {low:g}"
        if high is not None:
            bound += f" and {'below' if high_open else 'at most'} {high:g}"
        raise ValueError(f"{owner}: {name}={value!r} is not valid (a finite number {bound})")
    return v


#: Bytes of the weight an update without norms works on at a time (:meth:`Optimizer.update`).
UPDATE_BLOCK_BYTES = 256 << 10
#: Scratch arrays a direction is computed in.
_SCRATCH = 2


def _blocks(weight: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray]
            ) -> Iterator[tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]]:
    """``weight``, ``grad`` and ``state`` cut into aligned flat blocks of :data:`UPDATE_BLOCK_BYTES`
    (views: updates write through), or whole when the weight or a state tensor is no contiguous
    array (no flat view of it exists)."""
    if not all(a.flags.c_contiguous for a in (weight, *state.values())):
        yield weight, grad, state
        return
    w, g = weight.reshape(-1), grad.reshape(-1)
    flat = {name: s.reshape(-1) for name, s in state.items()}
    size = max(1, UPDATE_BLOCK_BYTES // weight.dtype.itemsize)
    for lo in range(0, w.size, size):
        part = slice(lo, lo + size)
        yield w[part], g[part], {name: s[part] for name, s in flat.items()}


def _descend(weight: np.ndarray, d: np.ndarray, lr: float, trust_ratio: float,
             scratch: np.ndarray | None = None) -> None:
    """``weight -= lr * trust_ratio * d`` in place, the scalar formed once in float64 and rounded to
    the weight's dtype (equal scalars, equal bits on every shard); ``scratch`` (``d`` itself, when
    it is no longer needed) takes the product instead of a new array."""
    np.subtract(weight, np.multiply(d, weight.dtype.type(lr * trust_ratio), out=scratch), out=weight)


class Optimizer:
    """Base: hyper-parameter resolution, state creation and checks, ``apply`` and ``update``.

    A subclass lists its hyper-parameters with their valid ranges in ``_ranges`` and the state it
    keeps per weight in ``_state``; it implements ``direction``.
    """

    _ranges: ClassVar[dict[str, _Range]] = {"lr": _AT_LEAST_0}
    _state: ClassVar[tuple[str, ...]] = ()
    lr: Hyper
    #: True when ``update`` needs whole-tensor norms (the trainer then sums shards' parts).
    uses_norms: ClassVar[bool] = False

    def __init__(self, **hypers: Any) -> None:
        for name, value in hypers.items():
            setattr(self, name, self._checked_hyper(name, value))

    def _checked_hyper(self, name: str, value: Any) -> Any:
        """A schedule as it is (checked at each update), a value checked now."""
        if not callable(value):
            _check_number(type(self).__name__, name, value, self._ranges[name])
        return value

    def __repr__(self) -> str:
        values = ", ".join(f"{n}={getattr(self, n)!r}" for n in self._ranges)
        return f"{type(self).__name__}({values})"

    @property
    def state_names(self) -> tuple[str, ...]:
        """The per-weight state tensors, each shaped like the weight (or its shard)."""
        return self._state

    def hyper(self, name: str, step: int) -> float:
        """Attribute ``name`` at 1-based update ``step``: its value, or its schedule's value there."""
        owner = type(self).__name__
        if name not in self._ranges:
            raise ValueError(f"{owner}: no hyper-parameter {name!r} (it has {', '.join(self._ranges)})")
        value, label = getattr(self, name), name
        if callable(value):  # a schedule: name its value at this step in an error
            value, label = value(step), f"{name}({step})"
        return _check_number(owner, label, value, self._ranges[name])

    def hypers(self, step: int) -> dict[str, float]:
        """Every hyper-parameter at ``step`` (what an update there uses; for logs)."""
        return {name: self.hyper(name, step) for name in self._ranges}

    def init_state(self, shape: tuple[int, ...] | int, dtype: Any = np.float32) -> dict[str, np.ndarray]:
        """New zero state tensors, one per name in ``state_names``."""
        if not np.issubdtype(np.dtype(dtype), np.floating):
            raise TypeError(f"{type(self).__name__}: state dtype {np.dtype(dtype)} is not floating point")
        return {name: np.zeros(shape, dtype) for name in self.state_names}

    def check(self, weight: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray], step: int) -> np.ndarray:
        """Everything an update reads, checked before anything changes: the step, every
        hyper-parameter (schedules too), the weight, the gradient and the state. Returns the
        gradient in the weight's dtype (the arithmetic's)."""
        owner = type(self).__name__
        validate.count(f"{owner}: step (the 1-based update number)", step)
        self.hypers(step)
        if not isinstance(weight, np.ndarray) or not np.issubdtype(weight.dtype, np.floating):
            raise TypeError(f"{owner}: the weight must be a floating-point ndarray, got "
                            f"{getattr(weight, 'dtype', type(weight).__name__)}")
        if not weight.flags.writeable:
            raise ValueError(f"{owner}: the weight is read-only; the update writes it in place")
        grad = np.asarray(grad)
        if grad.dtype.kind not in "fiu":
            raise TypeError(f"{owner}: gradient dtype {grad.dtype} is not a real number type")
        if grad.shape != weight.shape:
            raise ValueError(f"{owner}: gradient shape {grad.shape} differs from the weight's {weight.shape}")
        if not isinstance(state, dict):
            raise TypeError(f"{owner}: state must be a dict of arrays ({', '.join(self.state_names) or 'empty'}), "
                            f"got {type(state).__name__}")
        missing = [n for n in self.state_names if n not in state]
        if missing:
            raise ValueError(f"{owner}: state lacks {', '.join(missing)} (it needs {', '.join(self.state_names)})")
        for name in self.state_names:
            s = state[name]
            if not isinstance(s, np.ndarray) or s.shape != weight.shape or s.dtype != weight.dtype:
                got = f"{s.dtype}{list(s.shape)}" if isinstance(s, np.ndarray) else type(s).__name__
                raise ValueError(f"{owner}: state {name!r} is {got}, it must be like the weight: "
                                 f"{weight.dtype}{list(weight.shape)}")
            if not s.flags.writeable:
                raise ValueError(f"{owner}: state {name!r} is read-only; the update writes it in place")
        return grad if grad.dtype == weight.dtype else grad.astype(weight.dtype)

    def direction(self, weight: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray], step: int) -> np.ndarray:
        """Updates ``state`` in place and returns the direction ``d`` (a new array): elementwise."""
        grad = self.check(weight, grad, state, step)
        scratch = [np.empty_like(weight) for _ in range(_SCRATCH)]
        return self._direction(weight, grad, state, step, self.hypers(step), scratch)

    def _direction(self, weight: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray], step: int,
                   hypers: dict[str, float], scratch: list[np.ndarray]) -> np.ndarray:
        """:meth:`direction` on checked inputs (``grad`` in the weight's dtype) with the
        hyper-parameters of ``step``, computed in ``scratch`` (arrays like the weight, one of which
        it returns) with no other temporary: one operation at a time, in the order the rule is
        written, so any block of the tensors gives that block of the whole result."""
        raise NotImplementedError

    def trust_ratio(self, weight_norm: float, direction_norm: float, step: int) -> float:
        """How much of ``lr`` this tensor takes: 1.0 (LAMB overrides)."""
        return 1.0

    def apply(self, weight: np.ndarray, d: np.ndarray, step: int, trust_ratio: float = 1.0) -> None:
        """``weight -= lr * trust_ratio * d`` in place (:func:`_descend`)."""
        if d.shape != weight.shape:
            raise ValueError(f"{type(self).__name__}: direction shape {d.shape} differs from the weight's "
                             f"{weight.shape}")
        _descend(weight, d, self.hyper("lr", step), trust_ratio)

    def update(self, weight: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray], step: int,
               norm: Callable[[np.ndarray], float] | None = None) -> None:
        """One update in place. ``norm(x)``: the L2 norm of the whole tensor of which ``x`` is this
        piece (default: ``x`` is the whole tensor, :func:`exact_norm`); only LAMB asks for it.

        Without norms the update runs :data:`UPDATE_BLOCK_BYTES` of the weight at a time in scratch
        it reuses, with the bits of :meth:`direction` and :meth:`apply` on the whole tensor. A
        whole-tensor temporary of a large weight is a fresh memory mapping each step, whose pages
        the kernel zeroes on first touch: that zeroing was over a quarter of the training
        benchmark's replicated step."""
        if self.uses_norms:
            d = self.direction(weight, grad, state, step)
            measure = norm or exact_norm
            self.apply(weight, d, step, self.trust_ratio(measure(weight), measure(d), step))
            return
        grad = self.check(weight, grad, state, step)
        hypers = self.hypers(step)
        scratch: list[np.ndarray] = []
        for w, g, s in _blocks(weight, grad, state):
            if not scratch:  # the first block is the largest
                scratch = [np.empty_like(w) for _ in range(_SCRATCH)]
            cut = scratch if w.shape == scratch[0].shape else [x[:w.size] for x in scratch]
            d = self._direction(w, g, s, step, hypers, cut)
            _descend(w, d, hypers["lr"], 1.0, scratch=d)


class SGD(Optimizer):
    """Stochastic gradient descent with PyTorch's rules: L2 ``weight_decay`` added to the gradient;
    the momentum buffer starts as update 1's ``d_p``; ``nesterov`` steps along
    ``d_p + momentum * buf``. A weight has a momentum buffer when ``momentum`` is a schedule or
    not 0 (at an update where it is 0, the buffer is left alone, as in PyTorch)."""

    _ranges: ClassVar[dict[str, _Range]] = {
        "lr": _AT_LEAST_0, "momentum": _AT_LEAST_0, "dampening": _UNIT, "weight_decay": _AT_LEAST_0}
    momentum: Hyper
    dampening: Hyper
    weight_decay: Hyper

    def __init__(self, lr: Hyper, momentum: Hyper = 0.0, dampening: Hyper = 0.0, nesterov: bool = False,
                 weight_decay: Hyper = 0.0) -> None:
        super().__init__(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay)
        self.nesterov = validate.flag("SGD: nesterov", nesterov)
        if nesterov and not callable(momentum) and not callable(dampening):
            self._check_nesterov(float(momentum), float(dampening))

    def _check_nesterov(self, momentum: float, dampening: float, when: str = "") -> None:
        if momentum <= 0 or dampening != 0:
            raise ValueError(f"SGD: nesterov needs momentum > 0 and dampening 0{when} "
                             f"(got momentum={momentum!r}, dampening={dampening!r})")

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if callable(self.momentum) or self.momentum != 0 else ()

    def check(self, weight: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray], step: int) -> np.ndarray:
        g = super().check(weight, grad, state, step)
        validate.flag("SGD: nesterov", self.nesterov)
        if self.nesterov:
            self._check_nesterov(self.hyper("momentum", step), self.hyper("dampening", step), f" at update {step}")
        return g

    def _direction(self, weight: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray], step: int,
                   hypers: dict[str, float], scratch: list[np.ndarray]) -> np.ndarray:
        t = weight.dtype.type
        d, tmp = scratch
        decay, momentum = hypers["weight_decay"], hypers["momentum"]
        if decay:  # d = grad + decay * weight
            np.multiply(weight, t(decay), out=d)
            np.add(grad, d, out=d)
        else:
            np.copyto(d, grad)
        if not momentum:
            return d
        buf = state["momentum_buffer"]
        if step == 1:
            buf[...] = d
        else:  # buf = buf * momentum + (1 - dampening) * d
            np.multiply(buf, t(momentum), out=buf)
            np.multiply(d, t(1.0 - hypers["dampening"]), out=tmp)
            np.add(buf, tmp, out=buf)
        if self.nesterov:  # d + momentum * buf
            np.multiply(buf, t(momentum), out=tmp)
            np.add(d, tmp, out=d)
            return d
        np.copyto(d, buf)
        return d


class Adam(Optimizer):
    """Adam (Kingma & Ba, arXiv:1412.6980) with bias correction; ``weight_decay`` is L2, added to
    the gradient (PyTorch's ``Adam``). ``betas`` is stored as ``beta1`` and ``beta2`` (each a
    value or a schedule); ``eps`` must be above 0 and not round to 0 in the weight's dtype, or
    elements whose gradient was always 0 (and shard padding) would become 0 / 0."""

    _ranges: ClassVar[dict[str, _Range]] = {
        "lr": _AT_LEAST_0, "beta1": _BELOW_1, "beta2": _BELOW_1, "eps": _ABOVE_0, "weight_decay": _AT_LEAST_0}
    _state: ClassVar[tuple[str, ...]] = ("exp_avg", "exp_avg_sq")
    beta1: Hyper
    beta2: Hyper
    eps: Hyper
    weight_decay: Hyper
    #: Decoupled weight decay (AdamW): ``weight_decay * w`` joins the direction instead of the gradient.
    decoupled: ClassVar[bool] = False

    def __init__(self, lr: Hyper, betas: tuple[Hyper, Hyper] = (0.9, 0.999), eps: Hyper = 1e-8,
                 weight_decay: Hyper = 0.0) -> None:
        beta1, beta2 = self._pair(betas)
        super().__init__(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)

    def _pair(self, betas: Any) -> tuple[Hyper, Hyper]:
        if not isinstance(betas, tuple | list) or len(betas) != 2:
            raise ValueError(f"{type(self).__name__}: betas={betas!r} is not a pair (beta1, beta2), "
                             f"each in [0, 1) or a schedule")
        return betas[0], betas[1]

    @property
    def betas(self) -> tuple[Hyper, Hyper]:
        """``(beta1, beta2)``; assigning a pair sets both."""
        return (self.beta1, self.beta2)

    @betas.setter
    def betas(self, betas: tuple[Hyper, Hyper]) -> None:
        beta1, beta2 = self._pair(betas)
        beta1, beta2 = self._checked_hyper("beta1", beta1), self._checked_hyper("beta2", beta2)
        self.beta1, self.beta2 = beta1, beta2

    def check(self, weight: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray], step: int) -> np.ndarray:
        g = super().check(weight, grad, state, step)
        eps = self.hyper("eps", step)
        if weight.dtype.type(eps) == 0:
            raise ValueError(f"{type(self).__name__}: eps={eps!r} is 0 in the weight's dtype {weight.dtype}; "
                             f"use at least {float(np.finfo(weight.dtype).smallest_subnormal):g}")
        return g

    def _direction(self, weight: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray], step: int,
                   hypers: dict[str, float], scratch: list[np.ndarray]) -> np.ndarray:
        t = weight.dtype.type
        beta1, beta2, eps, decay = hypers["beta1"], hypers["beta2"], hypers["eps"], hypers["weight_decay"]
        a, b = scratch
        g = grad
        if decay and not self.decoupled:  # g = grad + decay * weight
            np.multiply(weight, t(decay), out=a)
            g = np.add(grad, a, out=a)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        np.multiply(m, t(beta1), out=m)  # m = m * beta1 + (1 - beta1) * g
        np.multiply(g, t(1.0 - beta1), out=b)
        np.add(m, b, out=m)
        np.multiply(v, t(beta2), out=v)  # v = v * beta2 + (1 - beta2) * (g * g)
        np.multiply(g, g, out=b)
        np.multiply(b, t(1.0 - beta2), out=b)
        np.add(v, b, out=v)
        np.divide(v, t(1.0 - beta2 ** step), out=b)  # d = m_hat / (sqrt(v_hat) + eps)
        np.sqrt(b, out=b)
        np.add(b, t(eps), out=b)
        np.divide(m, t(1.0 - beta1 ** step), out=a)
        np.divide(a, b, out=a)
        if decay and self.decoupled:  # d + decay * weight
            np.multiply(weight, t(decay), out=b)
            np.add(a, b, out=a)
        return a


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter, arXiv:1711.05101): ``weight_decay * w``
    joins the direction, so the applied step is ``lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * w)``
    (PyTorch's ``AdamW``, whose default decay 0.01 this keeps)."""

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
        """``weight_norm / direction_norm``; 1.0 when either is 0; NaN norms give NaN (as IEEE)."""
        if weight_norm == 0.0 or direction_norm == 0.0:
            return 1.0
        return weight_norm / direction_norm


#: The optimizers by name.
OPTIMIZERS: dict[str, Callable[..., Optimizer]] = {"sgd": SGD, "adam": Adam, "adamw": AdamW, "lamb": LAMB}

__all__ = ["LAMB", "MAX_NORM_ELEMENTS", "MAX_NORM_ELEMENTS_FLOAT64", "OPTIMIZERS", "PARTS_LENGTH", "SGD",
           "UPDATE_BLOCK_BYTES", "Adam", "AdamW", "Hyper", "Optimizer", "exact_norm", "norm_from_parts",
           "sum_squares_parts"]
