"""Batch-invariant building blocks: products whose per-sample results do not depend on the batch.

The engine gives the same bits under any split of the replicas into instances, micro-batches
and accumulation steps only if the model does its part: a sample's activations must not depend
on how many samples share its call, and a micro-batch's gradient must be the canonical pairwise
tree (:func:`~popdist_py.engine.canonical_sum`) of its samples' gradients. ``x @ w`` breaks the
first: BLAS chooses its kernel and its order of additions by shape and CPU (OpenBLAS gives a row
other bits in a call of 1, 3 or 17 rows than in one of 64), and ``x.T @ dy`` sums samples in an
order of its own. These do not:

    matmul(x, w)        # x @ w; row i depends on x[i] and w alone
    outer_sum(x, dy)    # x.T @ dy as the canonical tree over rows: a weight's gradient
    canonical_sum(dy)   # dy.sum(axis=0) as the same tree: a bias's gradient

Every output element is one fixed sequence of IEEE operations (``matmul``: an FMA chain over k
in blocks of :data:`KC`, the blocks added left to right; ``outer_sum``: rounded products added
in the tree), computed by a compiled kernel whose AVX-512, AVX2 and scalar paths give the same
bits, so the result also does not depend on the CPU. Both release the GIL, so local replicas on
threads compute at once.

The kernels are a compiled part (``_batch_invariant``). An install built without it (no C compiler)
has none of the two: each refuses at its first call with :class:`popcontract.compiled.MissingPart`,
one line, rather than give bits that would depend on the CPU or on numpy's build.
"""

from __future__ import annotations

from typing import Any, NoReturn

import numpy as np

from popcontract import compiled

__all__ = ["ISAS", "KC", "check_kernels", "matmul", "outer_sum"]

_kernels = compiled.load(compiled.BATCH_INVARIANT)

#: The width of matmul's k blocks: part of the definition of its result (the kernel's own, checked
#: equal to this where it is built).
KC: int = 256

#: The instruction sets this CPU runs, in the kernels' numbering (0 scalar, 1 AVX2, 2 AVX-512);
#: only the scalar one's number where the kernels were not built.
ISAS: tuple[int, ...] = tuple(range((_kernels.BEST_ISA if _kernels is not None else 0) + 1))
_BEST: int = ISAS[-1]


def _compiled(feature: str) -> Any:
    """The kernels, or :class:`~popcontract.compiled.MissingPart` saying that ``feature`` cannot run without them."""
    if _kernels is None:
        compiled.require(compiled.BATCH_INVARIANT, feature)
    return _kernels


def check_kernels() -> None:
    """:class:`~popcontract.compiled.MissingPart` (one line) where this install lacks the kernels
    (built without a C compiler): a program that uses them calls it first, to refuse before it
    starts its work rather than in its first product."""
    _compiled("the batch-invariant products (popdist_py.engine.batch_invariant)")

_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def matmul(x: np.ndarray, w: np.ndarray, *, isa: int | None = None) -> np.ndarray:
    """``x @ w`` for ``x`` [..., K] and ``w`` [K, N], each output row a function of its own row of
    ``x`` and of ``w`` only: the same bits in a call of one row or of thousands, at any position,
    on any CPU. ``isa`` picks a kernel (tests compare them); by default the fastest this CPU runs."""
    kernels = _compiled("popdist_py.engine.batch_invariant.matmul")
    x = np.asarray(x)
    w = np.asarray(w)
    rows = x if x.ndim == 2 else x.reshape(-1, x.shape[-1]) if x.ndim else x
    try:
        out = np.empty((rows.shape[0], w.shape[1]), x.dtype)
        kernels.matmul(rows, w, out, _BEST if isa is None else _isa(isa))
    except (ValueError, TypeError, IndexError) as exc:  # checked in the kernel; explained here
        if _misaligned(x, w):
            return matmul(x.copy(), w.copy(), isa=isa)
        _explain("matmul", x, w, exc)
    return out if x.ndim == 2 else out.reshape((*x.shape[:-1], w.shape[1]))


def outer_sum(x: np.ndarray, y: np.ndarray, *, isa: int | None = None) -> np.ndarray:
    """``x.T @ y`` for ``x`` [B, K] and ``y`` [B, N]: the sum over the B rows of the outer products
    ``x[s] (x) y[s]``, each product rounded, added in :func:`~popdist_py.engine.canonical_sum`'s
    tree. Bitwise ``canonical_sum(x[:, :, None] * y[:, None, :])`` without its B x K x N memory, so
    B rows in one call equal any power-of-two split of them summed again in the tree."""
    kernels = _compiled("popdist_py.engine.batch_invariant.outer_sum")
    x = np.asarray(x)
    y = np.asarray(y)
    try:
        out = np.empty((x.shape[1], y.shape[1]), x.dtype)
        kernels.outer_sum(x, np.ascontiguousarray(y), out, _BEST if isa is None else _isa(isa))
    except (ValueError, TypeError, IndexError) as exc:
        if _misaligned(x, y):
            return outer_sum(x.copy(), y.copy(), isa=isa)
        _explain("outer_sum", x, y, exc)
    return out


def _misaligned(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether an operand's items are not aligned to their size (a view at an odd byte offset of a
    buffer), which the kernels refuse: such operands are copied (aligned) and the call made again,
    on the refusal's path only, so aligned calls pay nothing for it."""
    return not (a.flags.aligned and b.flags.aligned)


def _explain(name: str, a: np.ndarray, b: np.ndarray, exc: Exception) -> NoReturn:
    """Re-raises a kernel's refusal as one line naming the operands and what would be valid."""
    if a.dtype != b.dtype or a.dtype not in _DTYPES:
        raise TypeError(f"{name}: operands must both be float32 or both float64, got {a.dtype} and {b.dtype}") from None
    if name == "matmul":
        if a.ndim == 0 or b.ndim != 2 or a.shape[-1] != b.shape[0]:
            raise ValueError(f"matmul: x must be [..., K] and w [K, N], got shapes {a.shape} and {b.shape}") from None
    elif a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[0] or a.shape[0] == 0:
        raise ValueError(f"outer_sum: x and y must be [B, K] and [B, N] with the same B >= 1, "
                         f"got shapes {a.shape} and {b.shape}") from None
    raise exc


def _isa(isa: int) -> int:
    if isa not in ISAS:
        raise ValueError(f"isa {isa!r} is not one this CPU runs; valid: {', '.join(map(str, ISAS))}")
    return isa
